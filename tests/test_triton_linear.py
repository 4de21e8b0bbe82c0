"""The Triton linear-layer kernels (a tiled matmul in the three layouts a linear layer needs, and
the bias gradient's row sum): their bodies under Triton's interpreter (TRITON_INTERPRET=1, set by
conftest on machines without a GPU) against torch, the jax-triton wrappers' launches, and
recompute_linear(implementation="triton") end to end through a stand-in jax_triton."""

import jax
import jax.numpy as jnp
import pytest
import torch
import torch.nn.functional as F

from jaxfuse.ops import recompute_linear
from jaxfuse.testing import triton_interpreter as interp
from jaxfuse.testing.torch_ref import seed as ref
from tests import helpers

triton = pytest.importorskip("triton")
from jaxfuse.kernels.triton import linear as kernels  # noqa: E402

pytestmark = pytest.mark.skipif(helpers.ON_GPU, reason="interpreter tests; GPUs run jax-triton")

# Small tiles, so that odd shapes take several tiles and K steps, with tails on every axis.
SMALL = (16, 32, 16)


def _matmul(a, b, a_layout, b_layout, bias=None, out_dtype=None, blocks=kernels.BLOCKS):
  """One launch of matmul_kernel as :func:`kernels.matmul` makes it."""
  size_i, size_k = a.shape if a_layout == "ik" else a.shape[::-1]
  size_j = b.shape[0] if b_layout == "jk" else b.shape[1]
  bi, bj, bk = kernels.blocks_for(size_i, size_j, size_k, blocks)
  out = torch.full((size_i, size_j), float("nan"), dtype=out_dtype or a.dtype)
  with interp.gpu_numerics():
    kernels.matmul_kernel[kernels.matmul_grid(size_i, size_j, bi, bj)](
        a, b, a if bias is None else bias, out, SIZE_I=size_i, SIZE_J=size_j,
        SIZE_K=size_k, A_LAYOUT=a_layout, B_LAYOUT=b_layout, HAS_BIAS=bias is not None,
        IEEE=a.dtype == torch.float32, BLOCK_I=bi, BLOCK_J=bj, BLOCK_K=bk)
  return out


