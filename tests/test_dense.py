"""dense (Flax's x @ kernel + bias) against torch's F.linear: forward and all gradients, the
weight-gradient product in both of its layouts, and no extra matmul in the MLP blocks."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxfuse.ops import dense, dense_reference
from jaxfuse.ops import linear as linear_ops
from jaxfuse.remat import mlp as blocks
from tests import helpers

# Odd sizes, (5, 37, 123) -> 67 with a bias and (37, 123) -> 67 without, are the op table's
# cases (tests/cases/linear.py), against torch in every dtype.
SHAPES = [((64, 32), 48), ((1, 3), 1)]


def _inputs(x_shape, out, dtype, seed=0):
  x, kernel, bias, g = helpers.numpy_normals(seed, x_shape, (x_shape[-1], out), (out,),
                                             (*x_shape[:-1], out))
  return helpers.to_jax(dtype, x, kernel / np.float32(x_shape[-1] ** 0.5), bias, g)


def _torch_dense(x, kernel, bias):
  return torch.nn.functional.linear(x, kernel.T, bias)


@pytest.mark.parametrize("x_shape,out", SHAPES, ids=str)
@pytest.mark.parametrize("with_bias", [True, False])
def test_fp32_matches_torch_linear(x_shape, out, with_bias):
  x, kernel, bias, g = _inputs(x_shape, out, jnp.float32)
  if not with_bias:
    got = helpers.jax_value_and_grads(
        lambda x, k: dense(x, k, precision=jax.lax.Precision.HIGHEST), (x, kernel), g)
    want = helpers.torch_value_and_grads(lambda x, k: _torch_dense(x, k, None), (x, kernel), g)
  else:
    got = helpers.jax_value_and_grads(
        lambda x, k, b: dense(x, k, b, precision=jax.lax.Precision.HIGHEST), (x, kernel, bias), g)
    want = helpers.torch_value_and_grads(_torch_dense, (x, kernel, bias), g)
  for a, b, what in zip(got, want, ("out", "grad x", "grad kernel", "grad bias")):
    helpers.assert_close(a, b, what=what)


@pytest.mark.parametrize("min_macs", [0, 1 << 62], ids=["transposed copy", "as is"])
def test_rows_product_in_both_layouts(monkeypatch, min_macs):
  """a^T @ b is the same whether it goes through a's transposed copy or not."""
  monkeypatch.setattr(linear_ops, "_TRANSPOSE_MIN_MACS", min_macs)
  a = helpers.normal(1, (300, 50))  # narrower than b: the copy applies
  b = helpers.normal(2, (300, 70))
  got = jax.jit(lambda a, b: linear_ops._rows_product(a, b, jnp.float32,
                                                      jax.lax.Precision.HIGHEST))(a, b)
  want = np.asarray(a, np.float64).T @ np.asarray(b, np.float64)
  helpers.assert_close(got, want)


@pytest.mark.parametrize("with_bias", [True, False])
def test_gradients_are_autodiffs_of_the_reference(with_bias):
  """The custom backward computes what autodiff of the plain-jnp reference does."""
  x, kernel, bias, g = _inputs((3, 50, 40), 90, jnp.float32, seed=4)
  b = bias if with_bias else None
  got = helpers.jax_value_and_grads(lambda x, k: dense(x, k, b), (x, kernel), g)
  want = helpers.jax_value_and_grads(lambda x, k: dense_reference(x, k, b), (x, kernel), g)
  for a, w, what in zip(got, want, ("out", "grad x", "grad kernel")):
    helpers.assert_close(a, w, what=what)


def test_bad_inputs_are_named():
  x, kernel, bias, _ = _inputs((4, 8), 6, jnp.float32)
  with pytest.raises(ValueError, match=r"dense: .*kernel is \[in, out\]"):
    dense(x, kernel.T)
  with pytest.raises(ValueError, match=r"dense: kernel"):
    dense(x, kernel[None])
  with pytest.raises(ValueError, match=r"dense: .*bias is \[out\]"):
    dense(x, kernel, jnp.zeros(5))
  with pytest.raises(ValueError, match=r"dense: bias"):
    dense(x, kernel, jnp.zeros((1, 6)))
  with pytest.raises(TypeError, match="dense: x, kernel must share one dtype"):
    dense(x, kernel.astype(jnp.bfloat16))
  with pytest.raises(TypeError, match="dense: x"):
    dense(x.astype(jnp.int32), kernel)
  with pytest.raises(ValueError, match="dense: implementation='pallas' is not provided"):
    dense(x, kernel, implementation="pallas")
  with pytest.raises(ValueError, match="dense: implementation must be"):
    dense(x, kernel, implementation="cuda")


def test_gated_mlp_step_has_nine_matmuls():
  """3 in the forward, 2 per projection in the backward: the custom gradient adds none, and
  the recomputation under recompute="activation" is the fused activation, not a matmul."""
  x = jnp.ones((64, 32))
  wg, wu, wd = jnp.ones((32, 96)), jnp.ones((32, 96)), jnp.ones((96, 32))
  step = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(blocks.gated_mlp(*a)),
                                    argnums=(0, 1, 2, 3)))
  hlo = step.lower(x, wg, wu, wd).compile().as_text()
  assert len(re.findall(r" dot\(", hlo)) == 9
