"""Triton kernels for linear layers: ``x @ w.T + b`` forward, ``dx``, ``dw`` and ``db``, called
from JAX through jax-triton.

One matmul kernel covers every layout a linear layer needs: ``C[I, J] = sum_K A[I, K] B[J, K]``
with each operand stored either way round (``A_LAYOUT`` ``"ik"`` or ``"ki"``, ``B_LAYOUT``
``"jk"`` or ``"kj"``), so the backward products read the saved arrays in place instead of
materializing transposes:

- forward ``y = x @ w.T + b``: ``A = x`` (``ik``), ``B = w`` (``jk``), the bias added in the
  epilogue;
- ``dx = g @ w``: ``A = g`` (``ik``), ``B = w`` stored ``[K, J]`` (``kj``);
- ``dw = g.T @ x``: ``A = g`` stored ``[K, I]`` (``ki``), ``B = x`` (``kj``).

Each program owns a ``BLOCK_I x BLOCK_J`` tile of C on a 2-D grid and loops over K in
``BLOCK_K`` steps; rows, columns and the K tail are masked (zeros contribute nothing), so no size
needs to be a multiple of a block. Accumulation is float32; float32 operands multiply in full
precision (``input_precision="ieee"``, not TF32), as torch does by default; bfloat16 and float16
operands use the tensor cores, whose products are exact in float32. The bias gradient is
:func:`sum_rows_kernel`: one program per column block walks all rows.

The same kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, torch CPU tensors) in
tests.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from .. import limits

# (BLOCK_I, BLOCK_J, BLOCK_K): tiles that fit registers and shared memory with 4 warps.
BLOCKS = (64, 64, 32)
NUM_WARPS = 4
NUM_STAGES = 3
# sum_rows_kernel: (rows per step, columns per program).
SUM_BLOCKS = (32, 128)


@triton.jit
def _operand_tile(ptr, outer, ks, OUTER: tl.constexpr, SIZE_K: tl.constexpr,
                  LAYOUT: tl.constexpr):
  """The ``[len(outer), len(ks)]`` tile of an operand stored ``[OUTER, SIZE_K]`` (``LAYOUT``
  ``"ik"`` or ``"jk"``) or ``[SIZE_K, OUTER]`` (``"ki"`` or ``"kj"``), zero outside it."""
  mask = (outer[:, None] < OUTER) & (ks[None, :] < SIZE_K)
  if LAYOUT == "ik" or LAYOUT == "jk":
    offsets = outer[:, None].to(tl.int64) * SIZE_K + ks[None, :]
  else:
    offsets = ks[None, :].to(tl.int64) * OUTER + outer[:, None]
  return tl.load(ptr + offsets, mask=mask, other=0.0)


@triton.jit
def matmul_kernel(a_ptr, b_ptr, bias_ptr, c_ptr, SIZE_I: tl.constexpr, SIZE_J: tl.constexpr,
                  SIZE_K: tl.constexpr, A_LAYOUT: tl.constexpr, B_LAYOUT: tl.constexpr,
                  HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_I: tl.constexpr,
                  BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr):
  """``C[i, j] = sum_k A[i, k] B[j, k] (+ bias[j])`` on one ``BLOCK_I x BLOCK_J`` tile of the
  ``SIZE_I x SIZE_J`` result, ``k`` over ``SIZE_K``.

  ``bias_ptr`` is read only with HAS_BIAS (any pointer may stand in); ``IEEE`` asks for full
  float32 products (float32 operands).
  """
  i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
  j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
  acc = tl.zeros([BLOCK_I, BLOCK_J], dtype=tl.float32)
  for step in range((SIZE_K + BLOCK_K - 1) // BLOCK_K):
    ks = step * BLOCK_K + tl.arange(0, BLOCK_K)
    a = _operand_tile(a_ptr, i, ks, SIZE_I, SIZE_K, A_LAYOUT)
    b = _operand_tile(b_ptr, j, ks, SIZE_J, SIZE_K, B_LAYOUT)
    if IEEE:
      acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
    else:
      acc = tl.dot(a, tl.trans(b), acc)
  if HAS_BIAS:
    acc += tl.load(bias_ptr + j, mask=j < SIZE_J, other=0.0).to(tl.float32)[None, :]
  mask = (i[:, None] < SIZE_I) & (j[None, :] < SIZE_J)
  tl.store(c_ptr + i[:, None].to(tl.int64) * SIZE_J + j[None, :],
           acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def sum_rows_kernel(g_ptr, out_ptr, SIZE_I: tl.constexpr, SIZE_J: tl.constexpr,
                    BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
  """``out[j] = sum_i g[i, j]`` for one block of ``BLOCK_J`` columns, accumulated in float32."""
  j = tl.program_id(0) * BLOCK_J + tl.arange(0, BLOCK_J)
  j_ok = j < SIZE_J
  acc = tl.zeros([BLOCK_J], dtype=tl.float32)
  for step in range((SIZE_I + BLOCK_I - 1) // BLOCK_I):
    i = step * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (i[:, None] < SIZE_I) & j_ok[None, :]
    g = tl.load(g_ptr + i[:, None].to(tl.int64) * SIZE_J + j[None, :], mask=mask, other=0.0)
    acc += tl.sum(g.to(tl.float32), axis=0)
  tl.store(out_ptr + j, acc.to(out_ptr.dtype.element_ty), mask=j_ok)


def blocks_for(size_i: int, size_j: int, size_k: int,
               blocks: tuple[int, int, int] = BLOCKS) -> tuple[int, int, int]:
  """Power-of-2 tiles no larger than the product needs, and at least 16 (``tl.dot``'s
  minimum)."""
  def fit(block, n):
    return max(16, min(block, triton.next_power_of_2(max(n, 1))))

  return fit(blocks[0], size_i), fit(blocks[1], size_j), fit(blocks[2], size_k)


def matmul_grid(size_i: int, size_j: int, block_i: int, block_j: int) -> tuple[int, int]:
  return max(1, math.ceil(size_i / block_i)), max(1, math.ceil(size_j / block_j))


def matmul(a, b, *, a_layout: str = "ik", b_layout: str = "jk", bias=None, out_dtype=None,
           blocks: tuple[int, int, int] = BLOCKS):
  """``C[I, J] = sum_K A[I, K] B[J, K] (+ bias[J])`` through jax-triton (GPU only).

  Args:
    a: stored ``[I, K]`` (``a_layout="ik"``) or ``[K, I]`` (``"ki"``).
    b: stored ``[J, K]`` (``b_layout="jk"``) or ``[K, J]`` (``"kj"``).
    bias: optional ``[J]``, added in the kernel's epilogue.
    out_dtype: the result's dtype (default: a's).
    blocks: ``(block_i, block_j, block_k)`` caps, powers of 2.

  Returns:
    ``C``, ``[I, J]``, rounded once from the float32 accumulator.
  """
  import jax
  import jax.numpy as jnp

  size_i, size_j, size_k = limits.matmul_sizes(a.shape, b.shape, a_layout, b_layout)
  out_dtype = jnp.dtype(out_dtype or a.dtype)
  if size_i == 0 or size_j == 0 or size_k == 0:
    out = jnp.zeros((size_i, size_j), jnp.float32)
    return (out if bias is None else out + bias.astype(jnp.float32)).astype(out_dtype)
  block_i, block_j, block_k = blocks_for(size_i, size_j, size_k, blocks)
  import jax_triton  # after the checks: without a GPU it raises ImportError

  return jax_triton.triton_call(
      a, b, a if bias is None else bias, kernel=matmul_kernel,
      out_shape=jax.ShapeDtypeStruct((size_i, size_j), out_dtype),
      grid=matmul_grid(size_i, size_j, block_i, block_j), num_warps=NUM_WARPS,
      num_stages=NUM_STAGES, SIZE_I=size_i, SIZE_J=size_j, SIZE_K=size_k,
      A_LAYOUT=a_layout, B_LAYOUT=b_layout, HAS_BIAS=bias is not None,
      IEEE=jnp.dtype(a.dtype) == jnp.float32 and jnp.dtype(b.dtype) == jnp.float32,
      BLOCK_I=block_i, BLOCK_J=block_j, BLOCK_K=block_k)


def sum_rows(g, *, out_dtype=None, blocks: tuple[int, int] = SUM_BLOCKS):
  """``g.sum(axis=0)`` for a 2-D ``g`` through jax-triton (GPU only), accumulated in float32."""
  import jax
  import jax.numpy as jnp
  import jax_triton

  size_i, size_j = g.shape
  out_dtype = jnp.dtype(out_dtype or g.dtype)
  if size_i == 0 or size_j == 0:
    return jnp.zeros((size_j,), out_dtype)
  block_i = min(blocks[0], triton.next_power_of_2(size_i))
  block_j = min(blocks[1], triton.next_power_of_2(size_j))
  return jax_triton.triton_call(
      g, kernel=sum_rows_kernel, out_shape=jax.ShapeDtypeStruct((size_j,), out_dtype),
      grid=(math.ceil(size_j / block_j),), num_warps=NUM_WARPS, SIZE_I=size_i, SIZE_J=size_j,
      BLOCK_I=block_i, BLOCK_J=block_j)


def linear_forward(x, weight, bias=None):
  """``x @ weight.T + bias`` for 2-D ``x`` ``[rows, in]`` and ``weight`` ``[out, in]``."""
  return matmul(x, weight, a_layout="ik", b_layout="jk", bias=bias)


def linear_backward(x, weight, bias, g):
  """``(dx, dweight, dbias)`` of :func:`linear_forward` for the output gradient ``g``
  ``[rows, out]``: three launches of :func:`matmul_kernel` (two layouts) and one of
  :func:`sum_rows_kernel` (None without a bias)."""
  dx = matmul(g, weight, a_layout="ik", b_layout="kj", out_dtype=x.dtype)
  dw = matmul(g, x, a_layout="ki", b_layout="kj", out_dtype=weight.dtype)
  db = None if bias is None else sum_rows(g, out_dtype=bias.dtype)
  return dx, dw, db
