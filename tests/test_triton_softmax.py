"""The Triton softmax kernels: their bodies under Triton's interpreter (TRITON_INTERPRET=1, set by
conftest on machines without a GPU) against torch's F.softmax, the jax-triton wrappers' launches,
and softmax(implementation="triton") end to end through a stand-in jax_triton."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxfuse.ops import softmax
from jaxfuse.testing import triton_interpreter as interp
from jaxfuse.testing.torch_ref import mlp as ref
from tests import helpers

triton = pytest.importorskip("triton")
from jaxfuse.kernels.triton import softmax as kernels  # noqa: E402

pytestmark = pytest.mark.skipif(helpers.ON_GPU, reason="interpreter tests; GPUs run jax-triton")


def _run(x, g, mask=None, scale=1.0, max_chunk=kernels.MAX_CHUNK):
  """The forward launch, then the backward on its output, as the wrappers make them."""
  rows, n = x.shape
  block_r, block_n, n_chunks = kernels.plan(rows, n, max_chunk=max_chunk)
  grid = kernels.grid_for(rows, block_r)
  meta = dict(ROWS=rows, N=n, SCALE=scale, BLOCK_R=block_r, BLOCK_N=block_n, N_CHUNKS=n_chunks)
  y, dx = torch.empty_like(x), torch.empty_like(x)
  with interp.gpu_numerics():
    kernels.softmax_fwd_kernel[grid](x, x if mask is None else mask.to(torch.int8), y,
                                     HAS_MASK=mask is not None, **meta)
    kernels.softmax_bwd_kernel[grid](y, g, dx, **meta)
  return y, dx


def _torch(x, g, mask=None, scale=1.0, dtype=None):
  tx = x.to(dtype or x.dtype).requires_grad_()
  y = ref.softmax(tx, scale=scale, mask=mask)
  y.backward(g.to(dtype or g.dtype))
  return y.detach(), tx.grad


def _inputs(shape, seed, dtype=torch.float32):
  torch.manual_seed(seed)
  return (3 * torch.randn(shape)).to(dtype), torch.randn(shape).to(dtype)


# rows x n, and the chunk the kernels walk rows in (n_chunks > 1 where the chunk is shorter).
SHAPES = [((5, 123), kernels.MAX_CHUNK), ((3, 423), kernels.MAX_CHUNK), ((3, 423), 128),
          ((2, 1000), 256), ((1, 1), kernels.MAX_CHUNK)]


@pytest.mark.parametrize("shape, chunk", SHAPES, ids=str)
@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
@pytest.mark.parametrize("scale", [1.0, 0.3])
def test_fp32_matches_torch(shape, chunk, masked, scale):
  x, g = _inputs(shape, seed=shape[1])
  mask = None
  if masked:
    mask = torch.rand(shape) > 0.4
    mask[:, 0] = True  # torch gives NaN for a row with no kept entry (tested below)
  got = _run(x, g, mask, scale, chunk)
  for a, b, what in zip(got, _torch(x, g, mask, scale), ("out", "grad")):
    helpers.assert_close(a, b, what=f"{shape} chunk={chunk} {what}")


@pytest.mark.parametrize("chunk", [kernels.MAX_CHUNK, 64])
def test_rows_with_no_kept_entry_are_zeros(chunk):
  x, g = _inputs((4, 200), seed=1)
  mask = torch.rand(4, 200) > 0.5
  mask[1] = False
  y, dx = _run(x, g, mask, 1.0, chunk)
  assert torch.equal(y[1], torch.zeros(200)) and torch.equal(dx[1], torch.zeros(200))
  keep = [0, 2, 3]
  want = _torch(x[keep], g[keep], mask[keep])
  helpers.assert_close(y[keep], want[0])
  helpers.assert_close(dx[keep], want[1])


@pytest.mark.parametrize("chunk", [kernels.MAX_CHUNK, 256])
def test_values_around_1e4_are_stable(chunk):
  x, g = _inputs((3, 1000), seed=2)
  x = 10 * x + 1e4
  got = _run(x, g, None, 1.0, chunk)
  assert all(torch.isfinite(t).all() for t in got)
  for a, b in zip(got, _torch(x, g)):
    helpers.assert_close(a, b)


@pytest.mark.parametrize("shape, chunk", [((7, 777), kernels.MAX_CHUNK), ((3, 777), 256)],
                         ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_within_twice_torch_error(shape, chunk, dtype):
  x, g = _inputs(shape, seed=3, dtype=dtype)
  mask = torch.rand(shape) > 0.2
  mask[:, 0] = True
  got = _run(x, g, mask, 0.5, chunk)
  exact = _torch(x, g, mask, 0.5, dtype=torch.float64)
  low = _torch(x, g, mask, 0.5)
  for a, e, t, what in zip(got, exact, low, ("out", "grad")):
    assert a.dtype == dtype
    helpers.assert_within_low_precision_error(a, e, t, what=what)


def test_plan():
  assert kernels.plan(5, 123) == (8, 128, 1)         # 8 rows of one 128-column chunk
  assert kernels.plan(3, 423, max_chunk=128) == (4, 128, 4)
  assert kernels.plan(1000, 40000) == (1, 16384, 3)  # long rows: one a program, in chunks


# The jax-triton wrappers ------------------------------------------------------------------------


def test_wrappers_launch_what_the_kernels_expect():
  x = jax.ShapeDtypeStruct((37, 40000), jnp.bfloat16)
  mask = jax.ShapeDtypeStruct((37, 40000), jnp.bool_)
  with interp.jax_triton_stand_in(run=False) as launches:
    jax.eval_shape(lambda x, m: kernels.softmax_forward(x, m, scale=0.5), x, mask)
    jax.eval_shape(lambda y, g: kernels.softmax_backward(y, g, scale=0.5), x, x)
  fwd, bwd = launches
  assert (fwd.kernel, fwd.grid, bwd.kernel, bwd.grid) == (
      "softmax_fwd_kernel", (37,), "softmax_bwd_kernel", (37,))
  assert fwd.constexprs == dict(ROWS=37, N=40000, SCALE=0.5, HAS_MASK=True, BLOCK_R=1,
                                BLOCK_N=16384, N_CHUNKS=3)
  assert bwd.constexprs == dict(ROWS=37, N=40000, SCALE=0.5, BLOCK_R=1, BLOCK_N=16384,
                                N_CHUNKS=3)
  assert fwd.inputs[1].dtype == jnp.int8  # the mask travels as int8
  assert fwd.outputs == [x] and bwd.outputs == [x]
  assert fwd.num_warps == bwd.num_warps == 16


def test_wrappers_run_in_the_interpreter():
  x, g = _inputs((5, 123), seed=4)
  mask = torch.rand(5, 123) > 0.3
  mask[:, 0] = True
  jx, jg, jm = (jnp.asarray(t.numpy()) for t in (x, g, mask))
  with interp.jax_triton_stand_in() as launches:
    y = kernels.softmax_forward(jx, jm, scale=0.3)
    dx = kernels.softmax_backward(y, jg, scale=0.3)
    assert not kernels.softmax_forward(jnp.zeros((0, 3)), None).size
  assert [launch.kernel for launch in launches] == ["softmax_fwd_kernel", "softmax_bwd_kernel"]
  for a, b in zip((y, dx), _torch(x, g, mask, 0.3)):
    helpers.assert_close(a, b)


# The op, end to end -----------------------------------------------------------------------------


@pytest.mark.parametrize("axis", [-1, 0])
def test_op_matches_torch(axis, monkeypatch):
  x, g = _inputs((5, 123), seed=5)
  mask = torch.rand(1, 123) > 0.3  # broadcast over the rows
  mask[:, :5] = True
  jx, jg, jm = (jnp.asarray(t.numpy()) for t in (x, g, mask))
  if axis == 0:
    jm = jnp.ones((5, 1), bool)
  with interp.triton_ops(monkeypatch) as launches:
    y, dx = helpers.jax_value_and_grads(
        lambda x: softmax(x, axis=axis, scale=0.5, mask=jm, implementation="triton"), (jx,), jg)
  assert [launch.kernel for launch in launches] == ["softmax_fwd_kernel", "softmax_bwd_kernel"]
  tmask = torch.from_numpy(np.array(jm))
  ty = ref.softmax(x.requires_grad_(), axis=axis, scale=0.5, mask=tmask)
  ty.backward(g)
  helpers.assert_close(y, ty)
  helpers.assert_close(dx, x.grad)
