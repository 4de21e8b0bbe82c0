"""Triton grouped matmul kernels for Mixture-of-Experts, called from JAX through jax-triton: the
same functions as :mod:`jaxfuse.kernels.pallas.grouped_matmul`, with the same visits.

- :func:`gmm_kernel`: ``out[rows of e] = lhs[rows of e] @ rhs[e]`` (``rhs[e]^T`` with
  ``TRANSPOSE_RHS``: the ``lhs`` gradient reads ``rhs`` in place). The grid is
  ``(visits, N tiles)``; a visit is a row tile and one group it holds, listed on the device
  from ``group_sizes`` (:func:`jaxfuse.kernels.pallas.grouped_matmul.group_metadata`): a tile
  that straddles groups is visited once per group, each visit reading and writing only that
  group's rows, an empty group has no visit, and the visits of the rows past the groups write
  zeros. The K loop runs inside each program.
- :func:`tgmm_kernel`: ``d rhs[e] = lhs_e^T @ g_e`` on a ``(G, K tiles, N tiles)`` grid, each
  program walking its group's rows in chunks.

Accumulation is float32; float32 operands multiply in full precision
(``input_precision="ieee"``), bfloat16 and float16 on the tensor cores. The kernels also run
under Triton's interpreter in tests.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

# (BLOCK_M, BLOCK_K, BLOCK_N): the Pallas kernels' GPU tiles.
BLOCKS = (64, 32, 64)
NUM_WARPS = 4
NUM_STAGES = 3


@triton.jit
def dot_accumulate(a, b, acc, IEEE: tl.constexpr):
  """``acc + a @ b``: float32 operands in full precision with ``IEEE``, else Triton's default."""
  if IEEE:
    out = tl.dot(a, b, acc, input_precision="ieee")
  else:
    out = tl.dot(a, b, acc)
  return out


