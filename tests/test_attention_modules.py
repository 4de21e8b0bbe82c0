"""The attention modules against their flax namesakes (twin tests: same parameters, same outputs
and gradients), and the rotary embedding against its torch twin."""

import warnings

import flax.linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import jaxfuse.linen
import jaxfuse.nnx
from jaxfuse.ops import attention_reference, rotary_embedding
from jaxfuse.testing.torch_ref import attention as ref
from tests import helpers

FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _x(shape, seed):
  return helpers.normal(seed, shape)


def _param_shapes(state):
  return jax.tree.map(lambda x: (x.shape, x.dtype), state)


# NNX -------------------------------------------------------------------------------------------


def _nnx_twins(cfg, seed=0, ours_cls=jaxfuse.nnx.MultiHeadAttention):
  theirs = nnx.MultiHeadAttention(**cfg, decode=False, rngs=nnx.Rngs(seed))
  ours = ours_cls(**cfg, decode=False, rngs=nnx.Rngs(seed + 1))
  want, got = nnx.state(theirs, nnx.Param), nnx.state(ours, nnx.Param)
  assert _param_shapes(got) == _param_shapes(want)
  nnx.update(ours, want)
  return theirs, ours


def _nnx_outputs_and_grads(module, q_in, kv_in, mask, w):
  """One jitted program: the outputs with a mask and causal (or cross) and the gradients of
  the parameters."""
  graphdef, params, rest = nnx.split(module, nnx.Param, ...)

  def run(params, rest):
    def loss(params):
      m = nnx.merge(graphdef, params, rest)
      if kv_in is None:
        second, masked = m(q_in, is_causal=True), m(q_in, mask=mask)
      else:
        second, masked = m(q_in, kv_in), m(q_in, kv_in, mask=mask)
      return jnp.sum(second * w), (masked, second)

    grads, outs = jax.grad(loss, has_aux=True)(params)
    return outs, grads

  return jax.jit(run, compiler_options=FAST_COMPILE)(params, rest)


@pytest.mark.parametrize("cfg", [
    dict(num_heads=4, in_features=32),
    dict(num_heads=4, in_features=32, qkv_features=48, out_features=24, num_kv_heads=2,
         in_kv_features=20, normalize_qk=True, use_bias=False)], ids=["mha", "gqa-cross-qknorm"])
def test_nnx_matches_flax(cfg):
  """Same parameters: same outputs (masked; causal or cross) and same parameter gradients."""
  theirs, ours = _nnx_twins(cfg)
  q_in = _x((2, 13, cfg["in_features"]), 1)
  kv_in = _x((2, 9, cfg["in_kv_features"]), 2) if "in_kv_features" in cfg else None
  mask = _x((2, 1, 13, 9 if kv_in is not None else 13), 3) > -0.5
  mask = mask.at[..., 0].set(True)    # every row sees a key: flax gives no zero rows
  w = _x((2, 13, ours.out_features), 4)
  (got_outs, got_grads) = _nnx_outputs_and_grads(ours, q_in, kv_in, mask, w)
  (want_outs, want_grads) = _nnx_outputs_and_grads(theirs, q_in, kv_in, mask, w)
  for got, want in zip(got_outs, want_outs):
    helpers.assert_close(got, want)
  jax.tree.map(lambda a, b: helpers.assert_close(a, b), got_grads,
               want_grads)


def test_nnx_self_attention_in_bfloat16():
  cfg = dict(num_heads=4, in_features=32, dtype=jnp.bfloat16)
  theirs, ours = _nnx_twins(cfg, ours_cls=jaxfuse.nnx.SelfAttention)
  x = _x((2, 30, 32), 7)
  got = jax.jit(lambda x: ours(x, is_causal=True), compiler_options=FAST_COMPILE)(x)
  peer = theirs(x, is_causal=True)
  assert got.dtype == peer.dtype == jnp.bfloat16
  # Against flax in float32 on the same parameters: our error at most twice flax's bfloat16 one.
  exact, _ = _nnx_twins({**cfg, "dtype": jnp.float32})
  nnx.update(exact, nnx.state(theirs, nnx.Param))
  helpers.assert_within_low_precision_error(got, exact(x, is_causal=True), peer)


def test_nnx_rejects_what_it_does_not_support():
  with pytest.raises(NotImplementedError, match="decode=True"):
    jaxfuse.nnx.MultiHeadAttention(num_heads=2, in_features=8, decode=True, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"num_heads \(4\) must be divisible by num_kv_heads \(3\)"):
    jaxfuse.nnx.MultiHeadAttention(num_heads=4, in_features=8, num_kv_heads=3, rngs=nnx.Rngs(0))
  layer = jaxfuse.nnx.MultiHeadAttention(num_heads=2, in_features=8, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"inputs_q must have 8 features.*\(1, 3, 4\)"):
    layer(jnp.ones((1, 3, 4)))


# Linen -----------------------------------------------------------------------------------------


