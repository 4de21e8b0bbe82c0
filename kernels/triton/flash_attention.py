"""FlashAttention kernels in Triton (``@triton.jit``, called from JAX through jax-triton):
forward, dq, dk/dv and dbias.

They are the Pallas kernels of :mod:`jaxfuse.kernels.pallas.flash_attention` written for Triton:
the same math, masks and tile ranges, and the same base-2 log-sum-exp. Layout
``[batch, seq, heads, head_dim]``, contiguous. Each program walks its rows in power-of-2 tiles
whose tails are masked, so sequence lengths need not be multiples of a tile; head dims are padded
inside the kernel to ``DP``, the next power of 2 (at least 16), with zeros. Scores are kept in
base 2 (``q kᵀ · scale · log2 e``) so the kernels use ``exp2``; with a soft-cap ``c`` the
natural-log scores become ``c · tanh(q kᵀ · scale / c)`` first, and only then go to base 2 (and
get the bias).

Masks: with ``CAUSAL`` (``"top_left"`` or ``"bottom_right"``; ``"none"`` without) query ``i``
sees keys ``j <= i + offset``, where ``offset`` is 0 at the top-left corner and
``kv_len - q_len`` at the bottom-right one (``kv_len`` is ``kv_lengths[b]``, read inside the
kernel, or k's length); a sliding window ``WINDOW`` (0: none) also asks
``j > i + offset - WINDOW``. Tiles these masks exclude are skipped, not loaded; of the tiles
visited, only those a mask edge crosses compute the mask (:func:`_key_tiles`,
:func:`_query_tiles`). With segment ids a tile whose ids do not meet the other side's is skipped.

- ``attention_fwd_res_kernel``, grid (q tiles, heads, batch): online softmax over the key tiles
  a query tile sees; writes ``o`` and the base-2 ``lse`` (``+inf`` for rows that see no key:
  their ``o`` is 0). ``attention_fwd_kernel`` is the same program writing ``o`` only.
- ``attention_bwd_dq_kernel``, grid (q tiles, heads, batch): recomputes ``p = exp2(s - lse)``
  over the same key tiles, ``ds = p (do vᵀ - delta)`` (times the soft-cap's ``1 - tanh²``) and
  accumulates ``dq = ds k``.
- ``attention_bwd_dkdv_kernel``, grid (k tiles, kv heads, batch): walks the query heads sharing
  its kv head and the query tiles that see its keys, accumulating ``dk = dsᵀ q`` and
  ``dv = pᵀ do`` in registers; no atomics.
- ``attention_bwd_dbias_kernel``, grid (q tiles, k tiles, batch x heads): ``ds`` of one tile
  (before the soft-cap's factor: the bias is added after the cap) in float32; the wrapper sums
  it over the axes the bias broadcasts.

Without a soft-cap the bias tile is the accumulator of ``q kᵀ`` (divided by the scale), which
saves the registers of a separate add; the scores are the Pallas kernels' up to rounding.
``delta = rowsum(o * do)`` is one fused XLA reduction before the backward kernels. Absent
optional inputs (kv_lengths, segment ids, bias) are compile-time flags; their pointer arguments
then receive ``q`` and are never read. The kernels run unchanged under Triton's interpreter
(``TRITON_INTERPRET=1``, torch CPU tensors), which is how CPU tests check them.
"""

from __future__ import annotations

import dataclasses
import math

import triton
import triton.language as tl

from .. import limits
from .attention_tiles import (_BIG, _INF, _LOG2E, _NEG_INF, CAUSAL_ALIGNMENTS, LOG2E,  # noqa: F401
                              _bias_base, _id_range, _key_tiles, _kv_limit_and_offset, _load_bias,
                              _load_rows, _load_vec, _meets, _query_tiles, _scores, _store_rows)


# Forward ---------------------------------------------------------------------------------------


