"""The XLA path of attention: the flash algorithm in plain ``jax.lax``, for CPUs.

The work is split into units, one per (batch, kv head), walked by lax.map so that a unit's
tiles stay in cache. A unit holds the G = heads // kv_heads query heads that share its keys:
a query tile is [block rows x G heads] flattened to block * G rows (row r is query position
r // G of head r % G), so every score tile is one [block * G, block] matmul. The forward keeps
a running row maximum, row sum and output per query tile (the online softmax); the backward
walks the key tiles, recomputing each score tile from the saved log-sum-exp.

Sequences are padded to a multiple of the block. Padded keys (and keys past kv_lengths) get a
-inf key bias; padded query rows get zero q and do and an lse of +inf, so they contribute
nothing to the backward and are sliced off. Tiles that the causal mask excludes are skipped.

The loops have bounds that depend on the data (kv_lengths) and on the tile (causal), so this
code is differentiated once, by its own backward; second-order gradients go through the
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

# Query and key tile of the XLA path. XLA:CPU runs the tile loop on one thread and splits only
# a large matmul over its cores, so long sequences use 512-wide tiles (their [512 x 512] x 64
# matmuls use every core) and everything else 128-wide ones (a tile's scores stay in L2).
# Measured on a 2-core Xeon, 8 heads, head dim 64, fwd+bwd, as a multiple of torch SDPA:
# causal T=2048: 128 -> 2.0x, 256 -> 2.2x, 512 -> 1.7x; non-causal T=2048: 2.4x, 2.5x, 1.6x;
# causal T=4096: 2.1x, 2.4x, 1.7x.
XLA_BLOCK = 128
XLA_LONG_BLOCK = 512


def xla_block_size(tq: int, tk: int) -> int:
  """Tile of the XLA path for these lengths: the long tile where it adds at most 1/8 padding."""
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


def _prepare_units(q, k, v, q_seg, kv_seg, kv_lengths, bias, cfg, scale_q=True):
  b, tq, hq, d = q.shape
  tk, hkv = k.shape[1], k.shape[2]
  g = hq // hkv
  blk = cfg.xla_block
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
    self.row_pos = jnp.arange(self.rows) // g     # query position within the tile
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
    blk, g = self.un.blk, self.un.g
    qs, ks = i * blk, j * blk
    dcap = None
    if self.cfg.softcap is not None:
      cap = self.cfg.softcap
      t = activations.tanh(s * (1.0 / cap))
      s, dcap = cap * t, 1.0 - t * t
    if self.bias is not None:
      tile = lax.dynamic_slice(self.bias, (0, qs, ks), (self.bias.shape[0], blk, blk))
      if transposed:   # [gb, q, k] -> [k, q, g] -> [blk, rows]
        tile = jnp.broadcast_to(tile.transpose(2, 1, 0), (blk, blk, g)).reshape(blk, self.rows)
      else:            # [gb, q, k] -> [q, g, k] -> [rows, blk]
        tile = jnp.broadcast_to(tile.transpose(1, 0, 2), (blk, g, blk)).reshape(self.rows, blk)
      s = s + tile
    if self.key_bias is not None:
      kb = lax.dynamic_slice_in_dim(self.key_bias, ks, blk)
      s = s + (kb[:, None] if transposed else kb[None, :])
    mask = None
    if masked:  # a tile that the causal or window boundary crosses
      row = qs + self.row_pos[:, None] + self.offset
      key = ks + jnp.arange(blk)[None, :]
      mask = key <= row
      if self.window is not None:
        mask = mask & (key > row - self.window)
    if self.q_seg is not None:
      qseg = jnp.repeat(lax.dynamic_slice_in_dim(self.q_seg, qs, blk), g)
      same = qseg[:, None] == lax.dynamic_slice_in_dim(self.kv_seg, ks, blk)[None, :]
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


def forward(q, k, v, q_seg, kv_seg, kv_lengths, bias, cfg):
  un = _prepare_units(q, k, v, q_seg, kv_seg, kv_lengths, bias, cfg)
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
      empty = l == 0
      o = acc / jnp.where(empty, 1.0, l)[:, None]
      lse = jnp.where(empty, jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))
      return o.reshape(blk, g, d), lse.reshape(blk, g)

    o, lse = lax.map(q_tile, jnp.arange(nq))
    return o.reshape(nq * blk, g, d), lse.reshape(nq * blk, g)

  units = jnp.arange(un.q.shape[0])
  o, lse = lax.map(unit, (units, un.q, un.k, un.v))
  b, tq, hq, hkv = un.b, un.tq, un.hq, un.hkv
  o = o[:, :tq].reshape(b, hkv, tq, g, d).transpose(0, 2, 1, 3, 4).reshape(b, tq, hq, d)
  lse = lse[:, :tq].reshape(b, hkv, tq, g).transpose(0, 1, 3, 2).reshape(b, hq, tq)
  return o.astype(q.dtype), lse


def backward(q, k, v, q_seg, kv_seg, kv_lengths, bias, o, lse, do, cfg):
  un = _prepare_units(q, k, v, q_seg, kv_seg, kv_lengths, bias, cfg)
  nq, nk, blk, g, d = un.nq, un.nk, un.blk, un.g, un.d
  b, tq, tk, hq, hkv = un.b, un.tq, un.tk, un.hq, un.hkv
  tqp = nq * blk
  f32 = jnp.float32

  def rows_of(x):  # [b, tq, hq, d] -> [units, tqp * g, d]
    x = x.astype(f32).reshape(b, tq, hkv, g, d).transpose(0, 2, 1, 3, 4)
    return _pad_to(x, 2, tqp).reshape(b * hkv, tqp * g, d)

  o_u, do_u = rows_of(o), rows_of(do)
  lse_u = lse.reshape(b, hkv, g, tq).transpose(0, 1, 3, 2)
  lse_u = _pad_to(lse_u, 2, tqp, jnp.inf).reshape(b * hkv, tqp * g)
  delta_u = jnp.sum(o_u * do_u, axis=-1)
  with_bias = bias is not None

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
      bb, hb = un.bias.shape[:2]
      if hb == 1:
        full = jnp.sum(full, axis=0, keepdims=True)
      at_b = tiles.bi if bb > 1 else 0
      at_h = tiles.kvh * g if hb > 1 else 0
      current = lax.dynamic_slice(dbias_acc, (at_b, at_h, 0, 0), (1,) + full.shape)
      dbias_acc = lax.dynamic_update_slice(dbias_acc, current + full[None], (at_b, at_h, 0, 0))
    return dbias_acc, (dqt.T, dk.reshape(-1, d), dv.reshape(-1, d))

  dbias0 = vary_like(jnp.zeros(un.bias.shape, f32), q, k, v, do) if with_bias else None
  units = jnp.arange(b * hkv)
  dbias, (dq, dk, dv) = lax.scan(unit, dbias0,
                                 (units, un.q, un.k, un.v, do_u, lse_u, delta_u))
  dq = dq.reshape(b, hkv, tqp, g, d)[:, :, :tq].transpose(0, 2, 1, 3, 4).reshape(b, tq, hq, d)
  dq = (dq * cfg.scale).astype(q.dtype)

  def back(x):
    return x.reshape(b, hkv, -1, d)[:, :, :tk].transpose(0, 2, 1, 3).astype(k.dtype)

  if with_bias:
    dbias = dbias[:, :, :tq, :tk].astype(bias.dtype)
  return dq, back(dk), back(dv), dbias

