"""2-D tiling for row-wise elementwise kernels over a ``rows x cols`` array.

Programs own ``block_rows x block_cols`` tiles (powers of 2) on a 2-D grid; tiles at the end of
either dimension run past the array and load and store through :func:`inside`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import common

# Elements per program tile on GPUs, and the widest column block.
GPU_TILE = 4096
GPU_MAX_COLS = 512
# Interpret mode walks the grid in a Python-level loop: big tiles keep it fast.
INTERPRET_TILE = 1 << 16
INTERPRET_MAX_COLS = 4096


def plan(rows: int, cols: int, *, interpret: bool, block_rows: int | None = None,
         block_cols: int | None = None) -> tuple[int, int]:
  """``(block_rows, block_cols)`` for a ``rows x cols`` array."""
  tile = INTERPRET_TILE if interpret else GPU_TILE
  if block_cols is None:
    block_cols = common.block_for(cols, INTERPRET_MAX_COLS if interpret else GPU_MAX_COLS)
  if block_rows is None:
    block_rows = common.block_for(rows, max(1, tile // block_cols))
  return block_rows, block_cols


def grid(rows: int, cols: int, block_rows: int, block_cols: int) -> tuple[int, int]:
  return pl.cdiv(rows, block_rows), pl.cdiv(cols, block_cols)


def num_warps(block_rows: int, block_cols: int) -> int:
  return max(1, min(8, block_rows * block_cols // 1024))


def inside(row_start, col_start, block_rows: int, block_cols: int, rows: int,
           cols: int) -> jax.Array:
  """True on the part of a tile that starts at ``(row_start, col_start)`` inside the array."""
  shape = (block_rows, block_cols)
  r = row_start + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
  c = col_start + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
  return (r < rows) & (c < cols)


def tile_mask(block_rows: int, block_cols: int, rows: int, cols: int) -> jax.Array:
  """:func:`inside` for this program's tile on the 2-D grid."""
  return inside(pl.program_id(0) * block_rows, pl.program_id(1) * block_cols, block_rows,
                block_cols, rows, cols)


def vjp(fn, x, g):
  """``g * fn'(x)`` for an elementwise ``fn`` (traced inside the kernel)."""
  return jax.vjp(fn, x)[1](g)[0]
