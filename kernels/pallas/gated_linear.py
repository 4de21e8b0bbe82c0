"""Gated linear units, ``act(a) * b``, forward and backward kernels over ``rows x h`` arrays.

Two layouts:

- separate: ``a`` and ``b`` are two ``rows x h`` arrays;
- packed: one ``rows x 2h`` array ``x`` with ``a = x[:, :h]`` and ``b = x[:, h:]``, viewed as
  ``rows x 2 x h`` (a free reshape), so that each tile reads its ``a`` and ``b`` halves directly and
  the backward writes ``dx`` in the same packed layout.

The forward reads ``a`` and ``b`` and writes ``act(a) * b``; the backward reads ``a``, ``b`` and the
output gradient ``g``, recomputes ``act(a)`` and writes ``da = g * b * act'(a)`` and
``db = g * act(a)``. Nothing else is kept between the passes.
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


def _glu(fn, a, b):
  return fn(a) * b


def _glu_vjp(fn, a, b, g):
  act, act_vjp = jax.vjp(fn, a)
  return act_vjp(g * b)[0], g * act


def _forward_kernel(a_ref, b_ref, y_ref, *, fn, rows, h, block_rows, block_cols):
  ok = tiles.tile_mask(block_rows, block_cols, rows, h)
  cd = common.compute_dtype(a_ref.dtype)
  a = pl_triton.load(a_ref, mask=ok, other=0).astype(cd)
  b = pl_triton.load(b_ref, mask=ok, other=0).astype(cd)
  pl_triton.store(y_ref, _glu(fn, a, b).astype(y_ref.dtype), mask=ok)


def _backward_kernel(a_ref, b_ref, g_ref, *out_refs, fn, rows, h, block_rows, block_cols,
                     packed):
  ok = tiles.tile_mask(block_rows, block_cols, rows, h)
  cd = common.compute_dtype(a_ref.dtype)
  a = pl_triton.load(a_ref, mask=ok, other=0).astype(cd)
  b = pl_triton.load(b_ref, mask=ok, other=0).astype(cd)
  g = pl_triton.load(g_ref, mask=ok, other=0).astype(cd)
  da, db = _glu_vjp(fn, a, b, g)
  if packed:
    (dx_ref,) = out_refs
    for half, d in ((0, da), (1, db)):
      pl_triton.store(dx_ref.at[:, pl.ds(half, 1), :], d.astype(dx_ref.dtype)[:, None, :],
                      mask=ok[:, None, :])
    return
  da_ref, db_ref = out_refs
  pl_triton.store(da_ref, da.astype(da_ref.dtype), mask=ok)
  pl_triton.store(db_ref, db.astype(db_ref.dtype), mask=ok)


def _specs(packed: bool, br: int, bc: int):
  """Block specs of ``a`` and ``b``: two tiles of one packed array, or tiles of two arrays."""
  if packed:
    return [pl.BlockSpec((br, None, bc), lambda i, j: (i, 0, j)),
            pl.BlockSpec((br, None, bc), lambda i, j: (i, 1, j))]
  return [pl.BlockSpec((br, bc), lambda i, j: (i, j))] * 2


def _inputs(a, b):
  """``(a, b, packed, rows, h)`` from two ``rows x h`` arrays, or one ``rows x 2h`` (b=None)."""
  if b is None:
    rows, width = a.shape
    x = a.reshape(rows, 2, width // 2)
    return x, x, True, rows, width // 2
  rows, h = a.shape
  return a, b, False, rows, h


def glu_forward(a: jax.Array, b: jax.Array | None, activation: str | Callable, *,
                interpret: bool = False, block_rows: int | None = None,
                block_cols: int | None = None) -> jax.Array:
  """``activation(a) * b`` for 2-D ``a`` and ``b``; with ``b=None``, ``a`` is packed
  ``[a | b]``."""
  fn = activations.get(activation)
  a_in, b_in, packed, rows, h = _inputs(a, b)
  if rows == 0 or h == 0:
    return jnp.zeros((rows, h), a.dtype)
  br, bc = tiles.plan(rows, h, interpret=interpret, block_rows=block_rows, block_cols=block_cols)
  out = jax.ShapeDtypeStruct((rows, h), a.dtype)
  kernel = functools.partial(_forward_kernel, fn=fn, rows=rows, h=h, block_rows=br,
                             block_cols=bc)
  return common.pallas_call(
      kernel,
      out_shape=out,
      grid=tiles.grid(rows, h, br, bc),
      in_specs=_specs(packed, br, bc),
      out_specs=pl.BlockSpec((br, bc), lambda i, j: (i, j)),
      interpret=interpret,
      compiler_params=common.triton_params(num_warps=tiles.num_warps(br, bc)),
      cost_estimate=common.cost([a_in, b_in], out, fun=functools.partial(_glu, fn),
                                args=[out, out]),
      name="glu_fwd",
  )(a_in, b_in)


def glu_backward(a: jax.Array, b: jax.Array | None, g: jax.Array,
                 activation: str | Callable, *,
                 interpret: bool = False, block_rows: int | None = None,
                 block_cols: int | None = None):
  """``(da, db)`` of ``activation(a) * b`` for the output gradient ``g`` (``dx``,
  packed, if b=None)."""
  fn = activations.get(activation)
  a_in, b_in, packed, rows, h = _inputs(a, b)
  if rows == 0 or h == 0:
    return jnp.zeros_like(a) if packed else (jnp.zeros_like(a), jnp.zeros_like(b))
  br, bc = tiles.plan(rows, h, interpret=interpret, block_rows=block_rows, block_cols=block_cols)
  tile = pl.BlockSpec((br, bc), lambda i, j: (i, j))
  if packed:
    out_shape = [jax.ShapeDtypeStruct((rows, 2, h), a.dtype)]
    out_specs = [pl.BlockSpec((br, 2, bc), lambda i, j: (i, 0, j))]
  else:
    out_shape = [jax.ShapeDtypeStruct((rows, h), a.dtype)] * 2
    out_specs = [tile, tile]
  kernel = functools.partial(_backward_kernel, fn=fn, rows=rows, h=h, block_rows=br,
                             block_cols=bc, packed=packed)
  outs = common.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=tiles.grid(rows, h, br, bc),
      in_specs=[*_specs(packed, br, bc), tile],
      out_specs=out_specs,
      interpret=interpret,
      compiler_params=common.triton_params(num_warps=tiles.num_warps(br, bc)),
      cost_estimate=common.cost([a_in, b_in, g], out_shape, fun=functools.partial(_glu_vjp, fn),
                                args=[g, g, g]),
      name="glu_bwd",
  )(a_in, b_in, g)
  if packed:
    return outs[0].reshape(rows, 2 * h)
  return tuple(outs)
