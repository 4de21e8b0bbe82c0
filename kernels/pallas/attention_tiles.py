"""What the Pallas attention kernels share (:mod:`jaxfuse.kernels.pallas.flash_attention`): the
tile sizes and their heuristics, the static description of a call, the loads, stores and
scores of a tile, and which tiles a program visits."""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from .. import limits
from . import common

LOG2E = 1.4426950408889634


_NEG_INF = float("-inf")
_INF = float("inf")
_BIG = 2**30


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes (powers of 2, at least 16) and Triton launch settings of the kernels.

  ``block_q``/``block_k``: the forward kernel's query and key tiles; ``*_dq``: the dq (and
  dbias) kernel's; ``*_dkdv``: the dk/dv kernel's. ``num_warps``/``num_stages`` apply to the
  forward, ``*_bwd`` to the backward kernels.
  """

  block_q: int = 64
  block_k: int = 64
  block_q_dq: int = 64
  block_k_dq: int = 64
  block_q_dkdv: int = 64
  block_k_dkdv: int = 64
  num_warps: int = 4
  num_stages: int = 2
  num_warps_bwd: int = 4
  num_stages_bwd: int = 2

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if field.name.startswith("block"):
        if not isinstance(value, int) or value < 16 or value & (value - 1):
          raise ValueError(f"BlockSizes: {field.name} must be a power of 2 >= 16, got {value!r}")
      elif not isinstance(value, int) or value < 1:
        raise ValueError(f"BlockSizes: {field.name} must be a positive int, got {value!r}")

  def clipped(self, q_len: int, kv_len: int) -> BlockSizes:
    """The same sizes, no larger than needed to cover the sequences (at least 16)."""
    def fit(block, n):
      return max(16, min(block, common.next_power_of_2(max(n, 1))))

    return dataclasses.replace(
        self, block_q=fit(self.block_q, q_len), block_k=fit(self.block_k, kv_len),
        block_q_dq=fit(self.block_q_dq, q_len), block_k_dq=fit(self.block_k_dq, kv_len),
        block_q_dkdv=fit(self.block_q_dkdv, q_len), block_k_dkdv=fit(self.block_k_dkdv, kv_len))

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


# Starting points for a Hopper-class GPU, keyed by (padded head dim, bytes per element): tiles
# shrink as the head dim and the element size grow, to keep the q tile, the double-buffered
# k/v tiles and the accumulators within shared memory and registers. `autotune` refines them.
# float32 products are IEEE (no tensor cores): Triton computes them with FMAs, whose operands
# and accumulators live in registers, so the float32 tiles are small and spread over 8 warps
# (at head dim 128 a 32 x 32 tile spilled in one kernel or another, Pallas or Triton).
# Every entry compiles for sm_90a without spilling registers (`python -m benchmarks kernels`
# measures them, tests/test_kernel_resources.py checks the 2-byte ones). At head dim 256 the dq
# (and dbias) tile is 32 x 16: at 32 x 32 the Triton dq kernel spilled, and the dbias kernels,
# which have no loop to stage their [32, 256] operands through shared memory, reached 255
# registers and spilled.
HEURISTIC_TABLE: dict[tuple[int, int], BlockSizes] = {
    (64, 2): BlockSizes(128, 64, 64, 64, 64, 64, num_warps=4, num_stages=3,
                        num_warps_bwd=4, num_stages_bwd=2),
    (128, 2): BlockSizes(128, 64, 64, 64, 64, 64, num_warps=8, num_stages=3,
                         num_warps_bwd=8, num_stages_bwd=2),
    (256, 2): BlockSizes(64, 32, 32, 16, 32, 32, num_warps=8, num_stages=2,
                         num_warps_bwd=8, num_stages_bwd=1),
    (64, 4): BlockSizes(64, 32, 64, 32, 32, 32, num_warps=8, num_stages=2,
                        num_warps_bwd=8, num_stages_bwd=2),
    (128, 4): BlockSizes(32, 16, 16, 16, 16, 32, num_warps=8, num_stages=2,
                         num_warps_bwd=8, num_stages_bwd=2),
    (256, 4): BlockSizes(32, 16, 32, 32, 32, 16, num_warps=4, num_stages=2,
                         num_warps_bwd=8, num_stages_bwd=2),
}

# With a bias the kernels also hold a float32 bias tile ([block_q, block_k]) in registers:
# where that pushes an entry above to 255 registers and into spills on sm_90a (the Triton
# kernels' forward at head dim 64, their dk/dv at 128), these replace it.
BIAS_HEURISTIC_TABLE: dict[tuple[int, int], BlockSizes] = {
    (64, 2): BlockSizes(64, 64, 64, 64, 64, 64, num_warps=4, num_stages=3,
                        num_warps_bwd=4, num_stages_bwd=2),
    (128, 2): BlockSizes(128, 64, 64, 64, 32, 64, num_warps=8, num_stages=3,
                         num_warps_bwd=8, num_stages_bwd=2),
}

MAX_HEAD_DIM = limits.MAX_HEAD_DIM


def heuristic_block_sizes(head_dim: int, dtype, *, has_bias: bool = False) -> BlockSizes:
  """The table's entry for this head dim (rounded up to 64, 128 or 256) and element size
  (:data:`BIAS_HEURISTIC_TABLE`'s, where it has one, for a call with a bias)."""
  if head_dim > MAX_HEAD_DIM:
    raise ValueError(f"attention: the Pallas and Triton kernels take head dims up to "
                     f"{MAX_HEAD_DIM}, got {head_dim}")
  padded = max(64, common.next_power_of_2(head_dim))
  size = 2 if jnp.dtype(dtype).itemsize <= 2 else 4
  if has_bias and (padded, size) in BIAS_HEURISTIC_TABLE:
    return BIAS_HEURISTIC_TABLE[(padded, size)]
  return HEURISTIC_TABLE[(padded, size)]


# Static description of one call ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Spec:
  b: int
  tq: int
  tk: int
  hq: int
  hkv: int
  d: int
  scale: float
  causal: str | None          # None, "top_left" or "bottom_right"
  window: int | None
  softcap: float | None
  has_kv_lengths: bool
  has_segments: bool
  bias_shape: tuple[int, ...] | None
  dtype: str

  @property
  def g(self):
    return self.hq // self.hkv

  @property
  def dp(self):
    return max(16, common.next_power_of_2(self.d))

  @property
  def qk_scale(self):
    return self.scale * LOG2E

  @property
  def precision(self):
    return lax.Precision.HIGHEST if jnp.dtype(self.dtype) == jnp.float32 else None


def _causal_alignment(causal) -> str | None:
  """``causal`` as None, ``"top_left"`` (also ``True``) or ``"bottom_right"``."""
  if causal is None or causal is False:
    return None
  if causal is True:
    return "top_left"
  if causal not in ("top_left", "bottom_right"):
    raise ValueError(f"attention kernels: causal must be a bool, 'top_left' or 'bottom_right', "
                     f"got {causal!r}")
  return causal


def _spec(q, k, bias, kv_lengths, q_seg, scale, causal, window, softcap):
  b, tq, hq, d = q.shape
  causal = _causal_alignment(causal)
  if window is not None and causal is None:
    raise ValueError("attention kernels: a sliding window needs a causal mask")
  return _Spec(b=b, tq=tq, tk=k.shape[1], hq=hq, hkv=k.shape[2], d=d, scale=float(scale),
               causal=causal, window=None if window is None else int(window),
               softcap=None if softcap is None else float(softcap),
               has_kv_lengths=kv_lengths is not None,
               has_segments=q_seg is not None,
               bias_shape=None if bias is None else tuple(bias.shape),
               dtype=jnp.dtype(q.dtype).name)


def _optional_refs(spec: _Spec, refs):
  """Splits the optional inputs off the front of ``refs``: kv_lengths, segments, bias."""
  refs = list(refs)
  kv_len = refs.pop(0) if spec.has_kv_lengths else None
  q_seg = kv_seg = None
  if spec.has_segments:
    q_seg, kv_seg = refs.pop(0), refs.pop(0)
  bias = refs.pop(0) if spec.bias_shape is not None else None
  return kv_len, q_seg, kv_seg, bias, refs


def _optional_args(spec: _Spec, kv_lengths, q_seg, kv_seg, bias, *, seg_q_map, seg_k_map,
                   bias_map):
  """The optional inputs and their block specs, in the order `_optional_refs` reads them."""
  args, specs = [], []
  if spec.has_kv_lengths:
    args.append(kv_lengths)
    specs.append(pl.BlockSpec((spec.b,), lambda *_: (0,)))
  if spec.has_segments:
    args += [q_seg, kv_seg]
    specs += [pl.BlockSpec((None, spec.tq), seg_q_map),
              pl.BlockSpec((None, spec.tk), seg_k_map)]
  if spec.bias_shape is not None:
    args.append(bias)
    specs.append(bias_map)
  return args, specs


def _bias_batch(spec, bi):
  return bi if spec.bias_shape[0] > 1 else 0


# In-kernel helpers -----------------------------------------------------------------------------


def _load_rows(ref, start, size, limit, spec: _Spec, other=0.0, head=None):
  """A [size, dp] tile of a [seq, d] ref (of head ``head`` of a [seq, heads, d] ref): rows past
  ``limit`` and columns past d read ``other``."""
  rows = start + jnp.arange(size)
  mask = (rows < limit)[:, None] & (jnp.arange(spec.dp) < spec.d)[None, :]
  if head is None:
    index = ref.at[pl.ds(start, size), pl.ds(0, spec.dp)]
  else:  # one indexer: Triton's lowering takes no chained .at[]
    index = ref.at[pl.ds(start, size), head, pl.ds(0, spec.dp)]
  return pl_triton.load(index, mask=mask, other=other)


def _store_rows(ref, start, value, limit, spec: _Spec):
  rows = start + jnp.arange(value.shape[0])
  mask = (rows < limit)[:, None] & (jnp.arange(spec.dp) < spec.d)[None, :]
  pl_triton.store(ref.at[pl.ds(start, value.shape[0]), pl.ds(0, spec.dp)],
                  value.astype(ref.dtype), mask=mask)


def _load_vec(ref, start, size, limit, other, head=None):
  pos = start + jnp.arange(size)
  index = ref.at[pl.ds(start, size)] if head is None else ref.at[head, pl.ds(start, size)]
  return pl_triton.load(index, mask=pos < limit, other=other)


def _dot(a, b, spec, trans_b=False):
  """``a @ b`` (or ``a @ bᵀ``) with float32 accumulation; IEEE float32 for float32 inputs."""
  dims = (((1,), (1 if trans_b else 0,)), ((), ()))
  return lax.dot_general(a, b, dims, precision=spec.precision,
                         preferred_element_type=jnp.float32)


def _kv_limit(spec, kv_len_ref, bi):
  """Keys at positions >= this are padding for batch element ``bi``."""
  if kv_len_ref is None:
    return spec.tk
  return jnp.clip(kv_len_ref[bi], 0, spec.tk)


def _offset(spec, kv_limit):
  """With a causal mask, query ``i`` sees keys ``j <= i + offset``: 0 at the top-left corner,
  the valid keys less the queries at the bottom-right one (per batch element with
  kv_lengths)."""
  return kv_limit - spec.tq if spec.causal == "bottom_right" else 0


def _segment_range(ids, valid):
  return (jnp.min(jnp.where(valid, ids, _BIG)), jnp.max(jnp.where(valid, ids, -_BIG)))


def _tanh(x):
  """tanh from ``expm1``, as the XLA path computes it (within 2 ulp in float32)."""
  m = jnp.expm1(-2.0 * jnp.abs(x))
  t = -m / (2.0 + m)
  return jnp.where(x < 0, -t, t)


def _logits(q, k, spec, qs, ks, bq, bk, kv_limit, offset, q_ids, k_ids, bias_tile, masked,
            keys_on_rows=False):
  """``(s, dcap)``: the base-2 scores of a query tile and a key tile, soft-capped, biased and
  masked (-inf where masked), and the soft-cap's derivative ``1 - tanh²`` (None without one).

  Queries on rows ([bq, bk]) unless ``keys_on_rows`` ([bk, bq]). The key limit and the
  segments always mask; the causal and window masks only where ``masked`` (a tile that one of
  their edges crosses).
  """
  rows = qs + jnp.arange(bq)
  cols = ks + jnp.arange(bk)
  if keys_on_rows:
    raw = _dot(k, q, spec, trans_b=True)
    row, col = rows[None, :], cols[:, None]
  else:
    raw = _dot(q, k, spec, trans_b=True)
    row, col = rows[:, None], cols[None, :]
  dcap = None
  if spec.softcap is None:
    s = raw * spec.qk_scale
  else:  # the cap acts on the natural-log scores; they go to base 2 after it
    t = _tanh(raw * (spec.scale / spec.softcap))
    s, dcap = t * (spec.softcap * LOG2E), 1.0 - t * t
  if bias_tile is not None:
    s = s + (bias_tile.T if keys_on_rows else bias_tile) * LOG2E
  mask = col < kv_limit
  if masked:
    mask = mask & (col <= row + offset)
    if spec.window is not None:
      mask = mask & (col > row + offset - spec.window)
  if q_ids is not None:
    if keys_on_rows:
      mask = mask & (k_ids[:, None] == q_ids[None, :])
    else:
      mask = mask & (q_ids[:, None] == k_ids[None, :])
  return jnp.where(mask, s, _NEG_INF), dcap


def _load_bias(bias_ref, spec, qs, ks, bq, bk, head=None):
  if bias_ref is None:
    return None
  rows = qs + jnp.arange(bq)
  cols = ks + jnp.arange(bk)
  mask = (rows < spec.tq)[:, None] & (cols < spec.tk)[None, :]
  if head is None:
    index = bias_ref.at[pl.ds(qs, bq), pl.ds(ks, bk)]
  else:
    index = bias_ref.at[head, pl.ds(qs, bq), pl.ds(ks, bk)]
  tile = pl_triton.load(index, mask=mask, other=0.0)
  return tile.astype(jnp.float32)


def _disjoint(id_range, ids, start, limit):
  """True when none of ``ids`` (those at positions below ``limit``) lies in ``id_range``: the
  tiles share no segment and their scores are all masked."""
  lo, hi = _segment_range(ids, start + jnp.arange(ids.shape[0]) < limit)
  return (hi < id_range[0]) | (lo > id_range[1])


# Which tiles a program visits. Query rows r (< q_len) see keys c (< kv_limit) with
# r + offset - W < c <= r + offset (no lower edge without a window W). A program visits exactly
# the tiles that hold a visible pair; [lo, a) and [b, hi) are crossed by a mask edge, [a, b) lie
# wholly inside the masks (rows past q_len and keys past kv_limit do not count: the key limit is
# always applied and padded rows are never stored). Divisions round down, also below zero; the
# arithmetic is the XLA path's (`xla._Tiles`) with query and key tiles of different sizes.


def _key_tiles(spec, qs, bq, bk, kv_limit, offset):
  """For the query tile starting at ``qs``: ``(lo, a, b, hi)`` over key tiles of ``bk``. With a
  window, ``[lo, a)`` is crossed by its lower edge; ``[b, hi)`` by the diagonal."""
  kv_tiles = pl.cdiv(kv_limit, bk)
  if spec.causal is None:
    return 0, 0, kv_tiles, kv_tiles
  first, last = qs, jnp.minimum(qs + bq, spec.tq) - 1      # the tile's first and last row
  hi = jnp.clip((last + offset) // bk + 1, 0, kv_tiles)     # past the last row's diagonal
  # Tiles whose keys the first row sees all (every tile when it sees every valid key).
  full_hi = jnp.where(kv_limit <= first + offset + 1, kv_tiles, (first + offset + 1) // bk)
  if spec.window is None:
    return 0, 0, jnp.clip(full_hi, 0, hi), hi
  w = spec.window
  hi = jnp.where(first + offset - w + 1 < kv_limit, hi, 0)  # windows wholly past the keys
  lo = jnp.clip((first + offset - w + 1) // bk, 0, hi)      # the first row's window start
  full_lo = -((w - 1 - last - offset) // bk)                # ceil((last + offset - w + 1) / bk)
  a = jnp.clip(full_lo, lo, hi)
  return lo, a, jnp.clip(full_hi, a, hi), hi


def _query_tiles(spec, ks, bq, bk, kv_limit, offset):
  """For the key tile starting at ``ks``: ``(lo, a, b, hi)`` over query tiles of ``bq``.
  ``[lo, a)`` is crossed by the diagonal; with a window, ``[b, hi)`` by its lower edge. A key
  tile wholly past the key limit gets no gradient: it visits nothing."""
  nq = np.int32(pl.cdiv(spec.tq, bq))
  live = ks < kv_limit
  if spec.causal is None:
    # int32 operands, not Python ints: Pallas' Triton lowering gives a weakly typed constant
    # of a select the other operand's type, here the predicate's (an i1 loop bound).
    hi = lax.select(live, nq, np.int32(0))
    return 0, 0, hi, hi
  first, last = ks, jnp.minimum(ks + bk, kv_limit) - 1     # the tile's first and last key
  live = live & (first - offset < spec.tq)                  # some row reaches the tile
  lo = jnp.clip((first - offset) // bq, 0, nq)              # the first row that sees ``first``
  full_lo = -((offset - last) // bq)                        # ceil((last - offset) / bq)
  if spec.window is None:
    hi = jnp.where(live, nq, lo)
    a = jnp.clip(full_lo, lo, hi)
    return lo, a, hi, hi
  w = spec.window
  hi = jnp.clip((last - offset + w - 1) // bq + 1, lo, nq)  # past the last row seeing ``last``
  hi = jnp.where(live, hi, lo)
  # Query tiles whose rows all see ``first`` (every tile when the last row does).
  full_hi = jnp.where(spec.tq <= first - offset + w, nq, (first - offset + w) // bq)
  a = jnp.clip(full_lo, lo, hi)
  return lo, a, jnp.clip(full_hi, a, hi), hi


def _visit(tiles, step, carry, *, masked_before: bool, masked_after: bool):
  """Runs ``step(t, carry, masked)`` over ``tiles = (lo, a, b, hi)``: ``[a, b)`` without the
  causal and window masks, ``[lo, a)`` (if ``masked_before``) and ``[b, hi)`` (if
  ``masked_after``) with them; a range that is empty by construction is not traced."""
  lo, a, b, hi = tiles
  masked = functools.partial(step, masked=True)
  if masked_before:
    carry = lax.fori_loop(lo, a, masked, carry)
  carry = lax.fori_loop(a, b, functools.partial(step, masked=False), carry)
  if masked_after:
    carry = lax.fori_loop(b, hi, masked, carry)
  return carry
