"""The Triton rms_norm kernels' bodies, run by Triton's interpreter on torch CPU tensors
(TRITON_INTERPRET=1 is set by conftest on machines without a GPU), against torch.nn.RMSNorm."""

import pytest
import torch

from tests import helpers
from tests.torch_ref import normalization as ref

triton = pytest.importorskip("triton")
from jaxfuse.kernels.triton import normalization as kernels  # noqa: E402

pytestmark = pytest.mark.skipif(helpers.ON_GPU, reason="interpreter tests; GPUs run jax-triton")

EPS = 1e-6


def _run(x, w, g, out_dtype=None):
  """Forward and backward kernels: (y, dx, dw); dw is None without a scale."""
  rows, hidden = x.shape
  block = kernels.block_for(hidden)
  y = torch.empty_like(x, dtype=out_dtype or x.dtype)
  rstd = torch.empty(rows, 1)
  kernels.rms_norm_fwd_kernel[(rows,)](x, x if w is None else w, y, rstd, H=hidden, eps=EPS,
                                       BLOCK_H=block, HAS_SCALE=w is not None)
  programs, per_program = kernels.backward_grid(rows)
  dx = torch.empty_like(x, dtype=out_dtype or x.dtype)
  partial = torch.zeros(programs, hidden)
  kernels.rms_norm_bwd_kernel[(programs,)](x, g, x if w is None else w, rstd, dx, partial,
                                           R=rows, H=hidden, ROWS_PER_PROGRAM=per_program,
                                           BLOCK_H=block, HAS_SCALE=w is not None)
  return y, dx, (None if w is None else partial.sum(0)), rstd


def _torch(x, w, g, dtype=None):
  x = x.to(dtype or x.dtype).requires_grad_()
  w = None if w is None else w.to(dtype or w.dtype).requires_grad_()
  y = ref.rms_norm(x, w, eps=EPS)
  y.backward(g.to(dtype or g.dtype))
  return y.detach(), x.grad, (None if w is None else w.grad)


@pytest.mark.parametrize("rows,hidden", [(5, 64), (33, 1000), (3, 4097), (2, 8192)])
def test_fp32_matches_torch(rows, hidden):
  torch.manual_seed(hidden)
  x, g = torch.randn(rows, hidden) + 1.0, torch.randn(rows, hidden)
  w = 1.0 + 0.5 * torch.randn(hidden)
  y, dx, dw, rstd = _run(x, w, g)
  want = _torch(x, w, g)
  for got, expected, what in zip((y, dx, dw), want, ("out", "grad x", "grad scale")):
    helpers.assert_close(got, expected, what=what)
  helpers.assert_close(rstd[:, 0], torch.rsqrt(x.pow(2).mean(-1) + EPS), what="rstd")


def test_without_scale():
  torch.manual_seed(1)
  x, g = torch.randn(7, 300), torch.randn(7, 300)
  y, dx, dw, _ = _run(x, None, g)
  want_y, want_dx, _ = _torch(x, None, g)
  assert dw is None
  helpers.assert_close(y, want_y)
  helpers.assert_close(dx, want_dx)


def test_many_rows_per_backward_program(monkeypatch):
  """More rows than backward programs: each program walks several rows and its partial scale
  gradient covers all of them."""
  monkeypatch.setattr(kernels, "MAX_BACKWARD_PROGRAMS", 8)
  rows = 8 + 3
  programs, per_program = kernels.backward_grid(rows)
  assert per_program == 2 and programs * per_program >= rows
  torch.manual_seed(2)
  x, g, w = torch.randn(rows, 16), torch.randn(rows, 16), torch.randn(16)
  _, dx, dw, _ = _run(x, w, g)
  _, want_dx, want_dw = _torch(x, w, g)
  helpers.assert_close(dx, want_dx)
  helpers.assert_close(dw, want_dw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_within_twice_torch_error(dtype):
  torch.manual_seed(3)
  x = torch.randn(9, 1000).to(dtype)
  g = torch.randn(9, 1000).to(dtype)
  w = (1.0 + 0.5 * torch.randn(1000)).to(dtype)
  if dtype == torch.bfloat16:
    # Triton's interpreter truncates float32 -> bfloat16 stores (GPUs round to nearest even), so
    # store float32 and round as a GPU would.
    y, dx, dw, _ = _run(x, w, g, out_dtype=torch.float32)
    y, dx = y.to(dtype), dx.to(dtype)
  else:
    y, dx, dw, _ = _run(x, w, g)
  dw = dw.to(dtype)
  exact = _torch(x, w, g, dtype=torch.float64)
  low = _torch(x, w, g)
  for got, e, t, what in zip((y, dx, dw), exact, low, ("out", "grad x", "grad scale")):
    assert got.dtype == dtype
    helpers.assert_within_low_precision_error(got, e, t, what=what)


def test_rejects_rows_longer_than_one_block():
  with pytest.raises(ValueError, match=r"hidden size of at most 32768, got 32769"):
    kernels.block_for(kernels.MAX_HIDDEN + 1)
