"""Triton kernels of the fused linear cross-entropy (``@triton.jit``, called from JAX through
jax-triton): per-token statistics and the logit gradient.

They are the Pallas kernels of :mod:`jaxfuse.kernels.pallas.cross_entropy` written for Triton,
with the same math:

- ``xent_stats_kernel``, grid (token blocks,): each program walks the vocabulary in tiles of
  ``BV``. A tile's logits ``h @ w.T (+ bias)`` are made in registers (a loop over the hidden
  axis in steps of ``BD``), soft-capped, scaled by ``SCALE`` (an inverse temperature), and
  folded into an online logsumexp, the target logit (gathered where the column is the label; a
  label outside ``[0, V)`` gathers 0), the sum of the logits (with ``ENTROPY``, their mean
  under the softmax instead) and the running argmax (the first column of the maximum). No
  logits reach memory.
- ``xent_logit_grad_kernel``, grid (token blocks, vocabulary tiles): each program recomputes its
  tile's logits and writes the logit gradient ``a * softmax - b * onehot(label) - c`` (``c``
  only with ``SMOOTHING``; with ``ENTROPY``, ``softmax * (a + c * z) - b * onehot(label)``),
  times ``SCALE`` and the soft-cap's derivative ``1 - (z / (SCALE * cap))²``; the caller
  multiplies it into ``dh`` and ``dweight``.

``h [N, D]`` and ``w [V, D]`` are read in power-of-2 tiles (at least 16, as ``tl.dot`` needs)
whose tails are masked, so no size needs to be a multiple of a block. float32 inputs multiply
exactly (``"ieee"``), as the Pallas kernels' ``HIGHEST``; the statistics are float32 and the
argmax int32. The same kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, torch CPU
tensors), which is how CPU tests check them.
"""

from __future__ import annotations

import dataclasses
import math

import triton
import triton.language as tl

from .elementwise import activation

# GPU tiles: tokens x vocabulary x hidden (the Pallas kernels' GPU tiles).
GPU_BLOCKS = (64, 128, 32)
NUM_WARPS = 4
# float32 products are IEEE FMAs whose operands live in registers: the 64x128 logit tile
# spills on sm_90a with 4 warps (336 B a thread); 64x64 over 8 warps does not.
GPU_BLOCKS_F32 = (64, 64, 32)
NUM_WARPS_F32 = 8
NUM_STAGES = 2
_NEG_INF = tl.constexpr(float("-inf"))
_INT_MAX = tl.constexpr(2**31 - 1)


@triton.jit
def _tile_logits(h_ptr, w_ptr, b_ptr, rows, rows_ok, cols, cols_ok, D: tl.constexpr,
                 BT: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr, SOFTCAP: tl.constexpr,
                 SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr):
  """The ``[BT, BV]`` logits of one tile in float32, soft-capped, times ``SCALE``; a loop over
  the hidden axis."""
  acc = tl.zeros((BT, BV), tl.float32)
  for d0 in range(0, D, BD):
    dd = d0 + tl.arange(0, BD)
    d_ok = dd < D
    hb = tl.load(h_ptr + rows[:, None].to(tl.int64) * D + dd[None, :],
                 mask=rows_ok[:, None] & d_ok[None, :], other=0.0)
    wb = tl.load(w_ptr + cols[:, None].to(tl.int64) * D + dd[None, :],
                 mask=cols_ok[:, None] & d_ok[None, :], other=0.0)
    acc += tl.dot(hb, tl.trans(wb), input_precision=PRECISION)
  if HAS_BIAS:
    acc += tl.load(b_ptr + cols, mask=cols_ok, other=0.0).to(tl.float32)[None, :]
  if SOFTCAP > 0:
    acc = SOFTCAP * activation(acc * (1.0 / SOFTCAP), "tanh")
  if SCALE != 1.0:
    acc = acc * SCALE
  return acc


