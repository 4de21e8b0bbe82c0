"""SimpleNN (NNX and Linen) against the seed's torch model with the same weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import jaxfuse
from jaxfuse import interop
from jaxfuse.metrics import residual_bytes, torch_residual_bytes
from jaxfuse.testing.torch_ref import seed as torch_seed
from tests import helpers

VARIANTS = [None, "fc1", "block"]
B, IN, HIDDEN, OUT = 37, 24, 130, 9  # nothing is a multiple of a block


def _torch_model(recompute, seed=0):
  torch.manual_seed(seed)
  model = torch_seed.SimpleNN(IN, HIDDEN, OUT, recompute=recompute).double()
  with torch.no_grad():
    model.fc1_weight.mul_(IN ** -0.5)  # the seed's randn init, scaled to keep values moderate
  return model.float()


def _data(seed=1):
  kx, ky = jax.random.split(jax.random.key(seed))
  return jax.random.normal(kx, (B, IN)), jax.random.normal(ky, (B, OUT))


def _torch_step(model, x, y):
  tx = helpers.to_torch(x, requires_grad=True)
  loss = torch.mean((model(tx) - helpers.to_torch(y)) ** 2)
  loss.backward()
  grads = {name: p.grad for name, p in model.named_parameters()}
  return loss, tx.grad, grads


def _nnx_step(model, x, y):
  graphdef, params = nnx.split(model, nnx.Param)

  def loss_fn(params, x):
    return jnp.mean((nnx.merge(graphdef, params)(x) - y) ** 2)

  loss, (grad_params, grad_x) = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))(params, x)
  nnx.update(model, grad_params)  # the model now holds the gradients, for the torch mapping
  return loss, grad_x, interop.torch_state_dict(model)


@pytest.mark.parametrize("recompute", VARIANTS)
def test_nnx_matches_torch_seed_model(recompute):
  x, y = _data()
  torch_model = _torch_model(recompute)
  model = jaxfuse.nnx.SimpleNN(IN, HIDDEN, OUT, recompute=recompute, rngs=nnx.Rngs(0))
  interop.load_torch_state_dict(model, torch_model.state_dict())
  loss, grad_x, grads = _nnx_step(model, x, y)
  t_loss, t_grad_x, t_grads = _torch_step(torch_model, x, y)
  helpers.assert_close(loss, t_loss, what="loss")
  helpers.assert_close(grad_x, t_grad_x, what="grad x")
  assert sorted(grads) == sorted(t_grads)
  for name, g in t_grads.items():
    helpers.assert_close(grads[name], g, what=f"grad {name}")


@pytest.mark.parametrize("recompute", VARIANTS)
def test_linen_matches_torch_seed_model(recompute):
  x, y = _data(seed=2)
  torch_model = _torch_model(recompute, seed=3)
  model = jaxfuse.linen.SimpleNN(HIDDEN, OUT, recompute=recompute)
  variables = model.init(jax.random.key(0), x)
  variables = interop.linen_params_from_torch(model, variables, torch_model.state_dict())

  def loss_fn(variables, x):
    return jnp.mean((model.apply(variables, x) - y) ** 2)

  loss, (grad_vars, grad_x) = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))(variables, x)
  grads = interop.linen_params_to_torch(model, grad_vars)
  t_loss, t_grad_x, t_grads = _torch_step(torch_model, x, y)
  helpers.assert_close(loss, t_loss, what="loss")
  helpers.assert_close(grad_x, t_grad_x, what="grad x")
  for name, g in t_grads.items():
    helpers.assert_close(grads[name], g, what=f"grad {name}")


def test_nnx_and_linen_agree_on_parameter_names_and_layouts():
  x, _ = _data()
  nnx_model = jaxfuse.nnx.SimpleNN(IN, HIDDEN, OUT, rngs=nnx.Rngs(0))
  linen_model = jaxfuse.linen.SimpleNN(HIDDEN, OUT)
  variables = linen_model.init(jax.random.key(0), x)
  nnx_state = interop.torch_state_dict(nnx_model)
  linen_state = interop.linen_params_to_torch(linen_model, variables)
  assert {k: v.shape for k, v in nnx_state.items()} == {k: v.shape for k, v in linen_state.items()}
  variables = interop.linen_params_from_torch(linen_model, variables, nnx_state)
  np.testing.assert_array_equal(linen_model.apply(variables, x), nnx_model(x))


def test_state_dict_round_trip_and_errors():
  model = jaxfuse.nnx.SimpleNN(IN, HIDDEN, OUT, rngs=nnx.Rngs(0))
  torch_model = _torch_model("fc1")
  interop.load_torch_state_dict(model, torch_model.state_dict())
  back = interop.torch_state_dict(model, as_torch=True)
  for name, value in torch_model.state_dict().items():
    torch.testing.assert_close(back[name], value, rtol=0, atol=0)
  state = dict(torch_model.state_dict())
  state["fc2.weight"] = state["fc2.weight"][:, :-1]
  with pytest.raises(ValueError, match=r"fc2.weight.*expected shape \(9, 130\), got \(9, 129\)"):
    interop.load_torch_state_dict(model, state)
  del state["fc2.weight"]
  with pytest.raises(ValueError, match=r"missing keys \['fc2.weight'\]"):
    interop.load_torch_state_dict(model, state)


def test_residual_bytes_of_the_three_layouts():
  """Plain autodiff and fc1 keep no more than torch's seed model (the relu reads its mask off
  its output, which fc2 keeps: no mask of the hidden width); block keeps at most its output
  and is >= 4x below plain autodiff."""
  x, y = _data()
  kept = {}
  for recompute in VARIANTS:
    model = jaxfuse.nnx.SimpleNN(IN, HIDDEN, OUT, recompute=recompute, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    kept[recompute] = residual_bytes(
        lambda p, x: jnp.mean((nnx.merge(graphdef, p)(x) - y) ** 2), params, x)
  torch_model = _torch_model("fc1")
  tx = helpers.to_torch(x, requires_grad=True)
  ty = helpers.to_torch(y)
  torch_kept = torch_residual_bytes(lambda: torch.mean((torch_model(tx) - ty) ** 2),
                                    exclude=[tx, ty, *torch_model.parameters()])
  output_bytes = B * OUT * 4
  assert kept["fc1"] <= torch_kept
  assert kept[None] <= torch_kept
  assert kept["block"] <= output_bytes
  assert kept[None] >= 4 * kept["block"]


@pytest.mark.parametrize("recompute", VARIANTS)
def test_pallas_fc1_and_bfloat16(recompute, pallas_mode):
  x, y = _data(seed=4)
  model = jaxfuse.nnx.SimpleNN(IN, HIDDEN, OUT, recompute=recompute, dtype=jnp.bfloat16,
                               implementation="pallas", rngs=nnx.Rngs(0))
  out = model(x)
  assert out.dtype == jnp.bfloat16
  # Against the float64 torch model with the same weights, our error is at most twice that of
  # the torch model in bfloat16.
  torch_model = _torch_model(recompute)
  interop.load_torch_state_dict(model, torch_model.state_dict())
  out = model(x)
  tx = helpers.to_torch(x)
  exact = torch_model.double()(tx.double())
  low = torch_model.bfloat16()(tx.bfloat16())
  helpers.assert_within_low_precision_error(out, exact, low)


def test_bad_recompute_choice():
  with pytest.raises(ValueError, match=r"recompute must be one of \(None, 'fc1', 'block'\)"):
    jaxfuse.nnx.SimpleNN(2, 3, 4, recompute="fc2", rngs=nnx.Rngs(0))
