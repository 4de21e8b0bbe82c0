"""GatedMLP and MLP (nnx and linen) against torch twins given the same weights: outputs and the
gradients of the input and of every parameter; what the backward keeps; kernel launches."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxfuse import linen as jlinen
from jaxfuse import nnx as jnnx
from jaxfuse.metrics import residual_bytes
from jaxfuse.remat import mlp as blocks
from jaxfuse.testing.torch_ref import mlp as ref
from tests import helpers

D, H = 64, 200  # H is not a multiple of any block
GATED = ("gate_proj", "up_proj", "down_proj")


def _copy_linears(torch_model, torch_names, dtype):
  """{our name: {"kernel": W.T, "bias": b}} from torch nn.Linear layers."""
  out = {}
  for ours, theirs in torch_names.items():
    layer = getattr(torch_model, theirs)
    entry = {"kernel": jnp.asarray(layer.weight.detach().float().numpy().T, dtype)}
    if layer.bias is not None:
      entry["bias"] = jnp.asarray(layer.bias.detach().float().numpy(), dtype)
    out[ours] = entry
  return out


def _set_nnx(model, params):
  for name, entry in params.items():
    for key, value in entry.items():
      getattr(getattr(model, name), key)[...] = value


def _nnx_value_and_grads(model, x, g):
  graphdef, state = nnx.split(model, nnx.Param)

  @jax.jit
  def run(state, x):
    def loss(state, x):
      y = nnx.merge(graphdef, state)(x)
      return jnp.sum(y.astype(jnp.float32) * g.astype(jnp.float32)), y
    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(state, x)
    return y, grads

  y, (grad_state, dx) = run(state, x)
  return y, dx, nnx.to_pure_dict(grad_state)


def _torch_value_and_grads(model, x, g):
  tx = helpers.to_torch(x, next(model.parameters()).dtype, requires_grad=True)
  y = model(tx)
  y.backward(helpers.to_torch(g, y.dtype))
  return y, tx.grad


def _inputs(dtype, seed=0, shape=(3, 37)):
  return helpers.normals(seed, (*shape, D), (*shape, D), dtype=dtype)


def _assert_grads(grads, torch_model, names, assert_fn):
  for ours, theirs in names.items():
    layer = getattr(torch_model, theirs)
    assert_fn(grads[ours]["kernel"], layer.weight.grad.T, f"{ours}.kernel")
    if layer.bias is not None:
      assert_fn(grads[ours]["bias"], layer.bias.grad, f"{ours}.bias")


@pytest.mark.parametrize("impl", helpers.CPU_IMPLEMENTATIONS)
@pytest.mark.parametrize("use_bias", [False, True], ids=["llama", "bias"])
def test_gated_mlp_matches_torch_llama_mlp(impl, use_bias, pallas_mode):
  torch.manual_seed(0)
  twin = ref.LlamaMLP(D, H, bias=use_bias)
  model = jnnx.GatedMLP(D, H, use_bias=use_bias, implementation=impl, rngs=nnx.Rngs(0))
  _set_nnx(model, _copy_linears(twin, {n: n for n in GATED}, jnp.float32))
  x, g = _inputs(jnp.float32)
  y, dx, grads = _nnx_value_and_grads(model, x, g)
  ty, tdx = _torch_value_and_grads(twin, x, g)
  helpers.assert_close(y, ty, what="out")
  helpers.assert_close(dx, tdx, what="grad x")
  _assert_grads(grads, twin, {n: n for n in GATED},
                lambda a, b, what: helpers.assert_close(a, b, what=what))


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
def test_gated_mlp_geglu_and_reglu(activation):
  torch.manual_seed(1)
  twin = ref.LlamaMLP(D, H, act=activation)
  model = jnnx.GatedMLP(D, H, activation=activation, rngs=nnx.Rngs(0))
  _set_nnx(model, _copy_linears(twin, {n: n for n in GATED}, jnp.float32))
  x, g = _inputs(jnp.float32, seed=1)
  y, dx, grads = _nnx_value_and_grads(model, x, g)
  ty, tdx = _torch_value_and_grads(twin, x, g)
  helpers.assert_close(y, ty)
  helpers.assert_close(dx, tdx)
  _assert_grads(grads, twin, {n: n for n in GATED},
                lambda a, b, what: helpers.assert_close(a, b, what=what))


@pytest.mark.parametrize("dtype", [jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_gated_mlp_low_precision_within_twice_torch_error(dtype):
  torch.manual_seed(2)
  exact = ref.LlamaMLP(D, H, dtype=torch.float64)
  low = ref.LlamaMLP(D, H, dtype=helpers.TORCH_DTYPES[jnp.dtype(dtype)])
  low.load_state_dict({k: v.to(low.gate_proj.weight.dtype) for k, v in exact.state_dict().items()})
  # Both start from the same low-precision weights.
  exact.load_state_dict({k: v.double() for k, v in low.state_dict().items()})
  model = jnnx.GatedMLP(D, H, param_dtype=dtype, rngs=nnx.Rngs(0))
  _set_nnx(model, _copy_linears(low, {n: n for n in GATED}, dtype))
  x, g = _inputs(dtype, seed=2)
  y, dx, grads = _nnx_value_and_grads(model, x, g)
  assert y.dtype == dtype
  ey, edx = _torch_value_and_grads(exact, x, g)
  ly, ldx = _torch_value_and_grads(low, x, g)
  helpers.assert_within_low_precision_error(y, ey, ly, what="out")
  helpers.assert_within_low_precision_error(dx, edx, ldx, what="grad x")
  for name in GATED:
    helpers.assert_within_low_precision_error(grads[name]["kernel"], getattr(exact, name).weight.grad.T,
                                      getattr(low, name).weight.grad.T, what=name)


@pytest.mark.parametrize("impl", helpers.CPU_IMPLEMENTATIONS)
def test_mlp_matches_torch(impl, pallas_mode):
  torch.manual_seed(3)
  twin = ref.MLP(D, H, act="gelu")
  names = {"up_proj": "fc1", "down_proj": "fc2"}
  model = jnnx.MLP(D, H, implementation=impl, rngs=nnx.Rngs(0))
  _set_nnx(model, _copy_linears(twin, names, jnp.float32))
  x, g = _inputs(jnp.float32, seed=3)
  y, dx, grads = _nnx_value_and_grads(model, x, g)
  ty, tdx = _torch_value_and_grads(twin, x, g)
  helpers.assert_close(y, ty)
  helpers.assert_close(dx, tdx)
  _assert_grads(grads, twin, names,
                lambda a, b, what: helpers.assert_close(a, b, what=what))


@pytest.mark.parametrize("kind", ["GatedMLP", "MLP"])
def test_linen_twin_of_nnx(kind):
  """The linen module, given the nnx module's parameters (same names and layouts), gives the same
  outputs and gradients."""
  nnx_model = getattr(jnnx, kind)(D, H, use_bias=True, rngs=nnx.Rngs(4))
  linen_model = getattr(jlinen, kind)(hidden_features=H, use_bias=True)
  x, g = _inputs(jnp.float32, seed=4)
  params = nnx.to_pure_dict(nnx.state(nnx_model, nnx.Param))
  shapes = jax.tree.map(jnp.shape, linen_model.init(jax.random.key(0), x)["params"])
  assert shapes == jax.tree.map(jnp.shape, params)

  def loss(params, x):
    return jnp.sum(linen_model.apply({"params": params}, x) * g)

  (got_grads, got_dx) = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
  y, dx, grads = _nnx_value_and_grads(nnx_model, x, g)
  helpers.assert_close(jax.jit(linen_model.apply)({"params": params}, x), y)
  helpers.assert_close(got_dx, dx)
  jax.tree.map(helpers.assert_close, got_grads, grads)


# What the backward keeps -------------------------------------------------------------------------


def _plain_gated_block(x, wg, wu, wd):
  return (jax.nn.silu(x @ wg) * (x @ wu)) @ wd


def test_gated_mlp_keeps_at_most_half_of_the_plain_block():
  x, _ = _inputs(jnp.float32, shape=(256,))
  wg, wu, wd = helpers.normals(5, (D, 4 * D), (D, 4 * D), (4 * D, D))
  plain = residual_bytes(lambda *a: jnp.sum(_plain_gated_block(*a)), x, wg, wu, wd)
  for recompute, hidden_arrays in (("activation", 2), ("block", 0), (None, 3)):
    ours = residual_bytes(lambda *a: jnp.sum(blocks.gated_mlp(*a, recompute=recompute)),
                          x, wg, wu, wd)
    assert ours == hidden_arrays * 256 * 4 * D * 4, recompute
  assert residual_bytes(lambda *a: jnp.sum(blocks.gated_mlp(*a)), x, wg, wu, wd) <= plain / 2


def test_recompute_choices_agree():
  model = jnnx.GatedMLP(D, H, rngs=nnx.Rngs(6))
  x, g = _inputs(jnp.float32, seed=6)
  results = []
  for recompute in blocks.RECOMPUTE:
    model.recompute = recompute
    results.append(_nnx_value_and_grads(model, x, g))
  for other in results[1:]:
    jax.tree.map(lambda a, b: helpers.assert_close(a, b), results[0], other)


def test_gated_mlp_kernel_launches():
  """glu_bwd runs once. glu_fwd runs twice with recompute="activation" (the forward, then the
  hidden activation's recomputation for the down projection's weight gradient) and once with
  recompute=None, which keeps the hidden activation instead."""
  x, _ = _inputs(jnp.float32, shape=(37,))
  wg, wu, wd = helpers.normals(7, (D, H), (D, H), (H, D))
  for recompute, fwd in (("activation", 2), (None, 1)):
    step = jax.value_and_grad(lambda *a: jnp.sum(blocks.gated_mlp(
        *a, recompute=recompute, implementation="pallas")), argnums=(0, 1, 2, 3))
    names = helpers.triton_kernel_names(helpers.lower_for_gpu(step, x, wg, wu, wd))
    assert sorted(names) == ["glu_bwd"] + ["glu_fwd"] * fwd, recompute


def test_bad_recompute_is_named():
  with pytest.raises(ValueError, match=r"GatedMLP: recompute must be one of.*'everything'"):
    jnnx.GatedMLP(D, H, recompute="everything", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"MLP: recompute must be one of.*'x'"):
    jlinen.MLP(H, recompute="x").init(jax.random.key(0), jnp.ones((2, D)))


def test_modules_are_keyword_only_for_rngs_and_dtypes():
  with pytest.raises(TypeError):
    jnnx.GatedMLP(D, H, D, "silu", rngs=nnx.Rngs(0))  # noqa: too many positional arguments
  model = jnnx.GatedMLP(D, H, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  assert model.gate_proj.kernel[...].dtype == jnp.float32
  y = nnx.jit(lambda m, x: m(x))(model, jnp.ones((2, D)))
  assert y.dtype == jnp.bfloat16
  assert np.isfinite(np.asarray(y.astype(jnp.float32))).all()
