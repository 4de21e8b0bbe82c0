"""Triton kernels for the row softmax ``y = softmax(SCALE * x)`` and its VJP, called from JAX
through jax-triton.

Each program owns ``BLOCK_R`` rows of a ``ROWS x N`` array and walks their columns in
``N_CHUNKS`` power-of-2 chunks of ``BLOCK_N``. A row that fits in one chunk is read once and
written once. A longer row is read twice: once for its running max ``m`` and sum ``total`` (the
online-softmax update ``total = total * exp(m - m_new) + sum(exp(z - m_new))``), once to write
the result. Entries whose int8 mask is 0, and columns past ``N``, count as ``-inf``; the running
max starts at :data:`FLOOR` instead of ``-inf``, so a row with no kept entry gives
``exp(-inf) = 0`` everywhere (never ``inf - inf``) and its sum of 0 is lifted to 1: it comes
out as zeros.

The backward, ``dx = SCALE * y * (g - sum(g * y))``, needs only the output ``y``; rows longer than
one chunk are read twice (once for the sum). Arithmetic is float32; outputs are stored in their
pointer's dtype. The same kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, torch
CPU tensors), which is how CPU tests check them.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

# The most columns one program holds at once: rows up to this long are read once.
MAX_CHUNK = 16384
# Elements of one program's tile: short rows are packed several to a program.
TILE = 4096
MAX_BLOCK_ROWS = 32
# The running max's start (float32's lowest finite value), see the module docstring.
FLOOR = tl.constexpr(-3.4028234663852886e38)


@triton.jit
def _offsets(rows, cols, ROWS: tl.constexpr, N: tl.constexpr):
  """Element offsets of a ``rows x cols`` tile of a row-major ``ROWS x N`` array, and its
  in-bounds mask."""
  offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
  return offsets, (rows[:, None] < ROWS) & (cols[None, :] < N)


@triton.jit
def _logits(x_ptr, mask_ptr, offsets, inside, SCALE: tl.constexpr, HAS_MASK: tl.constexpr):
  """``SCALE * x`` in float32, ``-inf`` where masked out or outside the array."""
  z = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
  if SCALE != 1.0:
    z = z * SCALE
  keep = inside
  if HAS_MASK:
    keep = keep & (tl.load(mask_ptr + offsets, mask=inside, other=0) != 0)
  return tl.where(keep, z, -float("inf"))


@triton.jit
def softmax_fwd_kernel(x_ptr, mask_ptr, y_ptr, ROWS: tl.constexpr, N: tl.constexpr,
                       SCALE: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_N: tl.constexpr, N_CHUNKS: tl.constexpr):
  """``y = softmax(SCALE * x)`` over rows; ``mask_ptr`` (int8, 0 drops) is read if HAS_MASK."""
  rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
  cols = tl.arange(0, BLOCK_N)
  if N_CHUNKS == 1:
    offsets, inside = _offsets(rows, cols, ROWS, N)
    z = _logits(x_ptr, mask_ptr, offsets, inside, SCALE, HAS_MASK)
    m = tl.maximum(tl.max(z, axis=1), FLOOR)
    e = tl.exp(z - m[:, None])
    inv_total = 1.0 / tl.maximum(tl.sum(e, axis=1), 1.0)
    tl.store(y_ptr + offsets, (e * inv_total[:, None]).to(y_ptr.dtype.element_ty), mask=inside)
  else:
    m = tl.full([BLOCK_R], FLOOR, tl.float32)
    total = tl.zeros([BLOCK_R], dtype=tl.float32)
    for c in range(N_CHUNKS):
      offsets, inside = _offsets(rows, c * BLOCK_N + cols, ROWS, N)
      z = _logits(x_ptr, mask_ptr, offsets, inside, SCALE, HAS_MASK)
      m_new = tl.maximum(m, tl.max(z, axis=1))
      total = total * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
      m = m_new
    inv_total = 1.0 / tl.maximum(total, 1.0)
    for c in range(N_CHUNKS):
      offsets, inside = _offsets(rows, c * BLOCK_N + cols, ROWS, N)
      z = _logits(x_ptr, mask_ptr, offsets, inside, SCALE, HAS_MASK)
      y = tl.exp(z - m[:, None]) * inv_total[:, None]
      tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=inside)


@triton.jit
def softmax_bwd_kernel(y_ptr, g_ptr, dx_ptr, ROWS: tl.constexpr, N: tl.constexpr,
                       SCALE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                       N_CHUNKS: tl.constexpr):
  """``dx = SCALE * y * (g - sum(g * y))`` over rows."""
  rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
  cols = tl.arange(0, BLOCK_N)
  if N_CHUNKS == 1:
    offsets, inside = _offsets(rows, cols, ROWS, N)
    y = tl.load(y_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    dot = tl.sum(y * g, axis=1)
    dx = (SCALE * y) * (g - dot[:, None])
    tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=inside)
  else:
    dot = tl.zeros([BLOCK_R], dtype=tl.float32)
    for c in range(N_CHUNKS):
      offsets, inside = _offsets(rows, c * BLOCK_N + cols, ROWS, N)
      y = tl.load(y_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
      g = tl.load(g_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
      dot += tl.sum(y * g, axis=1)
    for c in range(N_CHUNKS):
      offsets, inside = _offsets(rows, c * BLOCK_N + cols, ROWS, N)
      y = tl.load(y_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
      g = tl.load(g_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
      dx = (SCALE * y) * (g - dot[:, None])
      tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=inside)


def plan(rows: int, n: int, *, max_chunk: int = MAX_CHUNK,
         block_rows: int | None = None) -> tuple[int, int, int]:
  """``(block_r, block_n, n_chunks)`` for a ``rows x n`` array (powers of 2 but n_chunks)."""
  block_n = min(max_chunk, triton.next_power_of_2(max(n, 1)))
  n_chunks = max(1, math.ceil(n / block_n))
  if block_rows is None:
    cap = max(1, min(MAX_BLOCK_ROWS, TILE // block_n))
    block_rows = min(cap, triton.next_power_of_2(max(rows, 1)))
  return block_rows, block_n, n_chunks


def num_warps_for(block_r: int, block_n: int) -> int:
  return max(4, min(16, block_r * block_n // 512))


def grid_for(rows: int, block_r: int) -> tuple[int]:
  return (max(1, math.ceil(rows / block_r)),)


def softmax_forward(x, mask=None, *, scale: float = 1.0, max_chunk: int = MAX_CHUNK):
  """``softmax(scale * x)`` over the last axis of 2-D ``x`` through jax-triton (GPU only);
  ``mask`` (bool or int8, broadcast to ``x``'s shape) keeps entries where it is nonzero."""
  import jax
  import jax.numpy as jnp
  import jax_triton

  rows, n = x.shape
  if rows == 0 or n == 0:
    return jnp.zeros_like(x)
  block_r, block_n, n_chunks = plan(rows, n, max_chunk=max_chunk)
  has_mask = mask is not None
  return jax_triton.triton_call(
      x, mask.astype(jnp.int8) if has_mask else x, kernel=softmax_fwd_kernel,
      out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=grid_for(rows, block_r),
      num_warps=num_warps_for(block_r, block_n), ROWS=rows, N=n, SCALE=float(scale),
      HAS_MASK=has_mask, BLOCK_R=block_r, BLOCK_N=block_n, N_CHUNKS=n_chunks)


def softmax_backward(y, g, *, scale: float = 1.0, max_chunk: int = MAX_CHUNK):
  """``scale * y * (g - sum(g * y))`` over the last axis of 2-D ``y``, ``g`` (GPU only)."""
  import jax
  import jax.numpy as jnp
  import jax_triton

  rows, n = y.shape
  if rows == 0 or n == 0:
    return jnp.zeros_like(y)
  block_r, block_n, n_chunks = plan(rows, n, max_chunk=max_chunk)
  return jax_triton.triton_call(
      y, g, kernel=softmax_bwd_kernel, out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
      grid=grid_for(rows, block_r), num_warps=num_warps_for(block_r, block_n), ROWS=rows, N=n,
      SCALE=float(scale), BLOCK_R=block_r, BLOCK_N=block_n, N_CHUNKS=n_chunks)
