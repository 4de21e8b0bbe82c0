"""Pallas kernels of the fused linear cross-entropy: per-token statistics and the logit gradient.

- ``stats_forward``: one program per block of tokens walks the vocabulary in tiles. Each tile's
  logits ``h @ w.T (+ bias)`` are made in registers (a loop over the hidden dimension), soft-
  capped, scaled (an inverse temperature), and folded into an online logsumexp, the target
  logit (gathered where the column is the label), the sum of the logits (or, for the entropy,
  their mean under the softmax, rescaled online like the logsumexp) and the running argmax. No
  logits reach memory.
- ``logit_grad``: one program per (token block, vocabulary tile) recomputes that tile's logits
  and writes the logit gradient ``a * softmax - b * onehot(label) - c`` (or, for the entropy,
  ``softmax * (a + c * logit) - b * onehot(label)``), times the scale's and the soft-cap's
  derivatives, for a chunk of tokens; the caller multiplies it into ``dh`` and ``dweight``.

``h`` and ``w`` are read through whole-array refs in power-of-2 tiles whose tails (tokens,
vocabulary, hidden) are masked, so no size needs to be a multiple of a block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from . import common

# GPU tiles: tokens x vocabulary x hidden, and warps. float32 products are IEEE (FMAs, whose
# operands and accumulators live in registers): at the 2-byte tiles and warps they spill on
# sm_90a, so float32 takes narrower vocabulary tiles over 8 warps. Interpret mode loops over
# tiles in Python-free XLA loops, so it takes bigger ones.
GPU_BLOCKS = (64, 128, 32)
GPU_WARPS = 4
GPU_BLOCKS_F32 = (64, 64, 32)
GPU_WARPS_F32 = 8
INTERPRET_BLOCKS = (64, 256, 128)
_INT_MAX = jnp.iinfo(jnp.int32).max


def gpu_blocks(dtype) -> tuple[int, int, int]:
  """The GPU tiles (tokens, vocabulary, hidden) for inputs of ``dtype``."""
  return GPU_BLOCKS_F32 if jnp.dtype(dtype) == jnp.float32 else GPU_BLOCKS


def _blocks(n, v, d, interpret, blocks, dtype):
  bt, bv, bd = blocks or (INTERPRET_BLOCKS if interpret else gpu_blocks(dtype))
  return common.block_for(n, bt), common.block_for(v, bv), common.block_for(d, bd)


def _warps(num_warps, dtype) -> int:
  if num_warps is not None:
    return num_warps
  return GPU_WARPS_F32 if jnp.dtype(dtype) == jnp.float32 else GPU_WARPS


def _tile_logits(h_ref, w_ref, b_ref, row0, rows_ok, col0, cols_ok, *, bt, bv, bd, d, softcap,
                 scale=None):
  """The [bt, bv] logits of one tile in float32, soft-capped, then times ``scale``; a loop over
  the hidden axis."""

  def step(k, acc):
    d0 = k * bd
    d_ok = d0 + lax.broadcasted_iota(jnp.int32, (bd,), 0) < d
    hb = pl_triton.load(h_ref.at[pl.ds(row0, bt), pl.ds(d0, bd)],
                        mask=rows_ok[:, None] & d_ok[None, :], other=0)
    wb = pl_triton.load(w_ref.at[pl.ds(col0, bv), pl.ds(d0, bd)],
                        mask=cols_ok[:, None] & d_ok[None, :], other=0)
    return acc + lax.dot_general(hb, wb, (((1,), (1,)), ((), ())),
                                 precision=lax.Precision.HIGHEST,
                                 preferred_element_type=jnp.float32)

  acc = lax.fori_loop(0, pl.cdiv(d, bd), step, jnp.zeros((bt, bv), jnp.float32))
  if b_ref is not None:
    acc = acc + pl_triton.load(b_ref.at[pl.ds(col0, bv)], mask=cols_ok,
                               other=0).astype(jnp.float32)[None, :]
  if softcap is not None:
    # tanh from expm1 (Triton has no tanh lowering; this is also within 2 ulp).
    x = acc * (1.0 / softcap)
    m = jnp.expm1(-2.0 * jnp.abs(x))
    t = -m / (2.0 + m)
    acc = softcap * jnp.where(x < 0, -t, t)
  if scale is not None:
    acc = acc * scale
  return acc


def _chain(dz, z, *, softcap, scale):
  """``dz`` (the gradient of the scaled logits ``z``) times the derivatives of the scale and of
  the soft-cap: the gradient of the raw logits."""
  if scale is not None:
    dz = dz * scale
  if softcap is not None:
    t = z * (1.0 / (softcap * (scale if scale is not None else 1.0)))
    dz = dz * (1.0 - t * t)
  return dz


def _stats_kernel(*refs, n, v, d, bt, bv, bd, softcap, scale, entropy, has_bias):
  if has_bias:
    h_ref, w_ref, b_ref, y_ref, lse_ref, tgt_ref, sum_ref, arg_ref = refs
  else:
    h_ref, w_ref, y_ref, lse_ref, tgt_ref, sum_ref, arg_ref = refs
    b_ref = None
  row0 = pl.program_id(0) * bt
  rows_ok = common.tail_mask(0, bt, n)
  labels = pl_triton.load(y_ref, mask=rows_ok, other=-1)

  def tile(j, carry):
    m, s, target, total, best = carry
    col0 = j * bv
    cols = col0 + lax.broadcasted_iota(jnp.int32, (bv,), 0)
    cols_ok = cols < v
    z = _tile_logits(h_ref, w_ref, b_ref, row0, rows_ok, col0, cols_ok, bt=bt, bv=bv, bd=bd,
                     d=d, softcap=softcap, scale=scale)
    z = jnp.where(cols_ok[None, :], z, -jnp.inf)
    tile_max = jnp.max(z, axis=1)
    m_new = jnp.maximum(m, tile_max)
    rescale = jnp.exp(m - m_new)
    e = jnp.exp(z - m_new[:, None])
    s = s * rescale + jnp.sum(e, axis=1)
    target = target + jnp.sum(jnp.where(cols[None, :] == labels[:, None], z, 0.0), axis=1)
    if entropy:   # sum(exp(z - m) * z), rescaled as s is: the softmax's mean logit times s
      total = total * rescale + jnp.sum(e * jnp.where(cols_ok[None, :], z, 0.0), axis=1)
    else:
      total = total + jnp.sum(jnp.where(cols_ok[None, :], z, 0.0), axis=1)
    first = jnp.min(jnp.where(z == tile_max[:, None], cols[None, :], _INT_MAX), axis=1)
    best = jnp.where(tile_max > m, first, best)
    return m_new, s, target, total, best

  zeros = jnp.zeros((bt,), jnp.float32)
  init = (jnp.full((bt,), -jnp.inf, jnp.float32), zeros, zeros, zeros,
          jnp.zeros((bt,), jnp.int32))
  m, s, target, total, best = lax.fori_loop(0, pl.cdiv(v, bv), tile, init)
  pl_triton.store(lse_ref, m + jnp.log(s), mask=rows_ok)
  pl_triton.store(tgt_ref, target, mask=rows_ok)
  pl_triton.store(sum_ref, total / s if entropy else total, mask=rows_ok)
  pl_triton.store(arg_ref, best, mask=rows_ok)


def _specs(bt):
  """The block specs of a grid over token tiles (and vocabulary tiles, whose program id the
  index maps ignore): a whole operand, and a ``[bt]`` tile of a per-token vector."""
  whole = lambda x: pl.BlockSpec(x.shape, lambda i, *_: (0,) * x.ndim)  # noqa: E731
  row = pl.BlockSpec((bt,), lambda i, *_: (i,))
  return whole, row


def _operands(h, w, bias, per_token, whole, row):
  """The kernels' operands (``h``, ``w``, the bias if any, then the per-token vectors) and
  their specs."""
  params = [h, w] + ([bias] if bias is not None else [])
  return params + list(per_token), [whole(x) for x in params] + [row] * len(per_token)


def _estimate(inputs, out_shape, n, v, d, softcap):
  """The cost estimate (a scheduling hint) of a pass over the ``[n, v]`` logits."""
  return common.cost(inputs, out_shape, flops=2 * n * v * d + 8 * n * v,
                     transcendentals=n * v * (3 if softcap is not None else 1))


def refuses(*, grad_in_forward: bool = False, **_) -> str | None:
  """Why these kernels cannot take a call (None: they can): they compute the gradients in the
  backward pass only (``grad_in_forward=True`` is an XLA mode)."""
  if grad_in_forward:
    return "computes the gradients in the backward pass; grad_in_forward=True is an XLA mode"
  return None


def stats_forward(h, w, bias, labels, *, softcap=None, scale=None, entropy=False,
                  interpret=False, blocks=None, num_warps=None):
  """Per-token logsumexp, target logit, sum of logits and argmax of ``h @ w.T + bias``.

  Args:
    h: ``[N, D]``; w: ``[V, D]``; bias: ``[V]`` or None; labels: ``[N]`` int32 (any value;
      a label outside ``[0, V)`` gathers 0).
    softcap: logits become ``softcap * tanh(logits / softcap)`` first.
    scale: then they are multiplied by ``scale`` (an inverse temperature; None: 1).
    entropy: the third statistic is the logits' mean under their softmax, ``sum(p * z)`` (the
      entropy is ``lse`` minus it), instead of their sum.
    interpret: Pallas interpret mode (CPU tests).
    blocks: ``(tokens, vocabulary, hidden)`` tile sizes, powers of 2 (default
      :func:`gpu_blocks`, or larger ones in interpret mode).
    num_warps: warps per program (default ``GPU_WARPS``, ``GPU_WARPS_F32`` for float32).

  Returns:
    ``(lse, target, sum, argmax)``, each ``[N]``: float32 and the last int32.
  """
  n, d = h.shape
  v = w.shape[0]
  bt, bv, bd = _blocks(n, v, d, interpret, blocks, h.dtype)
  kernel = functools.partial(_stats_kernel, n=n, v=v, d=d, bt=bt, bv=bv, bd=bd, softcap=softcap,
                             scale=scale, entropy=entropy, has_bias=bias is not None)
  grid = (pl.cdiv(n, bt),)
  whole, row = _specs(bt)
  inputs, in_specs = _operands(h, w, bias, [labels], whole, row)
  out_shape = [jax.ShapeDtypeStruct((n,), jnp.float32)] * 3 + [
      jax.ShapeDtypeStruct((n,), jnp.int32)]
  return common.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=grid,
      in_specs=in_specs,
      out_specs=[row] * 4,
      interpret=interpret,
      compiler_params=common.triton_params(num_warps=_warps(num_warps, h.dtype), num_stages=2),
      cost_estimate=_estimate(inputs, out_shape, n, v, d, softcap),
      name="linear_xent_fwd",
  )(*inputs)


def _grad_kernel(*refs, n, v, d, bt, bv, bd, softcap, scale, has_bias, smoothing, entropy):
  if has_bias:
    h_ref, w_ref, b_ref, y_ref, lse_ref, a_ref, b2_ref, c_ref, o_ref = refs
  else:
    h_ref, w_ref, y_ref, lse_ref, a_ref, b2_ref, c_ref, o_ref = refs
    b_ref = None
  row0 = pl.program_id(0) * bt
  col0 = pl.program_id(1) * bv
  rows_ok = common.tail_mask(0, bt, n)
  cols = col0 + lax.broadcasted_iota(jnp.int32, (bv,), 0)
  cols_ok = cols < v
  labels = pl_triton.load(y_ref, mask=rows_ok, other=-1)
  lse = pl_triton.load(lse_ref, mask=rows_ok, other=0)
  a = pl_triton.load(a_ref, mask=rows_ok, other=0)
  b = pl_triton.load(b2_ref, mask=rows_ok, other=0)
  z = _tile_logits(h_ref, w_ref, b_ref, row0, rows_ok, col0, cols_ok, bt=bt, bv=bv, bd=bd, d=d,
                   softcap=softcap, scale=scale)
  p = jnp.exp(z - lse[:, None])
  if entropy:
    c = pl_triton.load(c_ref, mask=rows_ok, other=0)
    dz = p * (a[:, None] + c[:, None] * z)
  else:
    dz = p * a[:, None]
  dz = dz - jnp.where(cols[None, :] == labels[:, None], b[:, None], 0.0)
  if smoothing:
    dz = dz - pl_triton.load(c_ref, mask=rows_ok, other=0)[:, None]
  dz = _chain(dz, z, softcap=softcap, scale=scale)
  pl_triton.store(o_ref.at[pl.ds(row0, bt), pl.ds(col0, bv)], dz.astype(o_ref.dtype),
                  mask=rows_ok[:, None] & cols_ok[None, :])


def logit_grad(h, w, bias, labels, lse, a, b, c, *, softcap=None, scale=None, smoothing=True,
               entropy=False, interpret=False, blocks=None, num_warps=None, out_dtype=None):
  """The logit gradient ``[N, V]`` of a chunk of tokens, recomputing the logits tile by tile.

  Of the scaled logits ``z`` (:func:`stats_forward`): ``dz = a * exp(z - lse) - b *
  onehot(label) - c`` per token (``a, b, c, lse``: ``[N]`` float32; ``c`` only with
  ``smoothing``), or with ``entropy`` ``exp(z - lse) * (a + c * z) - b * onehot(label)``; then
  times ``scale`` and ``1 - (z / (scale * softcap))**2`` (the raw logits' gradient), in
  ``out_dtype`` (h's dtype by default); tiles and warps as in :func:`stats_forward`.
  """
  n, d = h.shape
  v = w.shape[0]
  bt, bv, bd = _blocks(n, v, d, interpret, blocks, h.dtype)
  kernel = functools.partial(_grad_kernel, n=n, v=v, d=d, bt=bt, bv=bv, bd=bd, softcap=softcap,
                             scale=scale, has_bias=bias is not None, smoothing=smoothing,
                             entropy=entropy)
  grid = (pl.cdiv(n, bt), pl.cdiv(v, bv))
  whole, row = _specs(bt)
  inputs, in_specs = _operands(h, w, bias, [labels, lse, a, b, c], whole, row)
  out_shape = jax.ShapeDtypeStruct((n, v), out_dtype or h.dtype)
  return common.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=grid,
      in_specs=in_specs,
      out_specs=whole(out_shape),
      interpret=interpret,
      compiler_params=common.triton_params(num_warps=_warps(num_warps, h.dtype), num_stages=2),
      cost_estimate=_estimate(inputs, out_shape, n, v, d, softcap),
      name="linear_xent_bwd_logit_grad",
  )(*inputs)