@triton.jit
def _fwd_step(j, m, l, acc, q, k_base, v_base, kv_seg_base, bias_base, qs, kv_limit, offset,
              q_ids, q_lo, q_hi, TQ: tl.constexpr, TK: tl.constexpr, KV_STRIDE: tl.constexpr,
              D: tl.constexpr, DP: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
              SCALE: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
              SOFTCAP: tl.constexpr, HAS_SEGMENTS: tl.constexpr, HAS_BIAS: tl.constexpr,
              PRECISION: tl.constexpr, KEY_TAIL: tl.constexpr, MASKED: tl.constexpr):
  """Folds key tile ``j`` into the online softmax ``(m, l, acc)`` of a query tile."""
  ks = j * BK
  k_ids = 0
  visit = True
  if HAS_SEGMENTS:
    k_ids = _load_vec(kv_seg_base, ks, BK, TK, -2)
    visit = _meets(q_lo, q_hi, k_ids, ks, TK)
  if visit:
    k = _load_rows(k_base, ks, BK, TK, KV_STRIDE, D, DP)
    v = _load_rows(v_base, ks, BK, TK, KV_STRIDE, D, DP)
    bias_tile = 0.0
    if HAS_BIAS:
      bias_tile = _load_bias(bias_base, qs, ks, BQ, BK, TQ, TK, False)
    s, _ = _scores(q, k, qs, ks, kv_limit, offset, q_ids, k_ids, bias_tile, BQ, BK, SCALE,
                   CAUSAL, WINDOW, SOFTCAP, HAS_SEGMENTS, HAS_BIAS, PRECISION, MASKED, False,
                   KEY_TAIL)
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_use = tl.where(m_new == _NEG_INF, 0.0, m_new)  # rows that saw no key yet
    alpha = tl.exp2(m - m_use)
    p = tl.exp2(s - m_use[:, None])
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    l = l * alpha + tl.sum(p, axis=1)
    m = m_new
  return m, l, acc


