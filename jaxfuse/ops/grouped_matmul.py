"""Grouped matmul for Mixture-of-Experts: each group of rows times its own weight matrix.

``grouped_matmul(lhs, rhs, group_sizes)`` multiplies ``lhs`` ``[M, K]``, whose rows are sorted by
group (expert), by one matrix of ``rhs`` ``[G, K, N]`` per group: rows
``offsets[g] : offsets[g] + group_sizes[g]`` (``offsets`` the exclusive cumulative sum of
``group_sizes``) are multiplied by ``rhs[g]``. Rows past ``sum(group_sizes)`` belong to no group
and come out as zeros, as in :func:`jax.lax.ragged_dot`.

The backward keeps the inputs only (no residual is computed, so none is named in
:mod:`jaxfuse.ops.names`) and computes

- ``d lhs = grouped_matmul(g, rhs transposed per group)``: the same grouped product, reading
  ``rhs`` as ``[G, N, K]`` in place;
- ``d rhs[e] = lhs_e^T @ g_e``: a transposed grouped product, one ``[K, N]`` sum per group over
  that group's rows (zero for an empty group).

Every product accumulates in float32 and is rounded once, to the inputs' dtype.

On CPUs the XLA implementation runs its three products as loops over row tiles
(:func:`_tiled_product`, :func:`_tiled_rows_product`): XLA:CPU lowers a ragged product as one
dense product over a copy of the rows expanded to every group (``[M, G * K] @ [G * K, N]``),
``G`` times the multiply-adds of the grouped product. Elsewhere (GPUs, TPUs) XLA's ragged
products run as they are. Both compute the same values, up to float rounding.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse.kernels.pallas import grouped_matmul as pallas_gmm
from jaxfuse.ops import base, checks, dispatch, partitioning

# A matmul: XLA (cuBLAS' grouped GEMM on GPUs) first; the Pallas and Triton kernels are there
# for fusion work and measurement.
GROUPED_MATMUL = base.Op("grouped_matmul", "grouped_matmul", base.MATMUL_GPU_ORDER)

# d lhs: lhs [M, N] (the cotangent) ragged over its rows, contracted with rhs [G, K, N] over N.
_LHS_GRAD_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])
# d rhs: lhs [M, K] and the cotangent [M, N] contracted over their rows, ragged: [G, K, N].
_RHS_GRAD_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[])


def _precision(dtype, precision):
  # Full float32 products unless asked otherwise, as torch (XLA on GPUs would use TF32).
  if precision is None and jnp.dtype(dtype) == jnp.float32:
    return jax.lax.Precision.HIGHEST
  return precision


def _out_sharding(lhs=None, rhs=None):
  """The out_sharding a ragged product must be given on Explicit mesh axes, where JAX infers
  none: ``lhs @ rhs[e]``'s from the operands' types when given, else a replicated result when
  a mesh with Explicit (not manual) axes is in context (the backward's products, which run on
  each device's shards); None elsewhere."""
  typed = None if lhs is None else partitioning.typed_product_sharding(lhs, rhs, 2)
  if typed is not None:
    return typed
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty and set(mesh.explicit_axes) - set(mesh.manual_axes):
    return jax.sharding.PartitionSpec()
  return None


# Reference --------------------------------------------------------------------------------------


def grouped_matmul_reference(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                             precision=None) -> jax.Array:
  """Plain-jnp grouped matmul (:func:`jax.lax.ragged_dot`), accumulated in float32 and rounded
  to lhs's dtype."""
  out = jax.lax.ragged_dot(lhs, rhs, jnp.asarray(group_sizes, jnp.int32),
                           precision=_precision(lhs.dtype, precision),
                           preferred_element_type=jnp.float32,
                           out_sharding=_out_sharding(lhs, rhs))
  return out.astype(lhs.dtype)


# Checks -----------------------------------------------------------------------------------------


def _concrete(x):
  """``x`` as a numpy array when its value is known while tracing, else None."""
  try:
    return np.asarray(x)
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
    return None


def _check(op, lhs, rhs, group_sizes):
  checks.floating(op, "lhs", lhs)
  checks.floating(op, "rhs", rhs)
  checks.rank(op, "lhs", lhs, 2)
  checks.rank(op, "rhs", rhs, 3)
  checks.dim(op, "rhs", rhs, 1, lhs.shape[1], "rhs is [groups, K, N]: lhs is [M, K]")
  checks.same_dtype(op, ("lhs", "rhs"), (lhs, rhs))
  _check_sizes(op, lhs, rhs.shape[0], group_sizes)


def _check_sizes(op, lhs, groups, group_sizes, weights="rhs"):
  """The checks of ``group_sizes`` (``[groups]`` integers, non-negative, summing to at most
  the rows of ``lhs``; the values when they are known while tracing)."""
  dtype = getattr(group_sizes, "dtype", None)
  if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
    got = jnp.dtype(dtype).name if dtype is not None else type(group_sizes).__name__
    raise TypeError(f"{op}: group_sizes must be an integer array (int32), got {got}")
  checks.rank(op, "group_sizes", group_sizes, 1)
  checks.dim(op, "group_sizes", group_sizes, 0, groups, f"one size per group of {weights}")
  sizes = _concrete(group_sizes)
  if sizes is None:
    return
  if (sizes < 0).any():
    raise ValueError(f"{op}: group_sizes must be non-negative, got {sizes.tolist()}")
  if int(sizes.astype(np.int64).sum()) > lhs.shape[0]:
    raise ValueError(f"{op}: group_sizes must sum to at most lhs.shape[0] = {lhs.shape[0]} "
                     f"(the rows), got sum {int(sizes.sum())}: {sizes.tolist()}")


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig(base.Config):
  precision: object = None


# The op -----------------------------------------------------------------------------------------


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                   implementation: str | None = None, precision=None) -> jax.Array:
  """Grouped matmul: rows of ``lhs`` sorted by group, each group times its own ``rhs[g]``.

  The forward keeps only its inputs for the backward pass, which computes
  ``d lhs = grouped_matmul(g, rhs^T)`` and ``d rhs[e] = lhs_e^T @ g_e`` (see the module
  docstring); no computed value is kept, so the op tags no residual name.

  Args:
    lhs: ``[M, K]``, rows sorted by group.
    rhs: ``[G, K, N]``, one matrix per group (expert), lhs's dtype.
    group_sizes: ``[G]`` integers (int32), non-negative, summing to at most ``M``; rows past
      the sum give zeros (as :func:`jax.lax.ragged_dot`). Checked when its value is known
      while tracing.
    implementation: ``None``, ``"xla"`` (:func:`jax.lax.ragged_dot`), ``"pallas"`` or
      ``"triton"`` (tiled kernels that visit each row tile once per group it holds).
    precision: the XLA products' precision (``None``: HIGHEST for float32, as torch; the
      default for bfloat16 and float16). The kernels always multiply in full precision.

  Returns:
    ``[M, N]`` in lhs's dtype, accumulated in float32.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxfuse.ops import grouped_matmul
    >>> lhs = jnp.ones((5, 2))
    >>> rhs = jnp.stack([jnp.eye(2), 2 * jnp.eye(2), 3 * jnp.eye(2)])
    >>> grouped_matmul(lhs, rhs, jnp.array([2, 0, 2], jnp.int32))   # the last row: no group
    Array([[1., 1.],
           [1., 1.],
           [3., 3.],
           [3., 3.],
           [0., 0.]], dtype=float32)
    >>> grads = jax.grad(lambda w: grouped_matmul(lhs, w, jnp.array([2, 0, 2])).sum())(rhs)
    >>> grads[:, 0, 0]
    Array([2., 0., 2.], dtype=float32)
  """
  op = GROUPED_MATMUL.name
  lhs, rhs = checks.as_array(lhs), checks.as_array(rhs)
  if not hasattr(group_sizes, "dtype"):
    group_sizes = np.asarray(group_sizes)
  _check(op, lhs, rhs, group_sizes)
  cfg = GROUPED_MATMUL.config(implementation, GroupedMatmulConfig, precision=precision)
  with jax.named_scope("jaxfuse.grouped_matmul"):
    return _grouped_matmul(cfg, lhs, rhs, jnp.asarray(group_sizes, jnp.int32))


