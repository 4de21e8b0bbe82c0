"""Fused attention with recomputation: ``softmax(q kᵀ · scale + bias) v`` in O(N) memory.

The forward never materializes the ``[Tq, Tk]`` score matrix. It walks the keys in tiles and
keeps a running row maximum, row sum and output (the online softmax), and it saves only the
output ``o`` and the row log-sum-exp ``lse`` for the backward (``q``, ``k`` and ``v`` are inputs
and exist anyway). The backward recomputes the probabilities tile by tile from ``lse``:
``p = exp(s - lse)``, ``ds = p * (do vᵀ - rowsum(do * o))``, then ``dq = ds k · scale``,
``dk = dsᵀ q · scale``, ``dv = pᵀ do``. Tiles that the causal mask excludes are skipped, not
masked.

Two implementations share that contract:

- ``"pallas"``: FlashAttention-style kernels for GPUs (Pallas, lowered through Triton): one
  forward kernel, one ``dq`` kernel and one ``dk/dv`` kernel, plus a ``dbias`` kernel when a
  bias is given. Tile sizes come from a table keyed by head dimension and dtype, or from
  :func:`autotune`, which times candidates on the GPU and caches its choice.
- ``"xla"``: the same algorithm in plain ``jax.lax`` for CPUs (and as a fallback): a loop over
  (batch, kv head) units, a loop over query tiles and a loop over the key tiles each query tile
  can see, with tiles small enough to stay in cache.

Layout is ``[batch, seq, heads, head_dim]``, as in :func:`jax.nn.dot_product_attention` and
flax. Grouped-query attention: ``k`` and ``v`` may have fewer heads than ``q`` (their number
must divide ``q``'s); query head ``h`` uses kv head ``h // (q_heads // kv_heads)``, as torch's
``scaled_dot_product_attention(..., enable_gqa=True)`` does.

Masks (all optional, combined with AND):

- ``causal``: query ``i`` sees keys ``j <= i`` (aligned at the top-left corner, as in torch's
  ``is_causal=True`` when the lengths differ).
- ``segment_ids``: ``[batch, seq]`` integers when ``q`` and ``k`` have one length, or a pair
  ``(q_segment_ids, kv_segment_ids)``; a query sees the keys of its own segment.
- ``kv_lengths``: ``[batch]`` integers; keys at positions ``>= kv_lengths[b]`` are padding.
- ``bias``: a float array added to the scaled scores, of shape
  ``[batch | 1, q_heads | 1, Tq | 1, Tk | 1]``; it is differentiable.

A query row that sees no key at all gets a zero output and zero gradients (not NaN).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import os
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jaxfuse.kernels.pallas import flash_attention as pallas_attention
from jaxfuse.kernels.pallas.flash_attention import BlockSizes
from jaxfuse.ops import checks, dispatch

__all__ = [
    "BlockSizes",
    "attention",
    "attention_reference",
    "autotune",
    "clear_autotune_cache",
    "dot_product_attention",
    "heuristic_block_sizes",
]

_IMPLEMENTATIONS = ("pallas", "xla")
_PREFERENCE = {"gpu": ("pallas", "xla"), "cpu": ("xla",), "tpu": ("xla",)}

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


# Reference -------------------------------------------------------------------------------------


def attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
                        scale: float | None = None, segment_ids=None,
                        kv_lengths: jax.Array | None = None,
                        bias: jax.Array | None = None) -> jax.Array:
  """Plain ``softmax(q kᵀ · scale + bias) v`` with the full score matrix (O(N²) memory).

  Same arguments and semantics as :func:`attention` (fully masked rows give zeros); computed in
  float32 and differentiated by JAX. It is the unfused baseline and the tests' oracle.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxfuse.ops import attention_reference
    >>> x = jnp.ones((1, 3, 2, 4))
    >>> attention_reference(x, x, x, causal=True).shape
    (1, 3, 2, 4)
  """
  _check("attention_reference", q, k, v, segment_ids, kv_lengths, bias)
  b, tq, hq, d = q.shape
  tk, hkv = k.shape[1], k.shape[2]
  scale = _default_scale(scale, d)
  cd = jnp.promote_types(q.dtype, jnp.float32)
  qg = q.astype(cd).reshape(b, tq, hkv, hq // hkv, d)
  s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(cd), precision=_HIGHEST) * scale
  s = s.reshape(b, hq, tq, tk)
  if bias is not None:
    s = s + bias.astype(cd)
  mask = _dense_mask(b, tq, tk, causal, _segments(segment_ids, tq, tk), kv_lengths)
  if mask is not None:
    s = jnp.where(mask, s, _NEG_INF)
  m = lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
  m = jnp.where(jnp.isneginf(m), 0.0, m)
  p = jnp.exp(s - m)
  l = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(l == 0, 1.0, l)
  pg = p.reshape(b, hkv, hq // hkv, tq, tk)
  o = jnp.einsum("bhgqk,bkhd->bqhgd", pg, v.astype(cd), precision=_HIGHEST)
  return o.reshape(b, tq, hq, d).astype(q.dtype)


def _dense_mask(b, tq, tk, causal, segments, kv_lengths):
  """The [b, 1, tq, tk] boolean mask of the reference, or None."""
  mask = None

  def both(m, new):
    return new if m is None else m & new

  if causal:
    mask = both(mask, (jnp.arange(tq)[:, None] >= jnp.arange(tk)[None, :])[None, None])
  if segments is not None:
    q_seg, kv_seg = segments
    mask = both(mask, (q_seg[:, :, None] == kv_seg[:, None, :])[:, None])
  if kv_lengths is not None:
    mask = both(mask, (jnp.arange(tk)[None, :] < kv_lengths[:, None])[:, None, None, :])
  if mask is not None:
    mask = jnp.broadcast_to(mask, (b, 1, tq, tk))
  return mask


# Public op -------------------------------------------------------------------------------------


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
              scale: float | None = None, segment_ids=None, kv_lengths: jax.Array | None = None,
              bias: jax.Array | None = None, implementation: str | None = None) -> jax.Array:
  """Scaled dot-product attention that saves only ``o`` and the row log-sum-exp.

  Args:
    q: queries ``[batch, q_len, heads, head_dim]``, float32, bfloat16 or float16.
    k: keys ``[batch, kv_len, kv_heads, head_dim]``; ``kv_heads`` divides ``heads``.
    v: values, the shape and dtype of ``k``.
    causal: query ``i`` sees keys ``j <= i`` (top-left aligned when the lengths differ).
    scale: multiplies ``q kᵀ``; default ``1 / sqrt(head_dim)``.
    segment_ids: ``[batch, seq]`` integer ids (one length for q and kv) or a pair
      ``(q_segment_ids [batch, q_len], kv_segment_ids [batch, kv_len])``: queries see only
      keys with the same id.
    kv_lengths: ``[batch]`` integers: keys at positions ``>= kv_lengths[b]`` are padding.
    bias: added to the scaled scores; shape ``[batch | 1, heads | 1, q_len | 1, kv_len | 1]``,
      any float dtype. Differentiable.
    implementation: ``None`` (the fastest here: Pallas on GPUs, XLA on CPUs), ``"pallas"`` or
      ``"xla"``.

  Returns:
    ``[batch, q_len, heads, head_dim]`` in the dtype of ``q``. Rows that see no key are zero.
    Low-precision inputs are multiplied with float32 accumulation and the softmax runs in
    float32.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxfuse.ops import attention
    >>> q = k = v = jax.random.normal(jax.random.key(0), (2, 77, 4, 64))
    >>> o = attention(q, k, v, causal=True)
    >>> o.shape
    (2, 77, 4, 64)
    >>> g = jax.grad(lambda q: attention(q, k, v, causal=True).sum())(q)
  """
  op = "attention"
  _check(op, q, k, v, segment_ids, kv_lengths, bias)
  if not isinstance(causal, bool):
    raise TypeError(f"{op}: causal must be a bool, got {causal!r}")
  impl = dispatch.resolve(op, implementation, _IMPLEMENTATIONS, _PREFERENCE)
  b, tq, hq, d = q.shape
  if implementation is None and impl == "pallas" and d > pallas_attention.MAX_HEAD_DIM:
    impl = "xla"  # the kernels' tiles would not fit; the XLA path takes any head dim
  tk = k.shape[1]
  scale = _default_scale(scale, d)
  segments = _segments(segment_ids, tq, tk)
  if tq == 0 or tk == 0:  # Nothing to attend to: zeros (rows without keys).
    return jnp.zeros(q.shape, q.dtype)
  q_seg, kv_seg = segments if segments is not None else (None, None)
  if kv_lengths is not None:
    kv_lengths = kv_lengths.astype(jnp.int32)
  if bias is not None:
    bias = _expand_bias(bias, tq, tk)
  if impl == "pallas":
    blocks = block_sizes_for(q, k, causal=causal, has_bias=bias is not None)
    xla_block = 0
  else:
    blocks = None
    xla_block = xla_block_size(tq, tk)
  cfg = _Config(causal=causal, scale=scale, impl=impl,
                interpret=impl == "pallas" and not dispatch.on_gpu(), blocks=blocks,
                xla_block=xla_block)
  with jax.named_scope(f"jaxfuse.attention[{impl}]"):
    return _attention(q, k, v, q_seg, kv_seg, kv_lengths, bias, cfg)


@dataclasses.dataclass(frozen=True)
class _Config:
  causal: bool
  scale: float
  impl: str
  interpret: bool
  blocks: BlockSizes | None
  xla_block: int


def _default_scale(scale, d):
  if scale is None:
    return 1.0 / math.sqrt(d)
  if not isinstance(scale, numbers.Real) or isinstance(scale, bool):
    raise TypeError(f"attention: scale must be a Python float or None, got {type(scale).__name__}")
  return float(scale)


def _check(op, q, k, v, segment_ids, kv_lengths, bias):
  for name, x in (("q", q), ("k", k), ("v", v)):
    checks.floating(op, name, x)
    checks.rank(op, name, x, 4)
  checks.same_dtype(op, ("q", "k", "v"), (q, k, v))
  checks.same_shape(op, ("k", "v"), (k, v))
  b, _, hq, d = q.shape
  checks.dim(op, "k", k, 0, b, "the batch size of q")
  checks.dim(op, "k", k, 3, d, "the head dim of q")
  hkv = k.shape[2]
  if hkv == 0 or hq % hkv:
    raise ValueError(f"{op}: the kv heads of k (axis 2, {hkv}) must divide the heads of q "
                     f"(axis 2, {hq}), got q {tuple(q.shape)} and k {tuple(k.shape)}")
  tq, tk = q.shape[1], k.shape[1]
  if segment_ids is not None:
    pair = segment_ids if isinstance(segment_ids, (tuple, list)) else None
    if pair is not None:
      if len(pair) != 2:
        raise ValueError(f"{op}: segment_ids must be an array or a pair (q_segment_ids, "
                         f"kv_segment_ids), got {len(pair)} entries")
      for name, x, t in (("q_segment_ids", pair[0], tq), ("kv_segment_ids", pair[1], tk)):
        _check_int(op, f"segment_ids ({name})", x, (b, t))
    else:
      if tq != tk:
        raise ValueError(f"{op}: segment_ids as one array needs q and k of one length, got "
                         f"{tq} and {tk}; pass (q_segment_ids, kv_segment_ids)")
      _check_int(op, "segment_ids", segment_ids, (b, tq))
  if kv_lengths is not None:
    _check_int(op, "kv_lengths", kv_lengths, (b,))
  if bias is not None:
    checks.floating(op, "bias", bias)
    checks.rank(op, "bias", bias, 4)
    want = (b, hq, tq, tk)
    if any(n not in (1, w) for n, w in zip(bias.shape, want)):
      raise ValueError(f"{op}: bias must have shape [batch | 1, heads | 1, q_len | 1, "
                       f"kv_len | 1] = {want} or 1 per axis, got shape {tuple(bias.shape)}")


def _check_int(op, name, x, shape):
  dtype = getattr(x, "dtype", None)
  if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
    got = jnp.dtype(dtype).name if dtype is not None else type(x).__name__
    raise TypeError(f"{op}: {name} must be an integer array, got {got}")
  if tuple(x.shape) != tuple(shape):
    raise ValueError(f"{op}: {name} must have shape {tuple(shape)}, got {tuple(x.shape)}")


def _segments(segment_ids, tq, tk):
  if segment_ids is None:
    return None
  if isinstance(segment_ids, (tuple, list)):
    return segment_ids[0].astype(jnp.int32), segment_ids[1].astype(jnp.int32)
  ids = segment_ids.astype(jnp.int32)
  return ids, ids


def _expand_bias(bias, tq, tk):
  """Materializes broadcast query/key axes; batch and head broadcasting stays implicit."""
  shape = (bias.shape[0], bias.shape[1], tq, tk)
  return bias if bias.shape == shape else jnp.broadcast_to(bias, shape)


# The custom VJP --------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _attention(q, k, v, q_seg, kv_seg, kv_lengths, bias, cfg):
  # The primal alone (what jax.checkpoint runs before recomputing residuals in the backward).
  return _forward(q, k, v, q_seg, kv_seg, kv_lengths, bias, cfg, with_lse=False)[0]


def _forward(q, k, v, q_seg, kv_seg, kv_lengths, bias, cfg, with_lse=True):
  if cfg.impl == "pallas":
    return pallas_attention.forward(q, k, v, q_seg, kv_seg, kv_lengths, bias, causal=cfg.causal,
                                    scale=cfg.scale, blocks=cfg.blocks, interpret=cfg.interpret,
                                    with_lse=with_lse)
  return _xla_forward(q, k, v, q_seg, kv_seg, kv_lengths, bias, cfg)


def _attention_fwd(q, k, v, q_seg, kv_seg, kv_lengths, bias, cfg):
  o, lse = _forward(q, k, v, q_seg, kv_seg, kv_lengths, bias, cfg)
  # Residuals: the inputs (free), the output and one float32 per query row and head.
  return o, (q, k, v, q_seg, kv_seg, kv_lengths, bias, o, lse)


def _attention_bwd(cfg, residuals, do):
  q, k, v, q_seg, kv_seg, kv_lengths, bias, o, lse = residuals
  if cfg.impl == "pallas":
    dq, dk, dv, dbias = pallas_attention.backward(
        q, k, v, q_seg, kv_seg, kv_lengths, bias, o, lse, do, causal=cfg.causal,
        scale=cfg.scale, blocks=cfg.blocks, interpret=cfg.interpret)
  else:
    dq, dk, dv, dbias = _xla_backward(q, k, v, q_seg, kv_seg, kv_lengths, bias, o, lse, do, cfg)
  return dq, dk, dv, None, None, None, dbias


_attention.defvjp(_attention_fwd, _attention_bwd, optimize_remat=True)


# XLA path --------------------------------------------------------------------------------------
#
# The work is split into units, one per (batch, kv head), walked by lax.map so that a unit's
# tiles stay in cache. A unit holds the G = heads // kv_heads query heads that share its keys:
# a query tile is [block rows x G heads] flattened to block * G rows (row r is query position
# r // G of head r % G), so every score tile is one [block * G, block] matmul.
#
# Sequences are padded to a multiple of the block. Padded keys (and keys past kv_lengths) get a
# -inf key bias; padded query rows get zero q and do and an lse of +inf, so they contribute
# nothing to the backward and are sliced off.


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


class _Tiles:
  """Score-tile helpers for one unit: bias, masks and slices, in the [rows, keys] layout."""

  def __init__(self, un: _Units, u, causal):
    self.un, self.causal = un, causal
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

  @property
  def dynamic(self):
    return self.bias is not None or self.key_bias is not None or self.q_seg is not None

  def key_blocks(self):
    """Key tiles that hold at least one key below kv_lengths (all of them without it)."""
    if self.kv_len is None:
      return self.un.nk
    return jnp.minimum(self.un.nk, -(-self.kv_len // self.un.blk))

  def scores(self, s, i, j, diagonal, transposed=False):
    """Adds the bias and applies the masks to the score tile of q tile i and k tile j.

    ``s`` is [rows, blk] (queries on rows), or [blk, rows] with ``transposed``.
    """
    blk, g = self.un.blk, self.un.g
    qs, ks = i * blk, j * blk
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
    if diagonal:  # i == j: the tile the causal diagonal crosses.
      mask = self.row_pos[:, None] >= jnp.arange(blk)[None, :]
    if self.q_seg is not None:
      qseg = jnp.repeat(lax.dynamic_slice_in_dim(self.q_seg, qs, blk), g)
      same = qseg[:, None] == lax.dynamic_slice_in_dim(self.kv_seg, ks, blk)[None, :]
      mask = same if mask is None else mask & same
    if mask is not None:
      s = jnp.where(mask.T if transposed else mask, s, _NEG_INF)
    return s


def _xla_forward(q, k, v, q_seg, kv_seg, kv_lengths, bias, cfg):
  un = _prepare_units(q, k, v, q_seg, kv_seg, kv_lengths, bias, cfg)
  nq, nk, blk, g, d = un.nq, un.nk, un.blk, un.g, un.d
  causal = cfg.causal

  def unit(args):
    u, qu, ku, vu = args
    tiles = _Tiles(un, u, causal)
    kv_blocks = tiles.key_blocks()

    def q_tile(i):
      qc = lax.dynamic_slice_in_dim(qu, i * blk, blk).reshape(tiles.rows, d)

      def step(j, carry, diagonal=False):
        m, l, acc = carry
        kj = lax.dynamic_slice_in_dim(ku, j * blk, blk)
        vj = lax.dynamic_slice_in_dim(vu, j * blk, blk)
        s = tiles.scores(_nt(qc, kj), i, j, diagonal)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_use = jnp.where(jnp.isneginf(m_new), 0.0, m_new)  # rows that saw no key yet
        alpha = jnp.exp(m - m_use)
        p = jnp.exp(s - m_use[:, None])
        return m_new, l * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + _nn(p, vj)

      carry = (jnp.full((tiles.rows,), _NEG_INF, jnp.float32),
               jnp.zeros((tiles.rows,), jnp.float32), jnp.zeros((tiles.rows, d), jnp.float32))
      if causal:
        # Tiles left of the diagonal are wholly visible; tiles right of it are skipped.
        carry = lax.fori_loop(0, jnp.minimum(i, kv_blocks), step, carry)
        diag = functools.partial(step, i, diagonal=True)
        carry = diag(carry) if nq <= nk else lax.cond(i < nk, diag, lambda c: c, carry)
      else:
        carry = lax.fori_loop(0, kv_blocks, step, carry)
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


def _xla_backward(q, k, v, q_seg, kv_seg, kv_lengths, bias, o, lse, do, cfg):
  un = _prepare_units(q, k, v, q_seg, kv_seg, kv_lengths, bias, cfg)
  nq, nk, blk, g, d = un.nq, un.nk, un.blk, un.g, un.d
  b, tq, tk, hq, hkv = un.b, un.tq, un.tk, un.hq, un.hkv
  tqp = nq * blk
  causal = cfg.causal
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
    tiles = _Tiles(un, u, causal)
    kv_blocks = tiles.key_blocks()
    qr = qu.reshape(tqp * g, d)
    rows = tiles.rows

    kt = ku.T   # [d, tkp]: dq is accumulated transposed, so that its product is a plain one

    def k_tile(dqt, j):
      kj = lax.dynamic_slice_in_dim(ku, j * blk, blk)
      ktj = lax.dynamic_slice_in_dim(kt, j * blk, blk, axis=1)
      vj = lax.dynamic_slice_in_dim(vu, j * blk, blk)

      def step(i, carry, diagonal=False):
        dk, dv, dqt, dbias_col = carry
        r0 = i * rows
        qc = lax.dynamic_slice_in_dim(qr, r0, rows)
        doc = lax.dynamic_slice_in_dim(dou, r0, rows)
        lse_c = lax.dynamic_slice_in_dim(lseu, r0, rows)
        delta_c = lax.dynamic_slice_in_dim(deltau, r0, rows)
        # Keys on rows: every product below is a plain or right-transposed matmul.
        st = _nt(kj, qc)
        if tiles.dynamic or diagonal:
          st = tiles.scores(st, i, j, diagonal, transposed=True)
        pt = jnp.exp(st - lse_c[None, :])
        dst = pt * (_nt(vj, doc) - delta_c[None, :])
        dv = dv + _nn(pt, doc)
        dk = dk + _nn(dst, qc)
        dqt_c = lax.dynamic_slice_in_dim(dqt, r0, rows, axis=1) + _nn(ktj, dst)
        dqt = lax.dynamic_update_slice_in_dim(dqt, dqt_c, r0, 1)
        if with_bias:
          tile = dst.T.reshape(blk, g, blk).transpose(1, 0, 2)
          dbias_col = lax.dynamic_update_slice_in_dim(dbias_col, tile, i * blk, 1)
        return dk, dv, dqt, dbias_col

      zeros = jnp.zeros((blk, d), f32)
      dbias_col = jnp.zeros((g, tqp, blk), f32) if with_bias else None
      carry = (zeros, zeros, dqt, dbias_col)
      live = j < kv_blocks   # a key tile wholly past kv_lengths gets no gradient
      if causal:
        diag = functools.partial(step, j, diagonal=True)
        carry = diag(carry) if nk <= nq else lax.cond(j < nq, diag, lambda c: c, carry)
        carry = lax.fori_loop(j + 1, jnp.where(live, nq, j + 1), step, carry)
      else:
        carry = lax.fori_loop(0, jnp.where(live, nq, 0), step, carry)
      dk, dv, dqt, dbias_col = carry
      return dqt, (dk, dv, dbias_col)

    dqt, (dk, dv, dbias_cols) = lax.scan(k_tile, jnp.zeros((d, tqp * g), f32), jnp.arange(nk))
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

  dbias0 = jnp.zeros(un.bias.shape, f32) if with_bias else None
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


# Tile sizes: heuristic table and autotuning ----------------------------------------------------

heuristic_block_sizes = pallas_attention.heuristic_block_sizes

_AUTOTUNE_CACHE: dict[str, BlockSizes] = {}
_CACHE_ENV = "JAXFUSE_ATTENTION_TUNING"
_loaded_cache_files: set[str] = set()


def _device_kind() -> str:
  return jax.devices()[0].device_kind if dispatch.on_gpu() else dispatch.platform()


def _tuning_key(q_shape, k_shape, dtype, causal: bool, has_bias: bool) -> str:
  return json.dumps([_device_kind(), list(q_shape), list(k_shape), jnp.dtype(dtype).name,
                     bool(causal), bool(has_bias)])


def _load_cache_file(path: str) -> None:
  try:
    with open(path) as f:
      entries = json.load(f)
  except (OSError, ValueError):
    return
  for key, sizes in entries.items():
    _AUTOTUNE_CACHE.setdefault(key, BlockSizes(**sizes))


def block_sizes_for(q, k, *, causal: bool, has_bias: bool = False) -> BlockSizes:
  """The tile sizes the Pallas kernels use for these shapes: the autotuned choice if one is
  cached (in memory, or in the JSON file named by ``$JAXFUSE_ATTENTION_TUNING``), else the
  heuristic table's, clipped to the sequence lengths."""
  path = os.environ.get(_CACHE_ENV)
  if path and path not in _loaded_cache_files:
    _loaded_cache_files.add(path)
    _load_cache_file(path)
  key = _tuning_key(q.shape, k.shape, q.dtype, causal, has_bias)
  sizes = _AUTOTUNE_CACHE.get(key) or heuristic_block_sizes(q.shape[-1], q.dtype)
  return sizes.clipped(q.shape[1], k.shape[1])


