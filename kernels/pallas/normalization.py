"""Pallas kernels for LayerNorm and RMSNorm over the last axis, optionally after a residual add.

Inputs are viewed as ``(rows, H)``. The forward kernel normalizes one tile of rows per program;
the backward kernel walks several tiles per program, so that its scale and bias gradients are
per-program partial sums (an ``[n_programs, H]`` float32 buffer, summed outside the kernel)
rather than values accumulated across programs, which run in parallel on a GPU.

``H`` is covered by power-of-2 column chunks of at most :data:`MAX_COLS` columns. With a single
chunk (``H <= MAX_COLS``) a tile is read once and kept in registers. The forward kernel walks
longer rows chunk by chunk: once for the statistics (combined across chunks with Chan's formula,
which stays accurate for rows with a large mean) and once more to normalize. The backward kernel
gives each column chunk programs of its own (grid ``(programs, chunks)``), so that a program
keeps the gradient partials of one chunk in registers, not of the whole row; the two row sums
its input gradient needs come from one XLA reduction over the rows before it. Rows past the end
and columns past ``H`` are masked on every load and store, since Pallas' Triton lowering does
not bound block accesses. Everything is computed in float32; outputs are rounded once.

Statistics (per-row mean and reciprocal standard deviation) are float32 arrays of shape
``(rows, 1)``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from .. import limits
from . import common

F32 = jnp.float32

# Columns per chunk: a chunk of a tile lives in registers on a GPU.
MAX_COLS = 4096
# Elements per tile (rows x columns of one chunk).
TILE_ELEMENTS = 4096
# Backward programs at most; each keeps one row of the partial scale/bias gradients.
MAX_BACKWARD_PROGRAMS = 512
# Column chunks at most: rows of up to MAX_HIDDEN columns.
MAX_CHUNKS = 16
MAX_HIDDEN = MAX_COLS * MAX_CHUNKS


@dataclasses.dataclass(frozen=True)
class Tiling:
  """How a ``(rows, H)`` array is cut: ``rows`` x ``cols`` tiles, ``chunks`` chunks per row."""

  rows: int
  cols: int
  chunks: int
  num_warps: int


def tiling(n_rows: int, n_cols: int, *, max_cols: int = MAX_COLS,
           tile_elements: int = TILE_ELEMENTS) -> Tiling:
  """The tiling for ``n_rows`` rows of ``n_cols`` features."""
  cols = common.block_for(n_cols, max_cols)
  rows = common.block_for(n_rows, max(1, tile_elements // cols))
  chunks = pl.cdiv(n_cols, cols)
  num_warps = 8 if rows * cols >= 4096 else 4
  return Tiling(rows=rows, cols=cols, chunks=chunks, num_warps=num_warps)


def refuses(*, hidden: int | None = None, **_) -> str | None:
  """Why these kernels cannot take a call (None: they can): rows wider than they hold."""
  return limits.too_large("a hidden size (x.shape[-1])", hidden, MAX_HIDDEN)


def _check_hidden(n_cols: int) -> None:
  reason = limits.too_large("a hidden size", n_cols, MAX_HIDDEN)
  if reason:
    raise ValueError(f"the Pallas normalization kernels {reason}; use implementation='xla'")


def _col_mask(start, cols: int, n_cols: int):
  return start + lax.broadcasted_iota(jnp.int32, (1, cols), 1) < n_cols


def _row_mask(row0, rows: int, n_rows: int):
  return row0 + lax.broadcasted_iota(jnp.int32, (rows, 1), 0) < n_rows


def _chunk_start(c, cols: int):
  """The first column of chunk ``c``, as a traced value: a static start past the end of a
  non-power-of-2 row would be rejected when the slice is built, even though it is masked."""
  return pl.multiple_of(jnp.asarray(c, jnp.int32) * cols, cols)


def _load(ref, idx, mask):
  return pl_triton.load(ref.at[idx], mask=mask, other=0).astype(F32)


def _load_params(ref, start, cols, col_ok):
  """A (1, cols) slice of a (1, H) parameter row, zero past H."""
  return _load(ref, (pl.ds(0, 1), pl.ds(start, cols)), col_ok)


# Forward ----------------------------------------------------------------------------------------


def _forward_kernel(*refs, n_rows, n_cols, t: Tiling, centered, has_residual, has_scale,
                    has_bias, store_stats, eps):
  refs = list(refs)
  x_ref = refs.pop(0)
  res_ref = refs.pop(0) if has_residual else None
  scale_ref = refs.pop(0) if has_scale else None
  bias_ref = refs.pop(0) if has_bias else None
  y_ref = refs.pop(0)
  z_ref = refs.pop(0) if has_residual else None
  mean_ref = refs.pop(0) if store_stats and centered else None
  rstd_ref = refs.pop(0) if store_stats else None

  row0 = pl.program_id(0) * t.rows
  row_ok = _row_mask(row0, t.rows, n_rows)
  rows = pl.ds(row0, t.rows)

  def chunk(start, write_sum):
    """The input chunk at column ``start`` (x, or x + residual rounded as stored) and its mask."""
    col_ok = _col_mask(start, t.cols, n_cols)
    mask = row_ok & col_ok
    idx = (rows, pl.ds(start, t.cols))
    v = _load(x_ref, idx, mask)
    if has_residual:
      s = (v + _load(res_ref, idx, mask)).astype(z_ref.dtype)
      if write_sum:
        pl_triton.store(z_ref.at[idx], s, mask=mask)
      v = s.astype(F32)
    return v, mask, col_ok

  def normalize(start, v, col_ok, mask, mean, rstd):
    y = (v - mean) * rstd if centered else v * rstd
    if has_scale:
      y = y * _load_params(scale_ref, start, t.cols, col_ok)
    if has_bias:
      y = y + _load_params(bias_ref, start, t.cols, col_ok)
    pl_triton.store(y_ref.at[rows, pl.ds(start, t.cols)], y.astype(y_ref.dtype), mask=mask)

  zeros = jnp.zeros((t.rows, 1), F32)
  if t.chunks == 1:
    v, mask, col_ok = chunk(0, True)
    if centered:
      mean = jnp.sum(v, axis=1, keepdims=True) / n_cols
      d = jnp.where(mask, v - mean, 0.0)
      var = jnp.sum(d * d, axis=1, keepdims=True) / n_cols
    else:
      mean = zeros
      var = jnp.sum(v * v, axis=1, keepdims=True) / n_cols
    rstd = lax.rsqrt(var + eps)
    normalize(0, v, col_ok, mask, mean, rstd)
  else:
    def stats_body(c, carry):
      # Chan et al.'s pairwise update: (count, mean, M2) of the chunks so far and this chunk.
      count, mean, m2 = carry
      start = _chunk_start(c, t.cols)
      v, mask, _ = chunk(start, True)
      if not centered:
        return count, mean, m2 + jnp.sum(v * v, axis=1, keepdims=True)
      n_c = jnp.minimum(t.cols, n_cols - start).astype(F32)
      mean_c = jnp.sum(v, axis=1, keepdims=True) / n_c
      d = jnp.where(mask, v - mean_c, 0.0)
      m2_c = jnp.sum(d * d, axis=1, keepdims=True)
      total = count + n_c
      delta = mean_c - mean
      mean = mean + delta * (n_c / total)
      m2 = m2 + m2_c + delta * delta * (count * n_c / total)
      return total, mean, m2

    _, mean, m2 = lax.fori_loop(0, t.chunks, stats_body, (jnp.float32(0), zeros, zeros))
    rstd = lax.rsqrt(m2 / n_cols + eps)

    def out_body(c, carry):
      start = _chunk_start(c, t.cols)
      v, mask, col_ok = chunk(start, False)
      normalize(start, v, col_ok, mask, mean, rstd)
      return carry

    lax.fori_loop(0, t.chunks, out_body, 0)
  if mean_ref is not None:
    pl_triton.store(mean_ref.at[rows, pl.ds(0, 1)], mean, mask=row_ok)
  if rstd_ref is not None:
    pl_triton.store(rstd_ref.at[rows, pl.ds(0, 1)], rstd, mask=row_ok)


def forward(x, residual, scale, bias, *, eps: float, centered: bool, store_stats: bool,
            interpret: bool = False, tile: Tiling | None = None, name: str | None = None):
  """Normalizes the rows of ``x`` (or of ``x + residual``) in one kernel.

  Args:
    x: ``(rows, H)``.
    residual: ``(rows, H)`` added to ``x`` first, or None.
    scale, bias: ``(H,)`` or None.
    eps: added to the variance (or mean square).
    centered: subtract the mean (LayerNorm) or not (RMSNorm).
    store_stats: also return the float32 statistics the backward kernel needs.
    interpret: Pallas interpret mode (CPU tests).
    tile: overrides the tiling (tests).
    name: the kernel's name.

  Returns:
    ``(y, z, mean, rstd)``: the normalized rows in x's dtype; ``x + residual`` rounded to x's
    dtype (None without a residual); float32 ``(rows, 1)`` mean (None unless centered and
    ``store_stats``) and rstd (None unless ``store_stats``).
  """
  n_rows, n_cols = x.shape
  _check_hidden(n_cols)
  t = tile or tiling(n_rows, n_cols)
  has_residual = residual is not None
  inputs = [x] + ([residual] if has_residual else [])
  inputs += [p.reshape(1, n_cols) for p in (scale, bias) if p is not None]
  out_shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype)]
  if has_residual:
    out_shapes.append(jax.ShapeDtypeStruct(x.shape, x.dtype))
  stat = jax.ShapeDtypeStruct((n_rows, 1), F32)
  if store_stats:
    out_shapes += [stat, stat] if centered else [stat]
  flops = (8 if centered else 5) * x.size + (2 * x.size if has_residual else 0)
  kind = "layer_norm" if centered else "rms_norm"
  default_name = ("add_" if has_residual else "") + kind + ("_fwd_res" if store_stats else "_fwd")
  kernel = _bind(_forward_kernel, n_rows=n_rows, n_cols=n_cols, t=t, centered=centered,
                 has_residual=has_residual, has_scale=scale is not None,
                 has_bias=bias is not None, store_stats=store_stats, eps=float(eps))
  outs = common.pallas_call(
      kernel,
      out_shape=out_shapes,
      grid=(pl.cdiv(n_rows, t.rows),),
      interpret=interpret,
      compiler_params=common.triton_params(num_warps=t.num_warps),
      cost_estimate=common.cost(inputs, out_shapes, flops=flops, transcendentals=n_rows),
      name=name or default_name,
  )(*inputs)
  outs = list(outs)
  y = outs.pop(0)
  z = outs.pop(0) if has_residual else None
  mean = outs.pop(0) if store_stats and centered else None
  rstd = outs.pop(0) if store_stats else None
  return y, z, mean, rstd


# Backward ---------------------------------------------------------------------------------------


def _backward_kernel(*refs, n_rows, n_cols, t: Tiling, tiles_per_program, centered,
                     has_sum_grad, has_scale, has_bias):
  refs = list(refs)
  x_ref = refs.pop(0)
  g_ref = refs.pop(0)
  gz_ref = refs.pop(0) if has_sum_grad else None
  scale_ref = refs.pop(0) if has_scale else None
  mean_ref = refs.pop(0) if centered else None
  rstd_ref = refs.pop(0)
  # Rows of several chunks come with their row sums (see `backward`).
  c1_ref = refs.pop(0) if t.chunks > 1 else None
  c2_ref = refs.pop(0) if t.chunks > 1 and centered else None
  dx_ref = refs.pop(0)
  dscale_ref = refs.pop(0) if has_scale else None
  dbias_ref = refs.pop(0) if has_bias else None

  program = pl.program_id(0)
  start = _chunk_start(pl.program_id(1), t.cols)     # this program's column chunk
  col_ok = _col_mask(start, t.cols, n_cols)
  inv_n = 1.0 / n_cols

  def tile_body(i, acc):
    row0 = (program * tiles_per_program + i) * t.rows
    row_ok = _row_mask(row0, t.rows, n_rows)
    rows = pl.ds(row0, t.rows)
    stat_idx = (rows, pl.ds(0, 1))
    rstd = _load(rstd_ref, stat_idx, row_ok)
    mean = _load(mean_ref, stat_idx, row_ok) if centered else None
    mask = row_ok & col_ok
    idx = (rows, pl.ds(start, t.cols))
    x = _load(x_ref, idx, mask)
    xhat = (x - mean) * rstd if centered else x * rstd
    g = _load(g_ref, idx, mask)
    gs = g * _load_params(scale_ref, start, t.cols, col_ok) if has_scale else g
    # The row sums the input gradient needs: sum(g*s * xhat) and (LayerNorm) sum(g*s).
    if c1_ref is None:
      c1 = jnp.sum(gs * xhat, axis=1, keepdims=True) * inv_n
      c2 = jnp.sum(gs, axis=1, keepdims=True) * inv_n if centered else None
    else:
      c1 = _load(c1_ref, stat_idx, row_ok)
      c2 = _load(c2_ref, stat_idx, row_ok) if centered else None
    dx = gs - xhat * c1
    if centered:
      dx = dx - c2
    dx = dx * rstd
    if has_sum_grad:
      dx = dx + _load(gz_ref, idx, mask)
    pl_triton.store(dx_ref.at[idx], dx.astype(dx_ref.dtype), mask=mask)
    # This tile's share of the parameter gradients.
    parts = []
    if has_scale:
      parts.append(jnp.sum(g * xhat, axis=0, keepdims=True))
    if has_bias:
      parts.append(jnp.sum(g, axis=0, keepdims=True))
    return tuple(a + p for a, p in zip(acc, parts))

  n_acc = int(has_scale) + int(has_bias)
  init = tuple(jnp.zeros((1, t.cols), F32) for _ in range(n_acc))
  acc = list(lax.fori_loop(0, tiles_per_program, tile_body, init))
  idx = (pl.ds(program, 1), pl.ds(start, t.cols))
  if has_scale:
    pl_triton.store(dscale_ref.at[idx], acc.pop(0), mask=col_ok)
  if has_bias:
    pl_triton.store(dbias_ref.at[idx], acc.pop(0), mask=col_ok)


def _row_sums(x, g, scale, mean, rstd):
  """``(c1, c2)``: the float32 ``(rows, 1)`` row means of ``g*s * xhat`` and (LayerNorm, else
  None) of ``g*s``, one XLA reduction over the rows."""
  n_cols = x.shape[1]
  x, g = x.astype(F32), g.astype(F32)
  xhat = (x - mean) * rstd if mean is not None else x * rstd
  gs = g * scale.astype(F32) if scale is not None else g
  c1 = jnp.sum(gs * xhat, axis=1, keepdims=True) * (1.0 / n_cols)
  c2 = jnp.sum(gs, axis=1, keepdims=True) * (1.0 / n_cols) if mean is not None else None
  return c1, c2


def backward(x, g, sum_grad, scale, mean, rstd, *, has_bias: bool, interpret: bool = False,
             tile: Tiling | None = None, max_programs: int = MAX_BACKWARD_PROGRAMS,
             name: str | None = None):
  """Gradients of a row normalization, recomputing the normalized rows from ``x``: one kernel,
  after an XLA reduction of the row sums the input gradient needs when a row spans several
  column chunks.

  Args:
    x: ``(rows, H)``, the rows that were normalized (``x + residual`` for the add variants).
    g: the gradient of the normalized output, ``(rows, H)``.
    sum_grad: the gradient of the ``x + residual`` output, added to the input gradient; or None.
    scale: ``(H,)`` or None.
    mean: float32 ``(rows, 1)`` for LayerNorm, None for RMSNorm.
    rstd: float32 ``(rows, 1)``.
    has_bias: also return the bias gradient.
    interpret: Pallas interpret mode (CPU tests).
    tile, max_programs: override the tiling and the number of programs (tests).
    name: the kernel's name.

  Returns:
    ``(dx, dscale, dbias)``: dx in x's dtype; float32 ``(H,)`` parameter gradients (None where
    there is no such parameter), summed over the per-program partials.
  """
  n_rows, n_cols = x.shape
  _check_hidden(n_cols)
  t = tile or tiling(n_rows, n_cols)
  centered = mean is not None
  has_scale = scale is not None
  has_sum_grad = sum_grad is not None
  n_tiles = pl.cdiv(n_rows, t.rows)
  tiles_per_program = pl.cdiv(n_tiles, min(n_tiles, max_programs))
  n_programs = pl.cdiv(n_tiles, tiles_per_program)

  inputs = [x, g] + ([sum_grad] if has_sum_grad else [])
  if has_scale:
    inputs.append(scale.reshape(1, n_cols))
  inputs += [mean, rstd] if centered else [rstd]
  if t.chunks > 1:
    c1, c2 = _row_sums(x, g, scale, mean, rstd)
    inputs += [c1, c2] if centered else [c1]
  partial = jax.ShapeDtypeStruct((n_programs, n_cols), F32)
  out_shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype)]
  out_shapes += [partial] * (int(has_scale) + int(has_bias))
  kind = "layer_norm" if centered else "rms_norm"
  default_name = ("add_" if has_sum_grad else "") + kind + "_bwd"
  kernel = _bind(_backward_kernel, n_rows=n_rows, n_cols=n_cols, t=t,
                 tiles_per_program=tiles_per_program, centered=centered,
                 has_sum_grad=has_sum_grad, has_scale=has_scale, has_bias=has_bias)
  outs = common.pallas_call(
      kernel,
      out_shape=out_shapes,
      grid=(n_programs, t.chunks),
      interpret=interpret,
      compiler_params=common.triton_params(num_warps=t.num_warps),
      cost_estimate=common.cost(inputs, out_shapes, flops=(10 if centered else 8) * x.size,
                                transcendentals=0),
      name=name or default_name,
  )(*inputs)
  outs = list(outs)
  dx = outs.pop(0)
  dscale = jnp.sum(outs.pop(0), axis=0) if has_scale else None
  dbias = jnp.sum(outs.pop(0), axis=0) if has_bias else None
  return dx, dscale, dbias


def _bind(kernel, **params):
  def bound(*refs):
    return kernel(*refs, **params)
  bound.__name__ = kernel.__name__
  return bound

