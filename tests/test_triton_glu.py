"""The Triton gated-linear-unit (SwiGLU) kernels' bodies, run by Triton's interpreter on torch CPU
tensors (TRITON_INTERPRET=1 is set by conftest on machines without a GPU), against torch; the
jax-triton wrappers' launches, and glu(implementation="triton") in both forms end to end through a
stand-in jax_triton."""

import jax
import jax.numpy as jnp
import pytest
import torch

from jaxfuse.ops import glu
from jaxfuse.testing import triton_interpreter as interp
from jaxfuse.testing.torch_ref import mlp as ref
from tests import helpers

triton = pytest.importorskip("triton")
from jaxfuse.kernels.triton import gated_linear as kernels  # noqa: E402

pytestmark = pytest.mark.skipif(helpers.ON_GPU, reason="interpreter tests; GPUs run jax-triton")


def _run(a, b, g, act, out_dtype=None, packed=False):
  """Forward and backward launches as the jax-triton wrappers make them."""
  rows, h = g.shape
  dtype = out_dtype or a.dtype
  grid = kernels.grid_for(rows, h)
  meta = dict(ROWS=rows, H=h, BLOCK_R=kernels.BLOCK_R, BLOCK_C=kernels.BLOCK_C, ACT=act)
  out = torch.empty(rows, h, dtype=dtype)
  if packed:
    x = torch.cat([a, b], dim=-1)
    kernels.glu_fwd_kernel[grid](x, x, out, IN_STRIDE=2 * h, B_OFFSET=h, **meta)
    dx = torch.empty(rows, 2 * h, dtype=dtype)
    kernels.glu_bwd_packed_kernel[grid](x, g, dx, **meta)
    return out, dx[:, :h], dx[:, h:]
  kernels.glu_fwd_kernel[grid](a, b, out, IN_STRIDE=h, B_OFFSET=0, **meta)
  da, db = torch.empty(rows, h, dtype=dtype), torch.empty(rows, h, dtype=dtype)
  kernels.glu_bwd_kernel[grid](a, b, g, da, db, IN_STRIDE=h, B_OFFSET=0, **meta)
  return out, da, db


def _torch(a, b, g, act, dtype=None):
  ta = a.to(dtype or a.dtype).requires_grad_()
  tb = b.to(dtype or b.dtype).requires_grad_()
  out = ref.glu(ta, tb, act)
  out.backward(g.to(dtype or g.dtype))
  return out.detach(), ta.grad, tb.grad


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("shape", [(1, 1), (5, 123), (3, 423), (13, 300), (9, 1000)], ids=str)
@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
def test_fp32_matches_torch(act, shape, packed):
  torch.manual_seed(shape[1])
  a, b, g = 2 * torch.randn(shape), torch.randn(shape), torch.randn(shape)
  got = _run(a, b, g, act, packed=packed)
  for x, y, what in zip(got, _torch(a, b, g, act), ("out", "grad a", "grad b")):
    helpers.assert_close(x, y, what=f"{act} {what}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
def test_swiglu_low_precision_within_twice_torch_error(dtype, packed):
  torch.manual_seed(0)
  shape = (17, 777)
  a, b, g = ((s * torch.randn(shape)).to(dtype) for s in (2, 1, 1))
  if dtype == torch.bfloat16:
    # Triton's interpreter truncates float32 -> bfloat16 stores (GPUs round to nearest even), so
    # store float32 and round as a GPU would.
    got = [x.to(dtype) for x in _run(a, b, g, "silu", out_dtype=torch.float32, packed=packed)]
  else:
    got = _run(a, b, g, "silu", packed=packed)
  exact = _torch(a, b, g, "silu", dtype=torch.float64)
  low = _torch(a, b, g, "silu")
  for x, e, t, what in zip(got, exact, low, ("out", "grad a", "grad b")):
    assert x.dtype == dtype
    helpers.assert_within_low_precision_error(x, e, t, what=what)


# The jax-triton wrappers ------------------------------------------------------------------------


def test_wrappers_launch_what_the_kernels_expect():
  half = jax.ShapeDtypeStruct((100, 1000), jnp.bfloat16)
  packed = jax.ShapeDtypeStruct((100, 2000), jnp.bfloat16)
  with interp.jax_triton_stand_in(run=False) as launches:
    jax.eval_shape(lambda a, b: kernels.glu_forward(a, b, "silu"), half, half)
    jax.eval_shape(lambda x: kernels.glu_forward(x, None, "silu"), packed)
    out = jax.eval_shape(lambda a, b, g: kernels.glu_backward(a, b, g, "silu"), half, half, half)
    dx = jax.eval_shape(lambda x, g: kernels.glu_backward(x, None, g, "silu"), packed, half)
  assert out == (half, half) and dx == packed
  assert [(c.kernel, c.grid) for c in launches] == [
      ("glu_fwd_kernel", (13, 4)), ("glu_fwd_kernel", (13, 4)), ("glu_bwd_kernel", (13, 4)),
      ("glu_bwd_packed_kernel", (13, 4))]
  blocks = dict(BLOCK_R=kernels.BLOCK_R, BLOCK_C=kernels.BLOCK_C, ACT="silu")
  assert launches[0].constexprs == dict(ROWS=100, H=1000, IN_STRIDE=1000, B_OFFSET=0, **blocks)
  assert launches[1].constexprs == dict(ROWS=100, H=1000, IN_STRIDE=2000, B_OFFSET=1000,
                                        **blocks)
  assert launches[3].constexprs == dict(ROWS=100, H=1000, **blocks)
  assert [c.outputs for c in launches] == [[half], [half], [half, half], [packed]]


@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
def test_wrappers_run_in_the_interpreter(packed):
  torch.manual_seed(5)
  a, b, g = 2 * torch.randn(5, 123), torch.randn(5, 123), torch.randn(5, 123)
  ja, jb, jg = (jnp.asarray(t.numpy()) for t in (a, b, g))
  with interp.jax_triton_stand_in():
    if packed:
      x = jnp.concatenate([ja, jb], axis=-1)
      y = kernels.glu_forward(x, None, "gelu")
      dx = kernels.glu_backward(x, None, jg, "gelu")
      da, db = dx[:, :123], dx[:, 123:]
    else:
      y = kernels.glu_forward(ja, jb, "gelu")
      da, db = kernels.glu_backward(ja, jb, jg, "gelu")
  for got, want in zip((y, da, db), _torch(a, b, g, "gelu")):
    helpers.assert_close(got, want)


# The op, end to end -----------------------------------------------------------------------------


@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
def test_op_matches_torch(packed, monkeypatch):
  torch.manual_seed(6)
  a, b, g = 2 * torch.randn(3, 5, 123), torch.randn(3, 5, 123), torch.randn(3, 5, 123)
  ja, jb, jg = (jnp.asarray(t.numpy()) for t in (a, b, g))
  want = _torch(a, b, g, "silu")
  with interp.triton_ops(monkeypatch) as launches:
    if packed:
      x = jnp.concatenate([ja, jb], axis=-1)
      y, dx = helpers.jax_value_and_grads(lambda x: glu(x, implementation="triton"), (x,), jg)
      got = (y, dx[..., :123], dx[..., 123:])
    else:
      got = helpers.jax_value_and_grads(lambda a, b: glu(a, b, implementation="triton"),
                                        (ja, jb), jg)
  backward = "glu_bwd_packed_kernel" if packed else "glu_bwd_kernel"
  assert [launch.kernel for launch in launches] == ["glu_fwd_kernel", backward]
  for x, y, what in zip(got, want, ("out", "grad a", "grad b")):
    helpers.assert_close(x, y, what=what)
