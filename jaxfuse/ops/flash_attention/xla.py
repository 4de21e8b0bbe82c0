"""The XLA path of attention: the flash algorithm in plain ``jax.lax``, for CPUs.

The work is split into units, one per (batch, kv head), walked by lax.map. A unit holds the
G = heads // kv_heads query heads that share its keys: a span of query positions is flattened
to [positions x G heads] rows (row r is position r // G of head r % G), so every score block
is one matmul. Each unit runs one of two paths, chosen by the lengths (:func:`strip_height`):

- Strips, up to 2048 positions (:data:`XLA_STRIP_MAX_LENGTH`). The work is unrolled into
  strips of static shape. The forward takes each strip of queries against every key one of
  them may see (:class:`_Spans`: for causal attention, the keys up to the strip's end) in one
  product and one softmax; the backward takes each strip of keys against every query that
  may see it, recomputing the probabilities from the saved log-sum-exp. Nothing is padded,
  the products are wide enough for XLA:CPU to split over the cores, and a few units run
  together (vmapped).
- Tiles, beyond. Square tiles in lax loops: the forward keeps a running row maximum, row sum
  and output per query tile (the online softmax); the backward walks the key tiles. Sequences
  are padded to a multiple of the tile. Padded keys (and keys past kv_lengths) get a -inf key
  bias; padded query rows get zero q and do and an lse of +inf, so they contribute nothing
  to the backward and are sliced off. Tiles that the causal mask excludes are skipped.

The tile loops have bounds that depend on the data (kv_lengths) and on the tile (causal), so
this code is differentiated once, by its own backward; second-order gradients go through the
reference (see :mod:`jaxfuse.ops.flash_attention.op`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxfuse.ops import activations
from jaxfuse.ops.partitioning import vary_like

# Query and key tile of the tile path. XLA:CPU runs the tile loop on one thread and splits only
# a large matmul over its cores, so long sequences use 512-wide tiles (their [512 x 512] x 64
# matmuls use every core) and everything else 128-wide ones (a tile's scores stay in L2).
# Measured on a 2-core Xeon, 8 heads, head dim 64, fwd+bwd, as a multiple of torch SDPA:
# causal T=2048: 128 -> 2.0x, 256 -> 2.2x, 512 -> 1.7x; non-causal T=2048: 2.4x, 2.5x, 1.6x;
# causal T=4096: 2.1x, 2.4x, 1.7x.
XLA_BLOCK = 128
XLA_LONG_BLOCK = 512

# The strip path. Up to 2048 positions a unit's work is unrolled into strips of
# static shape: the forward takes each strip of queries against every key any of them may
# see (for causal attention, the keys up to the strip's end) in one product and one softmax;
# the backward takes each strip of keys against every query that may see it. The products are
# wide enough for XLA:CPU to split over the cores, there are no loop steps, and several units
# are vmapped together. Measured on a 2-core Xeon, causal, batch 1, 8 heads, head dim 64,
# forward + backward, least of 20 interleaved runs, strips / tiles / torch SDPA: T=256 4.7 /
# 5.9 / 4.2 ms; T=512 14.0 / 16.4 / 13.4; T=1024 34.7 / 41.2 / 37.0; T=2048 135 / 133 / 121;
# T=4096 504 / 484 / 446. At T=1024 vmapping more units was slower (units vmapped in the
# forward / backward: 2 / 2 42.7 ms, 2 / 1 35.0 ms, 8 / 1 51.4 ms). At T=1024 the strips' time
# is bimodal between processes: about 34 ms in most and 52 in some (5 of 18, torch not loaded),
# with the same inputs padded to 1040 positions slow in the same processes. XLA:CPU's concurrent
# thunk execution settles into one of two patterns: with
# --xla_cpu_enable_concurrency_optimized_scheduler=false every process takes about 45 ms.
XLA_STRIP_ROWS = 128            # rows of a strip (positions x query heads of a kv head)
XLA_STRIP_LONG_ROWS = 256       # ... above XLA_STRIP_LONG_FROM positions
XLA_STRIP_LONG_FROM = 1024
XLA_MAX_STRIPS = 32             # strips are unrolled: longer sequences get taller strips
XLA_STRIP_MAX_LENGTH = 2048     # longer sequences run the tile path (as fast at T=4096)
XLA_STRIP_MAX_SCORES = 1 << 21  # score elements of one strip, above which the tile path runs
XLA_STRIP_BATCH_SCORES = 1 << 18  # score elements of the units computed together: forward
XLA_STRIP_BACKWARD_BATCH_SCORES = 1 << 22  # ... backward
# ... except for lengths in (lo, hi]: there the backward takes one unit at a time. Measured as
# above, fwd+bwd over torch SDPA, backward budget 2**16 / all units, two processes each (medians
# of 15 rounds): T=256 1.28 / 1.15x and 1.31 / 1.03x; T=512 1.05 / 0.86x and 1.04 / 0.89x;
# T=1024 0.90 / 0.97x and 0.92 / 1.01x; T=2048 1.12 / 1.01x and 1.11 / 1.05x.
XLA_STRIP_BACKWARD_ONE_UNIT = (512, 1024)


def xla_block_size(tq: int, tk: int) -> int:
  """Tile of the tile path for these lengths: the long tile where it adds at most 1/8
  padding."""
  def padded(t, blk):
    return -(-t // blk) * blk

  if min(tq, tk) >= XLA_LONG_BLOCK and all(
      padded(t, XLA_LONG_BLOCK) <= padded(t, XLA_BLOCK) * 9 // 8 for t in (tq, tk)):
    return XLA_LONG_BLOCK
  return min(XLA_BLOCK, max(tq, tk))


_HIGHEST = lax.Precision.HIGHEST
_NEG_INF = -jnp.inf

def _nt(a, b):
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_HIGHEST,
                         preferred_element_type=jnp.float32)


def _nn(a, b):
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=_HIGHEST,
                         preferred_element_type=jnp.float32)


@dataclasses.dataclass
class _Units:
  """Inputs of the XLA path rearranged into per-unit, block-padded float32 arrays."""

  q: jax.Array            # [units, tqp, g, d], scaled
  k: jax.Array            # [units, tkp, d]
  v: jax.Array            # [units, tkp, d]
  key_bias: jax.Array | None   # [batch, tkp]: 0 or -inf (padding, kv_lengths)
  q_seg: jax.Array | None      # [batch, tqp]
  kv_seg: jax.Array | None     # [batch, tkp]
  bias: jax.Array | None       # [bias batch, bias heads, tqp, tkp]
  kv_lengths: jax.Array | None
  b: int
  tq: int
  tk: int
  hq: int
  hkv: int
  g: int
  d: int
  blk: int

  @property
  def nq(self):
    return self.q.shape[1] // self.blk

  @property
  def nk(self):
    return self.k.shape[1] // self.blk


def _pad_to(x, axis, size, value=0):
  pad = size - x.shape[axis]
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def _prepare_units(q, k, v, q_seg, kv_seg, kv_lengths, bias, cfg, scale_q=True, blk=None):
  """The inputs as units, the sequences padded to a multiple of ``blk`` (the tile path's
  tile; 1 for the strip path, which pads nothing)."""
  b, tq, hq, d = q.shape
  tk, hkv = k.shape[1], k.shape[2]
  g = hq // hkv
  blk = blk or cfg.xla_block
  tqp, tkp = -(-tq // blk) * blk, -(-tk // blk) * blk
  f32 = jnp.float32
  qf = q.astype(f32) * cfg.scale if scale_q else q.astype(f32)
  qu = qf.reshape(b, tq, hkv, g, d).transpose(0, 2, 1, 3, 4)
  qu = _pad_to(qu, 2, tqp).reshape(b * hkv, tqp, g, d)

  def kv_units(x):
    return _pad_to(x.astype(f32).transpose(0, 2, 1, 3), 2, tkp).reshape(b * hkv, tkp, d)

  key_bias = None
  if kv_lengths is not None or tkp != tk:
    pos = jnp.arange(tkp)[None, :]
    valid = pos < tk
    if kv_lengths is not None:
      valid = valid & (pos < kv_lengths[:, None])
    key_bias = jnp.where(jnp.broadcast_to(valid, (b, tkp)), 0.0, _NEG_INF).astype(f32)
  if q_seg is not None:
    q_seg = _pad_to(q_seg, 1, tqp, -1)
    kv_seg = _pad_to(kv_seg, 1, tkp, -2)
  if bias is not None:
    bias = _pad_to(_pad_to(bias.astype(f32), 2, tqp), 3, tkp)
  return _Units(qu, kv_units(k), kv_units(v), key_bias, q_seg, kv_seg, bias, kv_lengths,
                b, tq, tk, hq, hkv, g, d, blk)


def strip_height(tq: int, tk: int, groups: int = 1) -> int | None:
  """Query (forward) and key (backward) positions per strip of the strip path, or None where
  the tile path runs: beyond :data:`XLA_STRIP_MAX_LENGTH` positions, or where a strip's scores
  would pass :data:`XLA_STRIP_MAX_SCORES`."""
  t = max(tq, tk)
  if t > XLA_STRIP_MAX_LENGTH:
    return None
  rows = XLA_STRIP_ROWS if t <= XLA_STRIP_LONG_FROM else XLA_STRIP_LONG_ROWS
  height = max(1, rows // groups, -(-t // XLA_MAX_STRIPS))
  if height * groups * t > XLA_STRIP_MAX_SCORES:
    return None
  return min(height, t)


def _strips(t: int, height: int) -> list[tuple[int, int]]:
  """``(start, width)`` of the strips of ``t`` positions; the last one may be narrower."""
  return [(s, min(height, t - s)) for s in range(0, t, height)]


def _unit_batch(un: _Units, height: int | None, budget: int) -> int | None:
  """Units computed together (vmapped) on the strip path: as many as keep their strips'
  scores within ``budget``; None (one at a time) on the tile path."""
  if not height:
    return None
  per_unit = height * un.g * max(un.tq, un.tk)
  batch = min(un.q.shape[0], budget // per_unit)
  return batch if batch > 1 else None


class _Spans:
  """The strip path's static spans: for a strip of queries the keys that any of them may see,
  for a strip of keys the queries that may see any of them, over every offset the causal
  alignment allows (kv_lengths make bottom-right's offset a traced value). Scores outside
  the masks inside a span are masked by :meth:`_Tiles.span_scores`."""

  def __init__(self, un: _Units, cfg):
    self.tq, self.tk = un.tq, un.tk
    self.causal = cfg.causal is not None
    self.window = cfg.sliding_window
    self.masked = self.causal
    if cfg.causal == "bottom_right":   # offset kv_len - tq, kv_len in [0, tk]
      hi = un.tk - un.tq
      self.offsets = (hi if un.kv_lengths is None else -un.tq, hi)
    else:
      self.offsets = (0, 0)

  def keys_of(self, qs: int, qn: int) -> tuple[int, int]:
    if not self.causal:
      return 0, self.tk
    o_min, o_max = self.offsets
    hi = min(self.tk, max(0, qs + qn + o_max))
    lo = 0 if self.window is None else min(hi, max(0, qs + o_min - self.window + 1))
    return lo, hi

  def queries_of(self, ks: int, kn: int) -> tuple[int, int]:
    if not self.causal:
      return 0, self.tq
    o_min, o_max = self.offsets
    lo = min(self.tq, max(0, ks - o_max))
    hi = self.tq if self.window is None else ks + kn - 1 - o_min + self.window
    return lo, max(lo, min(self.tq, hi))


def _floor_div(a, b):
  return jnp.floor_divide(a, b)


def _ceil_div(a, b):
  return -jnp.floor_divide(-a, b)


class _Tiles:
  """Score-tile helpers for one unit: bias, masks, soft-cap and which tiles to visit, in the
  [rows, keys] layout.

  With a causal mask, query position ``r`` sees keys ``k <= r + offset`` (offset 0: top-left
  alignment; ``kv_length - q_length``: bottom-right), and with a sliding window ``W`` also
  ``k > r + offset - W``. Tiles that the masks exclude are skipped; tiles wholly inside are
  visited without a mask; only tiles that a mask boundary crosses are masked.
  """

  def __init__(self, un: _Units, u, cfg):
    self.un, self.cfg = un, cfg
    self.bi = u // un.hkv
    self.kvh = u % un.hkv
    blk, g = un.blk, un.g
    self.rows = blk * g
    self.bias = None
    if un.bias is not None:
      bb, hb = un.bias.shape[:2]
      bias_b = self.bi if bb > 1 else 0
      if hb > 1:
        self.bias = lax.dynamic_slice_in_dim(un.bias[bias_b], self.kvh * g, g, 0)  # [g, tqp, tkp]
      else:
        self.bias = un.bias[bias_b]                                                # [1, tqp, tkp]
    self.key_bias = un.key_bias[self.bi] if un.key_bias is not None else None
    self.q_seg = un.q_seg[self.bi] if un.q_seg is not None else None
    self.kv_seg = un.kv_seg[self.bi] if un.kv_seg is not None else None
    self.kv_len = un.kv_lengths[self.bi] if un.kv_lengths is not None else None
    self.causal = cfg.causal is not None
    self.window = cfg.sliding_window
    self.offset = 0
    if cfg.causal == "bottom_right":
      kv_len = un.tk if self.kv_len is None else jnp.minimum(self.kv_len, un.tk)
      self.offset = kv_len - un.tq

  @property
  def dynamic(self):
    """Whether every tile needs the scores' adjustments (bias, padding, segments, soft-cap)."""
    return (self.bias is not None or self.key_bias is not None or self.q_seg is not None
            or self.cfg.softcap is not None)

  def key_blocks(self):
    """Key tiles that hold at least one key below kv_lengths (all of them without it)."""
    if self.kv_len is None:
      return self.un.nk
    return jnp.minimum(self.un.nk, _ceil_div(jnp.maximum(self.kv_len, 0), self.un.blk))

  def key_tiles(self, i):
    """For query tile ``i``: ``(lo, a, b, hi)``, the key tiles to visit are ``[lo, hi)``;
    ``[a, b)`` need no causal or window mask."""
    blk, kv_blocks = self.un.blk, self.key_blocks()
    if not self.causal:
      return 0, 0, kv_blocks, kv_blocks
    first, o = i * blk, self.offset
    hi = jnp.clip(_floor_div(first + blk - 1 + o, blk) + 1, 0, kv_blocks)
    full_hi = _floor_div(first + o + 1, blk)
    if self.window is None:
      lo = full_lo = 0
    else:
      w = self.window
      lo = jnp.clip(_floor_div(first + o - w + 1, blk), 0, hi)
      full_lo = _ceil_div(first + blk + o - w, blk)
    a = jnp.clip(full_lo, lo, hi)
    return lo, a, jnp.clip(full_hi, a, hi), hi

  def query_tiles(self, j):
    """For key tile ``j``: ``(lo, a, b, hi)`` over query tiles, as :meth:`key_tiles`."""
    blk, nq = self.un.blk, self.un.nq
    live = j < self.key_blocks()   # a key tile wholly past kv_lengths gets no gradient
    if not self.causal:
      hi = jnp.where(live, nq, 0)
      return 0, 0, hi, hi
    first, last, o = j * blk, j * blk + blk - 1, self.offset
    lo = jnp.clip(_floor_div(first - o, blk), 0, nq)
    full_lo = _ceil_div(last - o, blk)
    if self.window is None:
      hi, full_hi = nq, nq
    else:
      w = self.window
      hi = jnp.clip(_floor_div(last - o + w - 1, blk) + 1, lo, nq)
      full_hi = _floor_div(first - o + w, blk)
    hi = jnp.where(live, hi, lo)
    a = jnp.clip(full_lo, lo, hi)
    return lo, a, jnp.clip(full_hi, a, hi), hi

  def scores(self, s, i, j, masked, transposed=False):
    """The score tile of q tile i and k tile j: soft-capped, biased and masked.

    ``s`` is ``q kᵀ`` (q is already scaled), [rows, blk] (queries on rows) or [blk, rows] with
    ``transposed``. Returns ``(scores, dcap)``: ``dcap`` is the soft-cap's derivative (None
    without one), which the backward multiplies into ``ds``.
    """
    blk = self.un.blk
    return self.span_scores(s, i * blk, blk, j * blk, blk, masked, transposed)

  def span_scores(self, s, qs, qn, ks, kn, masked, transposed=False):
    """:meth:`scores` of the queries ``[qs, qs + qn)`` and keys ``[ks, ks + kn)`` (widths
    static, starts static or traced): ``s`` is [qn * g, kn], or [kn, qn * g] with
    ``transposed``."""
    g = self.un.g
    rows = qn * g
    dcap = None
    if self.cfg.softcap is not None:
      cap = self.cfg.softcap
      t = activations.tanh(s * (1.0 / cap))
      s, dcap = cap * t, 1.0 - t * t
    if self.bias is not None:
      tile = lax.dynamic_slice(self.bias, (0, qs, ks), (self.bias.shape[0], qn, kn))
      if transposed:   # [gb, q, k] -> [k, q, g] -> [kn, rows]
        tile = jnp.broadcast_to(tile.transpose(2, 1, 0), (kn, qn, g)).reshape(kn, rows)
      else:            # [gb, q, k] -> [q, g, k] -> [rows, kn]
        tile = jnp.broadcast_to(tile.transpose(1, 0, 2), (qn, g, kn)).reshape(rows, kn)
      s = s + tile
    if self.key_bias is not None:
      kb = lax.dynamic_slice_in_dim(self.key_bias, ks, kn)
      s = s + (kb[:, None] if transposed else kb[None, :])
    mask = None
    if masked:  # a tile that the causal or window boundary crosses
      row = qs + jnp.arange(rows)[:, None] // g + self.offset
      key = ks + jnp.arange(kn)[None, :]
      mask = key <= row
      if self.window is not None:
        mask = mask & (key > row - self.window)
    if self.q_seg is not None:
      qseg = jnp.repeat(lax.dynamic_slice_in_dim(self.q_seg, qs, qn), g)
      same = qseg[:, None] == lax.dynamic_slice_in_dim(self.kv_seg, ks, kn)[None, :]
      mask = same if mask is None else mask & same
    if mask is not None:
      s = jnp.where(mask.T if transposed else mask, s, _NEG_INF)
    return s, dcap


def _visit(lo, a, b, hi, step, carry):
  """Runs ``step(t, carry, masked)`` over tiles ``[lo, a)`` and ``[b, hi)`` with the mask and
  ``[a, b)`` without."""
  masked = functools.partial(step, masked=True)
  carry = lax.fori_loop(lo, a, masked, carry)
  carry = lax.fori_loop(a, b, functools.partial(step, masked=False), carry)
  return lax.fori_loop(b, hi, masked, carry)


def _tile_forward(un: _Units, cfg):
  """One unit's forward on the tile path: lax loops over query and key tiles."""
  nq, blk, g, d = un.nq, un.blk, un.g, un.d

  def unit(args):
    u, qu, ku, vu = args
    tiles = _Tiles(un, u, cfg)

    def q_tile(i):
      qc = lax.dynamic_slice_in_dim(qu, i * blk, blk).reshape(tiles.rows, d)

      def step(j, carry, masked):
        m, l, acc = carry
        kj = lax.dynamic_slice_in_dim(ku, j * blk, blk)
        vj = lax.dynamic_slice_in_dim(vu, j * blk, blk)
        s, _ = tiles.scores(_nt(qc, kj), i, j, masked)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_use = jnp.where(jnp.isneginf(m_new), 0.0, m_new)  # rows that saw no key yet
        alpha = jnp.exp(m - m_use)
        p = jnp.exp(s - m_use[:, None])
        return m_new, l * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + _nn(p, vj)

      carry = (jnp.full((tiles.rows,), _NEG_INF, jnp.float32),
               jnp.zeros((tiles.rows,), jnp.float32), jnp.zeros((tiles.rows, d), jnp.float32))
      carry = vary_like(carry, qu, ku, vu)
      carry = _visit(*tiles.key_tiles(i), step, carry)
      m, l, acc = carry
      return _normalized(m, l, acc, blk, g, d)

    o, lse = lax.map(q_tile, jnp.arange(nq))
    return o.reshape(nq * blk, g, d), lse.reshape(nq * blk, g)

  return unit


def _normalized(m, l, acc, qn, g, d):
  """A query span's output and log-sum-exp from its row maximum, row sum and unnormalized
  output; rows that saw no key get zeros and an lse of +inf."""
  empty = l == 0
  o = acc / jnp.where(empty, 1.0, l)[:, None]
  lse = jnp.where(empty, jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))
  return o.reshape(qn, g, d), lse.reshape(qn, g)


