"""Wall-clock timing: median of N runs after warm-up, interleaved across candidates."""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from collections.abc import Callable, Mapping

import jax


@dataclasses.dataclass(frozen=True)
class Timing:
  """Milliseconds per call: median, min and max over ``runs`` timed calls."""

  median: float
  min: float
  max: float
  runs: int

  def as_dict(self) -> dict[str, float]:
    return {"median": self.median, "min": self.min, "max": self.max}


def _block(out):
  """Waits for JAX arrays (and torch tensors, which are synchronous on CPU) in ``out``."""
  return jax.block_until_ready(out)


def _summarize(samples: list[float]) -> Timing:
  return Timing(statistics.median(samples), min(samples), max(samples), len(samples))


def time_fn(fn: Callable[[], object], *, warmup: int = 2, runs: int = 7,
            sync: Callable[[object], object] = _block) -> Timing:
  """Times ``fn()``: ``warmup`` untimed calls, then the median of ``runs`` timed calls.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxfuse.metrics import time_fn
    >>> f = jax.jit(lambda x: x * 2)
    >>> x = jnp.ones(1024)
    >>> time_fn(lambda: f(x), runs=5).runs
    5
  """
  return interleaved({"fn": fn}, warmup=warmup, runs=runs, sync=sync)["fn"]


def interleaved(fns: Mapping[str, Callable[[], object]], *, warmup: int = 2, runs: int = 7,
                sync: Callable[[object], object] = _block, shuffle_seed: int | None = 0,
                on_step: Callable[[], None] | None = None, min_seconds: float = 0.0,
                max_runs: int = 100) -> dict[str, Timing]:
  """Times several candidates in rounds, so that drift in the machine hits them alike.

  Each candidate gets ``warmup`` untimed calls, then ``runs`` rounds in which every candidate
  runs once. The order within a round is shuffled (seeded by ``shuffle_seed``; None keeps the
  given order): in a fixed order the call right after a torch call was measured 15-30% slower on
  a 2-core machine (torch's threads still spinning), and it always hit the same candidate.
  Rounds continue past ``runs`` while the timed rounds have taken less than ``min_seconds`` in
  all (at most ``max_runs`` rounds): fast candidates get more samples, so that their medians
  are steadier on a noisy machine. Returns each candidate's median, min and max in milliseconds.
  """
  if runs < 1:
    raise ValueError(f"runs must be >= 1, got {runs}")
  max_runs = max(runs, max_runs)
  for fn in fns.values():
    for _ in range(warmup):
      sync(fn())
  samples: dict[str, list[float]] = {name: [] for name in fns}
  names = list(fns)
  shuffler = None if shuffle_seed is None else random.Random(shuffle_seed)
  started = time.perf_counter()
  done = 0
  while done < runs or (done < max_runs and time.perf_counter() - started < min_seconds):
    done += 1
    order = names if shuffler is None else shuffler.sample(names, len(names))
    for name in order:
      start = time.perf_counter()
      sync(fns[name]())
      samples[name].append((time.perf_counter() - start) * 1e3)
    if on_step is not None:
      on_step()
  return {name: _summarize(s) for name, s in samples.items()}
