"""The elementwise Triton kernels (fused add + act, the unfused chain's add and act, relu's
backward from its output): their bodies, run by Triton's interpreter on torch CPU tensors
(TRITON_INTERPRET=1 is set by conftest on machines without a GPU), against the torch twins, and
the ops that use them with implementation="triton" end to end through a stand-in jax_triton."""

import jax
import jax.numpy as jnp
import pytest
import torch

from jaxfuse import ops
from jaxfuse.testing import triton_interpreter as interp
from jaxfuse.testing.torch_ref import elementwise as ref
from jaxfuse.testing.torch_ref import normalization as norm_ref
from tests import helpers

triton = pytest.importorskip("triton")
from jaxfuse.kernels.triton import elementwise as kernels  # noqa: E402

pytestmark = pytest.mark.skipif(helpers.ON_GPU, reason="interpreter tests; GPUs run jax-triton")


def _run(a, b, g, act, out_dtype=None):
  n = a.numel()
  out = torch.empty_like(a, dtype=out_dtype or a.dtype)
  grad = torch.empty_like(a, dtype=out_dtype or a.dtype)
  kernels.add_act_fwd_kernel[kernels.grid_for(n)](a, b, out, N=n, BLOCK=kernels.BLOCK, ACT=act)
  kernels.add_act_bwd_kernel[kernels.grid_for(n)](a, b, g, grad, N=n, BLOCK=kernels.BLOCK,
                                                 ACT=act)
  return out, grad


def _torch(a, b, g, act, dtype=None):
  ta = a.to(dtype or a.dtype).requires_grad_()
  tb = b.to(dtype or b.dtype)
  out = ref.add_act_unfused(ta, tb, act)
  out.backward(g.to(dtype or g.dtype))
  return out.detach(), ta.grad


@pytest.mark.parametrize("act", kernels.ACTIVATIONS)
@pytest.mark.parametrize("n", [1, 1000, 3 * 1024 + 5])
def test_fp32_matches_torch(act, n):
  torch.manual_seed(n)
  a, b, g = 2 * torch.randn(n), torch.randn(n), torch.randn(n)
  out, grad = _run(a, b, g, act)
  want_out, want_grad = _torch(a, b, g, act)
  helpers.assert_close(out, want_out, what=f"{act} out")
  helpers.assert_close(grad, want_grad, what=f"{act} grad")


