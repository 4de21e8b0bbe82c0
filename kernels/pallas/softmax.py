"""Row softmax kernels: ``y = softmax(scale * x)`` over the last axis of a 2-D array, and its VJP.

Each program owns ``block_rows`` rows and walks their columns in power-of-2 chunks. A row that
fits in one chunk is read once and written once (one pass, with a stable max). A longer row is read
twice: once for its running max and sum (the online-softmax update), once to write the result.

The backward, ``dx = scale * y * (g - sum(g * y))``, needs only the output ``y``: it is the one
residual. Masked-out entries (``mask == 0``) and columns past the end count as ``-inf``; a row
with no kept entry comes out as zeros (see ``FLOOR``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from . import common

# Columns one program holds at once (on GPUs): rows up to this long are read once.
GPU_MAX_CHUNK = 16384
# Elements of one program's tile: short rows are packed several to a program.
GPU_TILE = 4096
INTERPRET_TILE = 1 << 16
MAX_BLOCK_ROWS = 32
INTERPRET_MAX_BLOCK_ROWS = 1024


def plan(rows: int, n: int, *, interpret: bool, max_chunk: int | None = None,
         block_rows: int | None = None) -> tuple[int, int, int]:
  """``(block_rows, chunk, n_chunks)`` for a ``rows x n`` array."""
  chunk = common.block_for(n, max_chunk or GPU_MAX_CHUNK)
  n_chunks = pl.cdiv(n, chunk)
  if block_rows is None:
    tile = INTERPRET_TILE if interpret else GPU_TILE
    cap = INTERPRET_MAX_BLOCK_ROWS if interpret else MAX_BLOCK_ROWS
    block_rows = common.block_for(rows, max(1, min(cap, tile // chunk)))
  return block_rows, chunk, n_chunks


def _num_warps(block_rows: int, chunk: int) -> int:
  return max(1, min(16, block_rows * chunk // 512))


def _row_mask(block_rows, chunk, rows):
  return common.tail_mask(0, block_rows, rows, shape=(block_rows, chunk))


def _col_mask(start, block_rows, chunk, n):
  return start + jax.lax.broadcasted_iota(jnp.int32, (block_rows, chunk), 1) < n


# The running max starts here instead of at -inf: a row with no kept entry then gives
# exp(-inf - FLOOR) = 0 everywhere (never inf - inf = NaN), and its sum of 0 is lifted to 1.
FLOOR = float(jnp.finfo(jnp.float32).min)


def _forward_kernel(x_ref, *refs, rows, n, block_rows, chunk, n_chunks, scale, has_mask):
  mask_ref = refs[0] if has_mask else None
  y_ref = refs[-1]
  row_ok = _row_mask(block_rows, chunk, rows)

  def logits(start):
    ok = row_ok & _col_mask(start, block_rows, chunk, n)
    cols = pl.ds(start, chunk)
    z = pl_triton.load(x_ref.at[:, cols], mask=ok, other=0).astype(jnp.float32)
    if scale != 1.0:
      z = z * scale
    if has_mask:
      ok = ok & (pl_triton.load(mask_ref.at[:, cols], mask=ok, other=0) != 0)
    return jnp.where(ok, z, -jnp.inf)

  def store(start, m, inv_l):
    ok = row_ok & _col_mask(start, block_rows, chunk, n)
    y = jnp.exp(logits(start) - m[:, None]) * inv_l[:, None]
    pl_triton.store(y_ref.at[:, pl.ds(start, chunk)], y.astype(y_ref.dtype), mask=ok)

  if n_chunks == 1:
    z = logits(0)
    m = jnp.maximum(jnp.max(z, axis=1), FLOOR)
    e = jnp.exp(z - m[:, None])
    inv_l = 1.0 / jnp.maximum(jnp.sum(e, axis=1), 1.0)
    ok = row_ok & _col_mask(0, block_rows, chunk, n)
    pl_triton.store(y_ref.at[:, pl.ds(0, chunk)], (e * inv_l[:, None]).astype(y_ref.dtype),
                    mask=ok)
    return

  def stats(c, carry):
    m, l = carry
    z = logits(c * chunk)
    m_new = jnp.maximum(m, jnp.max(z, axis=1))
    l = l * jnp.exp(m - m_new) + jnp.sum(jnp.exp(z - m_new[:, None]), axis=1)
    return m_new, l

  init = (jnp.full((block_rows,), FLOOR, jnp.float32), jnp.zeros((block_rows,), jnp.float32))
  m, l = jax.lax.fori_loop(0, n_chunks, stats, init)
  inv_l = 1.0 / jnp.maximum(l, 1.0)

  @pl.loop(0, n_chunks)
  def _(c):
    store(c * chunk, m, inv_l)


def _backward_kernel(y_ref, g_ref, dx_ref, *, rows, n, block_rows, chunk, n_chunks, scale):
  row_ok = _row_mask(block_rows, chunk, rows)

  def load(start):
    ok = row_ok & _col_mask(start, block_rows, chunk, n)
    cols = pl.ds(start, chunk)
    y = pl_triton.load(y_ref.at[:, cols], mask=ok, other=0).astype(jnp.float32)
    g = pl_triton.load(g_ref.at[:, cols], mask=ok, other=0).astype(jnp.float32)
    return y, g, ok

  def store(start, y, g, ok, dot):
    dx = (scale * y) * (g - dot[:, None])
    pl_triton.store(dx_ref.at[:, pl.ds(start, chunk)], dx.astype(dx_ref.dtype), mask=ok)

  if n_chunks == 1:
    y, g, ok = load(0)
    store(0, y, g, ok, jnp.sum(y * g, axis=1))
    return

  def accumulate(c, dot):
    y, g, _ = load(c * chunk)
    return dot + jnp.sum(y * g, axis=1)

  dot = jax.lax.fori_loop(0, n_chunks, accumulate, jnp.zeros((block_rows,), jnp.float32))

  @pl.loop(0, n_chunks)
  def _(c):
    y, g, ok = load(c * chunk)
    store(c * chunk, y, g, ok, dot)


def _row_spec(block_rows, n):
  # The block spans whole rows (n need not be a power of 2); the kernels only ever load
  # power-of-2 column chunks of it, masked at the end.
  return pl.BlockSpec((block_rows, n), lambda i: (i, 0))


def softmax_forward(x: jax.Array, mask: jax.Array | None = None, *, scale: float = 1.0,
                    interpret: bool = False, max_chunk: int | None = None,
                    block_rows: int | None = None) -> jax.Array:
  """``softmax(scale * x)`` over the last axis of a 2-D ``x``; ``mask`` (int8/bool) keeps != 0."""
  rows, n = x.shape
  if rows == 0 or n == 0:
    return jnp.zeros_like(x)
  block_rows, chunk, n_chunks = plan(rows, n, interpret=interpret, max_chunk=max_chunk,
                                     block_rows=block_rows)
  inputs = [x] if mask is None else [x, mask.astype(jnp.int8)]
  out = jax.ShapeDtypeStruct(x.shape, x.dtype)
  kernel = functools.partial(_forward_kernel, rows=rows, n=n, block_rows=block_rows,
                             chunk=chunk, n_chunks=n_chunks, scale=float(scale),
                             has_mask=mask is not None)
  return common.pallas_call(
      kernel,
      out_shape=out,
      grid=(pl.cdiv(rows, block_rows),),
      in_specs=[_row_spec(block_rows, n)] * len(inputs),
      out_specs=_row_spec(block_rows, n),
      interpret=interpret,
      compiler_params=common.triton_params(num_warps=_num_warps(block_rows, chunk)),
      cost_estimate=common.cost(inputs, out, flops=5 * x.size, transcendentals=x.size),
      name="softmax_fwd",
  )(*inputs)


def softmax_backward(y: jax.Array, g: jax.Array, *, scale: float = 1.0, interpret: bool = False,
                     max_chunk: int | None = None, block_rows: int | None = None) -> jax.Array:
  """``scale * y * (g - sum(g * y))`` over the last axis of 2-D ``y`` and ``g``."""
  rows, n = y.shape
  if rows == 0 or n == 0:
    return jnp.zeros_like(y)
  block_rows, chunk, n_chunks = plan(rows, n, interpret=interpret, max_chunk=max_chunk,
                                     block_rows=block_rows)
  out = jax.ShapeDtypeStruct(y.shape, y.dtype)
  kernel = functools.partial(_backward_kernel, rows=rows, n=n, block_rows=block_rows,
                             chunk=chunk, n_chunks=n_chunks, scale=float(scale))
  return common.pallas_call(
      kernel,
      out_shape=out,
      grid=(pl.cdiv(rows, block_rows),),
      in_specs=[_row_spec(block_rows, n)] * 2,
      out_specs=_row_spec(block_rows, n),
      interpret=interpret,
      compiler_params=common.triton_params(num_warps=_num_warps(block_rows, chunk)),
      cost_estimate=common.cost([y, g], out, flops=4 * y.size, transcendentals=0),
      name="softmax_bwd",
  )(y, g)
