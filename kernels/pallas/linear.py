"""Tiled matmul kernels for linear layers: ``x @ w.T + b`` forward, ``dx``, ``dw`` and ``db``.

One kernel body covers every layout a linear layer needs: ``C[I, J] = sum_K A[I, K] B[J, K]``
with each operand stored either way round, so the backward products read the saved arrays in
place instead of materializing transposes. Each program owns a (block_i, block_j) tile of C and
loops over K inside the kernel; rows, columns and the K tail are masked, so no size needs to be a
multiple of a block. Accumulation is in float32; float32 inputs multiply in full precision
(IEEE, not TF32), as torch does by default.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from .. import limits
from . import common

# Tile sizes: (block_i, block_j, block_k). Interpret mode walks the grid in a loop, so it uses
# larger tiles to stay fast; GPUs want tiles that fit registers and shared memory.
GPU_BLOCKS = (64, 64, 32)
INTERPRET_BLOCKS = (128, 128, 128)


def _blocks(shape_i, shape_j, shape_k, blocks, interpret):
  default = INTERPRET_BLOCKS if interpret else GPU_BLOCKS
  bi, bj, bk = blocks or default
  # Triton's dot wants every tile dimension >= 16; powers of 2 throughout.
  fit = lambda b, n: max(16, common.block_for(n, b))  # noqa: E731
  return fit(bi, shape_i), fit(bj, shape_j), fit(bk, shape_k)


def _operand_spec(layout: str, block: int, size_k: int, grid_axis: int) -> pl.BlockSpec:
  """A's (or B's) block: all of K and one block of I (or J), stored [I, K] or [K, I]."""
  if layout in ("ik", "jk"):
    index = (lambda i, j: (i, 0)) if grid_axis == 0 else (lambda i, j: (j, 0))
    return pl.BlockSpec((block, size_k), index)
  index = (lambda i, j: (0, i)) if grid_axis == 0 else (lambda i, j: (0, j))
  return pl.BlockSpec((size_k, block), index)


def _load_chunk(ref, layout, k0, bk, outer_ok, size_k):
  """The (block, bk) or (bk, block) chunk at K offset ``k0``, zero outside the array."""
  if layout in ("ik", "jk"):
    k_ok = k0 + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1) < size_k
    return pl_triton.load(ref.at[:, pl.ds(k0, bk)], mask=outer_ok[:, None] & k_ok, other=0)
  k_ok = k0 + jax.lax.broadcasted_iota(jnp.int32, (bk, 1), 0) < size_k
  return pl_triton.load(ref.at[pl.ds(k0, bk), :], mask=k_ok & outer_ok[None, :], other=0)


def matmul(a: jax.Array, b: jax.Array, *, a_layout: str = "ik", b_layout: str = "jk",
           bias: jax.Array | None = None, out_dtype=None, interpret: bool = False,
           blocks: tuple[int, int, int] | None = None, name: str = "matmul",
           num_warps: int = 4) -> jax.Array:
  """``C[I, J] = sum_K A[I, K] B[J, K] (+ bias[J])`` in one kernel.

  Args:
    a: stored ``[I, K]`` (``a_layout="ik"``) or ``[K, I]`` (``"ki"``).
    b: stored ``[J, K]`` (``b_layout="jk"``) or ``[K, J]`` (``"kj"``).
    bias: optional ``[J]``, added in the kernel's epilogue.
    out_dtype: the result's dtype (default: a's).
    interpret: Pallas interpret mode (CPU tests).
    blocks: ``(block_i, block_j, block_k)``, powers of 2 (default by mode).
    name: the kernel's name in profiles and lowered HLO.
  """
  size_i, size_j, size_k = limits.matmul_sizes(a.shape, b.shape, a_layout, b_layout)
  out_dtype = jnp.dtype(out_dtype or a.dtype)
  bi, bj, bk = _blocks(size_i, size_j, size_k, blocks, interpret)
  n_k = pl.cdiv(size_k, bk)
  a_contract = 1 if a_layout == "ik" else 0
  b_contract = 1 if b_layout == "jk" else 0
  has_bias = bias is not None

  def kernel(a_ref, b_ref, *rest):
    bias_ref = rest[0] if has_bias else None
    out_ref = rest[-1]
    i_ok = pl.program_id(0) * bi + jax.lax.broadcasted_iota(jnp.int32, (bi,), 0) < size_i
    j_ok = pl.program_id(1) * bj + jax.lax.broadcasted_iota(jnp.int32, (bj,), 0) < size_j

    def body(step, acc):
      k0 = step * bk
      a_chunk = _load_chunk(a_ref, a_layout, k0, bk, i_ok, size_k)
      b_chunk = _load_chunk(b_ref, b_layout, k0, bk, j_ok, size_k)
      return acc + jax.lax.dot_general(
          a_chunk, b_chunk, (((a_contract,), (b_contract,)), ((), ())),
          preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, n_k, body, jnp.zeros((bi, bj), jnp.float32))
    if has_bias:
      acc = acc + pl_triton.load(bias_ref, mask=j_ok, other=0).astype(jnp.float32)[None, :]
    pl_triton.store(out_ref, acc.astype(out_ref.dtype), mask=i_ok[:, None] & j_ok[None, :])

  grid = (pl.cdiv(size_i, bi), pl.cdiv(size_j, bj))
  in_specs = [_operand_spec(a_layout, bi, size_k, 0), _operand_spec(b_layout, bj, size_k, 1)]
  operands = [a, b]
  if has_bias:
    in_specs.append(pl.BlockSpec((bj,), lambda i, j: (j,)))
    operands.append(bias)
  out_shape = jax.ShapeDtypeStruct((size_i, size_j), out_dtype)
  return common.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=grid,
      in_specs=in_specs,
      out_specs=pl.BlockSpec((bi, bj), lambda i, j: (i, j)),
      interpret=interpret,
      compiler_params=common.triton_params(num_warps=num_warps),
      cost_estimate=common.cost(operands, out_shape, flops=2 * size_i * size_j * size_k,
                                transcendentals=0),
      name=name,
  )(*operands)


def sum_rows(g: jax.Array, *, out_dtype=None, interpret: bool = False,
             blocks: tuple[int, int] | None = None, name: str = "sum_rows",
             num_warps: int = 4) -> jax.Array:
  """``g.sum(axis=0)`` for a 2-D ``g``, accumulated in float32 (a bias gradient)."""
  size_i, size_j = g.shape
  default = (INTERPRET_BLOCKS if interpret else GPU_BLOCKS)[:2]
  bi, bj = blocks or default
  bi, bj = common.block_for(size_i, bi), common.block_for(size_j, bj)
  out_dtype = jnp.dtype(out_dtype or g.dtype)

  def kernel(g_ref, out_ref):
    j_ok = common.tail_mask(0, bj, size_j)

    def body(step, acc):
      i0 = step * bi
      i_ok = i0 + jax.lax.broadcasted_iota(jnp.int32, (bi, 1), 0) < size_i
      chunk = pl_triton.load(g_ref.at[pl.ds(i0, bi), :], mask=i_ok & j_ok[None, :], other=0)
      return acc + jnp.sum(chunk.astype(jnp.float32), axis=0)

    acc = jax.lax.fori_loop(0, pl.cdiv(size_i, bi), body, jnp.zeros((bj,), jnp.float32))
    pl_triton.store(out_ref, acc.astype(out_ref.dtype), mask=j_ok)

  out_shape = jax.ShapeDtypeStruct((size_j,), out_dtype)
  return common.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=(pl.cdiv(size_j, bj),),
      in_specs=[pl.BlockSpec((size_i, bj), lambda j: (0, j))],
      out_specs=pl.BlockSpec((bj,), lambda j: (j,)),
      interpret=interpret,
      compiler_params=common.triton_params(num_warps=num_warps),
      cost_estimate=common.cost([g], out_shape, flops=size_i * size_j, transcendentals=0),
      name=name,
  )(g)


def linear_forward(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None, *,
                   interpret: bool = False) -> jax.Array:
  """``x @ weight.T + bias`` for 2-D ``x`` ``[rows, in]`` and ``weight`` ``[out, in]``, the
  bias added in the kernel's epilogue."""
  return matmul(x, weight, bias=bias, interpret=interpret, name="linear_fwd")


def linear_backward(x: jax.Array, weight: jax.Array, bias: jax.Array | None, g: jax.Array, *,
                    interpret: bool = False):
  """``(dx, dweight, dbias)`` of :func:`linear_forward` for the output gradient ``g``
  ``[rows, out]``: two :func:`matmul` kernels (two layouts) and a :func:`sum_rows` kernel
  (None without a bias)."""
  dx = matmul(g, weight, a_layout="ik", b_layout="kj", interpret=interpret, name="linear_dx")
  dw = matmul(g, x, a_layout="ki", b_layout="kj", out_dtype=weight.dtype, interpret=interpret,
              name="linear_dweight")
  db = None
  if bias is not None:
    db = sum_rows(g, out_dtype=bias.dtype, interpret=interpret, name="linear_dbias")
  return dx, dw, db
