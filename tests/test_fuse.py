"""jaxfuse.nnx.fuse on an existing NNX model, and jaxfuse's attention as flax's attention_fn:
the same outputs and gradients, less kept for the backward pass."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jaxfuse.nnx
from jaxfuse.metrics import residual_bytes
from jaxfuse.ops import dot_product_attention
from tests import helpers


class Transformer(nnx.Module):
  """A user's model, written with flax parts only."""

  def __init__(self, d, heads, rngs, **norm_options):
    self.ln = nnx.LayerNorm(d, rngs=rngs, **norm_options)
    self.attn = nnx.MultiHeadAttention(heads, d, decode=False, rngs=rngs)
    self.rms = nnx.RMSNorm(d, rngs=rngs)
    self.blocks = nnx.List([nnx.Linear(d, d, rngs=rngs), nnx.RMSNorm(d, rngs=rngs)])

  def __call__(self, x):
    x = x + self.attn(self.ln(x), is_causal=True)
    return self.blocks[1](self.blocks[0](self.rms(x)))


def _loss(model, x, w):
  return jnp.sum(model(x) * w)


def _value_and_grads(model, x, w):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  f = lambda p, x: _loss(nnx.merge(graphdef, p, rest), x, w)  # noqa: E731
  value, grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(params, x)
  kept = residual_bytes(f, params, x)
  return value, grads, kept


def test_fuse_keeps_outputs_and_gradients_and_keeps_less():
  x = jax.random.normal(jax.random.key(0), (2, 64, 32))
  w = jax.random.normal(jax.random.key(1), (2, 64, 32))
  model = Transformer(32, 4, nnx.Rngs(0))
  params_before = nnx.state(model, nnx.Param)
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)   # built before fusing
  value, grads, kept = _value_and_grads(model, x, w)

  report = jaxfuse.nnx.fuse(model)
  assert [(c.path, c.module, c.action) for c in report] == [
      ("attn", "MultiHeadAttention", "attention_fn"), ("blocks.1", "RMSNorm", "replaced"),
      ("ln", "LayerNorm", "replaced"), ("rms", "RMSNorm", "replaced")]
  assert isinstance(model.ln, jaxfuse.nnx.LayerNorm)
  assert isinstance(model.blocks[1], jaxfuse.nnx.RMSNorm)
  assert model.attn.attention_fn is dot_product_attention
  # The same parameter tree: the twins took over the variables.
  assert jax.tree.structure(nnx.state(model, nnx.Param)) == jax.tree.structure(params_before)

  value2, grads2, kept2 = _value_and_grads(model, x, w)
  helpers.assert_close(value2, value)
  for a, b in zip(jax.tree.leaves(grads2), jax.tree.leaves(grads)):
    helpers.assert_close(a, b)
  assert kept2 < kept / 2, (kept2, kept)     # the [64 x 64] probabilities of 4 heads are gone

  before = model.ln.scale[...]
  optimizer.update(model, nnx.grad(lambda m: _loss(m, x, w))(model))
  # The optimizer built before fusing updates the fused model's variables.
  assert not jnp.allclose(model.ln.scale[...], before)


def test_fuse_keeps_what_it_cannot_fuse_and_says_why():
  model = Transformer(32, 4, nnx.Rngs(0), reduction_axes=(-2, -1), feature_axes=-1)
  model.attn.dropout_rate = 0.1
  report = {c.path: c for c in jaxfuse.nnx.fuse(model)}
  assert report["ln"].action == "kept" and "reduction_axes" in report["ln"].detail
  assert report["attn"].action == "kept" and "dropout" in report["attn"].detail
  assert type(model.ln) is nnx.LayerNorm


@pytest.mark.parametrize("module", ["nnx", "linen"])
def test_attention_fn_of_flax_attention_modules(module):
  x = jax.random.normal(jax.random.key(2), (2, 9, 16))
  mask = nnx.make_causal_mask(jnp.ones((2, 9)))
  if module == "nnx":
    theirs = nnx.MultiHeadAttention(2, 16, decode=False, rngs=nnx.Rngs(0))
    ours = nnx.MultiHeadAttention(2, 16, decode=False, attention_fn=dot_product_attention,
                                  rngs=nnx.Rngs(0))
    got, want = ours(x, mask=mask), theirs(x, mask=mask)
  else:
    theirs = nn.MultiHeadDotProductAttention(num_heads=2)
    ours = nn.MultiHeadDotProductAttention(num_heads=2, attention_fn=dot_product_attention)
    variables = theirs.init(jax.random.key(0), x)
    got, want = ours.apply(variables, x, mask=mask), theirs.apply(variables, x, mask=mask)
  helpers.assert_close(got, want)


def test_attention_fn_refuses_dropout_and_sown_weights():
  x = jnp.ones((1, 4, 8))
  layer = nnx.MultiHeadAttention(2, 8, decode=False, dropout_rate=0.5,
                                 attention_fn=dot_product_attention, rngs=nnx.Rngs(0))
  with pytest.raises(NotImplementedError, match="attention dropout"):
    layer(x, deterministic=False, rngs=nnx.Rngs(1))
  with pytest.raises(NotImplementedError, match="sow_weights"):
    dot_product_attention(x[..., None, :], x[..., None, :], x[..., None, :], module=object())