@triton.jit
def xent_stats_kernel(h_ptr, w_ptr, b_ptr, y_ptr, lse_ptr, tgt_ptr, sum_ptr, arg_ptr,
                      N: tl.constexpr, V: tl.constexpr, D: tl.constexpr, BT: tl.constexpr,
                      BV: tl.constexpr, BD: tl.constexpr, SOFTCAP: tl.constexpr,
                      SCALE: tl.constexpr, ENTROPY: tl.constexpr, HAS_BIAS: tl.constexpr,
                      PRECISION: tl.constexpr):
  """Per token of one block: logsumexp, target logit, sum of logits (or, with ``ENTROPY``,
  their mean under the softmax) in float32, argmax (int32)."""
  rows = tl.program_id(0) * BT + tl.arange(0, BT)
  rows_ok = rows < N
  labels = tl.load(y_ptr + rows, mask=rows_ok, other=-1)
  m = tl.full((BT,), _NEG_INF, tl.float32)
  s = tl.zeros((BT,), tl.float32)
  target = tl.zeros((BT,), tl.float32)
  total = tl.zeros((BT,), tl.float32)
  best = tl.zeros((BT,), tl.int32)
  for col0 in range(0, V, BV):
    cols = col0 + tl.arange(0, BV)
    cols_ok = cols < V
    z = _tile_logits(h_ptr, w_ptr, b_ptr, rows, rows_ok, cols, cols_ok, D, BT, BV, BD, SOFTCAP,
                     SCALE, HAS_BIAS, PRECISION)
    z = tl.where(cols_ok[None, :], z, _NEG_INF)
    tile_max = tl.max(z, axis=1)
    m_new = tl.maximum(m, tile_max)
    rescale = tl.exp(m - m_new)
    e = tl.exp(z - m_new[:, None])
    s = s * rescale + tl.sum(e, axis=1)
    hit = (cols[None, :] == labels[:, None]) & cols_ok[None, :]  # labels >= V gather 0
    target += tl.sum(tl.where(hit, z, 0.0), axis=1)
    if ENTROPY:   # sum(exp(z - m) * z), rescaled as s is
      total = total * rescale + tl.sum(e * tl.where(cols_ok[None, :], z, 0.0), axis=1)
    else:
      total += tl.sum(tl.where(cols_ok[None, :], z, 0.0), axis=1)
    first = tl.min(tl.where(z == tile_max[:, None], cols[None, :], _INT_MAX), axis=1)
    best = tl.where(tile_max > m, first, best)
    m = m_new
  tl.store(lse_ptr + rows, m + tl.log(s), mask=rows_ok)
  tl.store(tgt_ptr + rows, target, mask=rows_ok)
  if ENTROPY:
    total = total / s
  tl.store(sum_ptr + rows, total, mask=rows_ok)
  tl.store(arg_ptr + rows, best, mask=rows_ok)


@triton.jit
def xent_logit_grad_kernel(h_ptr, w_ptr, b_ptr, y_ptr, lse_ptr, a_ptr, b2_ptr, c_ptr, dz_ptr,
                           N: tl.constexpr, V: tl.constexpr, D: tl.constexpr, BT: tl.constexpr,
                           BV: tl.constexpr, BD: tl.constexpr, SOFTCAP: tl.constexpr,
                           SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                           SMOOTHING: tl.constexpr, ENTROPY: tl.constexpr,
                           PRECISION: tl.constexpr):
  """``dz = a * exp(z - lse) - b * onehot(label) - c`` of one (token block, vocabulary tile)
  (with ``ENTROPY``, ``exp(z - lse) * (a + c * z) - b * onehot(label)``), chained through the
  scale and the soft-cap."""
  rows = tl.program_id(0) * BT + tl.arange(0, BT)
  cols = tl.program_id(1) * BV + tl.arange(0, BV)
  rows_ok = rows < N
  cols_ok = cols < V
  labels = tl.load(y_ptr + rows, mask=rows_ok, other=-1)
  lse = tl.load(lse_ptr + rows, mask=rows_ok, other=0.0)
  a = tl.load(a_ptr + rows, mask=rows_ok, other=0.0)
  b = tl.load(b2_ptr + rows, mask=rows_ok, other=0.0)
  z = _tile_logits(h_ptr, w_ptr, b_ptr, rows, rows_ok, cols, cols_ok, D, BT, BV, BD, SOFTCAP,
                   SCALE, HAS_BIAS, PRECISION)
  p = tl.exp(z - lse[:, None])
  if ENTROPY:
    c = tl.load(c_ptr + rows, mask=rows_ok, other=0.0)
    dz = p * (a[:, None] + c[:, None] * z)
  else:
    dz = p * a[:, None]
  dz = dz - tl.where(cols[None, :] == labels[:, None], b[:, None], 0.0)
  if SMOOTHING:
    dz -= tl.load(c_ptr + rows, mask=rows_ok, other=0.0)[:, None]
  if SCALE != 1.0:
    dz = dz * SCALE
  if SOFTCAP > 0:
    t = z * (1.0 / (SOFTCAP * SCALE))
    dz = dz * (1.0 - t * t)
  tl.store(dz_ptr + rows[:, None].to(tl.int64) * V + cols[None, :],
           dz.to(dz_ptr.dtype.element_ty), mask=rows_ok[:, None] & cols_ok[None, :])


