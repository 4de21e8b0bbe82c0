"""RMSNorm of query or key heads, then the rotary embedding, in one pass each way.

The rows are tokens, ``x`` is ``[tokens, heads, head_dim]`` (seen as ``[tokens, heads *
head_dim]``: the heads side by side, a free reshape). A program owns a block of tokens
and a group of heads: one head when the norm is per head (Qwen3, Gemma 3), all of them when it
spans the whole projection (OLMo 2). It reads each head as its two rotary halves, sums their
squares over the group, normalizes, scales by ``weight + offset`` (Gemma's ``1 + w``), rotates
by the token's ``cos`` and ``sin`` and writes the result: ``x`` is read once and the output
written once.

The backward keeps nothing but the inputs: it recomputes the statistics from ``x``, rotates
the output gradient back, and writes ``dx`` and float32 partial sums of the weight gradient, one
row per block of tokens (programs run in parallel, so they cannot add into one buffer); the
caller sums the few rows. Rows past the end and columns past the halves are masked on every
load and store; everything is computed in float32 and rounded once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from . import common

# Tokens a program owns: a few KiB of each head half in registers on a GPU; larger blocks in
# interpret mode, whose grid is a Python loop.
GPU_TOKENS, INTERPRET_TOKENS = 16, 256


def _plan(n: int, half: int, interpret: bool) -> tuple[int, int]:
  bp = common.next_power_of_2(max(half, 1))
  cap = INTERPRET_TOKENS if interpret else max(1, GPU_TOKENS * 64 // max(bp, 64))
  return common.block_for(n, cap), bp


def _traced(col, i):
  """``col`` as a traced value (``i`` is the program id): Pallas checks a static slice against
  the array's bounds, though the masked columns past them are never read or written."""
  return col + 0 * i


def _load(ref, i, col, bt, bp, mask):
  return pl_triton.load(ref.at[pl.ds(i * bt, bt), pl.ds(_traced(col, i), bp)], mask=mask,
                        other=0).astype(jnp.float32)


def _group(heads: int, d: int, whole: bool):
  """``(first head, heads in the group)`` of this program."""
  return (0, heads) if whole else (pl.program_id(1), 1)


def _stats(x_ref, i, first, count, *, d, half, bt, bp, mask, eps):
  """The float32 ``[bt]`` reciprocal RMS of this program's tokens over its heads."""
  def add(k, total):
    col = (first + k) * d
    x1, x2 = _load(x_ref, i, col, bt, bp, mask), _load(x_ref, i, col + half, bt, bp, mask)
    return total + jnp.sum(x1 * x1 + x2 * x2, axis=1)

  total = lax.fori_loop(0, count, add, jnp.zeros((bt,), jnp.float32))
  return lax.rsqrt(total * (1.0 / (count * d)) + eps)


def _weight(w_ref, head, i, *, d, half, bp, whole, offset):
  """The weight's two halves for ``head`` (the per-head weight is the same for every head)."""
  col = _traced(head * d if whole else 0, i)
  ok = lax.broadcasted_iota(jnp.int32, (bp,), 0) < half
  w1 = pl_triton.load(w_ref.at[pl.ds(col, bp)], mask=ok, other=0).astype(jnp.float32)
  w2 = pl_triton.load(w_ref.at[pl.ds(col + half, bp)], mask=ok, other=0).astype(jnp.float32)
  return w1 + offset, w2 + offset


def _masks(i, n, half, bt, bp):
  rows = i * bt + lax.broadcasted_iota(jnp.int32, (bt, bp), 0)
  cols = lax.broadcasted_iota(jnp.int32, (bt, bp), 1)
  return (rows < n) & (cols < half)