# Forward and backward ---------------------------------------------------------------------------


# The rows of one product of the CPU loops. In float32 on 2 cores, 8 uneven experts, forward and
# both gradients: at 8192 rows, 1024 -> 2816, tiles of 64, 128 and 256 rows all ran within the
# noise of one dense product of the same size (ragged_dot: about 8 times it). A group's last
# tile is cut to the multiple of _CPU_TAIL_ROWS that covers its rows: with whole tiles only, 8
# experts of about 256 rows each computed 2560 rows for 2048 (25% more); with tails of 32 rows,
# 2112; of 16, 2080. At 2048 rows, 256 -> 704 (the moe suite's --quick block), the experts'
# whole MLP step took 58 ms with tiles of 256 and tails of 16 against 64 ms with 128 and 32
# (one process, interleaved); 512 and 16 gave 57 ms for twice the compile time (6.7 s against
# 3.3, 1.5 with 128 and 32: one switch branch per tail size).
_CPU_TILE_ROWS = 256
_CPU_TAIL_ROWS = 16


def _tiles_rows() -> bool:
  """Whether the XLA formulas loop over row tiles (CPUs) rather than call XLA's ragged
  products (see the module docstring)."""
  return dispatch.platform() == "cpu"


def _visit_rows(start, end, rows: int, body, outs, sums):
  """One group's rows ``[start, end)`` in tiles: ``(outs, sums)`` after every visit.

  ``body(size, first, mine) -> (values, parts)`` computes a tile of ``size`` rows from row
  ``first``: ``values``, one ``[size, n]`` array per array of ``outs`` (``[rows, n]``), are
  written over the tile's rows that are the group's; ``parts``, one per array of ``sums``, are
  added to it (the body must leave out rows that are not ``mine``). The tiles are ``T`` rows
  from ``start`` (``mine`` None), then one tail for the rest, ``size`` the multiple of
  :data:`_CPU_TAIL_ROWS` that covers it (or ``T``); ``first`` is a tile's first row (a tail
  that would pass the last row of the array starts earlier instead) and ``mine`` the tail's
  ``[size, 1]`` rows that are the group's and not yet visited.

  The tail's branches return their values in a window of ``T`` rows rather than update
  ``outs``: an array updated inside a conditional is copied whole on entry (XLA:CPU), while the
  update after it is done in place.
  """
  tile = min(_CPU_TILE_ROWS, rows)
  whole = (end - start) // tile

  def write(outs, values, first, size, keep):
    # Selected against the rows held even in a whole tile: on Explicit mesh axes the update
    # then has the output's sharding.
    return tuple(jax.lax.dynamic_update_slice_in_dim(
        out, jnp.where(keep, v.astype(out.dtype),
                       jax.lax.dynamic_slice_in_dim(out, first, size, 0)), first, 0)
        for out, v in zip(outs, values))

  def visit(i, carry):
    outs, sums = carry
    first = start + i * tile
    values, parts = body(tile, first, None)
    outs = write(outs, values, first, tile, jnp.ones((tile, 1), bool))
    return outs, tuple(total + part for total, part in zip(sums, parts))

  outs, sums = jax.lax.fori_loop(0, whole, visit, (outs, sums))
  done = start + whole * tile
  # The rows of the array that every tail lies in: [done, end) and its tail's rows.
  window = jnp.minimum(done, rows - tile)
  sizes = sorted({min(s, tile) for s in range(_CPU_TAIL_ROWS, tile + _CPU_TAIL_ROWS,
                                               _CPU_TAIL_ROWS)})

  def windows():
    return tuple(jax.lax.dynamic_slice_in_dim(out, window, tile, 0) for out in outs)

  def tail(size):
    def run():
      first = jnp.minimum(done, rows - size)
      row = first + jnp.arange(size, dtype=jnp.int32)
      values, parts = body(size, first, ((row >= done) & (row < end))[:, None])
      # Each tail's values placed in the window's rows (with the output's sharding on
      # Explicit mesh axes: selected against what the rows hold).
      return tuple(jax.lax.dynamic_update_slice_in_dim(
          held, jnp.where(jnp.ones((size, 1), bool), v.astype(held.dtype),
                          jax.lax.dynamic_slice_in_dim(held, first - window, size, 0)),
          first - window, 0) for held, v in zip(windows(), values)), tuple(parts)
    return run

  def nothing():
    return windows(), tuple(partitioning.vary_like(jnp.zeros(total.shape, total.dtype), *outs,
                                                   *sums) for total in sums)

  # The smallest size that covers the rest (sizes[i] = min((i + 1) * Q, T), the rest < T).
  branch = jnp.clip((end - done + _CPU_TAIL_ROWS - 1) // _CPU_TAIL_ROWS - 1, 0, len(sizes) - 1)
  values, parts = jax.lax.cond(end > done,
                               lambda: jax.lax.switch(branch, [tail(s) for s in sizes]),
                               nothing)
  row = window + jnp.arange(tile, dtype=jnp.int32)
  outs = write(outs, values, window, tile, ((row >= done) & (row < end))[:, None])
  return outs, tuple(total + part for total, part in zip(sums, parts))


def _tiled_product(lhs, rhs, group_sizes, precision, *, transpose_rhs=False, out_dtype=None):
  """``out[rows of e] = lhs[rows of e] @ rhs[e]`` (``rhs[e]^T``, ``rhs`` ``[G, N, K]``, with
  ``transpose_rhs``), zeros past the groups, in ``out_dtype`` (default lhs's): a loop over
  the groups, each over its rows (:func:`_visit_rows`; rows of other groups keep what they
  hold), each ``rhs[e]`` read once. ``rhs`` may be a tuple of weights: then one output per
  weight, each tile of ``lhs`` read once for all of them."""
  several = isinstance(rhs, tuple)
  weights = rhs if several else (rhs,)
  rows, size_k = lhs.shape
  size_n = [w.shape[1] if transpose_rhs else w.shape[2] for w in weights]
  # Inside shard_map the loop carries vary over the mesh axes the operands vary over.
  outs = tuple(partitioning.vary_like(jnp.zeros((rows, n), out_dtype or lhs.dtype), lhs,
                                      *weights, group_sizes) for n in size_n)
  if 0 in (rows, size_k, *size_n):
    return outs if several else outs[0]
  starts, ends = pallas_gmm.group_bounds(group_sizes, rows)
  dims = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))
  precision = _precision(lhs.dtype, precision)

  def group(e, outs):
    mats = [jax.lax.dynamic_index_in_dim(w, e, 0, keepdims=False) for w in weights]

    def body(size, first, mine):
      del mine  # rows that are not the group's are not written
      block = jax.lax.dynamic_slice_in_dim(lhs, first, size, 0)
      return tuple(jax.lax.dot_general(block, w, dims, precision=precision,
                                       preferred_element_type=jnp.float32)
                   for w in mats), ()

    return _visit_rows(starts[e], ends[e], rows, body, outs, ())[0]

  outs = jax.lax.fori_loop(0, group_sizes.shape[0], group, outs)
  return outs if several else outs[0]


