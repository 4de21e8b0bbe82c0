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


def cost(fun=None, args: Sequence = (), *, bytes_accessed: int, flops: int | None = None,
         transcendentals: int | None = None) -> pl.CostEstimate:
  """A ``pl.CostEstimate`` with ``bytes_accessed`` taken from the block specs.

  FLOPs and transcendentals are given, or estimated by Pallas from the jnp function ``fun``
  applied to ``args`` (the whole-array computation the kernel performs).
  """
  if fun is not None and (flops is None or transcendentals is None):
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    estimate = pl.estimate_cost(fun, *specs)
    flops = estimate.flops if flops is None else flops
    transcendentals = estimate.transcendentals if transcendentals is None else transcendentals
  return pl.CostEstimate(flops=int(flops or 0), transcendentals=int(transcendentals or 0),
                         bytes_accessed=int(bytes_accessed))


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
