"""The Triton bias_act kernels: their bodies under Triton's interpreter (TRITON_INTERPRET=1, set by
conftest on machines without a GPU) against torch's ``act(x + bias)``, the jax-triton wrappers'
launches, and bias_act(implementation="triton") end to end through a stand-in jax_triton."""

import jax
import jax.numpy as jnp
import pytest
import torch

from jaxfuse.ops import bias_act
from jaxfuse.testing import triton_interpreter as interp
from jaxfuse.testing.torch_ref import mlp as ref
from tests import helpers

triton = pytest.importorskip("triton")
from jaxfuse.kernels.triton import bias_activation as kernels  # noqa: E402

pytestmark = pytest.mark.skipif(helpers.ON_GPU, reason="interpreter tests; GPUs run jax-triton")


def _run(x, b, g, act, target_programs=kernels.TARGET_PROGRAMS):
  """Forward and backward launches as the wrappers make them: ``(y, dx, dbias)``, dbias the
  float32 sum of the partials in the bias dtype."""
  rows, n = x.shape
  block_r, block_c = kernels.blocks_for(rows, n)
  _, _, steps, groups, col_blocks = kernels.backward_plan(rows, n, target_programs)
  y, dx = torch.empty_like(x), torch.empty_like(x)
  partials = torch.full((groups, n), float("nan"))
  with interp.gpu_numerics():
    kernels.bias_act_fwd_kernel[kernels.forward_grid(rows, n)](
        x, b, y, ROWS=rows, N=n, BLOCK_R=block_r, BLOCK_C=block_c, ACT=act)
    kernels.bias_act_bwd_kernel[(groups, col_blocks)](
        x, b, g, dx, partials, ROWS=rows, N=n, BLOCK_R=block_r, BLOCK_C=block_c, STEPS=steps,
        ACT=act)
  return y, dx, partials.sum(0).to(b.dtype)


def _torch(x, b, g, act, dtype=None):
  tx = x.to(dtype or x.dtype).requires_grad_()
  tb = b.to(dtype or b.dtype).requires_grad_()
  y = ref.bias_act(tx, tb, act)
  y.backward(g.to(dtype or g.dtype))
  return y.detach(), tx.grad, tb.grad


def _inputs(shape, seed, dtype=torch.float32):
  torch.manual_seed(seed)
  x, g, b = 2 * torch.randn(shape), torch.randn(shape), torch.randn(shape[-1])
  return x.to(dtype), b.to(dtype), g.to(dtype)


@pytest.mark.parametrize("act", kernels.ACTIVATIONS)
@pytest.mark.parametrize("shape", [(5, 123), (3, 423), (1, 1)], ids=str)
def test_fp32_matches_torch(act, shape):
  x, b, g = _inputs(shape, seed=shape[1])
  for got, want, what in zip(_run(x, b, g, act), _torch(x, b, g, act),
                             ("out", "grad x", "grad bias")):
    helpers.assert_close(got, want, what=f"{act} {shape} {what}")


@pytest.mark.parametrize("target_programs", [1, 4])
def test_row_groups_walk_several_blocks(target_programs):
  """Fewer programs than row blocks: each walks several of them (the last past the end) and
  its partial bias gradient covers them all."""
  x, b, g = _inputs((37, 700), seed=1)  # 8 x 512 tiles: tails on both axes
  rows, n = x.shape
  _, _, steps, _, col_blocks = kernels.backward_plan(rows, n, target_programs)
  assert steps > 1 and col_blocks == 2
  for got, want in zip(_run(x, b, g, "gelu", target_programs), _torch(x, b, g, "gelu")):
    helpers.assert_close(got, want)


@pytest.mark.parametrize("act", ["relu", "gelu", "gelu_tanh", "silu", "squared_relu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_within_twice_torch_error(act, dtype):
  x, b, g = _inputs((19, 777), seed=2, dtype=dtype)
  got = _run(x, b, g, act, target_programs=4)
  exact = _torch(x, b, g, act, dtype=torch.float64)
  low = _torch(x, b, g, act)
  for a, e, t, what in zip(got, exact, low, ("out", "grad x", "grad bias")):
    assert a.dtype == dtype
    helpers.assert_within_low_precision_error(a, e, t, what=f"{act} {what}")


def test_plans():
  assert kernels.blocks_for(5, 123) == (8, 128)
  assert kernels.blocks_for(4096, 4096) == (8, 512)
  assert kernels.backward_plan(4096, 4096) == (8, 512, 4, 128, 8)   # 128 x 8 = 1024 programs
  assert kernels.backward_plan(5, 123) == (8, 128, 1, 1, 1)


# The jax-triton wrappers ------------------------------------------------------------------------


def test_wrappers_launch_what_the_kernels_expect():
  x = jax.ShapeDtypeStruct((4100, 1000), jnp.bfloat16)
  b = jax.ShapeDtypeStruct((1000,), jnp.bfloat16)
  with interp.jax_triton_stand_in(run=False) as launches:
    jax.eval_shape(lambda x, b: kernels.bias_act_forward(x, b, "silu"), x, b)
    out = jax.eval_shape(lambda x, b, g: kernels.bias_act_backward(x, b, g, "silu"), x, b, x)
  fwd, bwd = launches
  assert (fwd.kernel, fwd.grid, bwd.kernel, bwd.grid) == (
      "bias_act_fwd_kernel", (513, 2), "bias_act_bwd_kernel", (257, 2))
  assert fwd.constexprs == dict(ROWS=4100, N=1000, BLOCK_R=8, BLOCK_C=512, ACT="silu")
  assert bwd.constexprs == dict(ROWS=4100, N=1000, BLOCK_R=8, BLOCK_C=512, STEPS=2, ACT="silu")
  assert fwd.outputs == [x]
  assert bwd.outputs == [x, jax.ShapeDtypeStruct((257, 1000), jnp.float32)]
  assert out == (x, b)


def test_wrappers_run_in_the_interpreter():
  x, b, g = _inputs((5, 123), seed=3)
  jx, jb, jg = (jnp.asarray(t.numpy()) for t in (x, b, g))
  with interp.jax_triton_stand_in() as launches:
    y = kernels.bias_act_forward(jx, jb, "gelu_tanh")
    dx, db = kernels.bias_act_backward(jx, jb, jg, "gelu_tanh")
  assert [launch.kernel for launch in launches] == ["bias_act_fwd_kernel", "bias_act_bwd_kernel"]
  for got, want in zip((y, dx, db), _torch(x, b, g, "gelu_tanh")):
    helpers.assert_close(got, want)


# The op, end to end -----------------------------------------------------------------------------


def test_op_matches_torch(monkeypatch):
  x, b, g = _inputs((5, 7, 123), seed=4)
  args = [jnp.asarray(t.numpy()) for t in (x, b, g)]
  with interp.triton_ops(monkeypatch) as launches:
    got = helpers.jax_value_and_grads(
        lambda x, b: bias_act(x, b, "gelu", implementation="triton"), args[:2], args[2])
  assert [launch.kernel for launch in launches] == ["bias_act_fwd_kernel", "bias_act_bwd_kernel"]
  assert launches[0].inputs[0].shape == (35, 123)
  for a, w, what in zip(got, _torch(x, b, g, "gelu"), ("out", "grad x", "grad bias")):
    helpers.assert_close(a, w, what=what)


def test_op_takes_named_activations_only(monkeypatch):
  x = jnp.ones((2, 8))
  with interp.triton_ops(monkeypatch), pytest.raises(
      ValueError, match=r"bias_act: implementation='triton' supports the named activations"):
    bias_act(x, x[0], jnp.sin, implementation="triton")
