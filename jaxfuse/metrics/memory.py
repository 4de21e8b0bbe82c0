"""Device memory: peak bytes where the platform reports them, and compiled memory statistics."""

from __future__ import annotations

import jax


def peak_bytes(device=None) -> int | None:
  """Peak bytes in use on ``device`` (default: the first device); None where not reported (CPU)."""
  device = device or jax.devices()[0]
  try:
    stats = device.memory_stats()
  except Exception:  # noqa: BLE001 - backends without statistics raise various errors.
    return None
  if not stats:
    return None
  value = stats.get("peak_bytes_in_use")
  return None if value is None else int(value)


def compiled_memory(f, *args, **kwargs) -> dict[str, int]:
  """XLA's memory analysis of the compiled ``f``: argument, output and temp bytes.

  On GPUs the temp bytes show what recomputation saves; XLA:CPU merges recomputation back into
  the forward pass, so on CPU use :func:`jaxfuse.metrics.residual_bytes` instead.
  """
  compiled = jax.jit(lambda *a: f(*a, **kwargs)).lower(*args).compile()
  stats = compiled.memory_analysis()
  return {
      "argument_bytes": int(stats.argument_size_in_bytes),
      "output_bytes": int(stats.output_size_in_bytes),
      "temp_bytes": int(stats.temp_size_in_bytes),
      "alias_bytes": int(stats.alias_size_in_bytes),
  }
