"""FlashAttention kernels (Pallas, lowered through Triton on GPUs): forward, dq, dk/dv, dbias.

Layout ``[batch, seq, heads, head_dim]``. Every kernel sees whole ``[seq, head_dim]`` slabs of
its (batch, head) and loads power-of-2 tiles of them with masks, so sequence lengths need not be
multiples of a tile and the head dim need not be a power of 2 (tiles are padded to the next one,
at least 16, with zeros). Scores are kept in base 2 (``q kᵀ · scale · log2 e``) so the kernels use
``exp2``; the saved log-sum-exp ``lse`` is in base 2 too. With a soft-cap ``c`` the natural-log
scores become ``c · tanh(q kᵀ · scale / c)`` first, and only then go to base 2 (and get the bias).

Masks: with ``causal`` query ``i`` sees keys ``j <= i + offset``, where ``offset`` is 0
(``"top_left"``) or ``kv_len - q_len`` (``"bottom_right"``; ``kv_len`` is ``kv_lengths[b]``,
read inside the kernel, or k's length); a sliding window ``W`` also asks ``j > i + offset - W``.
Tiles that these masks exclude are skipped, not loaded; of the tiles visited, only those a mask
edge crosses compute the mask (see :func:`_key_tiles` and :func:`_query_tiles`).

- ``attention_fwd_res``, grid (q tiles, heads, batch): online softmax over the key tiles a query
  tile can see (from the window's first one to the diagonal's last one); with segment ids, key
  tiles whose id range does not meet the query tile's are skipped. Writes ``o`` and ``lse``
  (``+inf`` for rows that see no key: their ``o`` is 0). ``attention_fwd`` is the same kernel
  writing ``o`` only, for a primal pass whose residuals are recomputed later (under
  ``jax.checkpoint``).
- ``attention_bwd_dq``, grid (q tiles, heads, batch): recomputes ``p = exp2(s - lse)`` over the
  same key tiles, ``ds = p (do vᵀ - delta)`` (times the soft-cap's ``1 - tanh²``) and
  accumulates ``dq = ds k``.
- ``attention_bwd_dkdv``, grid (k tiles, kv heads, batch): walks the query tiles (and the query
  heads sharing the kv head) that see its keys and accumulates ``dk = dsᵀ q``, ``dv = pᵀ do``
  in registers; no atomics.
- ``attention_bwd_dbias``, grid (q tiles, k tiles, batch x heads): ``ds`` per tile (before the
  soft-cap's factor: the bias is added after the cap), only when a bias is given. It is a
  kernel of its own, without side effects, so that XLA can drop it when nothing uses the bias
  gradient.

``delta = rowsum(o * do)`` is one fused XLA reduction before the backward kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from .. import limits
from . import common
# The tile sizes' public names, where callers have always found them.
from .attention_tiles import (BIAS_HEURISTIC_TABLE, HEURISTIC_TABLE, MAX_HEAD_DIM,  # noqa: F401
                              heuristic_block_sizes)
from .attention_tiles import (BlockSizes, _bias_batch, _disjoint, _dot, _INF,
                              _key_tiles, _kv_limit, _load_bias, _load_rows, _load_vec, _logits,
                              _NEG_INF, _offset, _optional_args, _optional_refs, _query_tiles,
                              _segment_range, _Spec, _spec, _store_rows, _visit)

LOG2E = 1.4426950408889634
# Forward ---------------------------------------------------------------------------------------


def _fwd_kernel(q_ref, k_ref, v_ref, *refs, spec: _Spec, bq: int, bk: int):
  kv_len_ref, q_seg_ref, kv_seg_ref, bias_ref, outs = _optional_refs(spec, refs)
  o_ref, lse_ref = outs if len(outs) == 2 else (outs[0], None)
  i, bi = pl.program_id(0), pl.program_id(2)
  if spec.causal is not None:  # the longest rows first: better balance at the end of the launch
    i = pl.num_programs(0) - 1 - i
  qs = i * bq
  q = _load_rows(q_ref, qs, bq, spec.tq, spec)
  kv_limit = _kv_limit(spec, kv_len_ref, bi)
  offset = _offset(spec, kv_limit)
  q_ids = q_range = None
  if q_seg_ref is not None:
    q_ids = _load_vec(q_seg_ref, qs, bq, spec.tq, -1)
    q_range = _segment_range(q_ids, qs + jnp.arange(bq) < spec.tq)

  def step(j, carry, masked):
    ks = j * bk

    def update(carry):
      m, l, acc = carry
      k = _load_rows(k_ref, ks, bk, spec.tk, spec)
      v = _load_rows(v_ref, ks, bk, spec.tk, spec)
      s, _ = _logits(q, k, spec, qs, ks, bq, bk, kv_limit, offset, q_ids, k_ids,
                     _load_bias(bias_ref, spec, qs, ks, bq, bk), masked)
      m_new = jnp.maximum(m, jnp.max(s, axis=1))
      m_use = jnp.where(m_new == _NEG_INF, 0.0, m_new)   # rows that saw no key yet
      alpha = jnp.exp2(m - m_use)
      p = jnp.exp2(s - m_use[:, None])
      acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v, spec)
      return m_new, l * alpha + jnp.sum(p, axis=1), acc

    k_ids = None
    if q_ids is not None:
      k_ids = _load_vec(kv_seg_ref, ks, bk, spec.tk, -2)
      return lax.cond(_disjoint(q_range, k_ids, ks, spec.tk), lambda c: c, update, carry)
    return update(carry)

  carry = (jnp.full((bq,), _NEG_INF, jnp.float32), jnp.zeros((bq,), jnp.float32),
           jnp.zeros((bq, spec.dp), jnp.float32))
  carry = _visit(_key_tiles(spec, qs, bq, bk, kv_limit, offset), step, carry,
                 masked_before=spec.window is not None, masked_after=spec.causal is not None)
  m, l, acc = carry
  empty = l == 0.0
  l_safe = jnp.where(empty, 1.0, l)
  _store_rows(o_ref, qs, acc / l_safe[:, None], spec.tq, spec)
  if lse_ref is not None:
    lse = jnp.where(empty, _INF, m + jnp.log2(l_safe))
    pl_triton.store(lse_ref.at[pl.ds(qs, bq)], lse, mask=qs + jnp.arange(bq) < spec.tq)


def _visible_pairs(spec: _Spec) -> int:
  """(query, key) pairs the causal and window masks leave (all of them without), per head: the
  kernels' cost hint (with kv_lengths, taken at k's length)."""
  if spec.causal is None:
    return spec.tq * spec.tk
  offset = spec.tk - spec.tq if spec.causal == "bottom_right" else 0
  last = np.arange(spec.tq) + offset               # each row's last visible key
  hi = np.clip(last + 1, 0, spec.tk)
  lo = 0 if spec.window is None else np.clip(last - spec.window + 1, 0, spec.tk)
  return int(np.sum(np.maximum(hi - lo, 0)))


def forward(q, k, v, q_seg, kv_seg, kv_lengths, bias, *, causal: bool | str | None,
            scale: float, blocks: BlockSizes, window: int | None = None,
            softcap: float | None = None, interpret: bool = False, with_lse: bool = True):
  """``(o, lse)``: the attention output and the base-2 row log-sum-exp ``[b, heads, q_len]``.

  ``causal`` is False/None, True/``"top_left"`` or ``"bottom_right"``; ``window`` (with a
  causal mask) and ``softcap`` as in :func:`jaxfuse.ops.attention`. Without ``with_lse`` the
  kernel (``attention_fwd`` instead of ``attention_fwd_res``) writes ``o`` only and ``lse`` is
  None: the primal pass under ``jax.checkpoint`` needs no residuals.
  """
  spec = _spec(q, k, bias, kv_lengths, q_seg, scale, causal, window, softcap)
  bq, bk = blocks.block_q, blocks.block_k
  g = spec.g
  slab_q = pl.BlockSpec((None, spec.tq, None, spec.d), lambda i, h, bi: (bi, 0, h, 0))
  slab_k = pl.BlockSpec((None, spec.tk, None, spec.d), lambda i, h, bi: (bi, 0, h // g, 0))
  bias_map = None
  if bias is not None:
    hb = spec.bias_shape[1]
    bias_map = pl.BlockSpec((None, None, spec.tq, spec.tk),
                            lambda i, h, bi: (_bias_batch(spec, bi), h if hb > 1 else 0, 0, 0))
  extra, extra_specs = _optional_args(
      spec, kv_lengths, q_seg, kv_seg, bias, seg_q_map=lambda i, h, bi: (bi, 0),
      seg_k_map=lambda i, h, bi: (bi, 0), bias_map=bias_map)
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
  out_specs = [slab_q]
  if with_lse:
    out_shape.append(jax.ShapeDtypeStruct((spec.b, spec.hq, spec.tq), jnp.float32))
    out_specs.append(pl.BlockSpec((None, None, spec.tq), lambda i, h, bi: (bi, h, 0)))
  nq = pl.cdiv(spec.tq, bq)
  pairs = _visible_pairs(spec) * spec.b * spec.hq
  operands = [q, k, v, *extra]
  outs = common.pallas_call(
      functools.partial(_fwd_kernel, spec=spec, bq=bq, bk=bk),
      out_shape=out_shape,
      grid=(nq, spec.hq, spec.b),
      in_specs=[slab_q, slab_k, slab_k] + extra_specs,
      out_specs=out_specs,
      interpret=interpret,
      compiler_params=common.triton_params(blocks.num_warps, blocks.num_stages),
      cost_estimate=common.cost(operands, out_shape, flops=4 * pairs * spec.d,
                                transcendentals=pairs),
      name="attention_fwd_res" if with_lse else "attention_fwd",
  )(*operands)
  return (outs[0], outs[1]) if with_lse else (outs[0], None)


# Backward --------------------------------------------------------------------------------------


def _dq_kernel(q_ref, k_ref, v_ref, *refs, spec: _Spec, bq: int, bk: int):
  kv_len_ref, q_seg_ref, kv_seg_ref, bias_ref, (do_ref, lse_ref, delta_ref, dq_ref) = (
      _optional_refs(spec, refs))
  i, bi = pl.program_id(0), pl.program_id(2)
  if spec.causal is not None:
    i = pl.num_programs(0) - 1 - i
  qs = i * bq
  q = _load_rows(q_ref, qs, bq, spec.tq, spec)
  do = _load_rows(do_ref, qs, bq, spec.tq, spec)
  lse = _load_vec(lse_ref, qs, bq, spec.tq, _INF)
  delta = _load_vec(delta_ref, qs, bq, spec.tq, 0.0)
  kv_limit = _kv_limit(spec, kv_len_ref, bi)
  offset = _offset(spec, kv_limit)
  q_ids = q_range = None
  if q_seg_ref is not None:
    q_ids = _load_vec(q_seg_ref, qs, bq, spec.tq, -1)
    q_range = _segment_range(q_ids, qs + jnp.arange(bq) < spec.tq)

  def step(j, dq, masked):
    ks = j * bk

    def update(dq):
      k = _load_rows(k_ref, ks, bk, spec.tk, spec)
      v = _load_rows(v_ref, ks, bk, spec.tk, spec)
      s, dcap = _logits(q, k, spec, qs, ks, bq, bk, kv_limit, offset, q_ids, k_ids,
                        _load_bias(bias_ref, spec, qs, ks, bq, bk), masked)
      p = jnp.exp2(s - lse[:, None])
      ds = p * (_dot(do, v, spec, trans_b=True) - delta[:, None])
      if dcap is not None:  # through the soft-cap
        ds = ds * dcap
      return dq + _dot(ds.astype(k.dtype), k, spec)

    k_ids = None
    if q_ids is not None:
      k_ids = _load_vec(kv_seg_ref, ks, bk, spec.tk, -2)
      return lax.cond(_disjoint(q_range, k_ids, ks, spec.tk), lambda c: c, update, dq)
    return update(dq)

  dq = jnp.zeros((bq, spec.dp), jnp.float32)
  dq = _visit(_key_tiles(spec, qs, bq, bk, kv_limit, offset), step, dq,
              masked_before=spec.window is not None, masked_after=spec.causal is not None)
  _store_rows(dq_ref, qs, dq * spec.scale, spec.tq, spec)


def _dkdv_kernel(q_ref, k_ref, v_ref, *refs, spec: _Spec, bq: int, bk: int):
  kv_len_ref, q_seg_ref, kv_seg_ref, bias_ref, (do_ref, lse_ref, delta_ref, dk_ref, dv_ref) = (
      _optional_refs(spec, refs))
  j, bi = pl.program_id(0), pl.program_id(2)
  ks = j * bk
  k = _load_rows(k_ref, ks, bk, spec.tk, spec)
  v = _load_rows(v_ref, ks, bk, spec.tk, spec)
  kv_limit = _kv_limit(spec, kv_len_ref, bi)
  offset = _offset(spec, kv_limit)
  tiles = _query_tiles(spec, ks, bq, bk, kv_limit, offset)
  k_ids = k_range = None
  if kv_seg_ref is not None:
    k_ids = _load_vec(kv_seg_ref, ks, bk, spec.tk, -2)
    k_range = _segment_range(k_ids, ks + jnp.arange(bk) < spec.tk)
  hb = spec.bias_shape[1] if spec.bias_shape is not None else 0

  def head(gi, carry):
    def step(i, carry, masked):
      qs = i * bq

      def update(carry):
        dk, dv = carry
        q = _load_rows(q_ref, qs, bq, spec.tq, spec, head=gi)
        do = _load_rows(do_ref, qs, bq, spec.tq, spec, head=gi)
        lse = _load_vec(lse_ref, qs, bq, spec.tq, _INF, head=gi)
        delta = _load_vec(delta_ref, qs, bq, spec.tq, 0.0, head=gi)
        bias_tile = _load_bias(bias_ref, spec, qs, ks, bq, bk, head=gi if hb > 1 else None)
        st, dcap = _logits(q, k, spec, qs, ks, bq, bk, kv_limit, offset, q_ids, k_ids,
                           bias_tile, masked, keys_on_rows=True)
        pt = jnp.exp2(st - lse[None, :])
        dv = dv + _dot(pt.astype(do.dtype), do, spec)
        dst = pt * (_dot(v, do, spec, trans_b=True) - delta[None, :])
        if dcap is not None:  # through the soft-cap
          dst = dst * dcap
        dk = dk + _dot(dst.astype(q.dtype), q, spec)
        return dk, dv

      q_ids = None
      if q_seg_ref is not None:
        q_ids = _load_vec(q_seg_ref, qs, bq, spec.tq, -1)
        return lax.cond(_disjoint(k_range, q_ids, qs, spec.tq), lambda c: c, update, carry)
      return update(carry)

    return _visit(tiles, step, carry, masked_before=spec.causal is not None,
                  masked_after=spec.window is not None)

  zeros = jnp.zeros((bk, spec.dp), jnp.float32)
  dk, dv = lax.fori_loop(0, spec.g, head, (zeros, zeros))
  _store_rows(dk_ref, ks, dk * spec.scale, spec.tk, spec)
  _store_rows(dv_ref, ks, dv, spec.tk, spec)


def _dbias_kernel(q_ref, k_ref, v_ref, *refs, spec: _Spec, bq: int, bk: int):
  kv_len_ref, q_seg_ref, kv_seg_ref, bias_ref, (do_ref, lse_ref, delta_ref, ds_ref) = (
      _optional_refs(spec, refs))
  i, j = pl.program_id(0), pl.program_id(1)
  bi = pl.program_id(2) // spec.hq
  qs, ks = i * bq, j * bk
  q = _load_rows(q_ref, qs, bq, spec.tq, spec)
  do = _load_rows(do_ref, qs, bq, spec.tq, spec)
  k = _load_rows(k_ref, ks, bk, spec.tk, spec)
  v = _load_rows(v_ref, ks, bk, spec.tk, spec)
  lse = _load_vec(lse_ref, qs, bq, spec.tq, _INF)
  delta = _load_vec(delta_ref, qs, bq, spec.tq, 0.0)
  q_ids = k_ids = None
  if q_seg_ref is not None:
    q_ids = _load_vec(q_seg_ref, qs, bq, spec.tq, -1)
    k_ids = _load_vec(kv_seg_ref, ks, bk, spec.tk, -2)
  kv_limit = _kv_limit(spec, kv_len_ref, bi)
  s, _ = _logits(q, k, spec, qs, ks, bq, bk, kv_limit, _offset(spec, kv_limit), q_ids, k_ids,
                 _load_bias(bias_ref, spec, qs, ks, bq, bk), spec.causal is not None)
  p = jnp.exp2(s - lse[:, None])
  # The gradient of the biased scores: the bias is added after the soft-cap.
  ds = p * (_dot(do, v, spec, trans_b=True) - delta[:, None])
  rows = qs + jnp.arange(bq)
  cols = ks + jnp.arange(bk)
  mask = (rows < spec.tq)[:, None] & (cols < spec.tk)[None, :]
  pl_triton.store(ds_ref.at[pl.ds(qs, bq), pl.ds(ks, bk)], ds.astype(ds_ref.dtype), mask=mask)


def forward_output(q, k, v, q_seg, kv_seg, kv_lengths, bias, **options):
  """The attention output alone, the primal pass: :func:`forward` without the log-sum-exp."""
  return forward(q, k, v, q_seg, kv_seg, kv_lengths, bias, with_lse=False, **options)[0]


refuses = limits.refuses_head_dim


def backward(q, k, v, q_seg, kv_seg, kv_lengths, bias, o, lse, do, *,
             causal: bool | str | None, scale: float, blocks: BlockSizes,
             window: int | None = None, softcap: float | None = None,
             interpret: bool = False):
  """``(dq, dk, dv, dbias)`` from the residuals; ``dbias`` is None without a bias. The masks
  and ``softcap`` as in :func:`forward`."""
  spec = _spec(q, k, bias, kv_lengths, q_seg, scale, causal, window, softcap)
  g = spec.g
  delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1).transpose(0, 2, 1)
  pairs = _visible_pairs(spec) * spec.b * spec.hq
  params = common.triton_params(blocks.num_warps_bwd, blocks.num_stages_bwd)

  # dq: grid (q tiles, heads, batch), like the forward.
  bq, bk = blocks.block_q_dq, blocks.block_k_dq
  slab_q = pl.BlockSpec((None, spec.tq, None, spec.d), lambda i, h, bi: (bi, 0, h, 0))
  slab_k = pl.BlockSpec((None, spec.tk, None, spec.d), lambda i, h, bi: (bi, 0, h // g, 0))
  rows = pl.BlockSpec((None, None, spec.tq), lambda i, h, bi: (bi, h, 0))
  bias_map = None
  if bias is not None:
    hb = spec.bias_shape[1]
    bias_map = pl.BlockSpec((None, None, spec.tq, spec.tk),
                            lambda i, h, bi: (_bias_batch(spec, bi), h if hb > 1 else 0, 0, 0))
  extra, extra_specs = _optional_args(
      spec, kv_lengths, q_seg, kv_seg, bias, seg_q_map=lambda i, h, bi: (bi, 0),
      seg_k_map=lambda i, h, bi: (bi, 0), bias_map=bias_map)
  operands = [q, k, v, *extra, do, lse, delta]
  dq_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
  dq = common.pallas_call(
      functools.partial(_dq_kernel, spec=spec, bq=bq, bk=bk),
      out_shape=dq_shape,
      grid=(pl.cdiv(spec.tq, bq), spec.hq, spec.b),
      in_specs=[slab_q, slab_k, slab_k] + extra_specs + [slab_q, rows, rows],
      out_specs=slab_q,
      interpret=interpret,
      compiler_params=params,
      cost_estimate=common.cost(operands, dq_shape, flops=6 * pairs * spec.d,
                                transcendentals=pairs),
      name="attention_bwd_dq",
  )(*operands)

  # dk, dv: grid (k tiles, kv heads, batch); each program walks the g query heads of its kv head.
  bq, bk = blocks.block_q_dkdv, blocks.block_k_dkdv
  group_q = pl.BlockSpec((None, spec.tq, g, spec.d), lambda j, h, bi: (bi, 0, h, 0))
  own_k = pl.BlockSpec((None, spec.tk, None, spec.d), lambda j, h, bi: (bi, 0, h, 0))
  group_rows = pl.BlockSpec((None, g, spec.tq), lambda j, h, bi: (bi, h, 0))
  bias_map = None
  if bias is not None:
    hb = spec.bias_shape[1]
    bias_map = pl.BlockSpec((None, g if hb > 1 else None, spec.tq, spec.tk),
                            lambda j, h, bi: (_bias_batch(spec, bi), h if hb > 1 else 0, 0, 0))
  extra, extra_specs = _optional_args(
      spec, kv_lengths, q_seg, kv_seg, bias, seg_q_map=lambda j, h, bi: (bi, 0),
      seg_k_map=lambda j, h, bi: (bi, 0), bias_map=bias_map)
  operands = [q, k, v, *extra, do, lse, delta]
  dkdv_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype)] * 2
  dk, dv = common.pallas_call(
      functools.partial(_dkdv_kernel, spec=spec, bq=bq, bk=bk),
      out_shape=dkdv_shape,
      grid=(pl.cdiv(spec.tk, bk), spec.hkv, spec.b),
      in_specs=[group_q, own_k, own_k] + extra_specs + [group_q, group_rows, group_rows],
      out_specs=[own_k, own_k],
      interpret=interpret,
      compiler_params=params,
      cost_estimate=common.cost(operands, dkdv_shape, flops=8 * pairs * spec.d,
                                transcendentals=pairs),
      name="attention_bwd_dkdv",
  )(*operands)

  dbias = None
  if bias is not None:
    dbias = _dbias(q, k, v, q_seg, kv_seg, kv_lengths, bias, lse, delta, do, spec, blocks,
                   interpret)
  return dq, dk, dv, dbias


def _dbias(q, k, v, q_seg, kv_seg, kv_lengths, bias, lse, delta, do, spec, blocks, interpret):
  """ds for every (batch, head, query, key), summed over the axes the bias broadcasts."""
  bq, bk = blocks.block_q_dq, blocks.block_k_dq
  g, hq = spec.g, spec.hq
  slab_q = pl.BlockSpec((None, spec.tq, None, spec.d), lambda i, j, n: (n // hq, 0, n % hq, 0))
  slab_k = pl.BlockSpec((None, spec.tk, None, spec.d),
                        lambda i, j, n: (n // hq, 0, (n % hq) // g, 0))
  rows = pl.BlockSpec((None, None, spec.tq), lambda i, j, n: (n // hq, n % hq, 0))
  hb = spec.bias_shape[1]
  bias_map = pl.BlockSpec(
      (None, None, spec.tq, spec.tk),
      lambda i, j, n: (_bias_batch(spec, n // hq), n % hq if hb > 1 else 0, 0, 0))
  extra, extra_specs = _optional_args(
      spec, kv_lengths, q_seg, kv_seg, bias, seg_q_map=lambda i, j, n: (n // hq, 0),
      seg_k_map=lambda i, j, n: (n // hq, 0), bias_map=bias_map)
  out = jax.ShapeDtypeStruct((spec.b, hq, spec.tq, spec.tk), jnp.float32)
  operands = [q, k, v, *extra, do, lse, delta]
  ds = common.pallas_call(
      functools.partial(_dbias_kernel, spec=spec, bq=bq, bk=bk),
      out_shape=out,
      grid=(pl.cdiv(spec.tq, bq), pl.cdiv(spec.tk, bk), spec.b * hq),
      in_specs=[slab_q, slab_k, slab_k] + extra_specs + [slab_q, rows, rows],
      out_specs=pl.BlockSpec((None, None, spec.tq, spec.tk),
                             lambda i, j, n: (n // hq, n % hq, 0, 0)),
      interpret=interpret,
      compiler_params=common.triton_params(blocks.num_warps_bwd, blocks.num_stages_bwd),
      cost_estimate=common.cost(operands, out,
                                flops=4 * spec.b * hq * spec.tq * spec.tk * spec.d,
                                transcendentals=spec.b * hq * spec.tq * spec.tk),
      name="attention_bwd_dbias",
  )(*operands)
  axes = tuple(a for a in (0, 1) if spec.bias_shape[a] == 1)
  if axes:
    ds = jnp.sum(ds, axis=axes, keepdims=True)
  return ds.astype(bias.dtype)