@triton.jit
def _fwd_body(q_ptr, k_ptr, v_ptr, kv_len_ptr, q_seg_ptr, kv_seg_ptr, bias_ptr, o_ptr, lse_ptr,
              TQ: tl.constexpr, TK: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
              D: tl.constexpr, DP: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
              SCALE: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
              SOFTCAP: tl.constexpr, HAS_KV_LENGTHS: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
              HAS_BIAS: tl.constexpr, BIAS_B: tl.constexpr, BIAS_H: tl.constexpr,
              PRECISION: tl.constexpr, WRITE_LSE: tl.constexpr):
  i = tl.program_id(0)
  h = tl.program_id(1)
  bi = tl.program_id(2)
  if CAUSAL != "none":  # the longest rows first: better balance at the end of the launch
    i = tl.num_programs(0) - 1 - i
  qs = i * BQ
  q_base = q_ptr + (bi.to(tl.int64) * TQ * HQ + h) * D
  kv_off = (bi.to(tl.int64) * TK * HKV + h // (HQ // HKV)) * D
  KEY_TAIL: tl.constexpr = HAS_KV_LENGTHS or TK % BK != 0  # a key tile may cross the limit
  q = _load_rows(q_base, qs, BQ, TQ, HQ * D, D, DP)
  kv_limit, offset = _kv_limit_and_offset(kv_len_ptr, bi, TQ, TK, CAUSAL, HAS_KV_LENGTHS)
  q_ids = 0
  q_lo = 0
  q_hi = 0
  if HAS_SEGMENTS:
    q_ids = _load_vec(q_seg_ptr + bi * TQ, qs, BQ, TQ, -1)
    q_lo, q_hi = _id_range(q_ids, qs, TQ)
  bias_base = _bias_base(bias_ptr, bi, h, TQ, TK, BIAS_B, BIAS_H)
  kv_seg_base = kv_seg_ptr + bi * TK
  m = tl.full((BQ,), _NEG_INF, tl.float32)
  l = tl.zeros((BQ,), tl.float32)
  acc = tl.zeros((BQ, DP), tl.float32)
  lo, a, b, hi = _key_tiles(qs, kv_limit, offset, TQ, BQ, BK, CAUSAL, WINDOW)
  if WINDOW > 0:
    for j in range(lo, a):
      m, l, acc = _fwd_step(j, m, l, acc, q, k_ptr + kv_off, v_ptr + kv_off, kv_seg_base,
                            bias_base, qs, kv_limit, offset, q_ids, q_lo, q_hi, TQ, TK,
                            HKV * D, D, DP, BQ, BK, SCALE, CAUSAL, WINDOW, SOFTCAP,
                            HAS_SEGMENTS, HAS_BIAS, PRECISION, KEY_TAIL, True)
  for j in range(a, b):
    m, l, acc = _fwd_step(j, m, l, acc, q, k_ptr + kv_off, v_ptr + kv_off, kv_seg_base,
                          bias_base, qs, kv_limit, offset, q_ids, q_lo, q_hi, TQ, TK, HKV * D,
                          D, DP, BQ, BK, SCALE, CAUSAL, WINDOW, SOFTCAP, HAS_SEGMENTS,
                          HAS_BIAS, PRECISION, KEY_TAIL, False)
  if CAUSAL != "none":
    for j in range(b, hi):
      m, l, acc = _fwd_step(j, m, l, acc, q, k_ptr + kv_off, v_ptr + kv_off, kv_seg_base,
                            bias_base, qs, kv_limit, offset, q_ids, q_lo, q_hi, TQ, TK,
                            HKV * D, D, DP, BQ, BK, SCALE, CAUSAL, WINDOW, SOFTCAP,
                            HAS_SEGMENTS, HAS_BIAS, PRECISION, KEY_TAIL, True)
  empty = l == 0.0
  l_safe = tl.where(empty, 1.0, l)
  _store_rows(o_ptr + (bi.to(tl.int64) * TQ * HQ + h) * D, qs, acc / l_safe[:, None], TQ,
              HQ * D, D, DP)
  if WRITE_LSE:
    lse = tl.where(empty, _INF, m + tl.log2(l_safe))
    rows = qs + tl.arange(0, BQ)
    tl.store(lse_ptr + (bi.to(tl.int64) * HQ + h) * TQ + rows, lse, mask=rows < TQ)


@triton.jit
def attention_fwd_res_kernel(q_ptr, k_ptr, v_ptr, kv_len_ptr, q_seg_ptr, kv_seg_ptr, bias_ptr,
                             o_ptr, lse_ptr, TQ: tl.constexpr, TK: tl.constexpr,
                             HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                             DP: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
                             SCALE: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                             SOFTCAP: tl.constexpr, HAS_KV_LENGTHS: tl.constexpr,
                             HAS_SEGMENTS: tl.constexpr, HAS_BIAS: tl.constexpr,
                             BIAS_B: tl.constexpr, BIAS_H: tl.constexpr,
                             PRECISION: tl.constexpr):
  """The forward writing ``o [b, tq, hq, d]`` and the base-2 ``lse [b, hq, tq]`` (float32)."""
  _fwd_body(q_ptr, k_ptr, v_ptr, kv_len_ptr, q_seg_ptr, kv_seg_ptr, bias_ptr, o_ptr, lse_ptr,
            TQ, TK, HQ, HKV, D, DP, BQ, BK, SCALE, CAUSAL, WINDOW, SOFTCAP, HAS_KV_LENGTHS,
            HAS_SEGMENTS, HAS_BIAS, BIAS_B, BIAS_H, PRECISION, True)


@triton.jit
def attention_fwd_kernel(q_ptr, k_ptr, v_ptr, kv_len_ptr, q_seg_ptr, kv_seg_ptr, bias_ptr,
                         o_ptr, TQ: tl.constexpr, TK: tl.constexpr, HQ: tl.constexpr,
                         HKV: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                         BQ: tl.constexpr, BK: tl.constexpr, SCALE: tl.constexpr,
                         CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                         HAS_KV_LENGTHS: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
                         HAS_BIAS: tl.constexpr, BIAS_B: tl.constexpr, BIAS_H: tl.constexpr,
                         PRECISION: tl.constexpr):
  """The forward writing ``o`` only (a primal pass whose residuals are recomputed later)."""
  _fwd_body(q_ptr, k_ptr, v_ptr, kv_len_ptr, q_seg_ptr, kv_seg_ptr, bias_ptr, o_ptr, o_ptr,
            TQ, TK, HQ, HKV, D, DP, BQ, BK, SCALE, CAUSAL, WINDOW, SOFTCAP, HAS_KV_LENGTHS,
            HAS_SEGMENTS, HAS_BIAS, BIAS_B, BIAS_H, PRECISION, False)


# Backward --------------------------------------------------------------------------------------


@triton.jit
def _dq_step(j, dq, q, do, lse, delta, k_base, v_base, kv_seg_base, bias_base, qs, kv_limit,
             offset, q_ids, q_lo, q_hi, TQ: tl.constexpr, TK: tl.constexpr,
             KV_STRIDE: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BQ: tl.constexpr,
             BK: tl.constexpr, SCALE: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
             SOFTCAP: tl.constexpr, HAS_SEGMENTS: tl.constexpr, HAS_BIAS: tl.constexpr,
             PRECISION: tl.constexpr, KEY_TAIL: tl.constexpr, MASKED: tl.constexpr):
  """Adds key tile ``j``'s share ``ds k`` to a query tile's ``dq``."""
  ks = j * BK
  k_ids = 0
  visit = True
  if HAS_SEGMENTS:
    k_ids = _load_vec(kv_seg_base, ks, BK, TK, -2)
    visit = _meets(q_lo, q_hi, k_ids, ks, TK)
  if visit:
    k = _load_rows(k_base, ks, BK, TK, KV_STRIDE, D, DP)
    v = _load_rows(v_base, ks, BK, TK, KV_STRIDE, D, DP)
    bias_tile = 0.0
    if HAS_BIAS:
      bias_tile = _load_bias(bias_base, qs, ks, BQ, BK, TQ, TK, False)
    s, dcap = _scores(q, k, qs, ks, kv_limit, offset, q_ids, k_ids, bias_tile, BQ, BK, SCALE,
                      CAUSAL, WINDOW, SOFTCAP, HAS_SEGMENTS, HAS_BIAS, PRECISION, MASKED,
                      False, KEY_TAIL)
    p = tl.exp2(s - lse[:, None])
    ds = p * (tl.dot(do, tl.trans(v), input_precision=PRECISION) - delta[:, None])
    if SOFTCAP > 0:  # through the soft-cap
      ds = ds * dcap
    dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
  return dq


@triton.jit
def attention_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, kv_len_ptr, q_seg_ptr, kv_seg_ptr, bias_ptr,
                            do_ptr, lse_ptr, delta_ptr, dq_ptr, TQ: tl.constexpr,
                            TK: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
                            D: tl.constexpr, DP: tl.constexpr, BQ: tl.constexpr,
                            BK: tl.constexpr, SCALE: tl.constexpr, CAUSAL: tl.constexpr,
                            WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                            HAS_KV_LENGTHS: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
                            HAS_BIAS: tl.constexpr, BIAS_B: tl.constexpr, BIAS_H: tl.constexpr,
                            PRECISION: tl.constexpr):
  """``dq [b, tq, hq, d]`` of one query tile, over the key tiles the forward visited."""
  i = tl.program_id(0)
  h = tl.program_id(1)
  bi = tl.program_id(2)
  if CAUSAL != "none":
    i = tl.num_programs(0) - 1 - i
  qs = i * BQ
  q_off = (bi.to(tl.int64) * TQ * HQ + h) * D
  kv_off = (bi.to(tl.int64) * TK * HKV + h // (HQ // HKV)) * D
  row_off = (bi.to(tl.int64) * HQ + h) * TQ
  KEY_TAIL: tl.constexpr = HAS_KV_LENGTHS or TK % BK != 0  # a key tile may cross the limit
  q = _load_rows(q_ptr + q_off, qs, BQ, TQ, HQ * D, D, DP)
  do = _load_rows(do_ptr + q_off, qs, BQ, TQ, HQ * D, D, DP)
  lse = _load_vec(lse_ptr + row_off, qs, BQ, TQ, _INF)
  delta = _load_vec(delta_ptr + row_off, qs, BQ, TQ, 0.0)
  kv_limit, offset = _kv_limit_and_offset(kv_len_ptr, bi, TQ, TK, CAUSAL, HAS_KV_LENGTHS)
  q_ids = 0
  q_lo = 0
  q_hi = 0
  if HAS_SEGMENTS:
    q_ids = _load_vec(q_seg_ptr + bi * TQ, qs, BQ, TQ, -1)
    q_lo, q_hi = _id_range(q_ids, qs, TQ)
  bias_base = _bias_base(bias_ptr, bi, h, TQ, TK, BIAS_B, BIAS_H)
  kv_seg_base = kv_seg_ptr + bi * TK
  dq = tl.zeros((BQ, DP), tl.float32)
  lo, a, b, hi = _key_tiles(qs, kv_limit, offset, TQ, BQ, BK, CAUSAL, WINDOW)
  if WINDOW > 0:
    for j in range(lo, a):
      dq = _dq_step(j, dq, q, do, lse, delta, k_ptr + kv_off, v_ptr + kv_off, kv_seg_base,
                    bias_base, qs, kv_limit, offset, q_ids, q_lo, q_hi, TQ, TK, HKV * D, D, DP,
                    BQ, BK, SCALE, CAUSAL, WINDOW, SOFTCAP, HAS_SEGMENTS, HAS_BIAS, PRECISION,
                    KEY_TAIL, True)
  for j in range(a, b):
    dq = _dq_step(j, dq, q, do, lse, delta, k_ptr + kv_off, v_ptr + kv_off, kv_seg_base,
                  bias_base, qs, kv_limit, offset, q_ids, q_lo, q_hi, TQ, TK, HKV * D, D, DP,
                  BQ, BK, SCALE, CAUSAL, WINDOW, SOFTCAP, HAS_SEGMENTS, HAS_BIAS, PRECISION,
                  KEY_TAIL, False)
  if CAUSAL != "none":
    for j in range(b, hi):
      dq = _dq_step(j, dq, q, do, lse, delta, k_ptr + kv_off, v_ptr + kv_off, kv_seg_base,
                    bias_base, qs, kv_limit, offset, q_ids, q_lo, q_hi, TQ, TK, HKV * D, D, DP,
                    BQ, BK, SCALE, CAUSAL, WINDOW, SOFTCAP, HAS_SEGMENTS, HAS_BIAS, PRECISION,
                    KEY_TAIL, True)
  _store_rows(dq_ptr + q_off, qs, dq * SCALE, TQ, HQ * D, D, DP)


@triton.jit
def _dkdv_step(i, dk, dv, k, v, q_base, do_base, lse_base, delta_base, q_seg_base, bias_base,
               ks, kv_limit, offset, k_ids, k_lo, k_hi, TQ: tl.constexpr, TK: tl.constexpr,
               Q_STRIDE: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BQ: tl.constexpr,
               BK: tl.constexpr, SCALE: tl.constexpr, CAUSAL: tl.constexpr,
               WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
               HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, KEY_TAIL: tl.constexpr,
               MASKED: tl.constexpr):
  """Adds query tile ``i``'s (of one query head) share to a key tile's ``dk`` and ``dv``."""
  qs = i * BQ
  q_ids = 0
  visit = True
  if HAS_SEGMENTS:
    q_ids = _load_vec(q_seg_base, qs, BQ, TQ, -1)
    visit = _meets(k_lo, k_hi, q_ids, qs, TQ)
  if visit:
    q = _load_rows(q_base, qs, BQ, TQ, Q_STRIDE, D, DP)
    do = _load_rows(do_base, qs, BQ, TQ, Q_STRIDE, D, DP)
    lse = _load_vec(lse_base, qs, BQ, TQ, _INF)
    delta = _load_vec(delta_base, qs, BQ, TQ, 0.0)
    bias_tile = 0.0
    if HAS_BIAS:
      bias_tile = _load_bias(bias_base, qs, ks, BQ, BK, TQ, TK, True)
    st, dcap = _scores(q, k, qs, ks, kv_limit, offset, q_ids, k_ids, bias_tile, BQ, BK, SCALE,
                       CAUSAL, WINDOW, SOFTCAP, HAS_SEGMENTS, HAS_BIAS, PRECISION, MASKED,
                       True, KEY_TAIL)
    pt = tl.exp2(st - lse[None, :])
    dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=PRECISION)
    dst = pt * (tl.dot(v, tl.trans(do), input_precision=PRECISION) - delta[None, :])
    if SOFTCAP > 0:  # through the soft-cap
      dst = dst * dcap
    dk = tl.dot(dst.to(q.dtype), q, dk, input_precision=PRECISION)
  return dk, dv


