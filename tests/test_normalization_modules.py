"""jaxfuse's LayerNorm / RMSNorm modules as drop-in twins of flax's (NNX and Linen): the same
parameters (names, shapes, dtypes) and, with the same parameter values, the same outputs and
gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import jaxfuse.linen
import jaxfuse.nnx
from tests import helpers

RNG = np.random.default_rng(0)


def _x(shape, dtype=jnp.float32):
  return jnp.asarray(RNG.standard_normal(shape, dtype=np.float32)).astype(dtype)


def _randomize(tree):
  """Random values of each leaf's shape and dtype (ones and zeros would hide a swapped
  scale/bias)."""
  return jax.tree.map(lambda p: (1.0 + 0.5 * _x(p.shape)).astype(p.dtype), tree)


def _structure(tree):
  return jax.tree.map(lambda p: (p.shape, jnp.dtype(p.dtype).name), tree)


# NNX ---------------------------------------------------------------------------------------------

NNX_CASES = [
    ("LayerNorm", {}),
    ("LayerNorm", {"use_bias": False}),
    ("LayerNorm", {"use_scale": False, "use_bias": False}),
    ("LayerNorm", {"epsilon": 1e-5, "param_dtype": jnp.bfloat16}),
    ("LayerNorm", {"dtype": jnp.bfloat16}),
    ("RMSNorm", {}),
    ("RMSNorm", {"use_scale": False}),
    ("RMSNorm", {"epsilon": 1e-5, "dtype": jnp.bfloat16}),
]


def _nnx_pair(cls, kwargs, features):
  ours = getattr(jaxfuse.nnx, cls)(features, rngs=nnx.Rngs(0), **kwargs)
  theirs = getattr(nnx, cls)(features, rngs=nnx.Rngs(0), **kwargs)
  return ours, theirs


@pytest.mark.parametrize("cls,kwargs", NNX_CASES, ids=lambda v: str(v))
def test_nnx_twin(cls, kwargs):
  features = 96
  ours, theirs = _nnx_pair(cls, kwargs, features)
  state = nnx.state(theirs, nnx.Param)
  assert _structure(nnx.state(ours, nnx.Param)) == _structure(state)
  state = _randomize(state)
  nnx.update(ours, state)
  nnx.update(theirs, state)
  x = _x((3, 5, features))
  g = _x((3, 5, features))

  @nnx.jit
  def run(model, x):
    def loss(model, x):
      return jnp.sum(model(x).astype(jnp.float32) * g)
    return model(x), nnx.grad(loss, argnums=(0, 1))(model, x)

  results = {}
  for name, model in (("ours", ours), ("theirs", theirs)):
    out, (gp, gx) = run(model, x)
    results[name] = [out, gx] + [getattr(gp, p)[...] for p in ("scale", "bias")
                                 if getattr(theirs, p, None) is not None]
  assert results["ours"][0].dtype == results["theirs"][0].dtype
  assert results["ours"][0].shape == results["theirs"][0].shape
  what = ["output", "grad x", "grad params"]
  low = results["ours"][0].dtype == jnp.bfloat16 or kwargs.get("param_dtype") == jnp.bfloat16
  if not low:
    for got, want, w in zip(results["ours"], results["theirs"], what):
      helpers.assert_close(got, want, what=w)
    return
  # Low precision: both against flax in float32 on the same (rounded) values.
  exact_kwargs = {**kwargs, "dtype": jnp.float32, "param_dtype": jnp.float32}
  exact = getattr(nnx, cls)(features, rngs=nnx.Rngs(0), **exact_kwargs)
  nnx.update(exact, jax.tree.map(lambda p: p.astype(jnp.float32), state))
  out, (gp, gx) = run(exact, x.astype(jnp.float32))
  reference = [out, gx] + [getattr(gp, p)[...] for p in ("scale", "bias")
                           if getattr(theirs, p, None) is not None]
  for got, want, peer, w in zip(results["ours"], reference, results["theirs"], what):
    helpers.assert_within_low_precision_error(got, want, peer, what=w)


def test_nnx_mixed_precision_input_promotes_as_flax():
  """bfloat16 input with float32 parameters: flax promotes to float32; so do we."""
  ours, theirs = _nnx_pair("RMSNorm", {}, 64)
  x = _x((4, 64), jnp.bfloat16)
  assert ours(x).dtype == theirs(x).dtype == jnp.float32
  helpers.assert_close(ours(x), theirs(x))


def test_nnx_takes_the_same_rng_streams():
  """The modules draw one params key per parameter, as flax does, so a model's later layers
  initialize identically with either."""
  rngs_ours, rngs_theirs = nnx.Rngs(3), nnx.Rngs(3)
  jaxfuse.nnx.LayerNorm(8, rngs=rngs_ours)
  nnx.LayerNorm(8, rngs=rngs_theirs)
  assert jnp.array_equal(jax.random.key_data(rngs_ours.params()),
                         jax.random.key_data(rngs_theirs.params()))


def test_nnx_unsupported_options_raise_naming_them():
  x = _x((2, 3, 8))
  with pytest.raises(NotImplementedError, match=r"LayerNorm: reduction_axes must be the last "
                                                r"axis \(-1\), got \(1, 2\)"):
    jaxfuse.nnx.LayerNorm(8, reduction_axes=(1, 2), rngs=nnx.Rngs(0))(x)
  with pytest.raises(NotImplementedError, match=r"RMSNorm: axis_name"):
    jaxfuse.nnx.RMSNorm(8, axis_name="batch", rngs=nnx.Rngs(0))(x)
  with pytest.raises(NotImplementedError, match=r"RMSNorm: mask is not supported"):
    jaxfuse.nnx.RMSNorm(8, rngs=nnx.Rngs(0))(x, mask=jnp.ones(x.shape, bool))


# Linen -------------------------------------------------------------------------------------------

LINEN_CASES = [
    ("LayerNorm", {}),
    ("LayerNorm", {"use_bias": False, "epsilon": 1e-5}),
    ("LayerNorm", {"use_scale": False}),
    ("LayerNorm", {"dtype": jnp.bfloat16}),
    ("RMSNorm", {}),
    ("RMSNorm", {"param_dtype": jnp.bfloat16}),
]


@pytest.mark.parametrize(
    "cls,kwargs,x_dtype",
    [(c, k, jnp.float32) for c, k in LINEN_CASES]
    + [("LayerNorm", {}, jnp.bfloat16), ("RMSNorm", {"param_dtype": jnp.bfloat16}, jnp.bfloat16)],
    ids=lambda v: jnp.dtype(v).name if isinstance(v, type) else str(v))
def test_linen_twin(cls, kwargs, x_dtype):
  features = 80
  ours = getattr(jaxfuse.linen, cls)(**kwargs)
  theirs = getattr(nn, cls)(**kwargs)
  x = _x((2, 7, features), x_dtype)
  g = _x((2, 7, features))
  params = theirs.init(jax.random.key(0), x)
  assert _structure(ours.init(jax.random.key(0), x)) == _structure(params)
  params = _randomize(params)

  def run(model):
    def loss(params, x):
      return jnp.sum(model.apply(params, x).astype(jnp.float32) * g)
    return jax.jit(lambda p, x: (model.apply(p, x), jax.grad(loss, argnums=(0, 1))(p, x)))

  out_ours, grads_ours = run(ours)(params, x)
  out_theirs, grads_theirs = run(theirs)(params, x)
  assert out_ours.dtype == out_theirs.dtype
  got = [out_ours, *jax.tree.leaves(grads_ours)]
  peer = [out_theirs, *jax.tree.leaves(grads_theirs)]
  low = jnp.bfloat16 in (out_ours.dtype, x_dtype, kwargs.get("param_dtype"))
  if not low:
    for a, b in zip(got, peer):
      helpers.assert_close(a, b)
    return
  # Low precision: both against flax in float32 on the same (rounded) values.
  exact = getattr(nn, cls)(**{**kwargs, "dtype": jnp.float32, "param_dtype": jnp.float32})
  params32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
  out, grads = run(exact)(params32, x.astype(jnp.float32))
  for a, e, b in zip(got, [out, *jax.tree.leaves(grads)], peer):
    helpers.assert_within_low_precision_error(a, e, b)


def test_linen_implementation_field():
  x = _x((3, 16))
  model = jaxfuse.linen.RMSNorm(implementation="xla")
  params = model.init(jax.random.key(0), x)
  helpers.assert_close(model.apply(params, x), nn.RMSNorm().apply(params, x))