def _sum_rows(g, out_dtype=None, blocks=kernels.SUM_BLOCKS):
  size_i, size_j = g.shape
  bi = min(blocks[0], triton.next_power_of_2(size_i))
  bj = min(blocks[1], triton.next_power_of_2(size_j))
  out = torch.full((size_j,), float("nan"), dtype=out_dtype or g.dtype)
  with interp.gpu_numerics():
    kernels.sum_rows_kernel[(-(-size_j // bj),)](g, out, SIZE_I=size_i, SIZE_J=size_j,
                                                  BLOCK_I=bi, BLOCK_J=bj)
  return out


def _run(x, w, b, g, blocks=kernels.BLOCKS, sum_blocks=kernels.SUM_BLOCKS):
  """``(y, dx, dw, db)`` from the launches :func:`kernels.linear_forward` and
  :func:`kernels.linear_backward` make."""
  y = _matmul(x, w, "ik", "jk", bias=b, blocks=blocks)
  dx = _matmul(g, w, "ik", "kj", blocks=blocks)
  dw = _matmul(g, x, "ki", "kj", blocks=blocks)
  db = None if b is None else _sum_rows(g, blocks=sum_blocks)
  return y, dx, dw, db


def _torch(x, w, b, g, dtype=None):
  """The seed's RecomputationLayer (F.linear without a bias): ``(y, dx, dw, db)``."""
  tx, tw = (t.to(dtype or t.dtype).requires_grad_() for t in (x, w))
  tb = None if b is None else b.to(dtype or b.dtype).requires_grad_()
  y = F.linear(tx, tw) if tb is None else ref.RecomputationLayer.apply(tx, tw, tb)
  y.backward(g.to(dtype or g.dtype))
  return y.detach(), tx.grad, tw.grad, None if tb is None else tb.grad


def _inputs(rows, n_in, n_out, seed, dtype=torch.float32):
  torch.manual_seed(seed)
  x, w = torch.randn(rows, n_in), torch.randn(n_out, n_in) / n_in ** 0.5
  b, g = torch.randn(n_out), torch.randn(rows, n_out)
  return tuple(t.to(dtype) for t in (x, w, b, g))


def _compare(got, want, what=""):
  for a, e, name in zip(got, want, ("out", "grad x", "grad weight", "grad bias")):
    assert (a is None) == (e is None), name
    if a is not None:
      helpers.assert_close(a, e, what=f"{what} {name}")


@pytest.mark.parametrize("a_layout", ["ik", "ki"])
@pytest.mark.parametrize("b_layout", ["jk", "kj"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matmul_layouts(a_layout, b_layout, with_bias):
  torch.manual_seed(0)
  a, b, bias = torch.randn(37, 123), torch.randn(45, 123), torch.randn(45)
  a_stored = a if a_layout == "ik" else a.T.contiguous()
  b_stored = b if b_layout == "jk" else b.T.contiguous()
  got = _matmul(a_stored, b_stored, a_layout, b_layout, bias if with_bias else None,
                blocks=SMALL)
  helpers.assert_close(got, a @ b.T + (bias if with_bias else 0))


# The bias is a flag of the kernels, independent of the tiles: without it, small tiles only.
@pytest.mark.parametrize("rows, n_in, n_out", [(5, 123, 45), (3, 423, 17), (37, 64, 130),
                                               (1, 1, 1)])
@pytest.mark.parametrize("with_bias, blocks", [(True, kernels.BLOCKS), (True, SMALL),
                                               (False, SMALL)],
                         ids=["bias-default", "bias-small tiles", "no bias-small tiles"])
def test_fp32_matches_torch(rows, n_in, n_out, with_bias, blocks):
  x, w, b, g = _inputs(rows, n_in, n_out, seed=n_in)
  b = b if with_bias else None
  _compare(_run(x, w, b, g, blocks, sum_blocks=(2, 16)), _torch(x, w, b, g),
           f"{rows}x{n_in}->{n_out}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_within_twice_torch_error(dtype):
  x, w, b, g = _inputs(37, 300, 70, seed=1, dtype=dtype)
  got = _run(x, w, b, g, sum_blocks=(8, 32))
  exact = _torch(x, w, b, g, dtype=torch.float64)
  low = _torch(x, w, b, g)
  for a, e, t, what in zip(got, exact, low, ("out", "grad x", "grad weight", "grad bias")):
    assert a.dtype == dtype
    helpers.assert_within_low_precision_error(a, e, t, what=what)


def test_blocks():
  assert kernels.blocks_for(5, 123, 45) == (16, 64, 32)    # at least 16 (tl.dot), powers of 2
  assert kernels.blocks_for(4096, 4096, 4096) == kernels.BLOCKS


# The jax-triton wrappers ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_wrappers_launch_what_the_kernels_expect(dtype):
  x = jax.ShapeDtypeStruct((300, 100), dtype)
  w = jax.ShapeDtypeStruct((70, 100), dtype)
  b = jax.ShapeDtypeStruct((70,), dtype)
  with interp.jax_triton_stand_in(run=False) as launches:
    y = jax.eval_shape(kernels.linear_forward, x, w, b)
    grads = jax.eval_shape(kernels.linear_backward, x, w, b, y)
  assert y == jax.ShapeDtypeStruct((300, 70), dtype) and grads == (x, w, b)
  assert [c.kernel for c in launches] == ["matmul_kernel"] * 3 + ["sum_rows_kernel"]
  fwd, dx, dw, db = launches
  ieee = jnp.dtype(dtype) == jnp.float32
  common = dict(IEEE=ieee, BLOCK_I=64, BLOCK_J=64, BLOCK_K=32)
  assert fwd.constexprs == dict(SIZE_I=300, SIZE_J=70, SIZE_K=100, A_LAYOUT="ik",
                                B_LAYOUT="jk", HAS_BIAS=True, **common)
  assert dx.constexprs == dict(SIZE_I=300, SIZE_J=100, SIZE_K=70, A_LAYOUT="ik",
                               B_LAYOUT="kj", HAS_BIAS=False, **common)
  assert dw.constexprs == dict(SIZE_I=70, SIZE_J=100, SIZE_K=300, A_LAYOUT="ki",
                               B_LAYOUT="kj", HAS_BIAS=False, **common)
  assert db.constexprs == dict(SIZE_I=300, SIZE_J=70, BLOCK_I=32, BLOCK_J=128)
  assert [c.grid for c in launches] == [(5, 2), (5, 2), (2, 2), (1,)]
  assert [c.outputs for c in launches] == [[y], [x], [w], [b]]
  assert fwd.num_warps == 4 and fwd.num_stages == 3


def test_wrappers_run_in_the_interpreter():
  x, w, b, g = _inputs(37, 123, 45, seed=2)
  j = lambda t: jnp.asarray(t.numpy())  # noqa: E731
  with interp.jax_triton_stand_in():
    y = kernels.linear_forward(j(x), j(w), j(b))
    grads = kernels.linear_backward(j(x), j(w), j(b), j(g))
    no_bias = kernels.linear_backward(j(x), j(w), None, j(g))
    assert kernels.matmul(jnp.ones((0, 4)), jnp.ones((3, 4))).shape == (0, 3)
  _compare((y, *grads), _torch(x, w, b, g))
  assert no_bias[2] is None
  helpers.assert_close(no_bias[1], grads[1])


def test_wrappers_reject_bad_layouts():
  with pytest.raises(ValueError, match=r"layouts must be ik\|ki and jk\|kj, got 'kk'"):
    kernels.matmul(jnp.ones((2, 2)), jnp.ones((2, 2)), a_layout="kk")
  with pytest.raises(ValueError, match=r"contracted sizes differ: 3 \(a\) and 4 \(b\)"):
    kernels.matmul(jnp.ones((2, 3)), jnp.ones((5, 4)))


# The op, end to end -----------------------------------------------------------------------------


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no bias"])
def test_op_matches_torch(with_bias, monkeypatch):
  x, w, b, g = _inputs(15, 123, 45, seed=3)
  b = b if with_bias else None
  j = lambda t, *shape: jnp.asarray(t.numpy()).reshape(*shape)  # noqa: E731
  args = (j(x, 3, 5, 123), j(w, 45, 123)) + ((j(b, 45),) if with_bias else ())
  with interp.triton_ops(monkeypatch) as launches:
    got = helpers.jax_value_and_grads(
        lambda *a: recompute_linear(*a, implementation="triton"), args, j(g, 3, 5, 45))
  kernels_run = ["matmul_kernel"] * 3 + (["sum_rows_kernel"] if with_bias else [])
  assert [c.kernel for c in launches] == kernels_run
  y, dx, dw, *db = got
  _compare((y.reshape(15, 45), dx.reshape(15, 123), dw, *(db or [None])), _torch(x, w, b, g))
