"""Grouped matmul kernels for Mixture-of-Experts: ``out[rows of e] = lhs[rows of e] @ rhs[e]``.

``lhs`` ``[M, K]`` has its rows sorted by group; ``group_sizes`` ``[G]`` says how many rows
each group has, ``rhs`` ``[G, K, N]`` holds one matrix per group.

The forward (and the ``lhs`` gradient, the same kernel reading ``rhs`` as ``[G, N, K]``) walks
*visits*: a row tile that lies inside one group is visited once; a row tile that straddles
groups is visited once per group it holds, each visit multiplying only that group's rows (the
others masked on load and on store); an empty group has no visit. The list of visits is
computed on the device from ``group_sizes`` (:func:`group_metadata`), as MaxText's megablox
``gmm`` does, and the grid is ``(visits, N tiles)`` with the K loop inside each program. One
more pseudo-group covers the rows past ``sum(group_sizes)``, whose visits write zeros. The grid
has the static upper bound ``row tiles + G`` of visits; the unused ones run no K step and store
nothing.

The weight gradient (:func:`tgmm`, ``d rhs[e] = lhs_e^T @ g_e``) is a grid of
``(G, K tiles, N tiles)``: each program sums the products of its group's row chunks (from the
group's first row, however it is aligned), zero for an empty group.

Every product accumulates in float32 (float32 inputs multiply in full precision) and is rounded
once; M, K, N and the group boundaries need not be multiples of any tile.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from . import common

# Tile sizes (rows, contraction, columns): powers of 2, >= 16 for Triton's dot. Interpret mode
# uses small tiles so that the CPU tests cross tiles and group boundaries at small shapes.
GPU_BLOCKS = (64, 32, 64)
INTERPRET_BLOCKS = (16, 16, 16)


def _fit(blocks, interpret, *sizes):
  default = INTERPRET_BLOCKS if interpret else GPU_BLOCKS
  return tuple(max(16, common.block_for(n, b)) for n, b in zip(sizes, blocks or default))


def _precision(dtype):
  return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def group_bounds(group_sizes: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
  """``(starts, ends)`` int32 ``[G]``: each group's rows, clipped to ``[0, rows]`` (sizes that
  are negative count as empty, sizes past the rows are cut at the last row)."""
  sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  ends = jnp.minimum(jnp.cumsum(sizes), rows)
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  return starts, ends


def max_visits(rows: int, groups: int, block_rows: int) -> int:
  """The static bound on visits: each row tile once, plus one more for each boundary between
  consecutive groups (the pseudo-group of rows past the sum included)."""
  return pl.cdiv(rows, block_rows) + groups


def group_metadata(group_sizes: jax.Array, rows: int, block_rows: int) -> jax.Array:
  """The visits of the grouped forward, as an int32 ``[5, V]`` array (``V`` =
  :func:`max_visits`), one column per visit:

  0. the row tile it multiplies;
  1. the group whose ``rhs`` it reads (clipped to ``G - 1`` for the pseudo-group);
  2. the first row it writes;
  3. the end of the rows it writes (rows of the tile outside ``[first, end)`` are untouched);
  4. the end of the rows it reads (``first`` for the pseudo-group of rows past the sum, whose
     visits write zeros; ``first`` for unused visits, which write nothing).

  Visits run group by group, each group's tiles in order; an empty group has none.

  Example:
    >>> import jax.numpy as jnp
    >>> meta = group_metadata(jnp.array([3, 0, 10], jnp.int32), rows=16, block_rows=8)
    >>> meta[:, :4].tolist()   # group 0 in tile 0, group 2 in tiles 0 and 1, the rest in 1
    [[0, 0, 1, 1], [0, 2, 2, 2], [0, 3, 3, 13], [3, 13, 13, 16], [3, 13, 13, 13]]
  """
  groups = group_sizes.shape[0]
  starts, ends = group_bounds(group_sizes, rows)
  total = ends[-1] if groups else jnp.int32(0)
  # The pseudo-group G: the rows past the sum.
  starts = jnp.concatenate([starts, total[None]])
  ends = jnp.concatenate([ends, jnp.full((1,), rows, jnp.int32)])
  first_tile = starts // block_rows
  tiles = jnp.where(ends > starts, (ends - 1) // block_rows - first_tile + 1, 0)
  after = jnp.cumsum(tiles)
  visits = max_visits(rows, groups, block_rows)
  v = jnp.arange(visits, dtype=jnp.int32)
  # The group of visit v: how many groups' visits all come before it.
  group = jnp.sum(after[None, :] <= v[:, None], axis=1).astype(jnp.int32)
  used = group <= groups
  g = jnp.minimum(group, groups)
  tile = first_tile[g] + v - (after[g] - tiles[g])
  lo = jnp.where(used, starts[g], 0)
  hi = jnp.where(used, ends[g], 0)
  read_hi = jnp.where(group < groups, hi, lo)
  tile = jnp.where(used, tile, 0)
  return jnp.stack([tile, jnp.minimum(g, groups - 1), lo, hi, read_hi]).astype(jnp.int32)


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, transpose_rhs: bool = False,
        out_dtype=None, interpret: bool = False, blocks: tuple[int, int, int] | None = None,
        name: str = "grouped_matmul", num_warps: int = 4) -> jax.Array:
  """``out[rows of e] = lhs[rows of e] @ rhs[e]`` (``rhs[e]^T`` with ``transpose_rhs``), zeros
  past the groups.

  Args:
    lhs: ``[M, K]``, rows sorted by group.
    rhs: ``[G, K, N]``, or ``[G, N, K]`` with ``transpose_rhs``.
    group_sizes: ``[G]`` integers.
    out_dtype: the result's dtype (default: lhs's).
    interpret: Pallas interpret mode (CPU tests).
    blocks: ``(rows, contraction, columns)`` tiles, powers of 2 (default by mode).
    name: the kernel's name in profiles and lowered HLO.
  """
  rows, size_k = lhs.shape
  groups = rhs.shape[0]
  size_n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  out_dtype = jnp.dtype(out_dtype or lhs.dtype)
  if 0 in (rows, size_k, size_n, groups):
    return jnp.zeros((rows, size_n), out_dtype)
  bm, bk, bn = _fit(blocks, interpret, rows, size_k, size_n)
  n_k = pl.cdiv(size_k, bk)
  meta = group_metadata(group_sizes, rows, bm)
  precision = _precision(lhs.dtype)

  def kernel(meta_ref, lhs_ref, rhs_ref, out_ref):
    v, j = pl.program_id(0), pl.program_id(1)
    tile, group, lo, hi, read_hi = (meta_ref[i, v] for i in range(5))
    row0, col0 = tile * bm, j * bn
    row = row0 + jax.lax.broadcasted_iota(jnp.int32, (bm,), 0)
    read = (row >= lo) & (row < read_hi) & (row < rows)
    write = (row >= lo) & (row < hi) & (row < rows)
    cols = col0 + jax.lax.broadcasted_iota(jnp.int32, (bn,), 0) < size_n

    def body(step, acc):
      k0 = step * bk
      k_ok = k0 + jax.lax.broadcasted_iota(jnp.int32, (bk,), 0) < size_k
      a = pl_triton.load(lhs_ref.at[pl.ds(row0, bm), pl.ds(k0, bk)],
                         mask=read[:, None] & k_ok[None, :], other=0)
      if transpose_rhs:
        b = pl_triton.load(rhs_ref.at[group, pl.ds(col0, bn), pl.ds(k0, bk)],
                           mask=cols[:, None] & k_ok[None, :], other=0)
        dims = (((1,), (1,)), ((), ()))
      else:
        b = pl_triton.load(rhs_ref.at[group, pl.ds(k0, bk), pl.ds(col0, bn)],
                           mask=k_ok[:, None] & cols[None, :], other=0)
        dims = (((1,), (0,)), ((), ()))
      return acc + jax.lax.dot_general(a, b, dims, precision=precision,
                                       preferred_element_type=jnp.float32)

    # Visits of the pseudo-group (rows past the sum) and unused visits run no K step.
    # (int32 bounds both: a weakly typed one lowers to an index of another width.)
    steps = jnp.where(read_hi > lo, jnp.int32(n_k), jnp.int32(0))
    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((bm, bn), jnp.float32))
    pl_triton.store(out_ref.at[pl.ds(row0, bm), pl.ds(col0, bn)], acc.astype(out_ref.dtype),
                    mask=write[:, None] & cols[None, :])

  grid = (meta.shape[1], pl.cdiv(size_n, bn))
  whole = lambda shape: pl.BlockSpec(shape, lambda v, j: (0,) * len(shape))
  out_shape = jax.ShapeDtypeStruct((rows, size_n), out_dtype)
  return common.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=grid,
      in_specs=[whole(meta.shape), whole(lhs.shape), whole(rhs.shape)],
      out_specs=whole(out_shape.shape),
      interpret=interpret,
      compiler_params=common.triton_params(num_warps=num_warps),
      cost_estimate=common.cost([lhs, rhs], out_shape, flops=2 * rows * size_k * size_n,
                                transcendentals=0),
      name=name,
  )(meta, lhs, rhs)


def tgmm(lhs: jax.Array, g: jax.Array, group_sizes: jax.Array, *, out_dtype=None,
         interpret: bool = False, blocks: tuple[int, int, int] | None = None,
         name: str = "grouped_matmul_t", num_warps: int = 4) -> jax.Array:
  """``out[e] = lhs[rows of e]^T @ g[rows of e]`` (``[G, K, N]``): the transposed grouped
  product (a weight gradient); zero for an empty group.

  Args:
    lhs: ``[M, K]``, rows sorted by group.
    g: ``[M, N]``.
    group_sizes: ``[G]`` integers.
    out_dtype: the result's dtype (default: lhs's).
    interpret: Pallas interpret mode (CPU tests).
    blocks: ``(rows, K, N)`` tiles, powers of 2 (default by mode).
    name: the kernel's name in profiles and lowered HLO.
  """
  rows, size_k = lhs.shape
  size_n = g.shape[1]
  groups = group_sizes.shape[0]
  out_dtype = jnp.dtype(out_dtype or lhs.dtype)
  if 0 in (rows, size_k, size_n, groups):
    return jnp.zeros((groups, size_k, size_n), out_dtype)
  bm, bk, bn = _fit(blocks, interpret, rows, size_k, size_n)
  starts, ends = group_bounds(group_sizes, rows)
  bounds = jnp.stack([starts, ends])
  precision = _precision(lhs.dtype)

  def kernel(bounds_ref, lhs_ref, g_ref, out_ref):
    e, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lo, hi = bounds_ref[0, e], bounds_ref[1, e]
    k0, col0 = i * bk, j * bn
    k_ok = k0 + jax.lax.broadcasted_iota(jnp.int32, (bk,), 0) < size_k
    cols = col0 + jax.lax.broadcasted_iota(jnp.int32, (bn,), 0) < size_n

    def body(step, acc):
      row0 = lo + step * bm
      read = row0 + jax.lax.broadcasted_iota(jnp.int32, (bm,), 0) < hi
      a = pl_triton.load(lhs_ref.at[pl.ds(row0, bm), pl.ds(k0, bk)],
                         mask=read[:, None] & k_ok[None, :], other=0)
      b = pl_triton.load(g_ref.at[pl.ds(row0, bm), pl.ds(col0, bn)],
                         mask=read[:, None] & cols[None, :], other=0)
      return acc + jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=precision,
                                       preferred_element_type=jnp.float32)

    # Clipped to the row chunks there are (a bound read from memory is otherwise unbounded).
    steps = jnp.clip((hi - lo + bm - 1) // bm, 0, pl.cdiv(rows, bm))
    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((bk, bn), jnp.float32))
    pl_triton.store(out_ref.at[e, pl.ds(k0, bk), pl.ds(col0, bn)], acc.astype(out_ref.dtype),
                    mask=k_ok[:, None] & cols[None, :])

  grid = (groups, pl.cdiv(size_k, bk), pl.cdiv(size_n, bn))
  whole = lambda shape: pl.BlockSpec(shape, lambda e, i, j: (0,) * len(shape))
  out_shape = jax.ShapeDtypeStruct((groups, size_k, size_n), out_dtype)
  return common.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=grid,
      in_specs=[whole(bounds.shape), whole(lhs.shape), whole(g.shape)],
      out_specs=whole(out_shape.shape),
      interpret=interpret,
      compiler_params=common.triton_params(num_warps=num_warps),
      cost_estimate=common.cost([lhs, g], out_shape, flops=2 * rows * size_k * size_n,
                                transcendentals=0),
      name=name,
  )(bounds, lhs, g)


def grouped_matmul_forward(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                           interpret: bool = False) -> jax.Array:
  """``[M, N]``: each group's rows of ``lhs`` times its ``rhs[e]``, zeros past the groups."""
  return gmm(lhs, rhs, group_sizes, interpret=interpret, name="grouped_matmul_fwd")


def grouped_matmul_backward(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                            g: jax.Array, *, interpret: bool = False):
  """``(d lhs, d rhs)`` of :func:`grouped_matmul_forward` for the output gradient ``g``: the
  grouped kernel on ``g`` and ``rhs`` read transposed, and :func:`tgmm`."""
  dlhs = gmm(g, rhs, group_sizes, transpose_rhs=True, out_dtype=lhs.dtype, interpret=interpret,
             name="grouped_matmul_dlhs")
  drhs = tgmm(lhs, g, group_sizes, out_dtype=rhs.dtype, interpret=interpret,
              name="grouped_matmul_drhs")
  return dlhs, drhs
