"""What the Triton attention kernels share (:mod:`jaxfuse.kernels.triton.flash_attention`): tile
arithmetic (which tiles a program visits), the loads and stores of a tile, its scores and masks."""

from __future__ import annotations


import triton
import triton.language as tl

from .elementwise import activation

LOG2E = 1.4426950408889634
CAUSAL_ALIGNMENTS = ("none", "top_left", "bottom_right")

_LOG2E = tl.constexpr(LOG2E)
_NEG_INF = tl.constexpr(float("-inf"))
_INF = tl.constexpr(float("inf"))
_BIG = tl.constexpr(2**30)


# Scalar tile arithmetic ------------------------------------------------------------------------
# Triton's integer division truncates toward zero; the tile ranges need floor division (their
# numerators go below zero), as the Pallas kernels' jnp arithmetic has.


@triton.jit
def _floordiv(a, b):
  """``floor(a / b)`` for ``b > 0``."""
  return tl.where(a >= 0, a // b, -((b - 1 - a) // b))


@triton.jit
def _clip(x, lo, hi):
  return tl.minimum(tl.maximum(x, lo), hi)


@triton.jit
def _key_tiles(qs, kv_limit, offset, TQ: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
               CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
  """For the query tile starting at ``qs``: ``(lo, a, b, hi)`` over key tiles of ``BK``. Tiles
  ``[lo, hi)`` hold a visible pair; ``[a, b)`` lie wholly inside the masks; with a window,
  ``[lo, a)`` is crossed by its lower edge, and ``[b, hi)`` by the diagonal."""
  kv_tiles = (kv_limit + BK - 1) // BK
  lo = qs * 0
  a = lo
  b = lo + kv_tiles
  hi = b
  if CAUSAL != "none":
    first = qs
    last = tl.minimum(qs + BQ, TQ) - 1
    hi = _clip(_floordiv(last + offset, BK) + 1, 0, kv_tiles)
    full_hi = tl.where(kv_limit <= first + offset + 1, kv_tiles,
                       _floordiv(first + offset + 1, BK))
    if WINDOW == 0:
      b = _clip(full_hi, 0, hi)
    else:
      hi = tl.where(first + offset - WINDOW + 1 < kv_limit, hi, 0)
      lo = _clip(_floordiv(first + offset - WINDOW + 1, BK), 0, hi)
      full_lo = -_floordiv(WINDOW - 1 - last - offset, BK)
      a = _clip(full_lo, lo, hi)
      b = _clip(full_hi, a, hi)
  return lo, a, b, hi


@triton.jit
def _query_tiles(ks, kv_limit, offset, TQ: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
                 CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
  """For the key tile starting at ``ks``: ``(lo, a, b, hi)`` over query tiles of ``BQ``.
  ``[lo, a)`` is crossed by the diagonal; with a window, ``[b, hi)`` by its lower edge. A key
  tile wholly past the key limit visits nothing."""
  nq: tl.constexpr = (TQ + BQ - 1) // BQ
  live = ks < kv_limit
  lo = ks * 0
  a = lo
  b = tl.where(live, nq, 0)
  hi = b
  if CAUSAL != "none":
    first = ks
    last = tl.minimum(ks + BK, kv_limit) - 1
    live = live & (first - offset < TQ)
    lo = _clip(_floordiv(first - offset, BQ), 0, nq)
    full_lo = -_floordiv(offset - last, BQ)
    if WINDOW == 0:
      hi = tl.where(live, nq, lo)
      a = _clip(full_lo, lo, hi)
      b = hi
    else:
      hi = _clip(_floordiv(last - offset + WINDOW - 1, BQ) + 1, lo, nq)
      hi = tl.where(live, hi, lo)
      full_hi = tl.where(TQ <= first - offset + WINDOW, nq, _floordiv(first - offset + WINDOW, BQ))
      a = _clip(full_lo, lo, hi)
      b = _clip(full_hi, a, hi)
  return lo, a, b, hi


# Tiles -----------------------------------------------------------------------------------------


@triton.jit
def _load_rows(base, start, ROWS: tl.constexpr, limit, STRIDE: tl.constexpr, D: tl.constexpr,
               DP: tl.constexpr):
  """A ``[ROWS, DP]`` tile of rows ``start..`` (stride ``STRIDE``) from ``base``: rows past
  ``limit`` (a constant) and columns past ``D`` read 0. A 64-bit offset to the first row and
  32-bit offsets inside the tile; when no tile can cross ``limit`` or ``D``, no mask."""
  local = tl.arange(0, ROWS)
  cols = tl.arange(0, DP)
  ptrs = base + start.to(tl.int64) * STRIDE + (local[:, None] * STRIDE + cols[None, :])
  if limit % ROWS == 0 and D == DP:  # every tile is whole: no mask
    return tl.load(ptrs)
  mask = (start + local[:, None] < limit) & (cols[None, :] < D)
  return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _store_rows(base, start, value, limit, STRIDE: tl.constexpr, D: tl.constexpr,
                DP: tl.constexpr):
  local = tl.arange(0, value.shape[0])
  cols = tl.arange(0, DP)
  mask = (start + local[:, None] < limit) & (cols[None, :] < D)
  tl.store(base + start.to(tl.int64) * STRIDE + (local[:, None] * STRIDE + cols[None, :]),
           value.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _load_vec(base, start, SIZE: tl.constexpr, limit, other):
  pos = start + tl.arange(0, SIZE)
  return tl.load(base + pos, mask=pos < limit, other=other)


@triton.jit
def _id_range(ids, start, limit):
  """The smallest and largest of ``ids`` at positions below ``limit``."""
  valid = start + tl.arange(0, ids.shape[0]) < limit
  return tl.min(tl.where(valid, ids, _BIG), axis=0), tl.max(tl.where(valid, ids, -_BIG), axis=0)


@triton.jit
def _meets(id_range_lo, id_range_hi, ids, start, limit):
  """Whether some id (at a position below ``limit``) lies in ``[id_range_lo, id_range_hi]``:
  otherwise the tiles share no segment and every score is masked."""
  lo, hi = _id_range(ids, start, limit)
  return (hi >= id_range_lo) & (lo <= id_range_hi)


@triton.jit
def _load_bias(bias_base, qs, ks, BQ: tl.constexpr, BK: tl.constexpr, TQ: tl.constexpr,
               TK: tl.constexpr, KEYS_ON_ROWS: tl.constexpr):
  """A float32 bias tile ``[BQ, BK]`` (``[BK, BQ]`` with ``KEYS_ON_ROWS``); 0 past the ends
  (no mask when the tiles divide both lengths)."""
  lq = tl.arange(0, BQ)
  lk = tl.arange(0, BK)
  start = bias_base + qs.to(tl.int64) * TK + ks
  if KEYS_ON_ROWS:
    mask = (ks + lk[:, None] < TK) & (qs + lq[None, :] < TQ)
    ptrs = start + (lq[None, :] * TK + lk[:, None])
  else:
    mask = (qs + lq[:, None] < TQ) & (ks + lk[None, :] < TK)
    ptrs = start + (lq[:, None] * TK + lk[None, :])
  if TQ % BQ == 0 and TK % BK == 0:
    return tl.load(ptrs).to(tl.float32)
  return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _scores(q, k, qs, ks, kv_limit, offset, q_ids, k_ids, bias_tile, BQ: tl.constexpr,
            BK: tl.constexpr, SCALE: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
            SOFTCAP: tl.constexpr, HAS_SEGMENTS: tl.constexpr, HAS_BIAS: tl.constexpr,
            PRECISION: tl.constexpr, MASKED: tl.constexpr, KEYS_ON_ROWS: tl.constexpr,
            KEY_TAIL: tl.constexpr):
  """``(s, dcap)``: the base-2 scores of a query and a key tile, soft-capped, biased and masked
  (-inf where masked), and the soft-cap's derivative ``1 - tanh²`` (unused without one).

  Queries on rows (``[BQ, BK]``) unless ``KEYS_ON_ROWS`` (``[BK, BQ]``). The segments always
  mask, the key limit wherever a tile may cross it (``KEY_TAIL``: with kv_lengths or a partial
  last key tile), the causal and window masks only where ``MASKED``.
  """
  rq = qs + tl.arange(0, BQ)
  ck = ks + tl.arange(0, BK)
  # Without a soft-cap the bias enters the product as its accumulator, in units of q kᵀ: its
  # tile then takes no registers beside the scores' (a separate add spills registers on H100s
  # at 128 x 64 tiles and 4 warps).
  fused_bias: tl.constexpr = HAS_BIAS and SOFTCAP == 0
  if KEYS_ON_ROWS:
    if fused_bias:
      raw = tl.dot(k, tl.trans(q), bias_tile * (1.0 / SCALE), input_precision=PRECISION)
    else:
      raw = tl.dot(k, tl.trans(q), input_precision=PRECISION)
    row = rq[None, :]
    col = ck[:, None]
  else:
    if fused_bias:
      raw = tl.dot(q, tl.trans(k), bias_tile * (1.0 / SCALE), input_precision=PRECISION)
    else:
      raw = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    row = rq[:, None]
    col = ck[None, :]
  if SOFTCAP > 0:  # the cap acts on the natural-log scores; they go to base 2 after it
    t = activation(raw * (SCALE / SOFTCAP), "tanh")
    s = t * (SOFTCAP * _LOG2E)
    dcap = 1.0 - t * t
    if HAS_BIAS:
      s = s + bias_tile * _LOG2E
  else:
    s = raw * (SCALE * _LOG2E)
    dcap = s
  if KEY_TAIL:  # some keys of the tile may lie past the key limit
    s = tl.where(col < kv_limit, s, _NEG_INF)
  if MASKED:
    visible = col <= row + offset
    if WINDOW > 0:
      visible = visible & (col > row + offset - WINDOW)
    s = tl.where(visible, s, _NEG_INF)
  if HAS_SEGMENTS:
    if KEYS_ON_ROWS:
      s = tl.where(k_ids[:, None] == q_ids[None, :], s, _NEG_INF)
    else:
      s = tl.where(q_ids[:, None] == k_ids[None, :], s, _NEG_INF)
  return s, dcap


@triton.jit
def _kv_limit_and_offset(kv_len_ptr, bi, TQ: tl.constexpr, TK: tl.constexpr,
                         CAUSAL: tl.constexpr, HAS_KV_LENGTHS: tl.constexpr):
  """Keys at positions >= ``kv_limit`` are padding for batch element ``bi``; with a causal
  mask, query ``i`` sees keys ``j <= i + offset``."""
  if HAS_KV_LENGTHS:
    kv_limit = _clip(tl.load(kv_len_ptr + bi), 0, TK)
  else:
    kv_limit = TK
  if CAUSAL == "bottom_right":
    offset = kv_limit - TQ
  else:
    offset = 0
  return kv_limit, offset


@triton.jit
def _bias_base(bias_ptr, bi, head, TQ: tl.constexpr, TK: tl.constexpr, BIAS_B: tl.constexpr,
               BIAS_H: tl.constexpr):
  """The ``[TQ, TK]`` bias slab of (batch ``bi``, head ``head``): index 0 on broadcast axes."""
  bb = bi if BIAS_B > 1 else bi * 0
  hb = head if BIAS_H > 1 else head * 0
  return bias_ptr + (bb * BIAS_H + hb).to(tl.int64) * (TQ * TK)
