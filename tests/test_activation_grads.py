"""The XLA paths' activation forms and hand-written derivatives against torch, over a wide range."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxfuse.ops import activation_grads, activations
from jaxfuse.testing.torch_ref.elementwise import ACTIVATIONS as TORCH
from tests import helpers

NAMES = ["silu", "gelu", "gelu_tanh", "relu", "squared_relu", "sigmoid", "tanh", "identity"]


@pytest.mark.parametrize("name", NAMES)
def test_value_and_grad_match_torch(name):
  x = jnp.concatenate([jnp.linspace(-30.0, 30.0, 20001),
                       jnp.array([0.0, -0.0, 1e-30, -100.0, -90.0, 90.0, 100.0])])
  value, grad = jax.jit(lambda x: activation_grads.value_and_grad(name, x))(x)
  tx = helpers.to_torch(x, requires_grad=True)
  ty = TORCH[name](tx)
  (tgrad,) = torch.autograd.grad(ty.sum(), tx)
  helpers.assert_close(value, ty, what=f"{name} value")
  helpers.assert_close(grad, tgrad, what=f"{name} grad")
  helpers.assert_close(activation_grads.value(name, x), ty, what=f"{name} value()")


def test_a_user_function_goes_through_jvp():
  fn = lambda x: jnp.sin(x) * x  # noqa: E731
  x = jnp.linspace(-3.0, 3.0, 101)
  value, grad = activation_grads.value_and_grad(fn, x)
  helpers.assert_close(value, np.sin(x) * x)
  helpers.assert_close(grad, np.cos(x) * x + np.sin(x))
  assert activation_grads.value(activations.gelu, x).shape == x.shape


def test_nan_propagates():
  values = jax.jit(lambda x: [activation_grads.value_and_grad(name, x)[0] for name in NAMES])(
      jnp.array([jnp.nan]))
  for name, value in zip(NAMES, values):
    assert np.isnan(np.asarray(value)).all(), name
