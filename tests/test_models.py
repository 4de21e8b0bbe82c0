"""The decoder: its fused and plain forms agree on the same parameters, decoding from the KV
cache equals the full forward, remat changes nothing but memory, and configs are checked.

(Agreement with Hugging Face's own implementation is in test_hf_twin.py.)
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxfuse.metrics import residual_bytes
from jaxfuse.models import (Decoder, DecoderConfig, UnsupportedConfigError, generate,
                            next_token_targets)
from tests import helpers

BASE = dict(vocab_size=97, d_model=48, num_layers=1, num_heads=4, num_kv_heads=2, mlp_dim=80)
VARIANTS = {
    "gqa": dict(num_layers=2),
    "mha-tied": dict(num_kv_heads=None, tie_embeddings=True),
    "llama-biases": dict(qkv_bias=True, o_bias=True, mlp_bias=True),   # Qwen2's qkv bias too
    "mistral-window": dict(sliding_window=5),
    "mqa-head-dim": dict(num_kv_heads=1, head_dim=16),
}


def _model(fused=True, seed=0, remat=None, **changes):
  cfg = DecoderConfig(**{**BASE, **changes})
  return Decoder(cfg, fused=fused, remat=remat, rngs=nnx.Rngs(seed))


def _tokens(b=2, t=19, seed=1, vocab=BASE["vocab_size"]):
  return jax.random.randint(jax.random.key(seed), (b, t), 0, vocab)


def _loss_and_grads(model, tokens):
  targets = next_token_targets(tokens).at[0, 3].set(-100)   # an ignored target too
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  @jax.jit
  def run(params, rest):
    return jax.value_and_grad(lambda p: nnx.merge(graphdef, p, rest)(tokens, targets))(params)

  return run(params, rest)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fused_and_plain_agree_on_the_same_parameters(variant):
  fused = _model(True, **VARIANTS[variant])
  plain = _model(False, seed=7, **VARIANTS[variant])
  nnx.update(plain, nnx.state(fused, nnx.Param))
  tokens = _tokens()
  (loss_f, grads_f), (loss_p, grads_p) = _loss_and_grads(fused, tokens), _loss_and_grads(
      plain, tokens)
  helpers.assert_close(loss_f, loss_p, what="loss")
  flat_f, flat_p = nnx.to_flat_state(grads_f), nnx.to_flat_state(grads_p)
  assert [path for path, _ in flat_f] == [path for path, _ in flat_p]
  for (path, a), (_, b) in zip(flat_f, flat_p):
    helpers.assert_close(a[...], b[...], what=str(path))
  logits = lambda m: nnx.jit(lambda m, t: m.logits(t))(m, tokens)  # noqa: E731
  helpers.assert_close(logits(fused), logits(plain), what="logits")


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("variant", ["gqa", "mistral-window"])
def test_decoding_with_the_cache_equals_the_full_forward(fused, variant):
  model = _model(fused, **VARIANTS[variant])
  tokens = _tokens(t=14)
  full = model.logits(tokens)
  cache = model.init_cache(2, max_len=20)
  logits, cache = jax.jit(model.decode)(tokens[:, :9], cache)
  helpers.assert_close(logits, full[:, 8], what="prefill")
  step = jax.jit(model.decode)
  for pos in range(9, 14):
    logits, cache = step(tokens[:, pos:pos + 1], cache)
    helpers.assert_close(logits, full[:, pos], what=f"position {pos}")
  assert int(cache["length"]) == 14


def test_greedy_generation_is_the_argmax_of_the_full_forward():
  model = _model(True)
  prompt = _tokens(b=1, t=4)
  out = generate(model, prompt, 6, jax.random.key(0), temperature=0)
  assert out.shape == (1, 10) and np.array_equal(out[:, :4], prompt)
  full = model.logits(out)   # causal: position p's logits see out[:, :p + 1] only
  assert np.array_equal(out[0, 4:], jnp.argmax(full[0, 3:9], axis=-1))


def test_remat_gives_the_same_gradients_and_keeps_less():
  tokens = _tokens()
  targets = next_token_targets(tokens)
  plain, remat = _model(True), _model(True, remat="block")
  (loss_a, grads_a), (loss_b, grads_b) = _loss_and_grads(plain, tokens), _loss_and_grads(
      remat, tokens)
  helpers.assert_close(loss_a, loss_b)
  for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)):
    helpers.assert_close(a, b)

  def kept(model):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return residual_bytes(lambda p: nnx.merge(graphdef, p, rest)(tokens, targets), params)

  assert kept(remat) < kept(plain)


def test_the_fused_model_keeps_less_for_its_backward():
  """The plain model keeps the attention probabilities, the logits and their softmax; the
  fused one none of them."""
  tokens = _tokens(t=64)
  targets = next_token_targets(tokens)

  def kept(model):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return residual_bytes(lambda p: nnx.merge(graphdef, p, rest)(tokens, targets), params)

  fused, plain = kept(_model(True)), kept(_model(False))
  assert 3 * fused < plain, (fused, plain)


def test_config_errors_name_the_field():
  with pytest.raises(ValueError, match=r"num_kv_heads \(3\) must divide num_heads \(4\)"):
    DecoderConfig(**{**BASE, "num_kv_heads": 3})
  with pytest.raises(ValueError, match="vocab_size must be a positive int"):
    DecoderConfig(**{**BASE, "vocab_size": 0})
  with pytest.raises(ValueError, match="even head_dim"):
    DecoderConfig(**{**BASE, "head_dim": 7})
  with pytest.raises(ValueError, match="unknown fields"):
    DecoderConfig.from_dict({**BASE, "layers": 3})


def test_hf_configs_map_and_unsupported_fields_are_refused():
  transformers = pytest.importorskip("transformers")
  hf = transformers.MistralConfig(vocab_size=97, hidden_size=48, intermediate_size=80,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, sliding_window=5)
  cfg = DecoderConfig.from_hf(hf)
  assert (cfg.sliding_window, cfg.kv_heads, cfg.head_dim, cfg.qkv_bias) == (5, 2, 12, False)
  assert DecoderConfig.from_hf(cfg.to_hf("mistral")) == cfg
  qwen = DecoderConfig.from_hf(transformers.Qwen2Config(
      vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
  assert qwen.qkv_bias and not qwen.o_bias and qwen.tie_embeddings
  llama = {k: v for k, v in hf.to_dict().items() if k != "sliding_window"} | {
      "model_type": "llama"}
  for field, value in [("hidden_act", "gelu_fast"), ("attention_dropout", 0.1),
                       ("rope_parameters", {"rope_type": "proportional", "rope_theta": 5e5,
                                            "factor": 8.0}),
                       ("rope_parameters", {"rope_type": "llama3", "rope_theta": 5e5,
                                            "factor": 8.0}),   # lacks the frequency factors
                       ("some_new_field", 3)]:
    with pytest.raises(UnsupportedConfigError, match=field):
      DecoderConfig.from_hf({**llama, field: value})
  with pytest.raises(UnsupportedConfigError, match="model_type 'gpt2'"):
    DecoderConfig.from_hf({"model_type": "gpt2"})
