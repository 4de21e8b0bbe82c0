"""Triton kernels for ``act(x + bias)`` over a ``ROWS x N`` array with a bias of ``N``, forward
and backward, called from JAX through jax-triton.

The forward walks the array in ``BLOCK_R x BLOCK_C`` tiles on a 2-D grid, reads ``x`` and the
bias and writes the result. The backward gives each program a column block of ``STEPS``
consecutive row blocks (a row group): it recomputes ``x + bias``, writes
``dx = g * act'(x + bias)`` and keeps the float32 column sums of ``dx`` in registers, stored as
one row of a ``[groups, N]`` float32 buffer of partial bias gradients that the caller sums (GPU
programs run in parallel, so they do not add into one buffer). Activations are taken by name
(:data:`ACTIVATIONS`). Arithmetic is float32; outputs are stored in their pointer's dtype. The
same kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, torch CPU tensors) in tests.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from .elementwise import ACTIVATIONS, activation, activation_grad, refuses  # noqa: F401

BLOCK_R = 8
BLOCK_C = 512
NUM_WARPS = 4
# Backward: aim for about this many programs (row groups x column blocks).
TARGET_PROGRAMS = 1024


@triton.jit
def bias_act_fwd_kernel(x_ptr, b_ptr, y_ptr, ROWS: tl.constexpr, N: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ACT: tl.constexpr):
  """``y = ACT(x + bias)`` on one ``BLOCK_R x BLOCK_C`` tile."""
  rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
  cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
  col_ok = cols < N
  mask = (rows[:, None] < ROWS) & col_ok[None, :]
  offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
  x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
  b = tl.load(b_ptr + cols, mask=col_ok).to(tl.float32)
  y = activation(x + b[None, :], ACT)
  tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def bias_act_bwd_kernel(x_ptr, b_ptr, g_ptr, dx_ptr, db_ptr, ROWS: tl.constexpr,
                        N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                        STEPS: tl.constexpr, ACT: tl.constexpr):
  """``dx = g * ACT'(x + bias)`` over ``STEPS`` row blocks; the float32 column sums of ``dx``
  go to row ``program_id(0)`` of the ``[groups, N]`` partials ``db_ptr``."""
  group = tl.program_id(0)
  cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
  col_ok = cols < N
  b = tl.load(b_ptr + cols, mask=col_ok).to(tl.float32)
  acc = tl.zeros([BLOCK_C], dtype=tl.float32)
  for step in range(STEPS):
    rows = (group * STEPS + step) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask = (rows[:, None] < ROWS) & col_ok[None, :]
    offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    dz = g * activation_grad(x + b[None, :], ACT)
    tl.store(dx_ptr + offsets, dz.to(dx_ptr.dtype.element_ty), mask=mask)
    acc += tl.sum(tl.where(mask, dz, 0.0), axis=0)
  tl.store(db_ptr + group.to(tl.int64) * N + cols, acc, mask=col_ok)


def blocks_for(rows: int, n: int) -> tuple[int, int]:
  """``(block_r, block_c)``: powers of 2, no larger than the array needs."""
  block_c = min(BLOCK_C, triton.next_power_of_2(max(n, 1)))
  block_r = min(max(BLOCK_R, BLOCK_R * BLOCK_C // block_c), triton.next_power_of_2(max(rows, 1)))
  return block_r, block_c


def forward_grid(rows: int, n: int) -> tuple[int, int]:
  block_r, block_c = blocks_for(rows, n)
  return max(1, math.ceil(rows / block_r)), max(1, math.ceil(n / block_c))


def backward_plan(rows: int, n: int,
                  target_programs: int = TARGET_PROGRAMS) -> tuple[int, int, int, int, int]:
  """``(block_r, block_c, steps, groups, col_blocks)`` of the backward kernel: each of its
  ``groups x col_blocks`` programs walks ``steps`` row blocks of one column block."""
  block_r, block_c = blocks_for(rows, n)
  row_blocks = max(1, math.ceil(rows / block_r))
  col_blocks = max(1, math.ceil(n / block_c))
  steps = math.ceil(row_blocks / max(1, target_programs // col_blocks))
  groups = math.ceil(row_blocks / steps)
  return block_r, block_c, steps, groups, col_blocks


def bias_act_forward(x, bias, activation: str):
  """``act(x + bias)`` for 2-D ``x`` and 1-D ``bias`` through jax-triton (GPU only)."""
  import jax
  import jax.numpy as jnp
  import jax_triton

  rows, n = x.shape
  if rows == 0 or n == 0:
    return jnp.zeros_like(x)
  block_r, block_c = blocks_for(rows, n)
  return jax_triton.triton_call(
      x, bias, kernel=bias_act_fwd_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      grid=forward_grid(rows, n), num_warps=NUM_WARPS, ROWS=rows, N=n, BLOCK_R=block_r,
      BLOCK_C=block_c, ACT=activation)


def bias_act_backward(x, bias, g, activation: str):
  """``(dx, dbias)`` of ``act(x + bias)`` through jax-triton (GPU only); ``dbias`` is the
  float32 sum of the kernel's per-group partials, cast to the bias dtype."""
  import jax
  import jax.numpy as jnp
  import jax_triton

  rows, n = x.shape
  if rows == 0 or n == 0:
    return jnp.zeros_like(x), jnp.zeros_like(bias)
  block_r, block_c, steps, groups, col_blocks = backward_plan(rows, n)
  dx, partials = jax_triton.triton_call(
      x, bias, g, kernel=bias_act_bwd_kernel,
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype),
                 jax.ShapeDtypeStruct((groups, n), jnp.float32)],
      grid=(groups, col_blocks), num_warps=NUM_WARPS, ROWS=rows, N=n, BLOCK_R=block_r,
      BLOCK_C=block_c, STEPS=steps, ACT=activation)
  return dx, jnp.sum(partials, axis=0).astype(bias.dtype)
