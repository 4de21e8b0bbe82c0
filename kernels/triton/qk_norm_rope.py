"""Triton kernels for RMSNorm of query or key heads followed by the rotary embedding, called
from JAX through jax-triton: the kernels of :mod:`jaxfuse.kernels.pallas.qk_norm_rope` (same
grid, arguments and outputs), written with ``@triton.jit``.

``x`` is ``[tokens, heads, head_dim]`` (contiguous: the kernels index it as
``[tokens, heads * head_dim]``). A program owns ``BLOCK_T`` tokens and a group of ``COUNT``
heads (one, or all for a norm over the whole projection); each head is read as its two rotary
halves of ``HALF`` columns, padded to the power of 2 ``BLOCK_H`` and masked. Arithmetic is
float32; outputs are stored in their pointer's dtype.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

NUM_WARPS = 4
TOKENS = 16


@triton.jit
def _tile(ptr, rows, cols, mask, STRIDE: tl.constexpr):
  return tl.load(ptr + rows[:, None].to(tl.int64) * STRIDE + cols[None, :], mask=mask,
                 other=0.0).to(tl.float32)


@triton.jit
def _rstd(x_ptr, rows, cols, mask, first, WIDTH: tl.constexpr, D: tl.constexpr,
          HALF: tl.constexpr, COUNT: tl.constexpr, EPS: tl.constexpr, BLOCK_T: tl.constexpr):
  total = tl.zeros([BLOCK_T], dtype=tl.float32)
  for k in range(COUNT):
    col = (first + k) * D
    x1 = _tile(x_ptr + col, rows, cols, mask, WIDTH)
    x2 = _tile(x_ptr + col + HALF, rows, cols, mask, WIDTH)
    total += tl.sum(x1 * x1 + x2 * x2, axis=1)
  return 1.0 / tl.sqrt(total / (COUNT * D) + EPS)


@triton.jit
def _weight(w_ptr, head, cols, col_ok, D: tl.constexpr, HALF: tl.constexpr,
            WHOLE: tl.constexpr, OFFSET: tl.constexpr):
  col = head * D if WHOLE else 0
  w1 = tl.load(w_ptr + col + cols, mask=col_ok, other=0.0).to(tl.float32) + OFFSET
  w2 = tl.load(w_ptr + col + HALF + cols, mask=col_ok, other=0.0).to(tl.float32) + OFFSET
  return w1, w2


@triton.jit
def _prologue(x_ptr, cos_ptr, sin_ptr, N: tl.constexpr, WIDTH: tl.constexpr, D: tl.constexpr,
              HALF: tl.constexpr, COUNT: tl.constexpr, EPS: tl.constexpr,
              BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
  """What both kernels start with: the program's rows and columns, the mask, its first head,
  the heads' reciprocal RMS and the rows' rotation."""
  rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
  cols = tl.arange(0, BLOCK_H)
  col_ok = cols < HALF
  mask = (rows[:, None] < N) & col_ok[None, :]
  first = tl.program_id(1) * COUNT
  rstd = _rstd(x_ptr, rows, cols, mask, first, WIDTH, D, HALF, COUNT, EPS, BLOCK_T)
  c = _tile(cos_ptr, rows, cols, mask, HALF)
  s = _tile(sin_ptr, rows, cols, mask, HALF)
  return rows, cols, col_ok, mask, first, rstd, c, s


@triton.jit
def _head(x_ptr, w_ptr, g_ptr, rows, cols, col_ok, mask, head, rstd, c, s, WIDTH: tl.constexpr,
          D: tl.constexpr, HALF: tl.constexpr, WHOLE: tl.constexpr, OFFSET: tl.constexpr,
          HAS_WEIGHT: tl.constexpr):
  """A head's halves in the backward: the normalized input ``xhat``, the gradient ``dn`` of the
  scaled normalized input (the output gradient rotated back) and ``dxhat``, the gradient of
  ``xhat``."""
  col = head * D
  g1 = _tile(g_ptr + col, rows, cols, mask, WIDTH)
  g2 = _tile(g_ptr + col + HALF, rows, cols, mask, WIDTH)
  dn1 = g1 * c + g2 * s
  dn2 = g2 * c - g1 * s
  dxh1 = dn1
  dxh2 = dn2
  if HAS_WEIGHT:
    w1, w2 = _weight(w_ptr, head, cols, col_ok, D, HALF, WHOLE, OFFSET)
    dxh1 = dn1 * w1[None, :]
    dxh2 = dn2 * w2[None, :]
  xh1 = _tile(x_ptr + col, rows, cols, mask, WIDTH) * rstd[:, None]
  xh2 = _tile(x_ptr + col + HALF, rows, cols, mask, WIDTH) * rstd[:, None]
  return xh1, xh2, dn1, dn2, dxh1, dxh2


@triton.jit
def qk_norm_rope_fwd_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, y_ptr, N: tl.constexpr,
                            WIDTH: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                            COUNT: tl.constexpr, EPS: tl.constexpr, OFFSET: tl.constexpr,
                            WHOLE: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                            BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
  rows, cols, col_ok, mask, first, rstd, c, s = _prologue(x_ptr, cos_ptr, sin_ptr, N, WIDTH, D,
                                                          HALF, COUNT, EPS, BLOCK_T, BLOCK_H)
  for k in range(COUNT):
    head = first + k
    col = head * D
    n1 = _tile(x_ptr + col, rows, cols, mask, WIDTH) * rstd[:, None]
    n2 = _tile(x_ptr + col + HALF, rows, cols, mask, WIDTH) * rstd[:, None]
    if HAS_WEIGHT:
      w1, w2 = _weight(w_ptr, head, cols, col_ok, D, HALF, WHOLE, OFFSET)
      n1 = n1 * w1[None, :]
      n2 = n2 * w2[None, :]
    offsets = rows[:, None].to(tl.int64) * WIDTH + col + cols[None, :]
    tl.store(y_ptr + offsets, (n1 * c - n2 * s).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + offsets + HALF, (n2 * c + n1 * s).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def qk_norm_rope_bwd_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, g_ptr, dx_ptr, dw_ptr,
                            N: tl.constexpr, WIDTH: tl.constexpr, D: tl.constexpr,
                            HALF: tl.constexpr, COUNT: tl.constexpr, EPS: tl.constexpr,
                            OFFSET: tl.constexpr, WHOLE: tl.constexpr,
                            HAS_WEIGHT: tl.constexpr, BLOCK_T: tl.constexpr,
                            BLOCK_H: tl.constexpr):
  """``dx`` and row ``program_id(0)`` of the float32 ``[blocks, WIDTH]`` weight partials."""
  rows, cols, col_ok, mask, first, rstd, c, s = _prologue(x_ptr, cos_ptr, sin_ptr, N, WIDTH, D,
                                                          HALF, COUNT, EPS, BLOCK_T, BLOCK_H)
  dot = tl.zeros([BLOCK_T], dtype=tl.float32)
  for k in range(COUNT):   # sum(xhat * dxhat) over the group
    xh1, xh2, dn1, dn2, dxh1, dxh2 = _head(x_ptr, w_ptr, g_ptr, rows, cols, col_ok, mask,
                                           first + k, rstd, c, s, WIDTH, D, HALF, WHOLE, OFFSET,
                                           HAS_WEIGHT)
    dot += tl.sum(xh1 * dxh1 + xh2 * dxh2, axis=1)
  mean_dot = dot / (COUNT * D)
  for k in range(COUNT):
    col = (first + k) * D
    xh1, xh2, dn1, dn2, dxh1, dxh2 = _head(x_ptr, w_ptr, g_ptr, rows, cols, col_ok, mask,
                                           first + k, rstd, c, s, WIDTH, D, HALF, WHOLE, OFFSET,
                                           HAS_WEIGHT)
    if HAS_WEIGHT:
      partial = tl.program_id(0).to(tl.int64) * WIDTH + col + cols
      tl.store(dw_ptr + partial, tl.sum(tl.where(mask, dn1 * xh1, 0.0), axis=0), mask=col_ok)
      tl.store(dw_ptr + partial + HALF, tl.sum(tl.where(mask, dn2 * xh2, 0.0), axis=0),
               mask=col_ok)
    offsets = rows[:, None].to(tl.int64) * WIDTH + col + cols[None, :]
    dx1 = rstd[:, None] * (dxh1 - xh1 * mean_dot[:, None])
    dx2 = rstd[:, None] * (dxh2 - xh2 * mean_dot[:, None])
    tl.store(dx_ptr + offsets, dx1.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dx_ptr + offsets + HALF, dx2.to(dx_ptr.dtype.element_ty), mask=mask)


def launch(n: int, width: int, heads: int, *, eps: float, offset: float, whole: bool,
           has_weight: bool) -> tuple[tuple[int, int], dict]:
  """The grid and compile-time constants of both kernels for ``x [n, width]``."""
  d = width // heads
  block_h = triton.next_power_of_2(max(d // 2, 1))
  block_t = min(max(1, TOKENS * 64 // max(block_h, 64)), triton.next_power_of_2(max(n, 1)))
  grid = (max(1, math.ceil(n / block_t)), 1 if whole else heads)
  return grid, dict(N=n, WIDTH=width, D=d, HALF=d // 2, COUNT=heads if whole else 1,
                    EPS=float(eps), OFFSET=float(offset), WHOLE=whole, HAS_WEIGHT=has_weight,
                    BLOCK_T=block_t, BLOCK_H=block_h)


def forward(x, weight, cos, sin, *, eps: float, offset: float = 0.0, whole: bool = False):
  """:func:`jaxfuse.kernels.pallas.qk_norm_rope.forward` through jax-triton (GPU only)."""
  import jax
  import jax.numpy as jnp
  import jax_triton

  n, heads, d = x.shape
  if x.size == 0:
    return jnp.zeros_like(x)
  grid, constants = launch(n, heads * d, heads, eps=eps, offset=offset, whole=whole,
                           has_weight=weight is not None)
  y = jax_triton.triton_call(
      x, x if weight is None else weight, cos, sin, kernel=qk_norm_rope_fwd_kernel,
      out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=grid, num_warps=NUM_WARPS,
      **constants)
  return y


def backward(x, weight, cos, sin, g, *, eps: float, offset: float = 0.0, whole: bool = False):
  """:func:`jaxfuse.kernels.pallas.qk_norm_rope.backward` through jax-triton (GPU only)."""
  import jax
  import jax.numpy as jnp
  import jax_triton

  n, heads, d = x.shape
  width = heads * d
  if x.size == 0:
    dw = None if weight is None else jnp.zeros(weight.shape, jnp.float32)
    return jnp.zeros_like(x), dw
  grid, constants = launch(n, width, heads, eps=eps, offset=offset, whole=whole,
                           has_weight=weight is not None)
  dx, partials = jax_triton.triton_call(
      x, x if weight is None else weight, cos, sin, g, kernel=qk_norm_rope_bwd_kernel,
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype),
                 jax.ShapeDtypeStruct((grid[0], width), jnp.float32)],
      grid=grid, num_warps=NUM_WARPS, **constants)
  if weight is None:
    return dx, None
  dw = jnp.sum(partials, axis=0)
  return dx, dw if whole else jnp.sum(dw.reshape(heads, d), axis=0)