def _tiled_rows_product(lhs, g, group_sizes, precision):
  """``d rhs[e] = lhs_e^T @ g_e`` in float32 (``[G, K, N]``): per group, a sum over its rows
  (:func:`_visit_rows`; a tail's rows that are not the group's, or that a tile already summed,
  are zeroed), zero for an empty group. ``g`` may be a tuple: then one result per ``g``, each
  tile of ``lhs`` read once for all of them."""
  several = isinstance(g, tuple)
  gs = g if several else (g,)
  rows, size_k = lhs.shape
  groups = group_sizes.shape[0]
  size_n = [x.shape[1] for x in gs]
  outs = tuple(partitioning.vary_like(jnp.zeros((groups, size_k, n), jnp.float32), lhs, *gs,
                                      group_sizes) for n in size_n)
  if 0 in (rows, size_k, *size_n):
    return outs if several else outs[0]
  starts, ends = pallas_gmm.group_bounds(group_sizes, rows)
  precision = _precision(lhs.dtype, precision)
  dims = (((0,), (0,)), ((), ()))

  def group(e, outs):
    def body(size, first, mine):
      a = jax.lax.dynamic_slice_in_dim(lhs, first, size, 0)
      if mine is not None:
        a = jnp.where(mine, a, 0)
      return (), tuple(jax.lax.dot_general(a, jax.lax.dynamic_slice_in_dim(x, first, size, 0),
                                           dims, precision=precision,
                                           preferred_element_type=jnp.float32) for x in gs)

    zeros = tuple(partitioning.vary_like(jnp.zeros((size_k, n), jnp.float32), lhs, *gs,
                                         group_sizes) for n in size_n)
    accs = _visit_rows(starts[e], ends[e], rows, body, (), zeros)[1]
    return tuple(jax.lax.dynamic_update_index_in_dim(out, acc, e, 0)
                 for out, acc in zip(outs, accs))

  outs = jax.lax.fori_loop(0, groups, group, outs)
  return outs if several else outs[0]


