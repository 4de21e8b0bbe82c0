"""What the training-step benchmark tests share: a timing context that runs every step and
reports fixed times, fast compiles, and the figures a row may carry."""

from __future__ import annotations

from benchmarks.harness import Context

# XLA:CPU spends most of these tests compiling; the optimization level changes how fast the step
# runs, not what it computes.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
FIGURES = ("time_ms", "ratio", "residual_bytes", "temp_bytes", "max_abs_err", "final_loss", "note")


def fixed_times(times: dict[str, float]) -> type[Context]:
  """A context class whose ``time`` calls every candidate ``warmup + runs`` times (each call is
  a training step) and returns ``times[name]`` as its median, min and max."""

  class FixedTimes(Context):
    def time(self, candidates, *, warmup=2, sync=None):
      out = {}
      for name, fn in candidates.items():
        for _ in range(warmup + self.n_runs):
          fn()
        t = times[name]
        out[name] = {"median": t, "min": t, "max": t, "runs": self.n_runs}
      return out

  return FixedTimes
