"""Recomputation against its PyTorch twin: Hugging Face's LLaMA with gradient checkpointing
(``torch.utils.checkpoint``, non-reentrant) gives the loss and gradients of jaxfuse's decoder
under a recomputation policy and under a plan, and checkpointing really changes what torch
keeps for its backward pass.

The twin is built as in test_hf_twin.py: a random ``LlamaForCausalLM`` in float32 whose state
dict is loaded into the decoder (:func:`jaxfuse.interop.from_pretrained`). Tolerances are
test_hf_twin's: a relative error per tensor of at most 1e-5.
"""

import jax
import jax.numpy as jnp
import pytest
import torch
from flax import nnx

from jaxfuse import interop
from jaxfuse.metrics import torch_residual_bytes
from jaxfuse.models import next_token_targets
from jaxfuse.remat import plan
from tests.test_hf_twin import STEP0_RTOL, _hf_model, _jit, _tokens, rel_err

pytest.importorskip("transformers")


def _checkpointing(hf, on: bool):
  """Hugging Face's gradient checkpointing of every decoder layer, non-reentrant (recent
  transformers name it activation checkpointing; the old name is a deprecated alias)."""
  kwargs = {"use_reentrant": False}
  if hasattr(hf, "activation_checkpointing_enable"):
    if on:
      hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
      hf.activation_checkpointing_disable()
  elif on:
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
  else:
    hf.gradient_checkpointing_disable()
  assert all(layer.gradient_checkpointing == on for layer in hf.model.layers)
  hf.train()   # Hugging Face checkpoints its layers only in training mode
  assert hf.config.attention_dropout == 0.0


def _torch_step(hf, tokens_t):
  hf.zero_grad(set_to_none=True)
  loss = hf(tokens_t, labels=tokens_t, use_cache=False).loss
  loss.backward()
  return loss.detach(), {name: p.grad.detach().clone() for name, p in hf.named_parameters()}


@pytest.fixture(scope="module")
def twin():
  """``(hf, tokens, loss, grads)``: the twin's step with gradient checkpointing."""
  hf = _hf_model("llama")
  tokens_t = _tokens(1)
  _checkpointing(hf, True)
  loss, grads = _torch_step(hf, tokens_t)
  return hf, tokens_t, loss, grads


def _loss_fn(model, batch):
  return model(*batch)


def _jax_step(model, tokens):
  """Loss and parameter gradients, under Hugging Face's names."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  batch = (tokens, next_token_targets(tokens))
  loss, grads = _jit(jax.value_and_grad(lambda p: _loss_fn(nnx.merge(graphdef, p, rest), batch)))(
      params)
  return loss, interop.hf_state_dict(nnx.merge(graphdef, grads, rest))


def _assert_matches(model, twin, what):
  _, tokens_t, hf_loss, hf_grads = twin
  loss, grads = _jax_step(model, jnp.asarray(tokens_t.numpy()))
  assert sorted(grads) == sorted(hf_grads)
  errors = {"loss": rel_err(loss, hf_loss)}
  errors |= {name: rel_err(grads[name], g) for name, g in hf_grads.items()}
  bad = {name: e for name, e in errors.items() if not e <= STEP0_RTOL}
  assert not bad, f"{what}: relative errors above {STEP0_RTOL}: {bad}"


def test_checkpointed_hf_matches_the_decoder_keeping_nothing(twin):
  model = interop.from_pretrained(twin[0], fused=True, remat="nothing")
  assert model.layer_policies == ("nothing",) * model.num_layers
  _assert_matches(model, twin, "remat='nothing'")


def test_checkpointed_hf_matches_the_decoder_under_a_plan(twin):
  hf, tokens_t = twin[0], twin[1]
  model = interop.from_pretrained(hf, fused=False)
  tokens = jnp.asarray(tokens_t.numpy())
  p = plan(_loss_fn, model, (tokens, next_token_targets(tokens)), "50%",
           choices=["none", "nothing", "dots", "minimal", "save_context"])
  assert p.measured_bytes <= p.budget_bytes
  model.set_remat(p)
  assert model.layer_policies == p.policies
  _assert_matches(model, twin, f"plan {p.choices}")


def test_torch_checkpointing_keeps_less_and_recomputes_each_layer(twin):
  hf, tokens_t, loss_on, grads_on = twin
  params = list(hf.parameters())
  calls = []
  # Hugging Face checkpoints a layer's forward (its own hooks stay outside the checkpoint), so
  # the recomputation shows in its attention's calls. A pre-hook: torch stops a recomputation
  # as soon as it has what the backward needs, possibly before a module returns.
  hooks = [layer.self_attn.register_forward_pre_hook(lambda *_, i=i: calls.append(i))
           for i, layer in enumerate(hf.model.layers)]
  try:
    kept = {}
    for on in (True, False):
      _checkpointing(hf, on)
      calls.clear()
      kept[on] = torch_residual_bytes(
          lambda: hf(tokens_t, labels=tokens_t, use_cache=False).loss.backward(), params)
      # Each attention runs once in the forward pass, and once more in the backward pass when
      # its layer is checkpointed.
      assert sorted(calls) == sorted(list(range(len(hf.model.layers))) * (2 if on else 1))
    loss_off, grads_off = _torch_step(hf, tokens_t)
  finally:
    for hook in hooks:
      hook.remove()
    _checkpointing(hf, True)
  assert 0 < kept[True] < kept[False], kept
  # Recomputation changes nothing in the results: torch's own gradients agree exactly.
  assert torch.equal(loss_on, loss_off)
  for name, g in grads_on.items():
    assert torch.equal(g, grads_off[name]), name