# The jax-triton wrappers -----------------------------------------------------------------------


def _block(n: int, cap: int) -> int:
  """The power-of-2 block covering ``n``, at most ``cap`` and at least 16 (``tl.dot``'s
  smallest)."""
  return max(16, min(cap, 1 if n <= 1 else 1 << (int(n) - 1).bit_length()))


def gpu_blocks(dtype_name: str) -> tuple[int, int, int]:
  """The tile caps for inputs of ``dtype_name``."""
  return GPU_BLOCKS_F32 if dtype_name == "float32" else GPU_BLOCKS


def gpu_warps(dtype_name: str) -> int:
  return NUM_WARPS_F32 if dtype_name == "float32" else NUM_WARPS


def block_sizes(n: int, v: int, d: int, blocks=None, dtype_name: str = "bfloat16"
                ) -> tuple[int, int, int]:
  """``(BT, BV, BD)``: token, vocabulary and hidden tiles (``blocks`` caps them; default
  :func:`gpu_blocks` of the dtype)."""
  bt, bv, bd = blocks or gpu_blocks(dtype_name)
  return _block(n, bt), _block(v, bv), _block(d, bd)


@dataclasses.dataclass(frozen=True)
class Launch:
  """One kernel launch as the wrappers make it; the tests launch the same under the
  interpreter."""

  kernel: object
  grid: tuple[int, ...]
  constants: dict
  num_warps: int = NUM_WARPS
  num_stages: int = NUM_STAGES


def _constants(n, v, d, blocks, softcap, scale, entropy, has_bias, dtype_name) -> dict:
  bt, bv, bd = block_sizes(n, v, d, blocks, dtype_name)
  return dict(N=n, V=v, D=d, BT=bt, BV=bv, BD=bd, SOFTCAP=float(softcap or 0.0),
              SCALE=float(1.0 if scale is None else scale), ENTROPY=bool(entropy),
              HAS_BIAS=bool(has_bias), PRECISION="ieee" if dtype_name == "float32" else "tf32")


def stats_launch(n: int, v: int, d: int, *, softcap=None, scale=None, entropy=False,
                 has_bias=False, dtype_name="float32", blocks=None, num_warps=None) -> Launch:
  """The statistics kernel's launch for ``h [n, d]``, ``w [v, d]``: grid (token blocks,)."""
  c = _constants(n, v, d, blocks, softcap, scale, entropy, has_bias, dtype_name)
  return Launch(xent_stats_kernel, (math.ceil(n / c["BT"]),), c,
                num_warps or gpu_warps(dtype_name))