def _prologue(x_ref, cos_ref, sin_ref, *, n, heads, d, bt, bp, eps, whole):
  """What both kernels start with: the program's block, its mask, its group of heads, their
  reciprocal RMS and the block's rotation."""
  i = pl.program_id(0)
  mask = _masks(i, n, d // 2, bt, bp)
  first, count = _group(heads, d, whole)
  rstd = _stats(x_ref, i, first, count, d=d, half=d // 2, bt=bt, bp=bp, mask=mask, eps=eps)
  c, s = _load(cos_ref, i, 0, bt, bp, mask), _load(sin_ref, i, 0, bt, bp, mask)
  return i, mask, first, count, rstd, c, s


def _forward_kernel(x_ref, w_ref, cos_ref, sin_ref, y_ref, *, n, heads, d, bt, bp, eps,
                    offset, whole, has_weight):
  half = d // 2
  i, mask, first, count, rstd, c, s = _prologue(x_ref, cos_ref, sin_ref, n=n, heads=heads, d=d,
                                                bt=bt, bp=bp, eps=eps, whole=whole)

  def write(k, carry):
    head = first + k
    col = head * d
    n1 = _load(x_ref, i, col, bt, bp, mask) * rstd[:, None]
    n2 = _load(x_ref, i, col + half, bt, bp, mask) * rstd[:, None]
    if has_weight:
      w1, w2 = _weight(w_ref, head, i, d=d, half=half, bp=bp, whole=whole, offset=offset)
      n1, n2 = n1 * w1[None, :], n2 * w2[None, :]
    rows = pl.ds(i * bt, bt)
    pl_triton.store(y_ref.at[rows, pl.ds(_traced(col, i), bp)],
                    (n1 * c - n2 * s).astype(y_ref.dtype), mask=mask)
    pl_triton.store(y_ref.at[rows, pl.ds(_traced(col + half, i), bp)],
                    (n2 * c + n1 * s).astype(y_ref.dtype), mask=mask)
    return carry

  lax.fori_loop(0, count, write, 0)


def _operands(x, weight, cos, sin):
  whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)  # noqa: E731
  w = weight if weight is not None else jnp.zeros((2,), jnp.float32)
  return [x, w, cos, sin], [whole(a) for a in (x, w, cos, sin)]


def forward(x: jax.Array, weight: jax.Array | None, cos: jax.Array, sin: jax.Array, *,
            eps: float, offset: float = 0.0, whole: bool = False,
            interpret: bool = False) -> jax.Array:
  """``rope(rms_norm(x) * (weight + offset))`` per head, in one kernel.

  Args:
    x: ``[tokens, heads, head_dim]``.
    weight: ``[head_dim]`` (the norm per head) or ``[heads * head_dim]`` (over the whole
      row, ``whole=True``), or None.
    cos, sin: float32 ``[tokens, head_dim // 2]``, each token's rotation.
    eps: added to the mean square.
    offset: added to the weight (Gemma's ``1 + w``).
    whole: normalize over the whole row (all heads) rather than each head.
    interpret: Pallas interpret mode (CPU tests).

  Returns:
    ``[tokens, heads, head_dim]`` in x's dtype.
  """
  n, heads, d = x.shape
  if x.size == 0:
    return jnp.zeros_like(x)
  x = x.reshape(n, heads * d)
  bt, bp = _plan(n, d // 2, interpret)
  operands, specs = _operands(x, weight, cos, sin)
  kernel = functools.partial(_forward_kernel, n=n, heads=heads, d=d, bt=bt, bp=bp,
                             eps=float(eps), offset=float(offset), whole=whole,
                             has_weight=weight is not None)
  out = jax.ShapeDtypeStruct(x.shape, x.dtype)
  return common.pallas_call(
      kernel,
      out_shape=out,
      grid=(pl.cdiv(n, bt), 1 if whole else heads),
      in_specs=specs,
      out_specs=pl.BlockSpec(x.shape, lambda *_: (0, 0)),
      interpret=interpret,
      compiler_params=common.triton_params(num_warps=4),
      cost_estimate=common.cost(operands, out, flops=10 * x.size, transcendentals=n * heads),
      name="qk_norm_rope_fwd",
  )(*operands).reshape(n, heads, d)


def _backward_kernel(x_ref, w_ref, cos_ref, sin_ref, g_ref, dx_ref, dw_ref, *, n, heads, d, bt,
                     bp, eps, offset, whole, has_weight):
  half = d // 2
  i, mask, first, count, rstd, c, s = _prologue(x_ref, cos_ref, sin_ref, n=n, heads=heads, d=d,
                                                bt=bt, bp=bp, eps=eps, whole=whole)
  rows = pl.ds(i * bt, bt)

  def head_grads(k):
    """``(xhat, dn, dxhat)`` halves of head ``first + k``: the normalized input, the gradient of
    the scaled normalized input (the output gradient rotated back) and of ``xhat``."""
    head = first + k
    col = head * d
    xh1 = _load(x_ref, i, col, bt, bp, mask) * rstd[:, None]
    xh2 = _load(x_ref, i, col + half, bt, bp, mask) * rstd[:, None]
    g1, g2 = _load(g_ref, i, col, bt, bp, mask), _load(g_ref, i, col + half, bt, bp, mask)
    dn1, dn2 = g1 * c + g2 * s, g2 * c - g1 * s
    dxh1, dxh2 = dn1, dn2
    if has_weight:
      w1, w2 = _weight(w_ref, head, i, d=d, half=half, bp=bp, whole=whole, offset=offset)
      dxh1, dxh2 = dn1 * w1[None, :], dn2 * w2[None, :]
    return (xh1, xh2), (dn1, dn2), (dxh1, dxh2)

  def dot(k, total):
    (xh1, xh2), _, (dxh1, dxh2) = head_grads(k)
    return total + jnp.sum(xh1 * dxh1 + xh2 * dxh2, axis=1)

  mean_dot = lax.fori_loop(0, count, dot, jnp.zeros((bt,), jnp.float32)) * (1.0 / (count * d))

  def write(k, carry):
    (xh1, xh2), (dn1, dn2), (dxh1, dxh2) = head_grads(k)
    col = (first + k) * d
    for start, xh, dxh in ((col, xh1, dxh1), (col + half, xh2, dxh2)):
      dx = rstd[:, None] * (dxh - xh * mean_dot[:, None])
      pl_triton.store(dx_ref.at[rows, pl.ds(_traced(start, i), bp)], dx.astype(dx_ref.dtype),
                      mask=mask)
    if has_weight:
      ok = lax.broadcasted_iota(jnp.int32, (1, bp), 1) < half
      for start, xh, dn in ((col, xh1, dn1), (col + half, xh2, dn2)):
        part = jnp.sum(jnp.where(mask, dn * xh, 0.0), axis=0, keepdims=True)
        pl_triton.store(dw_ref.at[pl.ds(i, 1), pl.ds(_traced(start, i), bp)], part, mask=ok)
    return carry

  lax.fori_loop(0, count, write, 0)


def backward(x: jax.Array, weight: jax.Array | None, cos: jax.Array, sin: jax.Array,
             g: jax.Array, *, eps: float, offset: float = 0.0, whole: bool = False,
             interpret: bool = False) -> tuple[jax.Array, jax.Array | None]:
  """``(dx, dweight)`` of :func:`forward` for the output gradient ``g``: dx in x's dtype,
  dweight in float32 (None without a weight), from the statistics recomputed from ``x``."""
  n, heads, d = x.shape
  width = heads * d
  if x.size == 0:
    dw = None if weight is None else jnp.zeros(weight.shape, jnp.float32)
    return jnp.zeros_like(x), dw
  x, g = x.reshape(n, width), g.reshape(n, width)
  bt, bp = _plan(n, d // 2, interpret)
  blocks = pl.cdiv(n, bt)
  operands, specs = _operands(x, weight, cos, sin)
  operands.append(g)
  specs.append(pl.BlockSpec(g.shape, lambda *_: (0, 0)))
  kernel = functools.partial(_backward_kernel, n=n, heads=heads, d=d, bt=bt, bp=bp,
                             eps=float(eps), offset=float(offset), whole=whole,
                             has_weight=weight is not None)
  out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype),
               jax.ShapeDtypeStruct((blocks, width), jnp.float32)]
  dx, partials = common.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=(blocks, 1 if whole else heads),
      in_specs=specs,
      out_specs=[pl.BlockSpec(s.shape, lambda *_: (0, 0)) for s in out_shape],
      interpret=interpret,
      compiler_params=common.triton_params(num_warps=4),
      cost_estimate=common.cost(operands, out_shape, flops=20 * x.size,
                                transcendentals=n * heads),
      name="qk_norm_rope_bwd",
  )(*operands)
  dx = dx.reshape(n, heads, d)
  if weight is None:
    return dx, None
  dw = jnp.sum(partials, axis=0)
  return dx, dw if whole else jnp.sum(dw.reshape(heads, d), axis=0)