def test_linen_matches_flax():
  cfg = dict(num_heads=2, qkv_features=24, out_features=10, normalize_qk=True)
  theirs = flax.linen.MultiHeadDotProductAttention(**cfg)
  ours = jaxfuse.linen.MultiHeadDotProductAttention(**cfg)
  q_in, kv_in = _x((2, 11, 16), 8), _x((2, 6, 16), 9)
  variables = jax.jit(theirs.init, compiler_options=FAST_COMPILE)(jax.random.key(0), q_in)
  assert _param_shapes(jax.eval_shape(ours.init, jax.random.key(1), q_in)) == (
      _param_shapes(variables))
  mask = (_x((2, 1, 11, 11), 10) > -0.5).at[..., 0].set(True)
  w = _x((2, 11, 10), 11)

  def run(module):
    def loss(v):
      cross = module.apply(v, q_in, kv_in)
      return jnp.sum(cross * w), (cross, module.apply(v, q_in, mask=mask))

    grads, outs = jax.grad(loss, has_aux=True)(variables)
    return outs, grads

  got_outs, got_grads = jax.jit(lambda: run(ours), compiler_options=FAST_COMPILE)()
  want_outs, want_grads = jax.jit(lambda: run(theirs), compiler_options=FAST_COMPILE)()
  for got, want in zip(got_outs, want_outs):
    helpers.assert_close(got, want)
  jax.tree.map(lambda a, b: helpers.assert_close(a, b), got_grads,
               want_grads)


def test_linen_self_attention_matches_flax():
  x = _x((2, 11, 16), 12)
  theirs = flax.linen.SelfAttention(num_heads=4, use_bias=False)
  ours = jaxfuse.linen.SelfAttention(num_heads=4, use_bias=False)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    variables = jax.jit(theirs.init, compiler_options=FAST_COMPILE)(jax.random.key(0), x)
    want = jax.jit(lambda x: theirs.apply(variables, x), compiler_options=FAST_COMPILE)(x)
  got = jax.jit(lambda x: ours.apply(variables, x), compiler_options=FAST_COMPILE)(x)
  helpers.assert_close(got, want)


def test_linen_grouped_query_attention():
  """With num_kv_heads the key/value projections have fewer heads; the output is the
  projections' attention computed by hand."""
  x = _x((2, 11, 16), 13)
  layer = jaxfuse.linen.MultiHeadDotProductAttention(num_heads=4, num_kv_heads=2)
  params = jax.jit(layer.init, compiler_options=FAST_COMPILE)(jax.random.key(0), x)["params"]
  assert params["key"]["kernel"].shape == (16, 2, 4)

  def project(name, y):
    return jnp.einsum("btf,fhd->bthd", y, params[name]["kernel"]) + params[name]["bias"]

  o = attention_reference(project("query", x), project("key", x), project("value", x),
                          causal=True)
  want = jnp.einsum("bthd,hdf->btf", o, params["out"]["kernel"]) + params["out"]["bias"]
  got = jax.jit(lambda x: layer.apply({"params": params}, x, is_causal=True),
                compiler_options=FAST_COMPILE)(x)
  helpers.assert_close(got, want)


# Rotary ----------------------------------------------------------------------------------------


def test_rotary_embedding_matches_torch():
  x = _x((2, 9, 3, 16), 14)
  positions = jnp.arange(9)[None] + jnp.array([[0], [5]])
  g = _x(x.shape, 15)
  def value_and_grad(x, g):
    out, vjp = jax.vjp(lambda x: rotary_embedding(x, positions, base=500.0), x)
    return out, vjp(g)[0]

  out, grad = jax.jit(value_and_grad)(x, g)
  tx = helpers.to_torch(x, requires_grad=True)
  want = ref.rotary(tx, torch.from_numpy(np.array(positions)), base=500.0)
  want.backward(helpers.to_torch(g))
  helpers.assert_close(out, want)
  helpers.assert_close(grad, tx.grad)


def test_rotary_scores_depend_on_relative_position_only():
  q, k = _x((1, 1, 1, 32), 16), _x((1, 1, 1, 32), 17)

  @jax.jit
  def score(m, n):
    return jnp.sum(rotary_embedding(q, jnp.array([m])) * rotary_embedding(k, jnp.array([n])))

  helpers.assert_close(score(7, 3), score(104, 100))
  assert abs(float(score(7, 3)) - float(score(3, 7))) > 1e-3


@pytest.mark.parametrize("module", ["nnx", "linen"])
def test_rotary_modules(module):
  """Rotary modules: queries and keys rotated by their positions before attention."""
  x = _x((2, 10, 16), 18)
  if module == "nnx":
    layer = jaxfuse.nnx.MultiHeadAttention(num_heads=2, in_features=16, rotary=True,
                                           rotary_base=100.0, rngs=nnx.Rngs(0))
    project = lambda name: getattr(layer, name)(x)  # noqa: E731
    out = lambda y, **kw: layer.out(y)  # noqa: E731
    got = jax.jit(lambda x: layer(x, is_causal=True), compiler_options=FAST_COMPILE)(x)
  else:
    layer = jaxfuse.linen.MultiHeadDotProductAttention(num_heads=2, rotary=True,
                                                       rotary_base=100.0)
    variables = jax.jit(layer.init, compiler_options=FAST_COMPILE)(jax.random.key(0), x)
    params = variables["params"]
    project = lambda name: (jnp.einsum("btf,fhd->bthd", x, params[name]["kernel"])  # noqa: E731
                            + params[name]["bias"])
    out = lambda y: jnp.einsum("bthd,hdf->btf", y, params["out"]["kernel"]) + params["out"]["bias"]  # noqa: E731
    got = jax.jit(lambda x: layer.apply(variables, x, is_causal=True),
                  compiler_options=FAST_COMPILE)(x)
  positions = torch.arange(10)
  q = ref.rotary(helpers.to_torch(project("query")), positions, base=100.0)
  k = ref.rotary(helpers.to_torch(project("key")), positions, base=100.0)
  v = helpers.to_torch(project("value"))
  o = ref.attention(q, k, v, causal=True)
  helpers.assert_close(got, out(jnp.asarray(o.numpy())))