def _dense_rows_product(lhs, g, group_sizes):
  """``d rhs`` as one dense product over a one-hot group mask: ``G`` times the work of the
  ragged product, but made of primitives JAX can transpose. Only the derivatives of the
  weight gradient use it (second order)."""
  ends = jnp.cumsum(group_sizes)
  rows = jnp.arange(lhs.shape[0])
  member = (rows[None, :] >= (ends - group_sizes)[:, None]) & (rows[None, :] < ends[:, None])
  masked = member[:, :, None].astype(jnp.float32) * lhs.astype(jnp.float32)[None]   # [G, M, K]
  return jnp.einsum("gmk,mn->gkn", masked, g.astype(jnp.float32),
                    precision=jax.lax.Precision.HIGHEST)


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _rows_product(lhs, g, group_sizes, precision):
  """``d rhs[e] = lhs_e^T @ g_e`` in float32 (``[G, K, N]``), XLA's ragged product.

  JAX differentiates this form (the ragged dimension contracted) in neither argument, so its
  tangent, linear in ``(d lhs, d g)``, is the dense masked product, which JAX can transpose:
  Hessian-vector products by reverse over reverse and forward over reverse both work.
  """
  return jax.lax.ragged_dot_general(lhs, g, group_sizes, _RHS_GRAD_DIMS,
                                    precision=_precision(lhs.dtype, precision),
                                    preferred_element_type=jnp.float32,
                                    out_sharding=_out_sharding())


