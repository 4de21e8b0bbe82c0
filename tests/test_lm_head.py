"""LMHead (NNX and Linen): owned or tied weight, loss against torch, logits in eval mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxfuse import linen as jf_linen
from jaxfuse import nnx as jf_nnx
from jaxfuse.testing.torch_ref import cross_entropy as ref
from tests import helpers

D, V = 16, 300


def _data(seed=0):
  rng = np.random.default_rng(seed)
  h = jnp.asarray(rng.standard_normal((2, 9, D), dtype=np.float32))
  y = rng.integers(0, V, (2, 9)).astype(np.int32)
  y[0, 0] = -100
  return h, jnp.asarray(y)


def _torch_loss_and_grads(h, w, b, y, **opts):
  th, tw = helpers.to_torch(h, requires_grad=True), helpers.to_torch(w, requires_grad=True)
  tb = None if b is None else helpers.to_torch(b, requires_grad=True)
  loss = ref.linear_cross_entropy(th, tw, torch.from_numpy(np.array(y)).long(), tb, **opts)
  loss.backward()
  return loss, th.grad, tw.grad, (None if b is None else tb.grad)


def test_nnx_owned_weight_matches_torch():
  h, y = _data()
  head = jf_nnx.LMHead(D, V, use_bias=True, label_smoothing=0.1, rngs=nnx.Rngs(0))
  head.bias[...] = 0.1 * jax.random.normal(jax.random.key(5), (V,))
  loss, grads = nnx.value_and_grad(lambda m, h: m(h, y), argnums=(0, 1))(head, h)
  want = _torch_loss_and_grads(h, head.kernel[...], head.bias[...], y, label_smoothing=0.1)
  helpers.assert_close(loss, want[0])
  helpers.assert_close(grads[1], want[1])
  helpers.assert_close(grads[0].kernel[...], want[2])
  helpers.assert_close(grads[0].bias[...], want[3])


def test_nnx_tied_to_embedding():
  h, y = _data(1)
  embed = nnx.Embed(V, D, rngs=nnx.Rngs(0))
  head = jf_nnx.LMHead(D, tie_to=embed, rngs=nnx.Rngs(1))
  assert head.kernel is None and head.vocab_size == V
  assert not any("kernel" in str(path) for path, _ in nnx.iter_graph(head))

  class Model(nnx.Module):
    def __init__(self):
      self.embed = embed
      self.head = head

  model = Model()
  grads = nnx.grad(lambda m: m.head(h, y))(model)
  want = _torch_loss_and_grads(h, embed.embedding[...], None, y)
  helpers.assert_close(grads.embed.embedding[...], want[2])


def test_nnx_eval_mode_returns_logits():
  h, y = _data(2)
  head = jf_nnx.LMHead(D, V, rngs=nnx.Rngs(0))
  assert head(h, y).shape == ()
  head.eval()
  logits = head(h[:, -1:], y[:, -1:])
  assert logits.shape == (2, 1, V) and logits.dtype == jnp.float32
  helpers.assert_close(logits, np.asarray(h[:, -1:]) @ np.asarray(head.kernel[...]).T)
  assert head.loss(h, y).shape == ()


def test_nnx_errors():
  embed = nnx.Embed(V, D, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="tie_to's embedding has 16 features, in_features is 8"):
    jf_nnx.LMHead(8, tie_to=embed, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="give vocab_size"):
    jf_nnx.LMHead(8, rngs=nnx.Rngs(0))


def test_linen_owned_and_tied_match_torch():
  h, y = _data(3)
  head = jf_linen.LMHead(vocab_size=V, use_bias=True, z_loss=1e-3)
  params = head.init(jax.random.key(0), h, y)
  loss, grads = jax.value_and_grad(lambda p, h: head.apply(p, h, y), argnums=(0, 1))(params, h)
  p = params["params"]
  want = _torch_loss_and_grads(h, p["kernel"], p["bias"], y, z_loss=1e-3)
  helpers.assert_close(loss, want[0])
  helpers.assert_close(grads[1], want[1])
  helpers.assert_close(grads[0]["params"]["kernel"], want[2])
  helpers.assert_close(grads[0]["params"]["bias"], want[3])

  table = jax.random.normal(jax.random.key(4), (V, D)) * 0.3
  tied = jf_linen.LMHead(vocab_size=V)
  tied_params = tied.init(jax.random.key(0), h, y, weight=table)
  assert "params" not in tied_params or "kernel" not in tied_params["params"]
  dtable = jax.grad(lambda t: tied.apply(tied_params, h, y, weight=t))(table)
  helpers.assert_close(dtable, _torch_loss_and_grads(h, table, None, y)[2])
  logits = tied.apply(tied_params, h[:, -1:], weight=table)
  assert logits.shape == (2, 1, V)
  assert tied.apply(tied_params, h, y, weight=table, deterministic=True).shape == (2, 9, V)
  with pytest.raises(ValueError, match=r"weight must have shape \(vocab_size, D\)"):
    tied.apply(tied_params, h, y, weight=table[:10])
