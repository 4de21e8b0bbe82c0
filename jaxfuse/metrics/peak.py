"""Peak FLOP/s of accelerators, the denominator of model FLOPs utilization (MFU).

The figures are the vendors' dense (not sparse) bfloat16 matmul peaks of one device (a GPU, or
a TPU chip); a CPU has no such figure here (its peak depends on the cores a process gets, their
clocks and vector units): pass one explicitly (``python -m jaxfuse.train --peak-tflops``).
"""

from __future__ import annotations

import jax

# (what the device kind contains, lower case; dense bf16 FLOP/s). More specific names first.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("gh200", 989e12),
    ("h200", 989e12),
    ("h100 pcie", 756e12),
    ("h100", 989e12),
    ("h800", 989e12),
    ("b200", 2250e12),
    ("a100", 312e12),
    ("a800", 312e12),
    ("l40s", 362e12),
    ("tpu v4", 275e12),
    ("tpu v5 lite", 197e12),
    ("tpu v5e", 197e12),
    ("tpu v5p", 459e12),
    ("tpu v5", 459e12),
    ("tpu v6", 918e12),
)


def peak_flops(device: jax.Device | None = None) -> float | None:
  """The dense bfloat16 peak FLOP/s of ``device`` (default: the first device), or None where
  it is not known (CPUs, unlisted accelerators).

  Example:
    >>> import jax
    >>> peak_flops(jax.devices("cpu")[0]) is None
    True
  """
  device = device or jax.devices()[0]
  if device.platform == "cpu":
    return None
  kind = device.device_kind.lower()
  for name, flops in PEAK_BF16_FLOPS:
    if name in kind:
      return flops
  return None
