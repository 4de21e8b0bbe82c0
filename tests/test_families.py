"""Every model family of :data:`jaxfuse.models.families.FAMILIES` against Hugging Face's own
model (``transformers``, PyTorch) on a checkpoint ``transformers`` wrote: tiny random configs
built here (no download).

Per family, from the checkpoint directory ``save_pretrained`` wrote:

- the logits (within 2e-5), the loss (1e-5) and the gradient of every parameter (1e-4) of
  ``Decoder(fused=True)`` and ``Decoder(fused=False)``, each relative to the tensor's largest
  entry (``test_hf_twin.rel_err``);
- greedy decoding with the KV cache, token for token equal to ``generate``, past twice the
  sliding window;
- our ``save_pretrained``, which ``AutoModelForCausalLM.from_pretrained`` loads with equal
  logits.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxfuse import interop
from jaxfuse.models import families, generate
from tests.test_hf_twin import _loss_logits_grads, _tokens, rel_err

transformers = pytest.importorskip("transformers")

SIZES = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)
WINDOW = 5
# Per family: (model_type, config changes). Every option that changes the computation is set
# where it matters at these sizes (soft-caps small enough to bind, rotary scalings whose
# frequencies differ from the default, windows shorter than the sequences).
FAMILIES = {
    "llama3-tied": ("llama", dict(
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8})),
    "qwen3": ("qwen3", dict(head_dim=16, use_sliding_window=True, sliding_window=WINDOW,
                            max_window_layers=1)),
    "gemma2": ("gemma2", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                              attn_logit_softcapping=5.0, final_logit_softcapping=2.0)),
    "gemma3": ("gemma3_text", dict(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0,
                                            "rope_theta": 1000000.0}})),
    "phi3-longrope": ("phi3", dict(
        pad_token_id=0, original_max_position_embeddings=8, max_position_embeddings=64,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": [1.0 + 0.1 * i for i in range(6)],
                         "long_factor": [2.0 + 0.5 * i for i in range(6)]})),
    "olmo2": ("olmo2", dict(pad_token_id=1)),
}
LOGITS_RTOL, LOSS_RTOL, GRAD_RTOL = 2e-5, 1e-5, 1e-4


def _hf_model(model_type, changes, seed=0):
  """A random ``*ForCausalLM`` in float32, eager attention, with weights large enough that
  attention is far from uniform and norm scales that are not their initial values."""
  fam = families.family(model_type)
  config = getattr(transformers, fam.config_class)(**{**SIZES, **changes},
                                                   attn_implementation="eager")
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if p.ndim == 2:
        p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
      elif "norm" in name:
        p.copy_((0.0 if model_type.startswith("gemma") else 1.0) + 0.2 * torch.randn_like(p))
      else:
        p.copy_(0.2 * torch.randn_like(p))
  return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory):
  """``(name, hf model, directory transformers wrote it to)``."""
  model_type, changes = FAMILIES[request.param]
  hf = _hf_model(model_type, changes)
  directory = tmp_path_factory.mktemp(request.param)
  hf.save_pretrained(directory)
  return request.param, hf, directory


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "plain"])
def test_logits_loss_and_every_gradient_match_hf(checkpoint, fused):
  name, hf, directory = checkpoint
  tokens_t = _tokens(1)
  hf.zero_grad()
  out = hf(tokens_t, labels=tokens_t)
  out.loss.backward()
  hf_grads = {key: p.grad for key, p in hf.named_parameters()}
  model = interop.from_pretrained(directory, fused=fused)
  assert model.cfg.model_type == FAMILIES[name][0]
  loss, logits, grads = _loss_logits_grads(model, jnp.asarray(tokens_t.numpy()))
  assert sorted(grads) == sorted(hf_grads)   # every parameter, a tied head's as the embedding's
  errors = {key: rel_err(grads[key], g) for key, g in hf_grads.items()}
  worst = max((e, key) for key, e in errors.items())
  print(f"\n{name} fused={fused}: loss {rel_err(loss, out.loss):.2e}, logits "
        f"{rel_err(logits, out.logits):.2e}, worst gradient {worst[0]:.2e} ({worst[1]})")
  assert rel_err(logits, out.logits) <= LOGITS_RTOL
  assert rel_err(loss, out.loss) <= LOSS_RTOL
  assert worst[0] <= GRAD_RTOL, {k: e for k, e in errors.items() if e > GRAD_RTOL}


def test_greedy_decoding_with_the_cache_matches_hf_generate(checkpoint):
  name, hf, directory = checkpoint
  model = interop.from_pretrained(directory)
  prompt = _tokens(2)[:1, :4]
  steps = 3 * WINDOW   # past twice the sliding window
  with torch.no_grad():
    want = hf.generate(prompt, max_new_tokens=steps, do_sample=False, min_new_tokens=steps)
  got = generate(model, jnp.asarray(prompt.numpy()), steps, jax.random.key(0), temperature=0)
  np.testing.assert_array_equal(np.asarray(got), want.numpy(), err_msg=name)


def test_our_save_pretrained_loads_in_transformers_with_equal_logits(checkpoint, tmp_path):
  name, hf, directory = checkpoint
  model = interop.from_pretrained(directory, fused=False)
  interop.save_pretrained(model, tmp_path)
  again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path,
                                                           attn_implementation="eager")
  assert type(again).__name__ == families.family(FAMILIES[name][0]).architecture
  tokens_t = _tokens(3)
  with torch.no_grad():
    assert rel_err(again(tokens_t).logits, hf(tokens_t).logits) == 0.0


def test_sharded_and_bfloat16_checkpoints_load(tmp_path):
  """A family with q/k norms and per-layer rotary bases (Gemma 3), saved by transformers in
  shards with an index, and in bfloat16: the values come back exactly."""
  model_type, changes = FAMILIES["gemma3"]
  hf = _hf_model(model_type, changes, seed=3)
  hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
  assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
  model = interop.from_pretrained(tmp_path / "sharded", fused=False)
  tokens_t = _tokens(4)
  with torch.no_grad():
    want = hf(tokens_t).logits
  assert rel_err(model.logits(jnp.asarray(tokens_t.numpy())), want) <= LOGITS_RTOL
  hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
  bf16 = interop.from_pretrained(tmp_path / "bf16", param_dtype=jnp.bfloat16)
  for key, value in interop.hf_state_dict(bf16, as_torch=True).items():
    assert value.dtype == torch.bfloat16
    torch.testing.assert_close(value, hf.state_dict()[key], rtol=0, atol=0)


def test_scanned_layers_of_alternating_kinds_match_unrolled():
  """Gemma 2's sliding and global layers in one scan: each layer takes its kind's branch."""
  model_type, changes = FAMILIES["gemma2"]
  hf = _hf_model(model_type, {**changes, "num_hidden_layers": 4})
  unrolled = interop.from_pretrained(hf)
  scanned = interop.from_pretrained(hf, scan_layers=True)
  tokens = jnp.asarray(_tokens(5).numpy())
  for fn in (lambda m: m.logits(tokens), lambda m: jax.grad(
      lambda p: p(tokens, tokens))(m).layers):
    a, b = fn(unrolled), fn(scanned)
    if not isinstance(a, jax.Array):   # the gradients: unrolled per layer, scanned stacked
      a = jax.tree.map(lambda *xs: jnp.stack(xs), *[a[i] for i in range(4)])
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("name,extra", [
    ("gemma2", ["--scan-layers", "--remat-policy", "save_dot_except_mlp"]),
    ("olmo2", ["--remat-budget", "50%"]),
], ids=["gemma2-scanned-recipe", "olmo2-planned"])
def test_the_train_cli_fine_tunes_a_checkpoint(tmp_path, name, extra):
  """``python -m jaxfuse.train --init-from`` a family's checkpoint (a vocabulary that holds
  the byte tokens), scanned or planned: it trains, the loss falls."""
  from jaxfuse import train

  model_type, changes = FAMILIES[name]
  hf = _hf_model(model_type, {**changes, "vocab_size": 260, "num_hidden_layers": 4})
  hf.save_pretrained(tmp_path / "init")
  cfg = train.parse_args(["--steps", "6", "--batch", "2", "--seq", "16", "--warmup", "1",
                          "--lr", "1e-2", "--eval-every", "100", "--sample-tokens", "0",
                          "--init-from", str(tmp_path / "init"), "--out", str(tmp_path / "run"),
                          *extra])
  result = train.train(cfg, log=lambda *_: None)
  losses = result["history"]["loss"]
  assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses


def test_the_readme_table_is_the_code_list():
  from pathlib import Path

  readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
  block = readme.split("<!-- families:start -->\n", 1)[1].split("\n<!-- families:end -->")[0]
  assert block == families.supported_table()
  assert set(FAMILIES_TESTED) == set(families.MODEL_TYPES)


FAMILIES_TESTED = {model_type for model_type, _ in FAMILIES.values()} | {
    "mistral", "qwen2",   # the earlier families' twins: tests/test_hf_twin.py
    "mixtral", "qwen2_moe", "qwen3_moe"}   # the Mixture-of-Experts families': tests/test_moe_families.py
