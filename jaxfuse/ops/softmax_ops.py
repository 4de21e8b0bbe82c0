"""Softmax with an optional boolean mask, whose backward keeps only the output.

``softmax(x)`` reads its row once (with a numerically stable max) and writes the result; the
backward ``dx = scale * y * (g - sum(g * y))`` needs only that output ``y``, so ``y`` is the one
array kept between the passes. Low-precision inputs are computed in float32 and rounded once.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp

from jaxfuse.ops import base, checks, partitioning

SOFTMAX = base.Op("softmax", "softmax", base.KERNEL_GPU_ORDER)


# Reference --------------------------------------------------------------------------------------


def softmax_reference(x: jax.Array, *, axis: int = -1, scale: float = 1.0,
                      mask: jax.Array | None = None) -> jax.Array:
  """Plain-jnp ``softmax(scale * x)`` over ``axis`` in float32; masked-out rows give zeros."""
  z = x.astype(base.compute_dtype(x.dtype))
  if scale != 1.0:
    z = z * scale
  if mask is not None:
    z = jnp.where(mask, z, -jnp.inf)
  # A row with no kept entry has max -inf: the floor keeps exp(z - m) at 0 there (not NaN), and
  # its sum of 0 is lifted to 1. Any other row has a sum >= 1 (its max contributes exp(0)).
  m = jnp.max(z, axis=axis, keepdims=True, initial=jnp.finfo(z.dtype).min)
  e = jnp.exp(z - m)
  l = jnp.sum(e, axis=axis, keepdims=True)
  return (e * (1.0 / jnp.maximum(l, 1.0))).astype(x.dtype)


# Checks -----------------------------------------------------------------------------------------


def _check(op, x, axis, scale, mask):
  checks.floating(op, "x", x)
  if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
    raise TypeError(f"{op}: axis must be an int, got {type(axis).__name__}")
  if not -x.ndim <= axis < max(x.ndim, 1) or x.ndim == 0:
    raise ValueError(f"{op}: axis {axis} is out of range for x of shape {tuple(x.shape)}")
  if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
    raise TypeError(f"{op}: scale must be a Python float, got {type(scale).__name__}")
  if mask is not None:
    dtype = getattr(mask, "dtype", None)
    if dtype is None or jnp.dtype(dtype) != jnp.bool_:
      got = jnp.dtype(dtype).name if dtype is not None else type(mask).__name__
      raise TypeError(f"{op}: mask must be a boolean array (True = keep), got {got}")
    try:
      shape = jnp.broadcast_shapes(mask.shape, x.shape)
    except ValueError:
      shape = None
    if shape != tuple(x.shape):
      raise ValueError(f"{op}: mask must broadcast to the shape of x {tuple(x.shape)}, got "
                       f"shape {tuple(mask.shape)}")


@dataclasses.dataclass(frozen=True)
class _Config(base.Config):
  axis: int
  scale: float


# The op -----------------------------------------------------------------------------------------


def softmax(x: jax.Array, *, axis: int = -1, scale: float = 1.0, mask: jax.Array | None = None,
            implementation: str | None = None) -> jax.Array:
  """``softmax(scale * x)`` along ``axis``, keeping only the output for the backward pass.

  Args:
    x: a float array (float32, bfloat16 or float16).
    axis: the axis to normalize over.
    scale: a Python float multiplying ``x`` first (attention's ``1/sqrt(d)``).
    mask: an optional boolean array broadcastable to ``x``; True keeps an entry, False drops it
      (its probability is 0). A row with no kept entry (or whose entries are all ``-inf``) comes
      out as zeros, and its gradient as zeros. ``torch.softmax`` returns NaN for such a row.
    implementation: ``None`` (Pallas on GPUs, XLA elsewhere), ``"pallas"``, ``"triton"`` or
      ``"xla"``.

  Returns:
    An array like ``x`` whose entries along ``axis`` are non-negative and sum to 1. An empty
    ``x`` (a zero-size axis) gives an empty result.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxfuse.ops import softmax
    >>> softmax(jnp.array([[0.0, 0.0], [1e4, 1e4]]))
    Array([[0.5, 0.5],
           [0.5, 0.5]], dtype=float32)
    >>> softmax(jnp.array([1.0, 2.0, 3.0]), mask=jnp.array([True, False, False]))
    Array([1., 0., 0.], dtype=float32)
  """
  _check(SOFTMAX.name, x, axis, scale, mask)
  cfg = SOFTMAX.config(implementation, _Config, axis=axis % x.ndim, scale=float(scale))
  if x.size == 0:  # nothing to normalize; the result (and its gradient) is empty
    return jnp.zeros_like(x)
  with jax.named_scope("jaxfuse.softmax"):
    return _softmax(x, mask, cfg)


# Forward and backward ---------------------------------------------------------------------------


def _to_rows(x, axis):
  """``x`` with ``axis`` moved last (the kernels see the other axes as their rows), plus how to
  undo it."""
  return jnp.moveaxis(x, axis, -1), lambda y: jnp.moveaxis(y, -1, axis)


def _xla_backward(y, g, axis, scale):
  cd = base.compute_dtype(y.dtype)
  yc, gc = y.astype(cd), g.astype(cd)
  dot = jnp.sum(yc * gc, axis=axis, keepdims=True)
  return (scale * yc * (gc - dot)).astype(y.dtype)


def _rule(operands, x):
  """The kernels' partitioning: over the rows (any of ``x``'s leading axes), each row whole."""
  r = partitioning.ROWS
  return partitioning.rows_rule((r,) * operands, (r,), lead=x.ndim - 1)


def _forward(x, mask, cfg):
  """Every implementation sees the normalized axis last (the other axes are its rows; with
  ``axis=-1`` nothing moves)."""
  rows, undo = _to_rows(x, cfg.axis)
  mask_rows = None
  if mask is not None:
    mask_rows, _ = _to_rows(jnp.broadcast_to(mask, x.shape), cfg.axis)
  twin = functools.partial(_rows_reference, scale=cfg.scale)
  return undo(cfg.run("softmax_forward", twin, rows, mask_rows, rule=_rule(2, rows),
                      scale=cfg.scale))


def _rows_reference(rows, mask_rows, scale):
  return softmax_reference(rows, axis=-1, scale=scale, mask=mask_rows)


def _backward(y, g, cfg):
  y_rows, undo = _to_rows(y, cfg.axis)
  g_rows, _ = _to_rows(g, cfg.axis)
  twin = functools.partial(_xla_backward, axis=-1, scale=cfg.scale)
  return undo(cfg.run("softmax_backward", twin, y_rows, g_rows, rule=_rule(2, y_rows),
                      scale=cfg.scale))


# The custom VJP ---------------------------------------------------------------------------------


@partitioning.matching_vma
@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _softmax(x, mask, cfg):
  return _forward(x, mask, cfg)


def _softmax_fwd(x, mask, cfg):
  y = _forward(x, mask, cfg)
  # The one residual: the output. Masked entries of y are 0, so the backward needs no mask.
  return y, y


def _softmax_bwd(cfg, y, g):
  return _backward(y, g, cfg), None


_softmax.defvjp(_softmax_fwd, _softmax_bwd)
