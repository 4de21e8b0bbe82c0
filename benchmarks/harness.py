"""What every suite shares: progress, interleaved timing, error figures, the table and a plot."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np

from benchmarks import records as rec
from jaxfuse.metrics import timing
from jaxfuse.ops import dispatch


def to_numpy(x) -> np.ndarray:
  """A float64 numpy copy of a JAX array or torch tensor."""
  if hasattr(x, "detach"):
    x = x.detach().float().cpu().numpy()
  return np.asarray(x, dtype=np.float64)


def max_abs_err(got, want) -> float:
  """Largest absolute difference over matching leaves of two pytrees (or sequences)."""
  got_leaves = got if isinstance(got, (list, tuple)) else jax.tree_util.tree_leaves(got)
  want_leaves = want if isinstance(want, (list, tuple)) else jax.tree_util.tree_leaves(want)
  if len(got_leaves) != len(want_leaves):
    raise ValueError(f"{len(got_leaves)} leaves against {len(want_leaves)}")
  worst = 0.0
  for g, w in zip(got_leaves, want_leaves):
    g, w = to_numpy(g), to_numpy(w)
    if g.shape != w.shape:
      raise ValueError(f"shape {g.shape} against {w.shape}")
    if g.size:
      worst = max(worst, float(np.max(np.abs(g - w))))
  return worst


def tokamax():
  """tokamax, or None when it is not installed (a peer row is then skipped with a note).

  tokamax reads its options from absl flags and parses sys.argv on first use, which fails on
  this CLI's own arguments (``--quick``): its flags keep their defaults instead.
  """
  try:
    import tokamax as module
    from absl import flags
  except Exception:  # noqa: BLE001 - any import failure means the peer is not available.
    return None
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  return module


def torch_sync(out):
  """Torch on CPU is synchronous; on CUDA wait for the stream."""
  import torch

  if torch.cuda.is_available():
    torch.cuda.synchronize()
  return out


@dataclasses.dataclass
class Context:
  """Per-run settings and helpers handed to a suite's ``run``."""

  suite: str
  quick: bool = False
  runs: int | None = None
  _progress: object = None
  _task: object = None

  @property
  def platform(self) -> str:
    return dispatch.platform()

  @property
  def n_runs(self) -> int:
    return self.runs or (5 if self.quick else 7)

  @property
  def min_seconds(self) -> float:
    """Timed rounds go on until this long (fast cases get more samples); 0 with ``--runs``."""
    return 0.0 if self.runs else (3.0 if self.quick else 10.0)

  def native(self, implementation: str) -> bool:
    """Whether jaxfuse's ``implementation`` compiles here (so its time means something)."""
    return dispatch.runs_natively(implementation)

  # Progress -------------------------------------------------------------------------------------

  @contextlib.contextmanager
  def progress_bar(self):
    try:
      from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:  # rich is optional: fall back to plain lines.
      yield
      return
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TimeElapsedColumn(),
                  transient=True) as progress:
      self._progress = progress
      self._task = progress.add_task(self.suite, total=None)
      try:
        yield
      finally:
        self._progress = None

  def step(self, description: str) -> None:
    """Shows what the suite is doing now."""
    if self._progress is not None:
      self._progress.update(self._task, description=f"{self.suite}: {description}", advance=1)
    else:
      print(f"[{self.suite}] {description}", flush=True)

  # Timing ---------------------------------------------------------------------------------------

  def time(self, candidates: Mapping[str, Callable[[], object]], *, warmup: int = 2,
           sync: Callable[[object], object] | None = None) -> dict[str, dict]:
    """Interleaved median/min/max in ms for each candidate (shuffled rounds, after warm-up)."""
    if not candidates:
      return {}
    timings = timing.interleaved(candidates, warmup=warmup, runs=self.n_runs,
                                 sync=sync or _sync_any, min_seconds=self.min_seconds)
    return {name: t.as_dict() for name, t in timings.items()}

  # Output ---------------------------------------------------------------------------------------

  def print_table(self, records: Sequence[rec.Record], title: str) -> None:
    try:
      from rich.console import Console
      from rich.table import Table
    except ImportError:
      print(title)
      print(rec.markdown_table(records))
      return
    table = Table(title=title)
    for column in rec.COLUMNS:
      table.add_column(column, justify="left" if column in ("case", "impl", "dtype") else "right")
    from rich.markup import escape

    for r in records:
      table.add_row(*(escape(cell) for cell in rec.row(r)))
    Console(width=200).print(table)

  def default_plot(self, records: Sequence[rec.Record], path: str) -> None:
    """Bars of median time and of residual bytes, per case and implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r.case for r in records))
    impls = list(dict.fromkeys(r.impl for r in records))
    fig, axes = plt.subplots(1, 2, figsize=(max(10, 1.6 * len(cases) + 6), 5))
    width = 0.8 / max(1, len(impls))
    for panel, (ax, field, label) in enumerate(zip(
        axes, ("time", "residual_bytes"), ("median time (ms)", "residual bytes (MiB)"))):
      for k, impl in enumerate(impls):
        values = []
        for case in cases:
          match = [r for r in records if r.case == case and r.impl == impl]
          r = match[0] if match else None
          if r is None:
            values.append(math.nan)
          elif field == "time":
            values.append(r.time_ms["median"] if r.time_ms else math.nan)
          else:
            values.append(r.residual_bytes / 2**20 if r.residual_bytes is not None else math.nan)
        xs = np.arange(len(cases)) + k * width
        ax.bar(xs, values, width, label=impl)
      ax.set_xticks(np.arange(len(cases)) + 0.4 - width / 2)
      ax.set_xticklabels(cases, rotation=30, ha="right", fontsize=7)
      ax.set_ylabel(label)
      if panel == 0:
        ax.legend(fontsize=7)
    fig.suptitle(f"{self.suite} on {self.platform}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _sync_any(out):
  leaves = jax.tree_util.tree_leaves(out)
  if any(hasattr(x, "detach") for x in leaves):
    return torch_sync(out)
  return jax.block_until_ready(out)