@triton.jit
def attention_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, kv_len_ptr, q_seg_ptr, kv_seg_ptr, bias_ptr,
                              do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, TQ: tl.constexpr,
                              TK: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
                              D: tl.constexpr, DP: tl.constexpr, BQ: tl.constexpr,
                              BK: tl.constexpr, SCALE: tl.constexpr, CAUSAL: tl.constexpr,
                              WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                              HAS_KV_LENGTHS: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
                              HAS_BIAS: tl.constexpr, BIAS_B: tl.constexpr,
                              BIAS_H: tl.constexpr, PRECISION: tl.constexpr):
  """``dk, dv [b, tk, hkv, d]`` of one key tile: the query heads of its kv head, and of each
  the query tiles that see its keys."""
  j = tl.program_id(0)
  h = tl.program_id(1)
  bi = tl.program_id(2)
  G: tl.constexpr = HQ // HKV
  ks = j * BK
  kv_off = (bi.to(tl.int64) * TK * HKV + h) * D
  k = _load_rows(k_ptr + kv_off, ks, BK, TK, HKV * D, D, DP)
  v = _load_rows(v_ptr + kv_off, ks, BK, TK, HKV * D, D, DP)
  KEY_TAIL: tl.constexpr = HAS_KV_LENGTHS or TK % BK != 0  # a key tile may cross the limit
  kv_limit, offset = _kv_limit_and_offset(kv_len_ptr, bi, TQ, TK, CAUSAL, HAS_KV_LENGTHS)
  lo, a, b, hi = _query_tiles(ks, kv_limit, offset, TQ, BQ, BK, CAUSAL, WINDOW)
  k_ids = 0
  k_lo = 0
  k_hi = 0
  if HAS_SEGMENTS:
    k_ids = _load_vec(kv_seg_ptr + bi * TK, ks, BK, TK, -2)
    k_lo, k_hi = _id_range(k_ids, ks, TK)
  q_seg_base = q_seg_ptr + bi * TQ
  dk = tl.zeros((BK, DP), tl.float32)
  dv = tl.zeros((BK, DP), tl.float32)
  for gi in range(G):
    head = h * G + gi
    q_off = (bi.to(tl.int64) * TQ * HQ + head) * D
    row_off = (bi.to(tl.int64) * HQ + head) * TQ
    bias_base = _bias_base(bias_ptr, bi, head, TQ, TK, BIAS_B, BIAS_H)
    if CAUSAL != "none":
      for i in range(lo, a):
        dk, dv = _dkdv_step(i, dk, dv, k, v, q_ptr + q_off, do_ptr + q_off, lse_ptr + row_off,
                            delta_ptr + row_off, q_seg_base, bias_base, ks, kv_limit, offset,
                            k_ids, k_lo, k_hi, TQ, TK, HQ * D, D, DP, BQ, BK, SCALE, CAUSAL,
                            WINDOW, SOFTCAP, HAS_SEGMENTS, HAS_BIAS, PRECISION, KEY_TAIL, True)
    for i in range(a, b):
      dk, dv = _dkdv_step(i, dk, dv, k, v, q_ptr + q_off, do_ptr + q_off, lse_ptr + row_off,
                          delta_ptr + row_off, q_seg_base, bias_base, ks, kv_limit, offset,
                          k_ids, k_lo, k_hi, TQ, TK, HQ * D, D, DP, BQ, BK, SCALE, CAUSAL,
                          WINDOW, SOFTCAP, HAS_SEGMENTS, HAS_BIAS, PRECISION, KEY_TAIL, False)
    if WINDOW > 0:
      for i in range(b, hi):
        dk, dv = _dkdv_step(i, dk, dv, k, v, q_ptr + q_off, do_ptr + q_off, lse_ptr + row_off,
                            delta_ptr + row_off, q_seg_base, bias_base, ks, kv_limit, offset,
                            k_ids, k_lo, k_hi, TQ, TK, HQ * D, D, DP, BQ, BK, SCALE, CAUSAL,
                            WINDOW, SOFTCAP, HAS_SEGMENTS, HAS_BIAS, PRECISION, KEY_TAIL, True)
  _store_rows(dk_ptr + kv_off, ks, dk * SCALE, TK, HKV * D, D, DP)
  _store_rows(dv_ptr + kv_off, ks, dv, TK, HKV * D, D, DP)