def _strip_forward(un: _Units, cfg, height: int):
  """One unit's forward on the strip path: each strip of queries against all the keys it may
  see, in one product and one softmax."""
  g, d = un.g, un.d
  spans = _Spans(un, cfg)

  def unit(args):
    u, qu, ku, vu = args
    tiles = _Tiles(un, u, cfg)
    outs, lses = [], []
    for qs, qn in _strips(un.tq, height):
      lo, hi = spans.keys_of(qs, qn)
      if hi <= lo:   # no key is visible to these queries
        outs.append(vary_like(jnp.zeros((qn, g, d), jnp.float32), qu, ku, vu))
        lses.append(vary_like(jnp.full((qn, g), jnp.inf, jnp.float32), qu, ku, vu))
        continue
      qc = qu[qs:qs + qn].reshape(qn * g, d)
      s, _ = tiles.span_scores(_nt(qc, ku[lo:hi]), qs, qn, lo, hi - lo, spans.masked)
      m = jnp.max(s, axis=1)
      p = jnp.exp(s - jnp.where(jnp.isneginf(m), 0.0, m)[:, None])
      o, lse = _normalized(m, jnp.sum(p, axis=1), _nn(p, vu[lo:hi]), qn, g, d)
      outs.append(o)
      lses.append(lse)
    return jnp.concatenate(outs), jnp.concatenate(lses)

  return unit


