"""Stopping a run when the machine is taken away: SIGTERM (what SLURM and spot instances send
before they kill a job) and SIGINT (Ctrl-C).

:class:`StopSignals` turns either signal into a request the training loop reads between steps;
the loop then saves a checkpoint of the step it has reached and exits. Across processes the
request is agreed on (:meth:`StopSignals.agreed`): a signal that reaches one process stops all
of them at the same step, so every process writes its shards of the same checkpoint. A second
signal of the same kind while the first is handled is not intercepted (a second Ctrl-C
interrupts at once).
"""

from __future__ import annotations

import signal
import threading

import jax
import numpy as np

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
  """A run stopped by a signal after saving a checkpoint of ``step``; ``--resume`` continues
  it."""

  def __init__(self, step: int, signum: int, directory: str):
    self.step, self.signal = step, signum
    super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; saved a "
                     f"checkpoint in {directory}: --resume continues the run")


class StopSignals:
  """A context in which SIGTERM and SIGINT ask the loop to stop (:attr:`received`) instead of
  killing the process; the previous handlers come back at its end. In a thread other than the
  main one (where Python cannot install handlers) it intercepts nothing."""

  def __init__(self, signals=SIGNALS):
    self.signals, self.received, self._previous = signals, None, {}

  def _handle(self, signum, frame):
    self.received = signum
    # A second one of the same kind goes to the previous handler (Ctrl-C twice interrupts).
    signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))

  def __enter__(self) -> StopSignals:
    if threading.current_thread() is threading.main_thread():
      for signum in self.signals:
        self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous.clear()

  def agreed(self) -> int | None:
    """The signal that stops every process (the first that any received), or None. With one
    process it reads :attr:`received`; with several it is a collective: every process must
    call it at the same step."""
    if jax.process_count() == 1:
      return self.received
    from jax.experimental import multihost_utils

    mine = np.asarray(self.received or 0, np.int32)
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1)
    received = [int(s) for s in every if s]
    return received[0] if received else None