@_rows_product.defjvp
def _rows_product_jvp(precision, primals, tangents):
  lhs, g, group_sizes = primals
  dlhs, dg, _ = tangents
  tangent = _dense_rows_product(dlhs, g, group_sizes) + _dense_rows_product(lhs, dg, group_sizes)
  return _rows_product(lhs, g, group_sizes, precision), tangent


def _xla_forward(lhs, rhs, group_sizes, precision=None):
  return grouped_matmul_reference(lhs, rhs, group_sizes, precision=precision)


def _xla_forward_kernel(lhs, rhs, group_sizes, precision=None):
  """The XLA implementation's forward: the row-tile loop on CPUs, XLA's ragged product
  elsewhere (the same values; differentiated as :func:`_xla_forward`)."""
  if not _tiles_rows():
    return _xla_forward(lhs, rhs, group_sizes, precision)
  return _tiled_product(lhs, rhs, group_sizes, precision)


def _xla_backward_kernel(lhs, rhs, group_sizes, g, precision=None):
  """The XLA implementation's backward: the row-tile loops on CPUs, XLA's ragged products
  elsewhere (the same values; differentiated as :func:`_xla_backward`)."""
  if not _tiles_rows():
    return _xla_backward(lhs, rhs, group_sizes, g, precision)
  dlhs = _tiled_product(g, rhs, group_sizes, precision, transpose_rhs=True)
  drhs = _tiled_rows_product(lhs, g, group_sizes, precision)
  return dlhs.astype(lhs.dtype), drhs.astype(rhs.dtype)