def forward(q, k, v, q_seg, kv_seg, kv_lengths, bias, cfg):
  height = strip_height(q.shape[1], k.shape[1], q.shape[2] // k.shape[2])
  un = _prepare_units(q, k, v, q_seg, kv_seg, kv_lengths, bias, cfg, blk=1 if height else None)
  unit = _strip_forward(un, cfg, height) if height else _tile_forward(un, cfg)
  units = jnp.arange(un.q.shape[0])
  o, lse = lax.map(unit, (units, un.q, un.k, un.v),
                   batch_size=_unit_batch(un, height, XLA_STRIP_BATCH_SCORES))
  b, tq, hq, hkv, g, d = un.b, un.tq, un.hq, un.hkv, un.g, un.d
  o = o[:, :tq].reshape(b, hkv, tq, g, d).transpose(0, 2, 1, 3, 4).reshape(b, tq, hq, d)
  lse = lse[:, :tq].reshape(b, hkv, tq, g).transpose(0, 1, 3, 2).reshape(b, hq, tq)
  return o.astype(q.dtype), lse


def _dbias_added(dbias_acc, full, un: _Units, tiles: _Tiles):
  """``dbias_acc`` plus one unit's bias gradient ``full`` [g, tqp, tkp], summed over the heads
  a head-broadcast bias spans."""
  bb, hb = un.bias.shape[:2]
  if hb == 1:
    full = jnp.sum(full, axis=0, keepdims=True)
  at_b = tiles.bi if bb > 1 else 0
  at_h = tiles.kvh * un.g if hb > 1 else 0
  current = lax.dynamic_slice(dbias_acc, (at_b, at_h, 0, 0), (1,) + full.shape)
  return lax.dynamic_update_slice(dbias_acc, current + full[None], (at_b, at_h, 0, 0))


def _tile_backward(un: _Units, cfg):
  """One unit's backward on the tile path (carry: the bias gradient or None)."""
  nq, nk, blk, g, d = un.nq, un.nk, un.blk, un.g, un.d
  tqp = nq * blk
  f32 = jnp.float32
  with_bias = un.bias is not None

  def unit(dbias_acc, args):
    u, qu, ku, vu, dou, lseu, deltau = args
    tiles = _Tiles(un, u, cfg)
    qr = qu.reshape(tqp * g, d)
    rows = tiles.rows

    kt = ku.T   # [d, tkp]: dq is accumulated transposed, so that its product is a plain one

    def k_tile(dqt, j):
      kj = lax.dynamic_slice_in_dim(ku, j * blk, blk)
      ktj = lax.dynamic_slice_in_dim(kt, j * blk, blk, axis=1)
      vj = lax.dynamic_slice_in_dim(vu, j * blk, blk)

      def step(i, carry, masked):
        dk, dv, dqt, dbias_col = carry
        r0 = i * rows
        qc = lax.dynamic_slice_in_dim(qr, r0, rows)
        doc = lax.dynamic_slice_in_dim(dou, r0, rows)
        lse_c = lax.dynamic_slice_in_dim(lseu, r0, rows)
        delta_c = lax.dynamic_slice_in_dim(deltau, r0, rows)
        # Keys on rows: every product below is a plain or right-transposed matmul.
        st, dcap = _nt(kj, qc), None
        if tiles.dynamic or masked:
          st, dcap = tiles.scores(st, i, j, masked, transposed=True)
        pt = jnp.exp(st - lse_c[None, :])
        dst = pt * (_nt(vj, doc) - delta_c[None, :])
        dv = dv + _nn(pt, doc)
        if with_bias:
          tile = dst.T.reshape(blk, g, blk).transpose(1, 0, 2)
          dbias_col = lax.dynamic_update_slice_in_dim(dbias_col, tile, i * blk, 1)
        if dcap is not None:   # through the soft-cap: the bias's gradient is taken before it
          dst = dst * dcap
        dk = dk + _nn(dst, qc)
        dqt_c = lax.dynamic_slice_in_dim(dqt, r0, rows, axis=1) + _nn(ktj, dst)
        dqt = lax.dynamic_update_slice_in_dim(dqt, dqt_c, r0, 1)
        return dk, dv, dqt, dbias_col

      zeros = vary_like(jnp.zeros((blk, d), f32), qu, ku, vu, dou)
      dbias_col = vary_like(jnp.zeros((g, tqp, blk), f32), qu, ku, vu, dou) if with_bias else None
      carry = _visit(*tiles.query_tiles(j), step, (zeros, zeros, dqt, dbias_col))
      dk, dv, dqt, dbias_col = carry
      return dqt, (dk, dv, dbias_col)

    dqt0 = vary_like(jnp.zeros((d, tqp * g), f32), qu, ku, vu, dou)
    dqt, (dk, dv, dbias_cols) = lax.scan(k_tile, dqt0, jnp.arange(nk))
    if with_bias:
      full = dbias_cols.transpose(1, 2, 0, 3).reshape(g, tqp, nk * blk)
      dbias_acc = _dbias_added(dbias_acc, full, un, tiles)
    return dbias_acc, (dqt.T, dk.reshape(-1, d), dv.reshape(-1, d))

  return unit


def _strip_backward(un: _Units, cfg, height: int):
  """One unit's backward on the strip path (carry: the bias gradient or None): each strip of
  keys against all the queries that may see it."""
  g, d, tq, tk = un.g, un.d, un.tq, un.tk
  f32 = jnp.float32
  with_bias = un.bias is not None
  spans = _Spans(un, cfg)

  def unit(dbias_acc, args):
    u, qu, ku, vu, dou, lseu, deltau = args
    tiles = _Tiles(un, u, cfg)
    qr = qu.reshape(tq * g, d)
    kt = ku.T   # dq is accumulated transposed, so that its product is a plain one
    dqt = vary_like(jnp.zeros((d, tq * g), f32), qu, ku, vu, dou)
    full = vary_like(jnp.zeros((g, tq, tk), f32), qu, ku, vu, dou) if with_bias else None
    dks, dvs = [], []
    for ks, kn in _strips(tk, height):
      qlo, qhi = spans.queries_of(ks, kn)
      if qhi <= qlo:   # no query sees these keys
        dks.append(vary_like(jnp.zeros((kn, d), f32), qu, ku, vu, dou))
        dvs.append(dks[-1])
        continue
      r0, r1 = qlo * g, qhi * g
      kj, vj = ku[ks:ks + kn], vu[ks:ks + kn]
      qc, doc = qr[r0:r1], dou[r0:r1]
      st, dcap = tiles.span_scores(_nt(kj, qc), qlo, qhi - qlo, ks, kn, spans.masked,
                                   transposed=True)
      pt = jnp.exp(st - lseu[None, r0:r1])
      dst = pt * (_nt(vj, doc) - deltau[None, r0:r1])
      dvs.append(_nn(pt, doc))
      if with_bias:
        tile = dst.T.reshape(qhi - qlo, g, kn).transpose(1, 0, 2)
        full = lax.dynamic_update_slice(full, tile, (0, qlo, ks))
      if dcap is not None:   # through the soft-cap: the bias's gradient is taken before it
        dst = dst * dcap
      dks.append(_nn(dst, qc))
      # (.at[].add would bring an index constant, which custom_partitioning refuses)
      dq_part = lax.slice_in_dim(dqt, r0, r1, axis=1) + _nn(kt[:, ks:ks + kn], dst)
      dqt = lax.dynamic_update_slice_in_dim(dqt, dq_part, r0, 1)
    if with_bias:
      dbias_acc = _dbias_added(dbias_acc, full, un, tiles)
    return dbias_acc, (dqt.T, jnp.concatenate(dks), jnp.concatenate(dvs))

  return unit


def backward(q, k, v, q_seg, kv_seg, kv_lengths, bias, o, lse, do, cfg):
  height = strip_height(q.shape[1], k.shape[1], q.shape[2] // k.shape[2])
  un = _prepare_units(q, k, v, q_seg, kv_seg, kv_lengths, bias, cfg, blk=1 if height else None)
  b, tq, tk, hq, hkv, g, d = un.b, un.tq, un.tk, un.hq, un.hkv, un.g, un.d
  tqp = un.q.shape[1]
  f32 = jnp.float32

  def rows_of(x):  # [b, tq, hq, d] -> [units, tqp * g, d]
    x = x.astype(f32).reshape(b, tq, hkv, g, d).transpose(0, 2, 1, 3, 4)
    return _pad_to(x, 2, tqp).reshape(b * hkv, tqp * g, d)

  o_u, do_u = rows_of(o), rows_of(do)
  lse_u = lse.reshape(b, hkv, g, tq).transpose(0, 1, 3, 2)
  lse_u = _pad_to(lse_u, 2, tqp, jnp.inf).reshape(b * hkv, tqp * g)
  delta_u = jnp.sum(o_u * do_u, axis=-1)
  unit = _strip_backward(un, cfg, height) if height else _tile_backward(un, cfg)
  units = jnp.arange(b * hkv)
  xs = (units, un.q, un.k, un.v, do_u, lse_u, delta_u)
  if bias is not None:   # the units add into one bias gradient, one after the other
    dbias0 = vary_like(jnp.zeros(un.bias.shape, f32), q, k, v, do)
    dbias, (dq, dk, dv) = lax.scan(unit, dbias0, xs)
  else:
    dbias = None
    lo, hi = XLA_STRIP_BACKWARD_ONE_UNIT
    budget = 0 if lo < max(tq, tk) <= hi else XLA_STRIP_BACKWARD_BATCH_SCORES
    dq, dk, dv = lax.map(lambda a: unit(None, a)[1], xs,
                         batch_size=_unit_batch(un, height, budget))
  dq = dq.reshape(b, hkv, tqp, g, d)[:, :, :tq].transpose(0, 2, 1, 3, 4).reshape(b, tq, hq, d)
  dq = (dq * cfg.scale).astype(q.dtype)

  def back(x):
    return x.reshape(b, hkv, -1, d)[:, :, :tk].transpose(0, 2, 1, 3).astype(k.dtype)

  if bias is not None:
    dbias = dbias[:, :, :tq, :tk].astype(bias.dtype)
  return dq, back(dk), back(dv), dbias
