"""Helpers shared by the Pallas kernels: block sizes, compiler params, cost estimates."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton


def next_power_of_2(n: int) -> int:
  return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def block_for(n: int, cap: int) -> int:
  """The power-of-2 block covering ``n`` elements, at most ``cap`` (Triton needs powers of 2)."""
  return min(cap, next_power_of_2(max(n, 1)))


def triton_params(num_warps: int = 4, num_stages: int | None = None):
  """Compiler params that make Pallas lower through Triton on GPUs."""
  return pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def nbytes(x) -> int:
  """Bytes of an array or ShapeDtypeStruct."""
  return math.prod(x.shape) * jnp.dtype(x.dtype).itemsize


def cost(operands: Sequence, results, *, flops: int | None = None,
         transcendentals: int | None = None, fun=None, args: Sequence | None = None
         ) -> pl.CostEstimate:
  """A scheduling hint for XLA: a ``pl.CostEstimate`` sized from the call's operands and results.

  ``bytes_accessed`` is the sum of the sizes of the call's ``operands`` and ``results``, taken
  mechanically from their shapes: it tells XLA's scheduler how big the call is, and no figure
  jaxfuse reports uses it (bytes moved are counted from the kernel body over its grid, by
  :mod:`jaxfuse.metrics.traffic`). FLOPs and transcendentals are given, or estimated by Pallas
  from the jnp function ``fun`` applied to ``args`` (default: the operands), the whole-array
  computation the kernel performs.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> x = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    >>> cost([x, x], x, fun=lambda a, b: a + b).bytes_accessed  # 3 arrays of 4 KiB
    12288
  """
  results = list(results) if isinstance(results, (list, tuple)) else [results]
  if fun is not None and (flops is None or transcendentals is None):
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (operands if args is None else args)]
    estimate = pl.estimate_cost(fun, *specs)
    flops = estimate.flops if flops is None else flops
    transcendentals = estimate.transcendentals if transcendentals is None else transcendentals
  size = sum(nbytes(a) for a in operands) + sum(nbytes(r) for r in results)
  return pl.CostEstimate(flops=int(flops or 0), transcendentals=int(transcendentals or 0),
                         bytes_accessed=int(size))


def compute_dtype(dtype) -> jnp.dtype:
  """Low-precision floats compute in float32 inside kernels; float32/64 stay as they are."""
  dtype = jnp.dtype(dtype)
  return jnp.dtype(jnp.float32) if dtype.itemsize < 4 else dtype


def tail_mask(axis: int, block: int, size: int, *, grid_axis: int | None = None,
              shape: tuple[int, ...] | None = None) -> jax.Array:
  """True where this program's block along ``axis`` lies inside an array dimension of ``size``.

  Pallas' Triton lowering reads and writes whole blocks without bounds checks, so every block
  that can run past the end of an array loads and stores through this mask.

  Args:
    axis: the block dimension the mask varies along.
    block: the block's extent along ``axis``.
    size: the array's extent along that dimension.
    grid_axis: the grid axis that walks the dimension (default: ``axis``).
    shape: the mask's shape, for 2-D blocks (default: ``(block,)``).
  """
  shape = shape or (block,)
  start = pl.program_id(axis if grid_axis is None else grid_axis) * block
  return start + jax.lax.broadcasted_iota(jnp.int32, shape, axis) < size


def _varying_axes(operands) -> tuple[frozenset, object]:
  """The manual mesh axes any of ``operands`` varies over (inside ``jax.shard_map``), and the
  type of an operand that varies over all of them (None outside ``shard_map``)."""
  union, widest = frozenset(), None
  for x in operands:
    if not isinstance(x, jax.Array):
      continue
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)   # jax 0.10; jax 0.11 calls it vma
    varying = frozenset(manual.varying) if manual is not None else frozenset(
        getattr(aval, "vma", ()))
    if varying >= union:
      union, widest = varying, manual if manual is not None else varying
  return union, widest


def _varying_struct(struct, widest):
  if isinstance(widest, frozenset):
    return jax.ShapeDtypeStruct(struct.shape, struct.dtype, vma=widest)
  return jax.ShapeDtypeStruct(struct.shape, struct.dtype, manual_axis_type=widest)


def pallas_call(kernel, *, out_shape, **options):
  """``pl.pallas_call`` whose results vary over the manual mesh axes its operands vary over,
  so that a kernel runs inside ``jax.shard_map`` with ``check_vma=True`` (a bare
  ``ShapeDtypeStruct`` result is taken to vary over none, and shard_map refuses it)."""

  def call(*operands):
    union, widest = _varying_axes(operands)
    shapes = out_shape
    if union:
      shapes = jax.tree.map(lambda s: _varying_struct(s, widest), out_shape)
    return pl.pallas_call(kernel, out_shape=shapes, **options)(*operands)

  return call
