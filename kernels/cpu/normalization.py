"""LayerNorm and RMSNorm, forward and backward kernels for CPUs (``normalization.cc``).

Over ``(rows, H)`` arrays, with the signatures of :mod:`jaxfuse.kernels.pallas.normalization`.
The parameters go in as float32. The forward reads ``x`` (and ``residual``) once and writes ``y`` (and ``z = x + residual``) and
the float32 row statistics; the backward reads ``x`` and ``g`` (and the gradient of ``z``) once
and writes ``dx``, summing the parameters' gradients per chunk of rows. XLA:CPU takes a loop
per reduction and per output for the same work. Float32 math for every storage dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import Library

_TARGETS = ("jaxfuse_norm_forward", "jaxfuse_norm_backward")
LIBRARY = Library("normalization", _TARGETS)
ready = LIBRARY.ready   # asked by implementation=None (False, warned, where it cannot load)
F32 = jnp.float32


def _empty(dtype):
  return jnp.zeros((0,), dtype)


def _spec(shape, dtype, present: bool):
  return jax.ShapeDtypeStruct(shape if present else (0,), dtype)


def forward(x, residual, scale, bias, *, eps: float, centered: bool, store_stats: bool):
  """``(y, z, mean, rstd)``: z None without a residual; the float32 ``(rows, 1)`` mean None
  unless centered and ``store_stats``, rstd None unless ``store_stats``."""
  LIBRARY.load()
  rows = x.shape[0]
  outs = (jax.ShapeDtypeStruct(x.shape, x.dtype),
          _spec(x.shape, x.dtype, residual is not None),
          _spec((rows, 1), F32, centered and store_stats),
          _spec((rows, 1), F32, store_stats))
  y, z, mean, rstd = jax.ffi.ffi_call("jaxfuse_norm_forward", outs, vmap_method="broadcast_all")(
      x, _empty(x.dtype) if residual is None else residual,
      *(_empty(F32) if a is None else a.astype(F32) for a in (scale, bias)),
      eps=np.float32(eps), centered=bool(centered))
  return (y, z if residual is not None else None, mean if centered and store_stats else None,
          rstd if store_stats else None)


def backward(x, g, sum_grad, scale, mean, rstd, *, has_bias: bool):
  """``(dx, dscale, dbias)``: dx in x's dtype, the float32 ``(H,)`` parameter gradients None
  where there is no scale or no bias."""
  LIBRARY.load()
  h = x.shape[-1]
  outs = (jax.ShapeDtypeStruct(x.shape, x.dtype), _spec((h,), F32, scale is not None),
          _spec((h,), F32, has_bias))
  dx, dscale, dbias = jax.ffi.ffi_call("jaxfuse_norm_backward", outs,
                                       vmap_method="broadcast_all")(
      x, g, _empty(x.dtype) if sum_grad is None else sum_grad.astype(x.dtype),
      _empty(F32) if scale is None else scale.astype(F32),
      _empty(F32) if mean is None else mean, rstd)
  return dx, dscale if scale is not None else None, dbias if has_bias else None
