"""Triton kernels for gated linear units, ``act(a) * b`` (SwiGLU with ``ACT="silu"``), called from
JAX through jax-triton.

The kernels walk a ``ROWS x H`` output in ``BLOCK_R x BLOCK_C`` tiles. ``a`` and ``b`` are rows of
stride ``IN_STRIDE``, and ``b`` starts ``B_OFFSET`` elements after ``a``: two separate ``ROWS x H``
arrays (``IN_STRIDE=H, B_OFFSET=0``, passed as two pointers) or one packed ``ROWS x 2H`` array
``[a | b]`` (``IN_STRIDE=2H, B_OFFSET=H``, the same pointer twice). The backward writes ``da`` and
``db`` into the same layout. They compute in float32 and store in the output pointer's dtype; the
same kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, torch CPU tensors) in tests.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from .elementwise import ACTIVATIONS, activation, activation_grad, refuses  # noqa: F401

BLOCK_R = 8
BLOCK_C = 256
NUM_WARPS = 4


@triton.jit
def _load_tile(a_ptr, b_ptr, ROWS: tl.constexpr, H: tl.constexpr, IN_STRIDE: tl.constexpr,
               B_OFFSET: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
  """This program's tile: the offsets of its gate and value in the inputs, the offsets of its
  output (``[ROWS, H]``), the mask, and the gate and value in float32."""
  rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
  cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
  mask = (rows[:, None] < ROWS) & (cols[None, :] < H)
  offsets = rows[:, None].to(tl.int64) * IN_STRIDE + cols[None, :]
  out = rows[:, None].to(tl.int64) * H + cols[None, :]
  a = tl.load(a_ptr + offsets, mask=mask).to(tl.float32)
  b = tl.load(b_ptr + B_OFFSET + offsets, mask=mask).to(tl.float32)
  return offsets, out, mask, a, b


@triton.jit
def glu_fwd_kernel(a_ptr, b_ptr, out_ptr, ROWS: tl.constexpr, H: tl.constexpr,
                   IN_STRIDE: tl.constexpr, B_OFFSET: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_C: tl.constexpr, ACT: tl.constexpr):
  _, out, mask, a, b = _load_tile(a_ptr, b_ptr, ROWS, H, IN_STRIDE, B_OFFSET, BLOCK_R, BLOCK_C)
  y = activation(a, ACT) * b
  tl.store(out_ptr + out, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def glu_bwd_kernel(a_ptr, b_ptr, g_ptr, da_ptr, db_ptr, ROWS: tl.constexpr, H: tl.constexpr,
                   IN_STRIDE: tl.constexpr, B_OFFSET: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_C: tl.constexpr, ACT: tl.constexpr):
  """``da = g * b * act'(a)``, ``db = g * act(a)``, written in the inputs' layout."""
  offsets, out, mask, a, b = _load_tile(a_ptr, b_ptr, ROWS, H, IN_STRIDE, B_OFFSET, BLOCK_R,
                                        BLOCK_C)
  g = tl.load(g_ptr + out, mask=mask).to(tl.float32)
  da = g * b * activation_grad(a, ACT)
  db = g * activation(a, ACT)
  tl.store(da_ptr + offsets, da.to(da_ptr.dtype.element_ty), mask=mask)
  tl.store(db_ptr + B_OFFSET + offsets, db.to(db_ptr.dtype.element_ty), mask=mask)


@triton.jit
def glu_bwd_packed_kernel(x_ptr, g_ptr, dx_ptr, ROWS: tl.constexpr, H: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ACT: tl.constexpr):
  """The backward for packed ``x = [a | b]``: writes ``dx = [da | db]`` (one output pointer)."""
  glu_bwd_kernel(x_ptr, x_ptr, g_ptr, dx_ptr, dx_ptr, ROWS, H, 2 * H, H, BLOCK_R, BLOCK_C, ACT)


def grid_for(rows: int, h: int, block_r: int = BLOCK_R, block_c: int = BLOCK_C) -> tuple[int, int]:
  return (max(1, math.ceil(rows / block_r)), max(1, math.ceil(h / block_c)))


def glu_forward(a, b, activation: str):
  """``act(a) * b`` for 2-D ``a`` and ``b``, or packed ``a = [a | b]`` when ``b`` is None (GPU)."""
  import jax
  import jax_triton

  packed = b is None
  rows = a.shape[0]
  h = a.shape[1] // 2 if packed else a.shape[1]
  return jax_triton.triton_call(
      a, a if packed else b, kernel=glu_fwd_kernel,
      out_shape=jax.ShapeDtypeStruct((rows, h), a.dtype), grid=grid_for(rows, h),
      num_warps=NUM_WARPS, ROWS=rows, H=h, IN_STRIDE=2 * h if packed else h,
      B_OFFSET=h if packed else 0, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, ACT=activation)


def glu_backward(a, b, g, activation: str):
  """``(da, db)`` for 2-D ``a`` and ``b``, or packed ``dx`` when ``b`` is None (GPU)."""
  import jax
  import jax_triton

  rows, h = g.shape
  if b is None:
    return jax_triton.triton_call(
        a, g, kernel=glu_bwd_packed_kernel, out_shape=jax.ShapeDtypeStruct(a.shape, a.dtype),
        grid=grid_for(rows, h), num_warps=NUM_WARPS, ROWS=rows, H=h, BLOCK_R=BLOCK_R,
        BLOCK_C=BLOCK_C, ACT=activation)
  out = jax.ShapeDtypeStruct((rows, h), a.dtype)
  return tuple(jax_triton.triton_call(
      a, b, g, kernel=glu_bwd_kernel, out_shape=[out, out], grid=grid_for(rows, h),
      num_warps=NUM_WARPS, ROWS=rows, H=h, IN_STRIDE=h, B_OFFSET=0, BLOCK_R=BLOCK_R,
      BLOCK_C=BLOCK_C, ACT=activation))