@pytest.mark.parametrize("act", ["relu", "gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_within_twice_torch_error(act, dtype):
  torch.manual_seed(0)
  n = 5 * 1024 + 77
  a, b, g = (2 * torch.randn(n)).to(dtype), torch.randn(n).to(dtype), torch.randn(n).to(dtype)
  if dtype == torch.bfloat16:
    # Triton's interpreter truncates float32 -> bfloat16 stores (GPUs round to nearest even), so
    # store the float32 result and round it as a GPU would.
    out, grad = (x.to(dtype) for x in _run(a, b, g, act, out_dtype=torch.float32))
  else:
    out, grad = _run(a, b, g, act)
  assert out.dtype == dtype and grad.dtype == dtype
  exact = _torch(a, b, g, act, dtype=torch.float64)
  low = _torch(a, b, g, act)
  helpers.assert_within_low_precision_error(out, exact[0], low[0], what=f"{act} out")
  helpers.assert_within_low_precision_error(grad, exact[1], low[1], what=f"{act} grad")


# The unfused chain's kernels (add, then act) and relu's ------------------------------------------


def _run_chain(a, b, g, act):
  """``(a + b, act(a + b), g * act'(a + b))`` from the add, act forward and act backward
  kernels, each reading the previous one's output as the chain does; stores round as a GPU's."""
  n = a.numel()
  c, out, grad = (torch.full_like(a, float("nan")) for _ in range(3))
  grid = kernels.grid_for(n)
  with interp.gpu_numerics():
    kernels.add_kernel[grid](a, b, c, N=n, BLOCK=kernels.BLOCK)
    kernels.act_fwd_kernel[grid](c, out, N=n, BLOCK=kernels.BLOCK, ACT=act)
    kernels.act_bwd_kernel[grid](c, g, grad, N=n, BLOCK=kernels.BLOCK, ACT=act)
  return c, out, grad


def _torch_chain(a, b, g, act, dtype=None):
  tc = (a.to(dtype or a.dtype) + b.to(dtype or b.dtype)).detach().requires_grad_()
  out = ref.ACTIVATIONS[act](tc)
  out.backward(g.to(dtype or g.dtype))
  return tc.detach(), out.detach(), tc.grad


@pytest.mark.parametrize("act", kernels.ACTIVATIONS)
def test_chain_kernels_fp32_match_torch(act):
  torch.manual_seed(1)
  n = 3 * 1024 + 5
  a, b, g = 2 * torch.randn(n), torch.randn(n), torch.randn(n)
  for got, want, what in zip(_run_chain(a, b, g, act), _torch_chain(a, b, g, act),
                             ("sum", "out", "grad")):
    helpers.assert_close(got, want, what=f"{act} {what}")


@pytest.mark.parametrize("act", ["gelu", "silu"])
def test_chain_kernels_bfloat16_within_twice_torch_error(act):
  torch.manual_seed(2)
  n = 2 * 1024 + 77
  a, b, g = ((s * torch.randn(n)).to(torch.bfloat16) for s in (2, 1, 1))
  got = _run_chain(a, b, g, act)
  exact = _torch_chain(a, b, g, act, dtype=torch.float64)
  low = _torch_chain(a, b, g, act)
  for x, e, t, what in zip(got, exact, low, ("sum", "out", "grad")):
    assert x.dtype == torch.bfloat16
    helpers.assert_within_low_precision_error(x, e, t, what=f"{act} {what}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_relu_backward_from_output(dtype):
  torch.manual_seed(3)
  n = 1024 + 3
  x, g = torch.randn(n).to(dtype), torch.randn(n).to(dtype)
  y, dx = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
  grid = kernels.grid_for(n)
  with interp.gpu_numerics():
    kernels.act_fwd_kernel[grid](x, y, N=n, BLOCK=kernels.BLOCK, ACT="relu")
    kernels.relu_bwd_from_output_kernel[grid](y, g, dx, N=n, BLOCK=kernels.BLOCK)
  assert torch.equal(y, torch.relu(x))
  assert torch.equal(dx, torch.where(x > 0, g, torch.zeros_like(g)))


# The ops, end to end ----------------------------------------------------------------------------

# op -> (f(impl), its torch twin, inputs(dtype)): the ops whose triton implementation uses the
# kernels above (add_rms_norm_unfused: the add kernel around the normalization kernels).
CHAIN_OPS = {
    "add_act_unfused": (
        lambda impl: lambda a, b: ops.add_act_unfused(a, b, "gelu_tanh", implementation=impl),
        lambda a, b: ref.add_act_unfused(a, b, "gelu_tanh"),
        lambda dtype: helpers.random_pair((3, 5, 77), dtype, seed=4)[:2]),
    "relu": (lambda impl: lambda x: ops.relu(x, implementation=impl), torch.relu,
             lambda dtype: helpers.random_pair((3, 5, 77), dtype, seed=5)[:1]),
    "add_rms_norm_unfused": (
        lambda impl: lambda x, r, s: ops.add_rms_norm_unfused(x, r, s, implementation=impl),
        norm_ref.add_rms_norm,
        lambda dtype: (*helpers.random_pair((3, 5, 77), dtype, seed=6)[:2],
                       (1.0 + 0.1 * jax.random.normal(jax.random.key(7), (77,))).astype(dtype))),
}
CHAIN_LAUNCHES = {
    "add_act_unfused": ["add_kernel", "act_fwd_kernel", "act_bwd_kernel"],
    "relu": ["act_fwd_kernel", "relu_bwd_from_output_kernel"],
    "add_rms_norm_unfused": ["add_kernel", "norm_fwd_kernel", "norm_bwd_kernel", "add_kernel"],
}


def _torch_value_and_grads(fn, args, cotangents, dtype=None):
  """The twin's outputs and the gradients of every argument, for one or several outputs."""
  leaves = [helpers.to_torch(a, dtype, requires_grad=True) for a in args]
  out = fn(*leaves)
  outs = list(out) if isinstance(out, tuple) else [out]
  torch.autograd.backward(outs, [helpers.to_torch(c, dtype)
                                 for c in jax.tree_util.tree_leaves(cotangents)])
  return [o.detach() for o in outs] + [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("op", CHAIN_OPS)
def test_chain_ops_match_torch(op, dtype, monkeypatch):
  make, twin, inputs = CHAIN_OPS[op]
  args = inputs(dtype)
  out = jax.eval_shape(make("xla"), *args)
  g = jax.tree_util.tree_map(
      lambda y: jax.random.normal(jax.random.key(8), y.shape).astype(y.dtype), out)
  with interp.triton_ops(monkeypatch) as launches:
    got = jax.tree_util.tree_leaves(helpers.jax_value_and_grads(make("triton"), args, g))
  assert [launch.kernel for launch in launches] == CHAIN_LAUNCHES[op]
  exact = _torch_value_and_grads(twin, args, g, torch.float64)
  if dtype == jnp.float32:
    for a, e in zip(got, exact, strict=True):
      helpers.assert_close(a, e, what=op)
    return
  low = _torch_value_and_grads(twin, args, g)
  for a, e, t in zip(got, exact, low, strict=True):
    assert a.dtype == dtype
    helpers.assert_within_low_precision_error(a, e, t, what=op)