def logit_grad_launch(n: int, v: int, d: int, *, softcap=None, scale=None, has_bias=False,
                      smoothing=True, entropy=False, dtype_name="float32", blocks=None,
                      num_warps=None) -> Launch:
  """The logit-gradient kernel's launch: grid (token blocks, vocabulary tiles)."""
  c = _constants(n, v, d, blocks, softcap, scale, entropy, has_bias, dtype_name)
  c["SMOOTHING"] = bool(smoothing)
  return Launch(xent_logit_grad_kernel, (math.ceil(n / c["BT"]), math.ceil(v / c["BV"])), c,
                num_warps or gpu_warps(dtype_name))


def _call(launch: Launch, operands, out_shape):
  import jax_triton

  return jax_triton.triton_call(
      *operands, kernel=launch.kernel, out_shape=out_shape, grid=launch.grid,
      num_warps=launch.num_warps, num_stages=launch.num_stages, **launch.constants)


def refuses(*, grad_in_forward: bool = False, **_) -> str | None:
  """Why these kernels cannot take a call (None: they can): they compute the gradients in the
  backward pass only (``grad_in_forward=True`` is an XLA mode)."""
  if grad_in_forward:
    return "computes the gradients in the backward pass; grad_in_forward=True is an XLA mode"
  return None


def stats_forward(h, w, bias, labels, *, softcap=None, scale=None, entropy=False, blocks=None,
                  num_warps=None):
  """Per-token logsumexp, target logit, sum of logits and argmax of ``h @ w.T + bias`` (GPU).

  Args:
    h: ``[N, D]``; w: ``[V, D]``; bias: ``[V]`` or None; labels: ``[N]`` int32 (any value;
      a label outside ``[0, V)`` gathers 0).
    softcap: logits become ``softcap * tanh(logits / softcap)`` first.
    scale: then they are multiplied by ``scale`` (None: 1).
    entropy: the third statistic is the logits' mean under their softmax, not their sum.
    blocks: ``(tokens, vocabulary, hidden)`` tile caps, powers of 2.

  Returns:
    ``(lse, target, sum, argmax)``, each ``[N]``: float32 and the last int32, as
    :func:`jaxfuse.kernels.pallas.cross_entropy.stats_forward` returns them.
  """
  import jax
  import jax.numpy as jnp

  n, d = h.shape
  v = w.shape[0]
  launch = stats_launch(n, v, d, softcap=softcap, scale=scale, entropy=entropy,
                        has_bias=bias is not None, dtype_name=str(h.dtype), blocks=blocks,
                        num_warps=num_warps)
  out_shape = [jax.ShapeDtypeStruct((n,), jnp.float32)] * 3 + [
      jax.ShapeDtypeStruct((n,), jnp.int32)]
  operands = [h, w, h if bias is None else bias, labels]  # h stands in for no bias: not read
  return tuple(_call(launch, operands, out_shape))


def logit_grad(h, w, bias, labels, lse, a, b, c, *, softcap=None, scale=None, smoothing=True,
               entropy=False, blocks=None, num_warps=None, out_dtype=None):
  """The logit gradient ``[N, V]`` of a chunk of tokens, recomputing the logits tile by tile
  (GPU), as :func:`jaxfuse.kernels.pallas.cross_entropy.logit_grad` computes it.

  ``dz = a * exp(z - lse) - b * onehot(label) - c`` per token (``a, b, c, lse``: ``[N]``
  float32; ``c`` is read only with ``smoothing``), or with ``entropy`` ``exp(z - lse) * (a +
  c * z) - b * onehot(label)``; times ``scale`` and ``1 - (z / (scale * softcap))**2``, in
  ``out_dtype`` (h's dtype by default).
  """
  import jax

  n, d = h.shape
  v = w.shape[0]
  launch = logit_grad_launch(n, v, d, softcap=softcap, scale=scale, has_bias=bias is not None,
                             smoothing=smoothing, entropy=entropy, dtype_name=str(h.dtype),
                             blocks=blocks, num_warps=num_warps)
  operands = [h, w, h if bias is None else bias, labels, lse, a, b, c]
  out_shape = [jax.ShapeDtypeStruct((n, v), out_dtype or h.dtype)]
  return _call(launch, operands, out_shape)[0]