@triton.jit
def gmm_kernel(meta_ptr, lhs_ptr, rhs_ptr, out_ptr, ROWS: tl.constexpr, SIZE_K: tl.constexpr,
               SIZE_N: tl.constexpr, VISITS: tl.constexpr, TRANSPOSE_RHS: tl.constexpr,
               IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
               BLOCK_N: tl.constexpr):
  """One visit (``program_id(0)``) times one ``BLOCK_N`` column tile.

  ``meta_ptr``: int32 ``[5, VISITS]``: each visit's row tile, group, first row written, end of
  the rows written, end of the rows read (see ``group_metadata``).
  """
  v = tl.program_id(0)
  tile = tl.load(meta_ptr + v)
  group = tl.load(meta_ptr + VISITS + v)
  lo = tl.load(meta_ptr + 2 * VISITS + v)
  hi = tl.load(meta_ptr + 3 * VISITS + v)
  read_hi = tl.load(meta_ptr + 4 * VISITS + v)
  rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
  cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
  read = (rows >= lo) & (rows < read_hi) & (rows < ROWS)
  write = (rows >= lo) & (rows < hi) & (rows < ROWS)
  cols_ok = cols < SIZE_N
  base = group.to(tl.int64) * SIZE_K * SIZE_N
  acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
  steps = tl.where(read_hi > lo, (SIZE_K + BLOCK_K - 1) // BLOCK_K, 0)
  for step in range(steps):
    ks = step * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = ks < SIZE_K
    a = tl.load(lhs_ptr + rows[:, None].to(tl.int64) * SIZE_K + ks[None, :],
                mask=read[:, None] & k_ok[None, :], other=0.0)
    if TRANSPOSE_RHS:   # rhs[group] is [SIZE_N, SIZE_K]
      offsets = cols[None, :].to(tl.int64) * SIZE_K + ks[:, None]
    else:               # rhs[group] is [SIZE_K, SIZE_N]
      offsets = ks[:, None].to(tl.int64) * SIZE_N + cols[None, :]
    b = tl.load(rhs_ptr + base + offsets, mask=k_ok[:, None] & cols_ok[None, :], other=0.0)
    acc = dot_accumulate(a, b, acc, IEEE)
  tl.store(out_ptr + rows[:, None].to(tl.int64) * SIZE_N + cols[None, :],
           acc.to(out_ptr.dtype.element_ty), mask=write[:, None] & cols_ok[None, :])


@triton.jit
def tgmm_kernel(bounds_ptr, lhs_ptr, g_ptr, out_ptr, GROUPS: tl.constexpr, SIZE_K: tl.constexpr,
                SIZE_N: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
  """``out[e, ks, cols] = lhs[rows of e, ks]^T @ g[rows of e, cols]`` for group ``e =
  program_id(0)``; ``bounds_ptr``: int32 ``[2, GROUPS]``, each group's first and end row."""
  e = tl.program_id(0)
  lo = tl.load(bounds_ptr + e)
  hi = tl.load(bounds_ptr + GROUPS + e)
  ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
  cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
  k_ok = ks < SIZE_K
  cols_ok = cols < SIZE_N
  acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
  for step in range((hi - lo + BLOCK_M - 1) // BLOCK_M):
    rows = lo + step * BLOCK_M + tl.arange(0, BLOCK_M)
    read = rows < hi
    a = tl.load(lhs_ptr + rows[None, :].to(tl.int64) * SIZE_K + ks[:, None],
                mask=k_ok[:, None] & read[None, :], other=0.0)          # [BLOCK_K, BLOCK_M]
    b = tl.load(g_ptr + rows[:, None].to(tl.int64) * SIZE_N + cols[None, :],
                mask=read[:, None] & cols_ok[None, :], other=0.0)       # [BLOCK_M, BLOCK_N]
    acc = dot_accumulate(a, b, acc, IEEE)
  offsets = e.to(tl.int64) * SIZE_K * SIZE_N + ks[:, None].to(tl.int64) * SIZE_N + cols[None, :]
  tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty),
           mask=k_ok[:, None] & cols_ok[None, :])


def blocks_for(rows: int, size_k: int, size_n: int,
               blocks: tuple[int, int, int] = BLOCKS) -> tuple[int, int, int]:
  """Power-of-2 tiles no larger than the product needs, and at least 16 (``tl.dot``'s
  minimum)."""
  def fit(block, n):
    return max(16, min(block, triton.next_power_of_2(max(n, 1))))

  return fit(blocks[0], rows), fit(blocks[1], size_k), fit(blocks[2], size_n)


def _ieee(*arrays) -> bool:
  import jax.numpy as jnp

  return all(jnp.dtype(a.dtype) == jnp.float32 for a in arrays)


def gmm(lhs, rhs, group_sizes, *, transpose_rhs: bool = False, out_dtype=None,
        blocks: tuple[int, int, int] = BLOCKS):
  """``out[rows of e] = lhs[rows of e] @ rhs[e]`` (``rhs[e]^T`` with ``transpose_rhs``, ``rhs``
  then ``[G, N, K]``) through jax-triton (GPU only); zeros past the groups."""
  import jax
  import jax.numpy as jnp

  from ..pallas.grouped_matmul import group_metadata

  rows, size_k = lhs.shape
  groups = rhs.shape[0]
  size_n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  out_dtype = jnp.dtype(out_dtype or lhs.dtype)
  if 0 in (rows, size_k, size_n, groups):
    return jnp.zeros((rows, size_n), out_dtype)
  block_m, block_k, block_n = blocks_for(rows, size_k, size_n, blocks)
  meta = group_metadata(group_sizes, rows, block_m)
  import jax_triton  # after the checks: without a GPU it raises ImportError

  return jax_triton.triton_call(
      meta, lhs, rhs, kernel=gmm_kernel,
      out_shape=jax.ShapeDtypeStruct((rows, size_n), out_dtype),
      grid=(meta.shape[1], math.ceil(size_n / block_n)), num_warps=NUM_WARPS,
      num_stages=NUM_STAGES, ROWS=rows, SIZE_K=size_k, SIZE_N=size_n, VISITS=meta.shape[1],
      TRANSPOSE_RHS=transpose_rhs, IEEE=_ieee(lhs, rhs), BLOCK_M=block_m, BLOCK_K=block_k,
      BLOCK_N=block_n)


def tgmm(lhs, g, group_sizes, *, out_dtype=None, blocks: tuple[int, int, int] = BLOCKS):
  """``out[e] = lhs[rows of e]^T @ g[rows of e]`` (``[G, K, N]``) through jax-triton (GPU
  only); zero for an empty group."""
  import jax
  import jax.numpy as jnp

  from ..pallas.grouped_matmul import group_bounds

  rows, size_k = lhs.shape
  size_n = g.shape[1]
  groups = group_sizes.shape[0]
  out_dtype = jnp.dtype(out_dtype or lhs.dtype)
  if 0 in (rows, size_k, size_n, groups):
    return jnp.zeros((groups, size_k, size_n), out_dtype)
  block_m, block_k, block_n = blocks_for(rows, size_k, size_n, blocks)
  bounds = jnp.stack(group_bounds(group_sizes, rows))
  import jax_triton

  return jax_triton.triton_call(
      bounds, lhs, g, kernel=tgmm_kernel,
      out_shape=jax.ShapeDtypeStruct((groups, size_k, size_n), out_dtype),
      grid=(groups, math.ceil(size_k / block_k), math.ceil(size_n / block_n)),
      num_warps=NUM_WARPS, num_stages=NUM_STAGES, GROUPS=groups, SIZE_K=size_k, SIZE_N=size_n,
      IEEE=_ieee(lhs, g), BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_N=block_n)


def grouped_matmul_forward(lhs, rhs, group_sizes):
  """``[M, N]``: each group's rows of ``lhs`` times its ``rhs[e]``, zeros past the groups."""
  return gmm(lhs, rhs, group_sizes)


def grouped_matmul_backward(lhs, rhs, group_sizes, g):
  """``(d lhs, d rhs)`` of :func:`grouped_matmul_forward` for the output gradient ``g``: one
  launch of :func:`gmm_kernel` reading ``rhs`` transposed and one of :func:`tgmm_kernel`."""
  dlhs = gmm(g, rhs, group_sizes, transpose_rhs=True, out_dtype=lhs.dtype)
  drhs = tgmm(lhs, g, group_sizes, out_dtype=rhs.dtype)
  return dlhs, drhs