def _xla_backward(lhs, rhs, group_sizes, g, precision=None):
  """``(d lhs, d rhs)``: two ragged products, neither of which transposes ``rhs`` in memory."""
  dlhs = jax.lax.ragged_dot_general(g, rhs, group_sizes, _LHS_GRAD_DIMS,
                                    precision=_precision(g.dtype, precision),
                                    preferred_element_type=jnp.float32,
                                    out_sharding=_out_sharding())
  drhs = _rows_product(lhs, g, group_sizes, precision)
  return dlhs.astype(lhs.dtype), drhs.astype(rhs.dtype)


def _rule(*, backward: bool):
  """The partitioning of the kernels and of XLA's ragged products alike (XLA infers none for a
  ragged product on Explicit mesh axes): over the output features ``n`` (each device
  multiplies every row by its columns of each expert) and the contraction ``k`` (the forward
  is then summed over it); the rows and the groups stay whole, since the groups' row offsets
  are global. Inside ``jax.shard_map`` each device's rows and group sizes are its own
  problem (expert parallelism after an all-to-all)."""
  lhs, rhs, sizes, out = ("m", "k"), ("g", "k", "n"), ("g",), ("m", "n")
  if backward:
    operands, results = (lhs, rhs, sizes, out), (lhs, rhs)
  else:
    operands, results = (lhs, rhs, sizes), (out,)
  return partitioning.Rule(operands, results, whole=("m", "g"))


def _forward(lhs, rhs, group_sizes, cfg):
  twin = lambda lhs, rhs, group_sizes: _xla_forward(lhs, rhs, group_sizes,
                                                    cfg.precision)
  kernel = lambda lhs, rhs, group_sizes: _xla_forward_kernel(lhs, rhs, group_sizes,
                                                             cfg.precision)
  return cfg.run("grouped_matmul_forward", twin, lhs, rhs, group_sizes,
                 rule=_rule(backward=False), xla_kernel=kernel)


def _backward(lhs, rhs, group_sizes, g, cfg):
  twin = lambda lhs, rhs, group_sizes, g: _xla_backward(lhs, rhs, group_sizes,
                                                        g, cfg.precision)
  kernel = lambda lhs, rhs, group_sizes, g: _xla_backward_kernel(lhs, rhs, group_sizes, g,
                                                                 cfg.precision)
  dlhs, drhs = cfg.run("grouped_matmul_backward", twin, lhs, rhs, group_sizes, g,
                       rule=_rule(backward=True), xla_kernel=kernel)
  return dlhs, drhs, None


# The custom VJP ---------------------------------------------------------------------------------


# Residuals: the inputs only (lhs, rhs and group_sizes); nothing computed is kept.
_grouped_matmul = base.recomputing_vjp(
    lambda cfg, lhs, rhs, group_sizes: _forward(lhs, rhs, group_sizes, cfg),
    lambda cfg, lhs, rhs, group_sizes, g: _backward(lhs, rhs, group_sizes, g, cfg))
