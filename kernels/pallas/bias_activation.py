"""``act(x + bias)`` over a ``rows x n`` array with a bias of ``n``, forward and backward kernels.

The forward reads ``x`` and the bias and writes the result. The backward reads ``x``, the bias and
the output gradient, recomputes ``x + bias`` and writes ``dx = g * act'(x + bias)``; the same
kernel reduces ``dx`` over its rows into float32 partial sums for the bias gradient, one row of
partials per row group (GPU programs run in parallel, so they cannot add into one buffer). The
caller sums the few partial rows.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from .. import activations
from . import common, tiles

# Backward: aim for about this many programs on a GPU (row groups x column blocks).
GPU_PROGRAMS = 1024


def _forward_kernel(x_ref, b_ref, y_ref, *, fn, rows, n, block_rows, block_cols):
  ok = tiles.tile_mask(block_rows, block_cols, rows, n)
  col_ok = common.tail_mask(0, block_cols, n, grid_axis=1)
  cd = common.compute_dtype(x_ref.dtype)
  x = pl_triton.load(x_ref, mask=ok, other=0).astype(cd)
  b = pl_triton.load(b_ref, mask=col_ok, other=0).astype(cd)
  pl_triton.store(y_ref, fn(x + b[None, :]).astype(y_ref.dtype), mask=ok)


def bias_act_forward(x: jax.Array, bias: jax.Array, activation: str | Callable, *,
                     interpret: bool = False, block_rows: int | None = None,
                     block_cols: int | None = None) -> jax.Array:
  """``activation(x + bias)`` for a 2-D ``x`` and a 1-D ``bias`` of ``x.shape[1]``."""
  fn = activations.get(activation)
  rows, n = x.shape
  if rows == 0 or n == 0:
    return jnp.zeros_like(x)
  br, bc = tiles.plan(rows, n, interpret=interpret, block_rows=block_rows, block_cols=block_cols)
  grid = tiles.grid(rows, n, br, bc)
  out = jax.ShapeDtypeStruct(x.shape, x.dtype)
  kernel = functools.partial(_forward_kernel, fn=fn, rows=rows, n=n, block_rows=br,
                             block_cols=bc)
  return common.pallas_call(
      kernel,
      out_shape=out,
      grid=grid,
      in_specs=[pl.BlockSpec((br, bc), lambda i, j: (i, j)),
                pl.BlockSpec((bc,), lambda i, j: (j,))],
      out_specs=pl.BlockSpec((br, bc), lambda i, j: (i, j)),
      interpret=interpret,
      compiler_params=common.triton_params(num_warps=tiles.num_warps(br, bc)),
      cost_estimate=common.cost([x, bias], out, fun=lambda x, b: fn(x + b)),
      name="bias_act_fwd",
  )(x, bias)


def _backward_kernel(x_ref, b_ref, g_ref, dx_ref, db_ref, *, fn, rows, n, block_rows,
                     block_cols, steps):
  cd = common.compute_dtype(x_ref.dtype)
  col_start = pl.program_id(1) * block_cols
  group_start = pl.program_id(0) * block_rows * steps
  col_ok = common.tail_mask(0, block_cols, n, grid_axis=1)
  b = pl_triton.load(b_ref, mask=col_ok, other=0).astype(cd)

  def step(k, acc):
    ok = tiles.inside(group_start + k * block_rows, col_start, block_rows, block_cols, rows, n)
    sub = (pl.ds(k * block_rows, block_rows), slice(None))
    x = pl_triton.load(x_ref.at[sub], mask=ok, other=0).astype(cd)
    g = pl_triton.load(g_ref.at[sub], mask=ok, other=0).astype(cd)
    dz = tiles.vjp(fn, x + b[None, :], g)
    pl_triton.store(dx_ref.at[sub], dz.astype(dx_ref.dtype), mask=ok)
    return acc + jnp.sum(jnp.where(ok, dz, 0.0).astype(jnp.float32), axis=0)

  acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((block_cols,), jnp.float32))
  pl_triton.store(db_ref, acc, mask=col_ok)


def backward_plan(rows: int, n: int, *, interpret: bool, block_rows: int | None = None,
                  block_cols: int | None = None, steps: int | None = None):
  """``(block_rows, block_cols, steps, groups)``: each program walks ``steps`` row blocks."""
  br, bc = tiles.plan(rows, n, interpret=interpret, block_rows=block_rows, block_cols=block_cols)
  row_blocks, col_blocks = tiles.grid(rows, n, br, bc)
  if steps is None:
    target_groups = max(1, GPU_PROGRAMS // col_blocks) if not interpret else 1
    steps = common.next_power_of_2(pl.cdiv(row_blocks, target_groups))
  groups = pl.cdiv(rows, br * steps)
  return br, bc, steps, groups


def bias_act_backward(x: jax.Array, bias: jax.Array, g: jax.Array,
                      activation: str | Callable, *,
                      interpret: bool = False, block_rows: int | None = None,
                      block_cols: int | None = None,
                      steps: int | None = None) -> tuple[jax.Array, jax.Array]:
  """``(dx, dbias)`` of ``activation(x + bias)`` for the output gradient ``g``; ``x + bias`` is
  recomputed, and ``dbias`` is the float32 sum of the kernel's per-row-group partials."""
  fn = activations.get(activation)
  rows, n = x.shape
  if rows == 0 or n == 0:
    return jnp.zeros_like(x), jnp.zeros_like(bias)
  br, bc, steps, groups = backward_plan(rows, n, interpret=interpret, block_rows=block_rows,
                                        block_cols=block_cols, steps=steps)
  col_blocks = pl.cdiv(n, bc)
  out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype),
               jax.ShapeDtypeStruct((groups, n), jnp.float32)]
  kernel = functools.partial(_backward_kernel, fn=fn, rows=rows, n=n, block_rows=br,
                             block_cols=bc, steps=steps)
  group_spec = pl.BlockSpec((br * steps, bc), lambda i, j: (i, j))
  dx, partials = common.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=(groups, col_blocks),
      in_specs=[group_spec, pl.BlockSpec((bc,), lambda i, j: (j,)), group_spec],
      out_specs=[group_spec, pl.BlockSpec((None, bc), lambda i, j: (i, j))],
      interpret=interpret,
      compiler_params=common.triton_params(num_warps=tiles.num_warps(br, bc)),
      cost_estimate=common.cost([x, bias, g], out_shape,
                                fun=lambda x, b, g: tiles.vjp(fn, x + b, g)),
      name="bias_act_bwd",
  )(x, bias, g)
  return dx, jnp.sum(partials, axis=0).astype(bias.dtype)
