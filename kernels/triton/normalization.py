"""Triton kernels for RMSNorm over the last axis, called from JAX through jax-triton.

The forward kernel normalizes one row per program and stores the row's float32 reciprocal RMS.
The backward kernel gives each program a contiguous range of rows: it writes their input
gradients and keeps its share of the scale gradient in registers, stored as one row of an
``[n_programs, H]`` float32 buffer that is summed outside the kernel (no accumulation across
programs). A row is held whole in one power-of-2 block, so ``H`` is at most :data:`MAX_HIDDEN`;
the tail of the block is masked. Arithmetic is float32; outputs are stored in their pointer's
dtype.

The same kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, torch CPU tensors),
which is how CPU tests check them.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

MAX_HIDDEN = 32768
# Backward programs at most; each keeps one row of the partial scale gradient.
MAX_BACKWARD_PROGRAMS = 1024


@triton.jit
def rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, H: tl.constexpr, eps: tl.constexpr,
                        BLOCK_H: tl.constexpr, HAS_SCALE: tl.constexpr):
  row = tl.program_id(0).to(tl.int64)
  cols = tl.arange(0, BLOCK_H)
  mask = cols < H
  x = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
  rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
  y = x * rstd
  if HAS_SCALE:
    y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
  tl.store(y_ptr + row * H + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
  tl.store(rstd_ptr + row, rstd)


@triton.jit
def rms_norm_bwd_kernel(x_ptr, g_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, R: tl.constexpr,
                        H: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr, BLOCK_H: tl.constexpr,
                        HAS_SCALE: tl.constexpr):
  pid = tl.program_id(0)
  cols = tl.arange(0, BLOCK_H)
  col_ok = cols < H
  if HAS_SCALE:
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
  dw = tl.zeros([BLOCK_H], dtype=tl.float32)
  for i in range(ROWS_PER_PROGRAM):
    row = pid.to(tl.int64) * ROWS_PER_PROGRAM + i
    row_ok = row < R
    mask = col_ok & (tl.zeros([BLOCK_H], dtype=tl.int64) + row < R)
    x = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + row, mask=row_ok, other=0.0)
    xhat = x * rstd
    if HAS_SCALE:
      gw = g * w
    else:
      gw = g
    c1 = tl.sum(gw * xhat, axis=0) / H
    dx = (gw - xhat * c1) * rstd
    tl.store(dx_ptr + row * H + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    dw += g * xhat
  if HAS_SCALE:
    tl.store(dw_ptr + pid * H + cols, dw, mask=col_ok)


def block_for(n_cols: int) -> int:
  """The power-of-2 block holding a whole row."""
  if n_cols > MAX_HIDDEN:
    raise ValueError(f"the Triton rms_norm kernels take a hidden size of at most {MAX_HIDDEN}, "
                     f"got {n_cols}; use implementation='pallas' or 'xla'")
  return triton.next_power_of_2(n_cols)


def num_warps_for(block: int) -> int:
  return 4 if block < 2048 else 8 if block < 8192 else 16


def backward_grid(n_rows: int) -> tuple[int, int]:
  """``(n_programs, rows_per_program)`` of the backward kernel."""
  rows_per_program = max(1, math.ceil(n_rows / MAX_BACKWARD_PROGRAMS))
  return max(1, math.ceil(n_rows / rows_per_program)), rows_per_program


def rms_norm_forward(x, scale, *, eps: float):
  """``(y, rstd)`` for ``(rows, H)`` x through jax-triton (GPU only); rstd is float32 (rows, 1)."""
  import jax
  import jax.numpy as jnp
  import jax_triton

  n_rows, n_cols = x.shape
  block = block_for(n_cols)
  y, rstd = jax_triton.triton_call(
      x, x if scale is None else scale, kernel=rms_norm_fwd_kernel,
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype),
                 jax.ShapeDtypeStruct((n_rows, 1), jnp.float32)],
      grid=(n_rows,), num_warps=num_warps_for(block), H=n_cols, eps=float(eps), BLOCK_H=block,
      HAS_SCALE=scale is not None)
  return y, rstd


def rms_norm_backward(x, g, scale, rstd):
  """``(dx, dscale)`` through jax-triton (GPU only); dscale is float32 (None without scale)."""
  import jax
  import jax.numpy as jnp
  import jax_triton

  n_rows, n_cols = x.shape
  block = block_for(n_cols)
  programs, rows_per_program = backward_grid(n_rows)
  # Without a scale the kernel writes no partial gradient: a (1, 1) placeholder stands in.
  partial_shape = (programs, n_cols) if scale is not None else (1, 1)
  dx, partial = jax_triton.triton_call(
      x, g, x if scale is None else scale, rstd, kernel=rms_norm_bwd_kernel,
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype),
                 jax.ShapeDtypeStruct(partial_shape, jnp.float32)],
      grid=(programs,), num_warps=num_warps_for(block), R=n_rows, H=n_cols,
      ROWS_PER_PROGRAM=rows_per_program, BLOCK_H=block, HAS_SCALE=scale is not None)
  return dx, (None if scale is None else jnp.sum(partial, axis=0))
