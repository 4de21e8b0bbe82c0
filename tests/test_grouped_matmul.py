"""grouped_matmul: what the op table (tests/cases/grouped_matmul.py) cannot express.

- the visits of the grouped kernels (``group_metadata``): every row written exactly once, a
  straddling row tile visited once per group it holds, no visit for an empty group;
- group sizes passed as a traced argument under ``jit`` (the kernels list their visits on the
  device), on XLA, Pallas (interpret mode) and Triton (its interpreter), against the torch
  per-expert loop in float32, with tiles that straddle groups, empty groups, rows past the sum
  and every row on one expert;
- bfloat16 on every implementation: the error against the float64 loop at most twice that of
  the torch loop in bfloat16;
- the XLA implementation's row-tile loops on CPUs, with tiles small enough to straddle groups
  and a last tile that would pass the last row, against the torch loop; on GPUs (lowered from
  here) XLA's ragged products instead;
- empty problems (no rows, no rows in any group);
- what the backward keeps: the inputs only.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxfuse import ops
from jaxfuse.kernels.pallas import grouped_matmul as pallas_gmm
from jaxfuse.metrics import residuals
from jaxfuse.ops import dispatch
from jaxfuse.testing.torch_ref import grouped_matmul as ref
from tests import helpers

# The op's module (jaxfuse.ops.grouped_matmul is also the name of the function).
gmm_op = importlib.import_module("jaxfuse.ops.grouped_matmul")

M, K, N, G = 40, 24, 40, 4
# With 16-row tiles (interpret mode): groups that straddle tiles, an empty one, a tile holding
# three groups, rows past the sum, and every row on one expert.
SIZES = {
    "straddling": [5, 11, 0, 24],
    "three in a tile": [2, 3, 30, 5],
    "sum < M": [7, 0, 13, 9],
    "one expert takes all": [0, 0, M, 0],
    "none": [0, 0, 0, 0],
}


@pytest.mark.parametrize("sizes", [[5, 11, 0, 24], [0, 0, 40, 0], [7, 0, 13, 9], [0] * 4,
                                   [16, 16, 8, 0], [1] * 4, [3, 0, 0, 0]])
@pytest.mark.parametrize("rows,block", [(40, 16), (40, 8), (37, 16)])
def test_visits_write_every_row_once_and_skip_empty_groups(sizes, rows, block):
  sizes = np.minimum(np.array(sizes), rows - np.concatenate([[0], np.cumsum(sizes)[:-1]]))
  sizes = np.maximum(sizes, 0).astype(np.int32)
  meta = np.asarray(pallas_gmm.group_metadata(jnp.asarray(sizes), rows, block))
  tile, group, lo, hi, read_hi = meta
  assert meta.shape[1] == pallas_gmm.max_visits(rows, len(sizes), block)
  written = np.zeros(rows, int)
  ends = np.cumsum(sizes)
  for v in range(meta.shape[1]):
    r = np.arange(tile[v] * block, tile[v] * block + block)
    r = r[(r >= lo[v]) & (r < hi[v]) & (r < rows)]
    written[r] += 1
    if hi[v] > lo[v]:
      assert r.size, f"visit {v} writes nothing"
      if read_hi[v] > lo[v]:   # a group's visit reads its own rows only
        e = group[v]
        assert lo[v] == ends[e] - sizes[e] and hi[v] == read_hi[v] == ends[e]
      else:                    # the rows past the sum
        assert (lo[v], hi[v]) == (ends[-1], rows)
  assert (written == 1).all(), written
  for e, size in enumerate(sizes):
    visits = [v for v in range(meta.shape[1]) if read_hi[v] > lo[v] and group[v] == e]
    start = ends[e] - size
    want = 0 if size == 0 else (ends[e] - 1) // block - start // block + 1
    assert len(visits) == want, (e, visits)


def _inputs(dtype=jnp.float32, rows=M):
  lhs, rhs, g = helpers.numpy_normals(0, (rows, K), (G, K, N), (rows, N))
  return helpers.to_jax(dtype, lhs, rhs, g)


def _run(impl, lhs, rhs, sizes, g):
  """Output and gradients under jit, the group sizes a traced argument."""
  def step(lhs, rhs, sizes, g):
    out, vjp = jax.vjp(lambda a, b: ops.grouped_matmul(a, b, sizes, implementation=impl),
                       lhs, rhs)
    return (out, *vjp(g))
  return jax.jit(step, compiler_options=helpers.FAST_COMPILE)(lhs, rhs, sizes, g)


def _torch(lhs, rhs, sizes, g, dtype=None):
  return helpers.torch_value_and_grads(
      lambda a, b: ref.grouped_matmul(a, b, torch.tensor(sizes)), (lhs, rhs), g, dtype)


def _implementations():
  return [pytest.param(i, id=i) for i in ("xla", "pallas", "triton")]


def _context(impl, monkeypatch):
  if impl == "triton":
    pytest.importorskip("triton")
    from jaxfuse.testing import triton_interpreter
    return triton_interpreter.triton_ops(monkeypatch)
  import jaxfuse
  return jaxfuse.pallas_interpret(impl == "pallas")


@pytest.mark.parametrize("impl", _implementations())
@pytest.mark.parametrize("label", list(SIZES))
def test_traced_group_sizes_match_the_torch_loop_in_float32(impl, label, monkeypatch):
  lhs, rhs, g = _inputs()
  sizes = jnp.array(SIZES[label], jnp.int32)
  with _context(impl, monkeypatch):
    got = _run(impl, lhs, rhs, sizes, g)
  want = _torch(lhs, rhs, SIZES[label], g)
  for what, a, b in zip(("out", "d lhs", "d rhs"), got, want):
    helpers.assert_close(a, b, what=f"{impl} {label} {what}")
  past = int(np.sum(SIZES[label]))
  assert not np.asarray(got[0][past:]).any() and not np.asarray(got[1][past:]).any()


@pytest.mark.parametrize("impl", _implementations())
def test_bfloat16_within_twice_the_torch_loops_error(impl, monkeypatch):
  lhs, rhs, g = _inputs(jnp.bfloat16)
  sizes = SIZES["straddling"]
  with _context(impl, monkeypatch):
    got = _run(impl, lhs, rhs, jnp.array(sizes, jnp.int32), g)
  exact = _torch(lhs, rhs, sizes, g, torch.float64)
  low = _torch(lhs, rhs, sizes, g)
  for what, a, e, t in zip(("out", "d lhs", "d rhs"), got, exact, low):
    assert a.dtype == jnp.bfloat16, what
    helpers.assert_within_low_precision_error(a, e, t, what=f"{impl} {what}")


@pytest.mark.parametrize("label", list(SIZES))
@pytest.mark.parametrize("rows,tile,tail", [(40, 16, 16), (37, 16, 4), (37, 8, 3)])
def test_cpu_row_tiles_match_the_torch_loop(label, rows, tile, tail, monkeypatch):
  """Whole tiles, then a tail cut to a multiple of ``tail`` rows (several sizes to choose
  from), near the end of the array or not."""
  monkeypatch.setattr(gmm_op, "_CPU_TILE_ROWS", tile)
  monkeypatch.setattr(gmm_op, "_CPU_TAIL_ROWS", tail)
  sizes = np.array(SIZES[label])
  sizes = np.maximum(np.minimum(sizes, rows - np.concatenate([[0], np.cumsum(sizes)[:-1]])), 0)
  lhs, rhs, g = _inputs(rows=rows)
  got = _run("xla", lhs, rhs, jnp.array(sizes, jnp.int32), g)
  want = _torch(lhs, rhs, sizes.tolist(), g)
  for what, a, b in zip(("out", "d lhs", "d rhs"), got, want):
    helpers.assert_close(a, b, what=f"{label} {what}")
  past = int(sizes.sum())
  assert not np.asarray(got[0][past:]).any() and not np.asarray(got[1][past:]).any()


@pytest.mark.parametrize("platform,ragged", [("cpu", False), ("gpu", True)])
def test_xla_loops_over_row_tiles_on_cpus_only(platform, ragged):
  lhs, rhs, _ = _inputs()
  sizes = jnp.array(SIZES["straddling"], jnp.int32)
  loss = lambda a, b: ops.grouped_matmul(a, b, sizes, implementation="xla").sum()
  with dispatch.target_platform(platform):
    text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(lhs, rhs))
  assert ("ragged_dot_general" in text) == ragged
  assert ("while" in text) != ragged


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("rows,sizes", [(0, [0, 0, 0, 0]), (5, [0, 0, 0, 0])])
def test_empty_problems(impl, rows, sizes, monkeypatch):
  lhs, rhs, g = _inputs(rows=rows)
  with _context(impl, monkeypatch):
    out, dlhs, drhs = _run(impl, lhs, rhs, jnp.array(sizes, jnp.int32), g)
  assert out.shape == (rows, N) and dlhs.shape == (rows, K) and drhs.shape == (G, K, N)
  assert not np.asarray(out).any() and not np.asarray(dlhs).any()
  assert not np.asarray(drhs).any()


def test_the_backward_keeps_only_the_inputs():
  lhs, rhs, _ = _inputs()
  sizes = jnp.array(SIZES["straddling"], jnp.int32)
  kept = residuals(lambda a, b: ops.grouped_matmul(a, b, sizes), lhs, rhs)
  assert kept == [], kept
