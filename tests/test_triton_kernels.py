"""The Triton kernels' bodies, run by Triton's interpreter on torch CPU tensors (TRITON_INTERPRET=1
is set by conftest on machines without a GPU), against the torch twins."""

import pytest
import torch

from tests import helpers
from tests.torch_ref import elementwise as ref

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