def clear_autotune_cache() -> None:
  """Forgets every autotuned choice held in memory."""
  _AUTOTUNE_CACHE.clear()
  _loaded_cache_files.clear()


def default_candidates(head_dim: int, dtype) -> list[BlockSizes]:
  """The heuristic choice and its neighbours: tiles of 32..128, 4 or 8 warps, 1..3 stages."""
  base = heuristic_block_sizes(head_dim, dtype)
  out = [base]
  for fwd in ((128, 64), (64, 64), (128, 32), (64, 32)):
    for bwd in ((64, 64), (32, 64), (64, 32), (32, 32)):
      for warps in (4, 8):
        for stages in (1, 2, 3):
          out.append(BlockSizes(fwd[0], fwd[1], bwd[0], bwd[1], bwd[0], bwd[1], num_warps=warps,
                                num_stages=stages, num_warps_bwd=warps,
                                num_stages_bwd=max(1, stages - 1)))
  return list(dict.fromkeys(out))


def autotune(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
             bias: jax.Array | None = None, candidates: Sequence[BlockSizes] | None = None,
             runs: int = 5, cache_path: str | None = None,
             timer: Callable[[Callable[[], object]], float] | None = None) -> BlockSizes:
  """Times the Pallas kernels (forward + backward) with each candidate tile size; caches the
  fastest for this device, these shapes, dtype, causality and bias presence.

  Later calls of :func:`attention` with ``implementation="pallas"`` (or None on a GPU) and the
  same signature use the cached choice. Candidates that fail to compile are skipped.

  Args:
    q, k, v: example inputs (their shapes and dtype are the cache key; values are used to run).
    causal, bias: as in :func:`attention`.
    candidates: the tile sizes to try (default :func:`default_candidates`).
    runs: timed calls per candidate (after one warm-up call that also compiles).
    cache_path: also merge the choice into this JSON file (read back through
      ``$JAXFUSE_ATTENTION_TUNING``).
    timer: ``timer(fn) -> seconds`` for one call; the default waits for the result.

  Returns:
    The fastest candidate.

  Raises:
    ImplementationUnavailableError: Pallas cannot run here (no GPU and no interpret mode).
    RuntimeError: no candidate ran.
  """
  dispatch.resolve("attention.autotune", "pallas", _IMPLEMENTATIONS)
  _check("attention.autotune", q, k, v, None, None, bias)
  candidates = list(candidates or default_candidates(q.shape[-1], q.dtype))
  timer = timer or _wall_time
  interpret = not dispatch.on_gpu()
  scale = _default_scale(None, q.shape[-1])
  expanded = None if bias is None else _expand_bias(bias, q.shape[1], k.shape[1])
  results = []
  errors = []
  for sizes in candidates:
    cfg = _Config(causal=causal, scale=scale, impl="pallas", interpret=interpret,
                  blocks=sizes.clipped(q.shape[1], k.shape[1]), xla_block=0)

    def loss(q, k, v, cfg=cfg):
      o = _attention(q, k, v, None, None, None, expanded, cfg)
      return jnp.sum(o.astype(jnp.float32))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    try:
      jax.block_until_ready(step(q, k, v))
      seconds = sorted(timer(lambda step=step: step(q, k, v)) for _ in range(runs))[runs // 2]
    except Exception as e:  # noqa: BLE001 - a candidate that does not compile is skipped.
      errors.append(f"{sizes}: {type(e).__name__}: {e}")
      continue
    results.append((seconds, sizes))
  if not results:
    raise RuntimeError("attention.autotune: no candidate ran:\n" + "\n".join(errors[:5]))
  best = min(results, key=lambda r: r[0])[1]
  key = _tuning_key(q.shape, k.shape, q.dtype, causal, bias is not None)
  _AUTOTUNE_CACHE[key] = best
  if cache_path:
    _save_choice(cache_path, key, best)
  return best


def _wall_time(fn) -> float:
  start = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - start


def _save_choice(path: str, key: str, sizes: BlockSizes) -> None:
  try:
    with open(path) as f:
      entries = json.load(f)
  except (OSError, ValueError):
    entries = {}
  entries[key] = sizes.as_dict()
  with open(path, "w") as f:
    json.dump(entries, f, indent=1, sort_keys=True)


# A jax.nn-style entry point --------------------------------------------------------------------


def dot_product_attention(query: jax.Array, key: jax.Array, value: jax.Array,
                          bias: jax.Array | None = None, mask: jax.Array | None = None, *,
                          scale: float | None = None, is_causal: bool = False,
                          segment_ids=None, kv_lengths: jax.Array | None = None,
                          implementation: str | None = None) -> jax.Array:
  """:func:`attention` with the argument names of :func:`jax.nn.dot_product_attention`.

  ``query`` is ``[batch..., q_len, heads, head_dim]`` with any number of batch axes (``key``
  and ``value`` share them). A boolean ``mask`` (True = attend), broadcastable to
  ``[batch..., heads, q_len, kv_len]``, becomes a ``-inf`` bias, which costs a
  ``[q_len, kv_len]`` array per head that it varies over; prefer ``is_causal``,
  ``segment_ids`` and ``kv_lengths``, which cost nothing. Unlike jax.nn, a row that every
  mask excludes gives zeros.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxfuse.ops import dot_product_attention
    >>> x = jax.random.normal(jax.random.key(0), (2, 3, 10, 4, 16))
    >>> dot_product_attention(x, x, x, is_causal=True).shape
    (2, 3, 10, 4, 16)
  """
  batch = query.shape[:-3]
  if key.shape[:-3] != batch or value.shape[:-3] != batch:
    raise ValueError(f"dot_product_attention: query, key and value must share their batch "
                     f"axes, got {query.shape}, {key.shape} and {value.shape}")
  n = math.prod(batch)

  def flat(x):
    return x.reshape((n,) + x.shape[-3:])

  if mask is not None:
    mask_bias = jnp.where(mask, 0.0, _NEG_INF).astype(jnp.float32)
    bias = mask_bias if bias is None else bias.astype(jnp.float32) + mask_bias
  if bias is not None:
    full = jnp.broadcast_shapes(bias.shape, batch + (1, 1, 1))
    bias = jnp.broadcast_to(bias, full)
    per_batch = any(s != 1 for s in bias.shape[:-3])
    if per_batch:
      bias = jnp.broadcast_to(bias, batch + bias.shape[-3:])
    bias = bias.reshape((n if per_batch else 1,) + bias.shape[-3:])
  if segment_ids is not None:
    if isinstance(segment_ids, (tuple, list)):
      segment_ids = tuple(s.reshape(n, -1) for s in segment_ids)
    else:
      segment_ids = segment_ids.reshape(n, -1)
  if kv_lengths is not None:
    kv_lengths = jnp.broadcast_to(kv_lengths, batch).reshape(n)
  out = attention(flat(query), flat(key), flat(value), causal=is_causal, scale=scale,
                  segment_ids=segment_ids, kv_lengths=kv_lengths, bias=bias,
                  implementation=implementation)
  return out.reshape(query.shape)
