"""jaxfuse: kernel fusion and recomputation for training Flax models in JAX.

- :mod:`jaxfuse.ops`: differentiable fused ops (``implementation=None | "pallas" | "triton" |
  "xla"``);
- :func:`jaxfuse.recompute` and :mod:`jaxfuse.remat`: save less, recompute the rest;
- :mod:`jaxfuse.nnx` and :mod:`jaxfuse.linen`: Flax modules over the ops;
- :mod:`jaxfuse.metrics`: residual bytes, bytes moved, timing.
"""

from jaxfuse import interop, linen, metrics, nnx, ops, remat
from jaxfuse.ops.dispatch import ImplementationUnavailableError, pallas_interpret
from jaxfuse.remat import recompute

__version__ = "0.1.0"

__all__ = [
    "ImplementationUnavailableError",
    "interop",
    "linen",
    "metrics",
    "nnx",
    "ops",
    "pallas_interpret",
    "recompute",
    "remat",
]
