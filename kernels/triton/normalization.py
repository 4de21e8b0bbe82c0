"""Triton kernels for LayerNorm and RMSNorm over the last axis, optionally after a residual add,
called from JAX through jax-triton.

One kernel each way covers the four ops (``CENTERED``: LayerNorm or RMSNorm; ``HAS_RESIDUAL``:
``z = x + residual`` first), with or without a scale and a bias:

- the forward kernel normalizes one row per program. With a residual it writes ``z`` rounded
  to its output dtype and normalizes that rounded ``z``, exactly as ``z = x + residual`` followed
  by the normalization would. With ``STORE_STATS`` it stores the row's float32 mean (LayerNorm)
  and reciprocal standard deviation, what the backward needs;
- the backward kernel gives each program a contiguous range of rows: it recomputes the
  normalized rows from the saved input and statistics, writes their input gradients (plus the
  gradient of ``z`` for the add variants, the "sum gradient") and keeps its share of the scale
  and bias gradients in registers, stored as one row of ``[n_programs, H]`` float32 buffers that
  are summed outside the kernel (no accumulation across programs).

A row is held whole in one power-of-2 block, so ``H`` is at most :data:`MAX_HIDDEN`; the tail of
the block is masked. Arithmetic is float32; outputs are stored in their pointer's dtype.
:func:`rms_norm_fwd_kernel` and :func:`rms_norm_bwd_kernel` are the RMSNorm-only launches of
the same kernels.

The same kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, torch CPU tensors),
which is how CPU tests check them.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from .. import limits

# The widest row. The backward kernel holds whole rows of x, g and the scale and its two float32
# gradient accumulators in registers, at most 128 a thread with 16 warps: past 8192 columns it
# spills on sm_90a (bfloat16 at 16384: 392 to 752 bytes a thread; at 32768: over 6 KB). Wider
# rows take the Pallas kernels, which walk a row in chunks, or XLA.
MAX_HIDDEN = 8192
# Backward programs at most; each keeps one row of the partial scale (and bias) gradients.
MAX_BACKWARD_PROGRAMS = 1024


@triton.jit
def norm_fwd_kernel(x_ptr, res_ptr, w_ptr, b_ptr, y_ptr, z_ptr, mean_ptr, rstd_ptr,
                    H: tl.constexpr, eps: tl.constexpr, BLOCK_H: tl.constexpr,
                    CENTERED: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_SCALE: tl.constexpr,
                    HAS_BIAS: tl.constexpr, STORE_STATS: tl.constexpr):
  """Normalizes row ``program_id(0)`` of ``x`` (or of ``z = x + residual``, also stored).

  Pointers a variant does not use (``res_ptr``, ``w_ptr``, ``b_ptr``, ``z_ptr``, ``mean_ptr``,
  ``rstd_ptr``) are never read or written; any pointer may stand in for them.
  """
  row = tl.program_id(0).to(tl.int64)
  cols = tl.arange(0, BLOCK_H)
  mask = cols < H
  x = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
  if HAS_RESIDUAL:
    r = tl.load(res_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
    z = (x + r).to(z_ptr.dtype.element_ty)
    tl.store(z_ptr + row * H + cols, z, mask=mask)
    x = z.to(tl.float32)
  if CENTERED:
    mean = tl.sum(x, axis=0) / H
    d = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=0) / H + eps)
  else:
    d = x
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
  y = d * rstd
  if HAS_SCALE:
    y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
  if HAS_BIAS:
    y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
  tl.store(y_ptr + row * H + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
  if STORE_STATS:
    if CENTERED:
      tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def norm_bwd_kernel(x_ptr, g_ptr, gz_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr,
                    R: tl.constexpr, H: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr,
                    BLOCK_H: tl.constexpr, CENTERED: tl.constexpr, HAS_SUM_GRAD: tl.constexpr,
                    HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr):
  """Input gradients of rows ``[pid * ROWS_PER_PROGRAM, (pid + 1) * ROWS_PER_PROGRAM)`` and
  this program's row of the float32 partial scale (``dw_ptr``) and bias (``db_ptr``) gradients.

  With ``xhat = (x - mean) * rstd`` and ``gs = g * scale``:
  ``dx = rstd * (gs - xhat * mean(gs * xhat) - mean(gs)) + gz`` (LayerNorm; RMSNorm drops the
  ``mean(gs)`` term and has ``mean = 0``; ``gz`` only with HAS_SUM_GRAD), and the parameter
  gradients are the column sums of ``g * xhat`` and ``g``.
  """
  pid = tl.program_id(0)
  cols = tl.arange(0, BLOCK_H)
  col_ok = cols < H
  if HAS_SCALE:
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
  dw = tl.zeros([BLOCK_H], dtype=tl.float32)
  db = tl.zeros([BLOCK_H], dtype=tl.float32)
  for i in range(ROWS_PER_PROGRAM):
    row = pid.to(tl.int64) * ROWS_PER_PROGRAM + i
    row_ok = row < R
    mask = col_ok & (tl.zeros([BLOCK_H], dtype=tl.int64) + row < R)
    x = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + row, mask=row_ok, other=0.0)
    if CENTERED:
      xhat = (x - tl.load(mean_ptr + row, mask=row_ok, other=0.0)) * rstd
    else:
      xhat = x * rstd
    if HAS_SCALE:
      gs = g * w
    else:
      gs = g
    dx = gs - xhat * (tl.sum(gs * xhat, axis=0) / H)
    if CENTERED:
      dx = dx - tl.sum(gs, axis=0) / H
    dx = dx * rstd
    if HAS_SUM_GRAD:
      dx = dx + tl.load(gz_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(dx_ptr + row * H + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    dw += g * xhat
    db += g
  if HAS_SCALE:
    tl.store(dw_ptr + pid * H + cols, dw, mask=col_ok)
  if HAS_BIAS:
    tl.store(db_ptr + pid * H + cols, db, mask=col_ok)


@triton.jit
def rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, H: tl.constexpr, eps: tl.constexpr,
                        BLOCK_H: tl.constexpr, HAS_SCALE: tl.constexpr):
  """:func:`norm_fwd_kernel` for RMSNorm without residual or bias, storing rstd."""
  norm_fwd_kernel(x_ptr, x_ptr, w_ptr, w_ptr, y_ptr, y_ptr, rstd_ptr, rstd_ptr, H, eps, BLOCK_H,
                  False, False, HAS_SCALE, False, True)


@triton.jit
def rms_norm_bwd_kernel(x_ptr, g_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, R: tl.constexpr,
                        H: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr, BLOCK_H: tl.constexpr,
                        HAS_SCALE: tl.constexpr):
  """:func:`norm_bwd_kernel` for RMSNorm without residual or bias."""
  norm_bwd_kernel(x_ptr, g_ptr, g_ptr, w_ptr, rstd_ptr, rstd_ptr, dx_ptr, dw_ptr, dw_ptr, R, H,
                  ROWS_PER_PROGRAM, BLOCK_H, False, False, HAS_SCALE, False)


def refuses(*, hidden: int | None = None, **_) -> str | None:
  """Why these kernels cannot take a call (None: they can): rows wider than they hold."""
  return limits.too_large("a hidden size (x.shape[-1])", hidden, MAX_HIDDEN)


def block_for(n_cols: int) -> int:
  """The power-of-2 block holding a whole row."""
  reason = limits.too_large("a hidden size", n_cols, MAX_HIDDEN)
  if reason:
    raise ValueError(f"the Triton normalization kernels {reason}; use implementation='pallas' "
                     f"or 'xla'")
  return triton.next_power_of_2(n_cols)


def num_warps_for(block: int) -> int:
  return 4 if block < 2048 else 8 if block < 8192 else 16


def backward_grid(n_rows: int) -> tuple[int, int]:
  """``(n_programs, rows_per_program)`` of the backward kernel."""
  rows_per_program = max(1, math.ceil(n_rows / MAX_BACKWARD_PROGRAMS))
  return max(1, math.ceil(n_rows / rows_per_program)), rows_per_program


def forward(x, residual, scale, bias, *, eps: float, centered: bool, store_stats: bool):
  """Normalizes the rows of ``x`` (or of ``x + residual``) through jax-triton (GPU only): the
  arguments and the ``(y, z, mean, rstd)`` of :func:`jaxfuse.kernels.pallas.normalization.
  forward` (z None without a residual; float32 ``(rows, 1)`` statistics, None unless
  ``store_stats``, and the mean unless ``centered``)."""
  import jax
  import jax.numpy as jnp
  import jax_triton

  n_rows, n_cols = x.shape
  block = block_for(n_cols)
  has_residual = residual is not None
  rows = jax.ShapeDtypeStruct(x.shape, x.dtype)
  stat = jax.ShapeDtypeStruct((n_rows, 1), jnp.float32)
  # Outputs a variant does not write are (1, 1) placeholders, dropped below.
  unused = jax.ShapeDtypeStruct((1, 1), jnp.float32)
  y, z, mean, rstd = jax_triton.triton_call(
      x, residual if has_residual else x, x if scale is None else scale,
      x if bias is None else bias, kernel=norm_fwd_kernel,
      out_shape=[rows, rows if has_residual else unused,
                 stat if store_stats and centered else unused,
                 stat if store_stats else unused],
      grid=(n_rows,), num_warps=num_warps_for(block), H=n_cols, eps=float(eps), BLOCK_H=block,
      CENTERED=centered, HAS_RESIDUAL=has_residual, HAS_SCALE=scale is not None,
      HAS_BIAS=bias is not None, STORE_STATS=store_stats)
  return (y, z if has_residual else None, mean if store_stats and centered else None,
          rstd if store_stats else None)


def backward(x, g, sum_grad, scale, mean, rstd, *, has_bias: bool):
  """Gradients of a row normalization through jax-triton (GPU only): the arguments and the
  ``(dx, dscale, dbias)`` of :func:`jaxfuse.kernels.pallas.normalization.backward` (dx in x's
  dtype; float32 ``(H,)`` parameter gradients, None where there is no such parameter)."""
  import jax
  import jax.numpy as jnp
  import jax_triton

  n_rows, n_cols = x.shape
  block = block_for(n_cols)
  programs, rows_per_program = backward_grid(n_rows)
  centered = mean is not None
  partial = jax.ShapeDtypeStruct((programs, n_cols), jnp.float32)
  unused = jax.ShapeDtypeStruct((1, 1), jnp.float32)
  dx, dscale, dbias = jax_triton.triton_call(
      x, g, g if sum_grad is None else sum_grad, x if scale is None else scale,
      rstd if mean is None else mean, rstd, kernel=norm_bwd_kernel,
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype), partial if scale is not None else unused,
                 partial if has_bias else unused],
      grid=(programs,), num_warps=num_warps_for(block), R=n_rows, H=n_cols,
      ROWS_PER_PROGRAM=rows_per_program, BLOCK_H=block, CENTERED=centered,
      HAS_SUM_GRAD=sum_grad is not None, HAS_SCALE=scale is not None, HAS_BIAS=has_bias)
  return (dx, None if scale is None else jnp.sum(dscale, axis=0),
          jnp.sum(dbias, axis=0) if has_bias else None)


def rms_norm_forward(x, scale, *, eps: float):
  """``(y, rstd)`` of RMSNorm for ``(rows, H)`` x through jax-triton (GPU only); rstd is float32
  ``(rows, 1)``."""
  y, _, _, rstd = forward(x, None, scale, None, eps=eps, centered=False, store_stats=True)
  return y, rstd


def rms_norm_backward(x, g, scale, rstd):
  """``(dx, dscale)`` of RMSNorm through jax-triton (GPU only); dscale is float32 (None without
  scale)."""
  dx, dscale, _ = backward(x, g, None, scale, None, rstd, has_bias=False)
  return dx, dscale
