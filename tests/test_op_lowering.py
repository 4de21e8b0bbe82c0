"""Every case of the op tables (``tests/cases``) that runs on the Pallas kernels lowers for CUDA
through Pallas' Triton backend on this machine (which rejects what Triton would: non-power-of-2
blocks, unsupported ops), forward and backward, in float32 and bfloat16, and launches exactly
the kernels its table entry names (``Case.kernels``): the fused forward once and its backward
kernels once, nothing unfused in between."""

import jax
import jax.numpy as jnp
import pytest

from tests import cases, helpers

PARAMS = [pytest.param(c, dtype, id=f"{c.id}-{dtype}") for c in cases.CASES
          if c.runs_on("pallas") for dtype in ("float32", "bfloat16")]


def _loss(f):
  def loss(*args):
    return sum(jnp.sum(o.astype(jnp.float32)) for o in cases.outputs(f(*args))
               if jnp.issubdtype(o.dtype, jnp.floating))
  return loss


@pytest.mark.parametrize("case,dtype", PARAMS)
def test_forward_and_backward_lower_for_cuda(case, dtype):
  f, diff = case.bind(case.inputs(dtype=jnp.dtype(dtype)), "pallas")
  step = jax.value_and_grad(_loss(f), argnums=tuple(range(len(diff))))
  names = sorted(helpers.triton_kernel_names(helpers.lower_for_gpu(step, *diff)))
  assert names, f"{case.id}: no Pallas kernel in the lowered module"
  if case.kernels is not None:
    assert tuple(names) == case.kernels, (case.id, names)
