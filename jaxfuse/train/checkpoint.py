"""Orbax checkpoints of a run: the training state and a JSON ``meta`` (history and config).

Each save is written to a temporary directory and renamed when complete, so a failed save never
replaces the last good checkpoint; the two latest are kept. :func:`resume` picks where a run
starts: the latest checkpoint with ``--resume``, else step 0 in a directory without checkpoints.

Across processes (:mod:`jaxfuse.train.distributed`) every process makes the same calls: each
writes the shards its devices hold and reads those back, process 0 writes ``meta`` and the
metadata and renames the checkpoint once all have written (orbax's barriers), so the directory
must be one that every host sees (a shared filesystem).
"""

from __future__ import annotations

from pathlib import Path

import jax


class CheckpointError(RuntimeError):
  """A checkpoint cannot be read back (corrupt, or from another model)."""


def checkpoint_manager(directory: Path):
  """An orbax ``CheckpointManager`` of the items ``state`` and ``meta`` in ``directory``."""
  import orbax.checkpoint as ocp

  options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
  return ocp.CheckpointManager(directory.absolute(), options=options,
                               item_names=("state", "meta"))


def save_checkpoint(manager, step: int, state, meta: dict) -> None:
  """Writes ``state`` and ``meta`` for ``step``; orbax writes to a temporary directory and
  renames it when complete, so an interrupted save leaves the last good checkpoint as it was."""
  import orbax.checkpoint as ocp

  manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                             meta=ocp.args.JsonSave(meta)))
  manager.wait_until_finished()


def read_meta(manager, step: int) -> dict:
  """The ``meta`` of step ``step``'s checkpoint (without reading its state)."""
  import orbax.checkpoint as ocp

  try:
    return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  except Exception as e:  # noqa: BLE001 - orbax raises many kinds; all mean "unreadable"
    raise CheckpointError(f"the checkpoint of step {step} in {manager.directory} cannot be "
                          f"read ({type(e).__name__}: {e})") from e


def restore_checkpoint(manager, abstract_state, step: int | None = None):
  """``(step, state, meta)`` of the latest complete checkpoint (or of ``step``), or None if
  there is none."""
  import orbax.checkpoint as ocp

  step = manager.latest_step() if step is None else step
  if step is None:
    return None
  try:
    restored = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
  except Exception as e:  # noqa: BLE001 - orbax raises many kinds; all mean "unreadable"
    raise CheckpointError(f"the checkpoint of step {step} in {manager.directory} cannot be "
                          f"read ({type(e).__name__}: {e}); remove it or start without "
                          f"--resume in another --out directory") from e
  return step, restored["state"], restored["meta"]


def refuse_other_run(manager, directory: Path, *, resume: bool) -> None:
  """Raises FileExistsError when a run that does not ``resume`` would write into ``directory``
  holding another run's checkpoints (before it writes anything there)."""
  if not resume and manager.latest_step() is not None:
    raise FileExistsError(f"{directory} holds checkpoints of another run: pass --resume to "
                          f"continue it, or another --out")


def resume(manager, directory: Path, state, *, resume: bool, log=print):
  """``(step, state, meta, manager)`` a run starts from: with ``resume``, the latest readable
  checkpoint in ``manager`` (restored with ``state``'s shapes, dtypes and shardings), or
  ``(0, state, None, manager)`` when there is none yet; without, ``(0, state, None, manager)``.

  A latest checkpoint that cannot be read is reported by name and moved aside, into
  ``<directory>-unreadable/<step>`` (kept for inspection, out of the way of the step's next
  save), and the run resumes from the one before it; the manager returned sees the move.

  Raises:
    FileExistsError: without ``resume``, ``directory`` holds checkpoints (of another run).
    CheckpointError: no checkpoint in ``directory`` can be read (nothing is moved then).
  """
  if not resume:
    refuse_other_run(manager, directory, resume=False)
    return 0, state, None, manager
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
  steps = sorted(manager.all_steps(), reverse=True)
  if not steps:
    log(f"--resume: no checkpoint in {directory}; starting at step 0")
    return 0, state, None, manager
  failures = []
  for step in steps:
    try:
      restored = restore_checkpoint(manager, abstract, step)
    except CheckpointError as e:
      failures.append((step, e))
      log(f"--resume: {e}")
      continue
    if failures:
      manager = _set_aside(manager, directory, [s for s, _ in failures])
      log(f"--resume: resuming from step {step}, the latest readable checkpoint; moved "
          f"{', '.join(str(s) for s, _ in failures)} to {_aside(directory)}")
    log(f"resumed at step {restored[0]}")
    return (*restored, manager)
  raise failures[0][1]


def _aside(directory: Path) -> Path:
  return directory.with_name(directory.name + "-unreadable")


def _set_aside(manager, directory: Path, steps: list[int]):
  """Moves the checkpoints of ``steps`` out of ``directory`` (process 0, once every process has
  failed to read them) and returns a manager of what is left."""
  from jax.experimental import multihost_utils

  multihost_utils.sync_global_devices("jaxfuse: unreadable checkpoints found")
  if jax.process_index() == 0:
    aside = _aside(directory)
    aside.mkdir(exist_ok=True)
    for step in steps:
      target = aside / str(step)
      suffix = 1
      while target.exists():
        target, suffix = aside / f"{step}.{suffix}", suffix + 1
      (directory / str(step)).rename(target)
  multihost_utils.sync_global_devices("jaxfuse: unreadable checkpoints moved")
  manager.close()
  return checkpoint_manager(directory)