@triton.jit
def attention_bwd_dbias_kernel(q_ptr, k_ptr, v_ptr, kv_len_ptr, q_seg_ptr, kv_seg_ptr,
                               bias_ptr, do_ptr, lse_ptr, delta_ptr, ds_ptr, TQ: tl.constexpr,
                               TK: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
                               D: tl.constexpr, DP: tl.constexpr, BQ: tl.constexpr,
                               BK: tl.constexpr, SCALE: tl.constexpr, CAUSAL: tl.constexpr,
                               WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                               HAS_KV_LENGTHS: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
                               HAS_BIAS: tl.constexpr, BIAS_B: tl.constexpr,
                               BIAS_H: tl.constexpr, PRECISION: tl.constexpr):
  """``ds [b, hq, tq, tk]`` (float32) of one (query tile, key tile): the gradient of the biased
  scores."""
  i = tl.program_id(0)
  j = tl.program_id(1)
  n = tl.program_id(2)
  bi = n // HQ
  h = n % HQ
  qs = i * BQ
  ks = j * BK
  q_off = (bi.to(tl.int64) * TQ * HQ + h) * D
  kv_off = (bi.to(tl.int64) * TK * HKV + h // (HQ // HKV)) * D
  row_off = (bi.to(tl.int64) * HQ + h) * TQ
  q = _load_rows(q_ptr + q_off, qs, BQ, TQ, HQ * D, D, DP)
  do = _load_rows(do_ptr + q_off, qs, BQ, TQ, HQ * D, D, DP)
  k = _load_rows(k_ptr + kv_off, ks, BK, TK, HKV * D, D, DP)
  v = _load_rows(v_ptr + kv_off, ks, BK, TK, HKV * D, D, DP)
  lse = _load_vec(lse_ptr + row_off, qs, BQ, TQ, _INF)
  delta = _load_vec(delta_ptr + row_off, qs, BQ, TQ, 0.0)
  q_ids = 0
  k_ids = 0
  if HAS_SEGMENTS:
    q_ids = _load_vec(q_seg_ptr + bi * TQ, qs, BQ, TQ, -1)
    k_ids = _load_vec(kv_seg_ptr + bi * TK, ks, BK, TK, -2)
  kv_limit, offset = _kv_limit_and_offset(kv_len_ptr, bi, TQ, TK, CAUSAL, HAS_KV_LENGTHS)
  bias_tile = 0.0
  if HAS_BIAS:
    bias_tile = _load_bias(_bias_base(bias_ptr, bi, h, TQ, TK, BIAS_B, BIAS_H), qs, ks, BQ, BK,
                           TQ, TK, False)
  s, _ = _scores(q, k, qs, ks, kv_limit, offset, q_ids, k_ids, bias_tile, BQ, BK, SCALE,
                 CAUSAL, WINDOW, SOFTCAP, HAS_SEGMENTS, HAS_BIAS, PRECISION, CAUSAL != "none",
                 False, HAS_KV_LENGTHS or TK % BK != 0)
  p = tl.exp2(s - lse[:, None])
  # The gradient of the biased scores: the bias is added after the soft-cap.
  ds = p * (tl.dot(do, tl.trans(v), input_precision=PRECISION) - delta[:, None])
  rq = qs + tl.arange(0, BQ)
  ck = ks + tl.arange(0, BK)
  mask = (rq[:, None] < TQ) & (ck[None, :] < TK)
  tl.store(ds_ptr + (n.to(tl.int64) * TQ + rq[:, None]) * TK + ck[None, :], ds, mask=mask)


# The jax-triton wrappers -----------------------------------------------------------------------


def next_power_of_2(n: int) -> int:
  return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def padded_head_dim(d: int) -> int:
  """The head dim the kernels compute with: the next power of 2, at least 16."""
  return max(16, next_power_of_2(d))


@dataclasses.dataclass(frozen=True)
class Launch:
  """One kernel launch as the wrappers make it: the kernel, its grid, its compile-time
  constants and its launch settings. The tests launch the same thing under the interpreter."""

  kernel: object
  grid: tuple[int, int, int]
  constants: dict
  num_warps: int
  num_stages: int


def constants(q_shape, k_shape, *, causal, scale, window, softcap, has_kv_lengths,
              has_segments, bias_shape, dtype_name, block_q, block_k) -> dict:
  """The compile-time constants every kernel takes, for ``q [b, tq, hq, d]``,
  ``k [b, tk, hkv, d]`` and ``block_q x block_k`` tiles.

  ``causal``: None, ``"top_left"`` (also True) or ``"bottom_right"``; ``window`` (with a causal
  mask) and ``softcap`` None or positive; ``bias_shape`` ``[b | 1, hq | 1, tq, tk]`` or None.
  float32 products are exact (``"ieee"``), as the Pallas kernels' ``HIGHEST``.
  """
  if causal is True:
    causal = "top_left"
  causal = causal or "none"
  if causal not in CAUSAL_ALIGNMENTS:
    raise ValueError(f"attention kernels: causal must be a bool, 'top_left' or 'bottom_right', "
                     f"got {causal!r}")
  if window is not None and causal == "none":
    raise ValueError("attention kernels: a sliding window needs a causal mask")
  _, tq, hq, d = q_shape
  _, tk, hkv, _ = k_shape
  return dict(TQ=tq, TK=tk, HQ=hq, HKV=hkv, D=d, DP=padded_head_dim(d), BQ=block_q, BK=block_k,
              SCALE=float(scale), CAUSAL=causal, WINDOW=int(window or 0),
              SOFTCAP=float(softcap or 0.0), HAS_KV_LENGTHS=bool(has_kv_lengths),
              HAS_SEGMENTS=bool(has_segments), HAS_BIAS=bias_shape is not None,
              BIAS_B=int(bias_shape[0]) if bias_shape is not None else 1,
              BIAS_H=int(bias_shape[1]) if bias_shape is not None else 1,
              PRECISION="ieee" if dtype_name == "float32" else "tf32")


def forward_launch(q_shape, k_shape, blocks, *, with_lse=True, **options) -> Launch:
  """The forward's launch: grid (q tiles, heads, batch). ``options`` as in :func:`constants`."""
  c = constants(q_shape, k_shape, block_q=blocks.block_q, block_k=blocks.block_k, **options)
  grid = (math.ceil(c["TQ"] / c["BQ"]), c["HQ"], q_shape[0])
  return Launch(attention_fwd_res_kernel if with_lse else attention_fwd_kernel, grid, c,
                blocks.num_warps, blocks.num_stages)


def backward_launches(q_shape, k_shape, blocks, **options) -> dict[str, Launch]:
  """The backward's launches: ``dq`` (grid (q tiles, heads, batch)), ``dkdv`` (grid (k tiles,
  kv heads, batch)) and, with a bias, ``dbias`` (grid (q tiles, k tiles, batch x heads), on the
  dq kernel's tiles)."""
  b = q_shape[0]
  out = {}
  c = constants(q_shape, k_shape, block_q=blocks.block_q_dq, block_k=blocks.block_k_dq,
                **options)
  nq, nk = math.ceil(c["TQ"] / c["BQ"]), math.ceil(c["TK"] / c["BK"])
  out["dq"] = Launch(attention_bwd_dq_kernel, (nq, c["HQ"], b), c, blocks.num_warps_bwd,
                     blocks.num_stages_bwd)
  if c["HAS_BIAS"]:
    out["dbias"] = Launch(attention_bwd_dbias_kernel, (nq, nk, b * c["HQ"]), c,
                          blocks.num_warps_bwd, blocks.num_stages_bwd)
  c = constants(q_shape, k_shape, block_q=blocks.block_q_dkdv, block_k=blocks.block_k_dkdv,
                **options)
  out["dkdv"] = Launch(attention_bwd_dkdv_kernel, (math.ceil(c["TK"] / c["BK"]), c["HKV"], b),
                       c, blocks.num_warps_bwd, blocks.num_stages_bwd)
  return out


def _options(q, k, bias, kv_lengths, q_seg, causal, scale, window, softcap):
  return dict(causal=causal, scale=scale, window=window, softcap=softcap,
              has_kv_lengths=kv_lengths is not None, has_segments=q_seg is not None,
              bias_shape=None if bias is None else tuple(bias.shape),
              dtype_name=str(q.dtype))


def _optional_operands(q, q_seg, kv_seg, kv_lengths, bias):
  """kv_lengths, q and kv segment ids and bias, in the kernels' order; ``q`` stands in for an
  absent one (its flag is off, so it is never read)."""
  return [q if x is None else x for x in (kv_lengths, q_seg, kv_seg, bias)]


def _call(launch: Launch, operands, out_shape):
  import jax_triton

  return jax_triton.triton_call(
      *operands, kernel=launch.kernel, out_shape=out_shape, grid=launch.grid,
      num_warps=launch.num_warps, num_stages=launch.num_stages, **launch.constants)


def forward(q, k, v, q_seg, kv_seg, kv_lengths, bias, *, causal, scale: float, blocks,
            window: int | None = None, softcap: float | None = None, with_lse: bool = True):
  """``(o, lse)``: the attention output and the base-2 row log-sum-exp ``[b, heads, q_len]``
  (float32), as :func:`jaxfuse.kernels.pallas.flash_attention.forward` returns them (GPU).

  ``blocks`` is a :class:`~jaxfuse.kernels.pallas.flash_attention.BlockSizes`. Without
  ``with_lse`` the kernel writes ``o`` only and ``lse`` is None.
  """
  import jax
  import jax.numpy as jnp

  launch = forward_launch(q.shape, k.shape, blocks, with_lse=with_lse,
                          **_options(q, k, bias, kv_lengths, q_seg, causal, scale, window,
                                     softcap))
  operands = [q, k, v, *_optional_operands(q, q_seg, kv_seg, kv_lengths, bias)]
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
  if with_lse:
    out_shape.append(jax.ShapeDtypeStruct((q.shape[0], q.shape[2], q.shape[1]), jnp.float32))
  outs = _call(launch, operands, out_shape)
  return (outs[0], outs[1]) if with_lse else (outs[0], None)


def forward_output(q, k, v, q_seg, kv_seg, kv_lengths, bias, **options):
  """``o`` alone through jax-triton (GPU): :func:`forward` writing no log-sum-exp."""
  o, _ = forward(q, k, v, q_seg, kv_seg, kv_lengths, bias, with_lse=False, **options)
  return o


refuses = limits.refuses_head_dim


def backward(q, k, v, q_seg, kv_seg, kv_lengths, bias, o, lse, do, *, causal, scale: float,
             blocks, window: int | None = None, softcap: float | None = None):
  """``(dq, dk, dv, dbias)`` from the residuals (GPU); ``dbias`` is None without a bias."""
  import jax
  import jax.numpy as jnp

  launches = backward_launches(q.shape, k.shape, blocks,
                               **_options(q, k, bias, kv_lengths, q_seg, causal, scale, window,
                                          softcap))
  delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1).transpose(0, 2, 1)
  operands = [q, k, v, *_optional_operands(q, q_seg, kv_seg, kv_lengths, bias), do, lse, delta]
  dq = _call(launches["dq"], operands, [jax.ShapeDtypeStruct(q.shape, q.dtype)])[0]
  dk, dv = _call(launches["dkdv"], operands, [jax.ShapeDtypeStruct(k.shape, k.dtype)] * 2)
  dbias = None
  if bias is not None:
    b, tq, hq, _ = q.shape
    ds = _call(launches["dbias"], operands,
               [jax.ShapeDtypeStruct((b, hq, tq, k.shape[1]), jnp.float32)])[0]
    dbias = reduce_dbias(ds, bias)
  return dq, dk, dv, dbias


def reduce_dbias(ds, bias):
  """``ds [b, hq, tq, tk]`` summed over the axes ``bias`` broadcasts, in bias's dtype."""
  import jax.numpy as jnp

  axes = tuple(a for a in (0, 1) if bias.shape[a] == 1 and ds.shape[a] != 1)
  if axes:
    ds = jnp.sum(ds, axis=axes, keepdims=True)
  return ds.astype(bias.dtype)
