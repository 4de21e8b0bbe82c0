"""Where a run's metrics go: TensorBoard event files, Weights & Biases, and ``metrics.jsonl``.

:class:`MetricWriters` takes the scalars of a step (``train/loss``, ``train/grad_norm``,
``train/learning_rate``, ``perf/tokens_per_second``, ``perf/mfu``, ``eval/loss``, ...) and
writes them to every writer the run has:

- ``<out>/tensorboard``: TensorBoard event files through ``tensorboardX`` (a small, well-kept
  writer without TensorFlow or torch); ``tensorboard --logdir <out>`` shows them.
  ``--no-tensorboard`` turns them off.
- ``--wandb PROJECT``: a Weights & Biases run (``wandb`` must be installed; ``WANDB_MODE=offline``
  works without a network). A resumed run continues the same W&B run (its id is kept in
  ``<out>/wandb-run-id``).
- ``<out>/metrics.jsonl``: one JSON object a step, always (the simplest thing to tail or parse).

Only process 0 writes. :func:`read_scalars` reads TensorBoard event files back.
"""

from __future__ import annotations

import importlib.util
import json
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any


def tensorboard_available() -> bool:
  return importlib.util.find_spec("tensorboardX") is not None


def wandb_available() -> bool:
  return importlib.util.find_spec("wandb") is not None


class MetricWriters:
  """The writers of a run in ``out`` (see the module docstring); :meth:`write` sends one step's
  scalars to each, :meth:`close` flushes and closes them."""

  def __init__(self, out: str | Path, *, tensorboard: bool = True, wandb: str | None = None,
               config: Mapping[str, Any] | None = None, log: Callable[[str], None] = print):
    out = Path(out)
    self.jsonl = open(out / "metrics.jsonl", "a")   # noqa: SIM115 - closed by close()
    self.tensorboard = None
    if tensorboard:
      if tensorboard_available():
        from tensorboardX import SummaryWriter

        self.tensorboard = SummaryWriter(str(out / "tensorboard"))
      else:
        log("tensorboardX is not installed: no TensorBoard files (pip install tensorboardX, or "
            "pass --no-tensorboard)")
    self.wandb = None
    if wandb is not None:
      self.wandb = _wandb_run(out, wandb, dict(config or {}))

  def write(self, step: int, scalars: Mapping[str, float | None]) -> None:
    """Writes the scalars of ``step`` (None values are left out)."""
    values = {k: float(v) for k, v in scalars.items() if v is not None}
    if not values:
      return
    self.jsonl.write(json.dumps({"step": step, **values}) + "\n")
    if self.tensorboard is not None:
      for tag, value in values.items():
        self.tensorboard.add_scalar(tag, value, step)
    if self.wandb is not None:
      self.wandb.log(values, step=step)

  def flush(self) -> None:
    self.jsonl.flush()
    if self.tensorboard is not None:
      self.tensorboard.flush()

  def close(self) -> None:
    self.flush()
    self.jsonl.close()
    if self.tensorboard is not None:
      self.tensorboard.close()
    if self.wandb is not None:
      self.wandb.finish()


def _wandb_run(out: Path, project: str, config: dict):
  """A W&B run of ``project`` in ``out``, the same one a resumed run continued."""
  if not wandb_available():
    raise ValueError("--wandb needs the wandb package: pip install wandb")
  import wandb

  id_file = out / "wandb-run-id"
  run_id = id_file.read_text().strip() if id_file.is_file() else wandb.util.generate_id()
  id_file.write_text(run_id + "\n")
  return wandb.init(project=project, id=run_id, resume="allow", dir=str(out), config=config,
                    name=out.name)


def read_scalars(directory: str | Path) -> dict[str, list[tuple[int, float]]]:
  """Every scalar in the TensorBoard event files under ``directory``: ``{tag: [(step, value),
  ...]}`` in the order written (files by name: a resumed run's come after).

  Example:
    >>> import tempfile
    >>> from jaxfuse.train.writers import MetricWriters, read_scalars
    >>> out = tempfile.mkdtemp()
    >>> writers = MetricWriters(out)
    >>> writers.write(1, {"train/loss": 2.5}); writers.close()
    >>> read_scalars(out + "/tensorboard")
    {'train/loss': [(1, 2.5)]}
  """
  from tensorboardX.proto import event_pb2

  scalars: dict[str, list[tuple[int, float]]] = {}
  for path in sorted(Path(directory).rglob("events.out.tfevents.*")):
    for record in _records(path.read_bytes()):
      event = event_pb2.Event.FromString(record)
      for value in event.summary.value:
        if value.HasField("simple_value"):
          scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
  return scalars


def _records(data: bytes):
  """The payloads of a TFRecord file: each is ``length (u64) | crc (u32) | data | crc (u32)``."""
  at = 0
  while at + 12 <= len(data):
    (length,) = struct.unpack_from("<Q", data, at)
    start = at + 12
    if start + length + 4 > len(data):
      return   # a record still being written
    yield data[start:start + length]
    at = start + length + 4
