"""The GRPO-family policy loss on whole models against TRL: a tiny Llama and a tiny Qwen3 that
``transformers`` wrote, fixed rollouts (prompts and completions of different lengths, old and
reference log-probabilities, advantages), and TRL 1.16's own ``GRPOTrainer._compute_loss`` run
on the Hugging Face model in float64 (a stand-in returns the model's per-token log-probabilities
of the completions, as TRL's ``_get_per_token_logps_and_entropies`` would).

jaxfuse's side: each rollout as one row (prompt, completion, padding), the policy's per-token
log-probabilities from the fused head (:meth:`jaxfuse.models.Decoder.token_log_probs`) gathered
into the completions' ``[B, T]`` layout, then :func:`jaxfuse.posttrain.grpo_loss`. For every
loss type and clipping option the loss and the gradient of every parameter agree within 1e-5
relative (per parameter, against its largest entry): the model's VJP of the loss's gradient
with respect to the log-probabilities.
"""

import types
import warnings
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxfuse import interop
from jaxfuse.data.packing import IGNORE_INDEX
from jaxfuse.posttrain import GRPO_LOSS_TYPES, grpo_loss
from jaxfuse.testing.checkpoints import write_tiny_checkpoint

transformers = pytest.importorskip("transformers")
pytest.importorskip("trl")

RTOL = 1e-5
PROMPTS = (5, 9, 3, 7)       # prompt lengths
COMPLETIONS = (6, 11, 2, 9, 11, 4, 8, 1)   # two completions a prompt
T = max(COMPLETIONS)
CASES = ([{"loss_type": t} for t in GRPO_LOSS_TYPES if t != "luspo"]
         + [{"loss_type": "luspo", "importance_sampling_level": "sequence"},
            {"loss_type": "grpo", "importance_sampling_level": "sequence"},   # GSPO
            {"loss_type": "dapo", "epsilon_high": 0.28},
            {"loss_type": "dapo", "delta": 1.3},
            {"loss_type": "grpo", "epsilon": 0.1, "epsilon_high": 0.3, "delta": 1.5},
            {"loss_type": "cispo", "epsilon_high": 1.1},
            {"loss_type": "bnpo", "beta": 0.04},
            {"loss_type": "grpo", "beta": 0.1, "use_bias_correction_kl": True},
            {"loss_type": "dr_grpo", "max_completion_length": 16},
            {"loss_type": "sapo", "sapo_temperature_pos": 0.8, "sapo_temperature_neg": 1.3},
            {"loss_type": "dapo", "old": False}])   # one update a batch: old = the policy


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def checkpoint(request, tmp_path_factory):
  return write_tiny_checkpoint(tmp_path_factory.mktemp(request.param) / "policy",
                               family=request.param, seed=0, initializer_range=0.15)


def _rollouts(vocab):
  """Rows of prompt + completion (right-padded), each completion's start, the completion ids
  ``[B, T]`` and mask, advantages, and the noise that makes old and reference log-probabilities
  differ from the policy's (so that ratios leave the clipping range)."""
  rng = np.random.default_rng(0)
  b = len(COMPLETIONS)
  prompts = [rng.integers(3, vocab, PROMPTS[i // 2]) for i in range(b)]
  completions = [rng.integers(3, vocab, c) for c in COMPLETIONS]
  seq = max(len(p) for p in prompts) + T
  tokens = np.zeros((b, seq), np.int32)
  targets = np.full((b, seq), IGNORE_INDEX, np.int32)
  ids = np.zeros((b, T), np.int64)
  mask = np.zeros((b, T), np.float64)
  for i, (p, c) in enumerate(zip(prompts, completions)):
    tokens[i, :len(p) + len(c)] = np.concatenate([p, c])
    targets[i, len(p) - 1:len(p) - 1 + len(c)] = c
    ids[i, :len(c)], mask[i, :len(c)] = c, 1.0
  starts = np.array([len(p) - 1 for p in prompts])
  return dict(tokens=tokens, targets=targets, starts=starts, ids=ids, mask=mask,
              advantages=rng.standard_normal(b), old_noise=0.3 * rng.standard_normal((b, T)),
              ref_noise=0.3 * rng.standard_normal((b, T)))


def _completion_layout(per_position, starts):
  """Per-position values ``[B, S]`` (position p scores token p + 1) as ``[B, T]`` completions."""
  index = starts[:, None] + np.arange(T)[None]
  index = np.minimum(index, per_position.shape[1] - 1)
  return index


def _trl_loss(per_token, r, old, ref, options):
  """TRL's ``GRPOTrainer._compute_loss`` on the given per-token log-probabilities."""
  from trl.trainer.grpo_trainer import GRPOTrainer

  trainer = GRPOTrainer.__new__(GRPOTrainer)
  trainer.loss_type = options["loss_type"]
  trainer.beta = options.get("beta", 0.0)
  trainer.epsilon_low = options.get("epsilon", 0.2)
  trainer.epsilon_high = options.get("epsilon_high", trainer.epsilon_low)
  trainer.importance_sampling_level = options.get("importance_sampling_level", "token")
  trainer.top_entropy_quantile = 1.0
  trainer.off_policy_mask_threshold = None
  trainer.use_vllm = False
  trainer.vllm_importance_sampling_correction = False
  trainer._entropy_bonus_enabled = False
  trainer.aux_loss_enabled = False
  trainer.max_completion_length = options.get("max_completion_length", T)
  trainer.current_gradient_accumulation_steps = 1
  trainer.args = types.SimpleNamespace(
      delta=options.get("delta"), use_bias_correction_kl=options.get("use_bias_correction_kl",
                                                                     False),
      sapo_temperature_pos=options.get("sapo_temperature_pos", 1.0),
      sapo_temperature_neg=options.get("sapo_temperature_neg", 1.05),
      vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0,
      steps_per_generation=1)
  trainer._metrics = defaultdict(lambda: defaultdict(list))
  trainer.model = types.SimpleNamespace(training=True)
  trainer.accelerator = types.SimpleNamespace(
      num_processes=1, gather=lambda x: x, gather_for_metrics=lambda x: x,
      reduce=lambda x, reduction: x)
  trainer._get_per_token_logps_and_entropies = (
      lambda *a, **k: (per_token, torch.zeros_like(per_token), None))
  b = len(COMPLETIONS)
  mask = torch.tensor(r["mask"]).long()
  inputs = {"prompt_ids": torch.zeros((b, 1), dtype=torch.long),
            "prompt_mask": torch.ones((b, 1), dtype=torch.long),
            "completion_ids": torch.tensor(r["ids"]), "completion_mask": mask,
            "advantages": torch.tensor(r["advantages"]),
            "num_items_in_batch": mask.sum().double()}
  if old is not None:
    inputs["old_per_token_logps"] = torch.tensor(old)
  if trainer.beta:
    inputs["ref_per_token_logps"] = torch.tensor(ref)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    loss = GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
  return loss, dict(trainer._metrics["train"])


def _rel(ours, theirs) -> float:
  ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
  assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
  return float(np.max(np.abs(ours - theirs)) / max(np.max(np.abs(theirs)), 1e-30))


def test_every_grpo_loss_type_matches_trl_on_the_model(checkpoint):
  model = interop.from_pretrained(checkpoint, dtype=jnp.float32)
  r = _rollouts(model.cfg.vocab_size)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  index = _completion_layout(r["tokens"], r["starts"])
  mask = jnp.asarray(r["mask"], jnp.float32)

  def policy(params):
    m = nnx.merge(graphdef, params, rest)
    per_position = m.token_log_probs(jnp.asarray(r["tokens"]), jnp.asarray(r["targets"]))
    return jnp.take_along_axis(per_position, jnp.asarray(index), axis=1) * mask

  logps, vjp = jax.vjp(policy, params)
  vjp = jax.jit(vjp)

  hf = transformers.AutoModelForCausalLM.from_pretrained(
      checkpoint, dtype=torch.float32, attn_implementation="eager").double()
  hf_params = dict(hf.named_parameters())
  tokens = torch.tensor(r["tokens"]).long()
  logits = hf(input_ids=tokens).logits.double()
  logp = torch.log_softmax(logits, -1).gather(-1, tokens.roll(-1, 1)[..., None])[..., 0]
  per_token = logp.gather(1, torch.tensor(index)) * torch.tensor(r["mask"])
  np.testing.assert_allclose(np.asarray(logps), per_token.detach().numpy(), rtol=RTOL,
                             atol=RTOL * float(per_token.detach().abs().max()))

  # The rollouts' data, as float32 holds it, given to both sides alike.
  base = np.asarray(logps, np.float64)
  as32 = lambda x: x.astype(np.float32).astype(np.float64)  # noqa: E731
  old_all = as32((base + r["old_noise"]) * r["mask"])
  ref_all = as32((base + r["ref_noise"]) * r["mask"])
  r["advantages"] = as32(r["advantages"])
  worst = {}
  for options in CASES:
    options = dict(options)
    use_old = options.pop("old", True)
    old = old_all if use_old else None
    loss_t, metrics_t = _trl_loss(per_token, r, old, ref_all, {**options})
    want = dict(zip(hf_params, torch.autograd.grad(loss_t, list(hf_params.values()),
                                                   retain_graph=True)))

    def loss_of(token_logps, options=options, old=old):
      return grpo_loss(token_logps, None if old is None else jnp.asarray(old, jnp.float32),
                       jnp.asarray(r["advantages"], jnp.float32), mask,
                       ref_logps=jnp.asarray(ref_all, jnp.float32), **options)

    (loss, metrics), cotangent = jax.value_and_grad(loss_of, has_aux=True)(logps)
    (grads,) = vjp(cotangent)
    got = interop.hf_state_dict(nnx.merge(graphdef, grads, rest))
    assert sorted(got) == sorted(want)
    errors = {"loss": _rel(loss, loss_t.item())}
    errors |= {name: _rel(got[name], g.detach().numpy()) for name, g in want.items()}
    name = ",".join(f"{k}={v}" for k, v in options.items()) + ("" if use_old else ",old=None")
    worst[name] = max(errors.values())
    # TRL's metrics of the same step (its clip fractions and KL).
    for key, value in metrics.items():
      if key in metrics_t and key != "entropy":
        np.testing.assert_allclose(float(value), metrics_t[key][0], rtol=1e-5, atol=1e-6,
                                   err_msg=f"{name}: {key}")
    # The same metrics (TRL also logs the entropy, and per-sequence extremes of the clipping).
    assert set(metrics) == set(metrics_t) - {"entropy", "clip_ratio/low_min",
                                             "clip_ratio/high_max"}, name
  print("\nworst relative error per case: " + "; ".join(f"{k} {v:.1e}" for k, v in worst.items()))
  bad = {k: e for k, e in worst.items() if not e <= RTOL}
  assert not bad, f"relative errors above {RTOL}: {bad}"


def test_grpo_loss_refuses_bad_options_by_name():
  x, adv, mask = jnp.zeros((2, 3)), jnp.ones(2), jnp.ones((2, 3))
  with pytest.raises(ValueError, match="unknown loss_type 'ppo'"):
    grpo_loss(x, None, adv, mask, loss_type="ppo")
  with pytest.raises(ValueError, match="importance_sampling_level must be one of"):
    grpo_loss(x, None, adv, mask, importance_sampling_level="batch")
  with pytest.raises(ValueError, match="beta != 0 needs ref_logps"):
    grpo_loss(x, None, adv, mask, beta=0.1)
  with pytest.raises(ValueError, match="delta .* not 'cispo'"):
    grpo_loss(x, None, adv, mask, loss_type="cispo", delta=2.0)
  with pytest.raises(ValueError, match="epsilon and epsilon_high must be >= 0"):
    grpo_loss(x, None, adv, mask, epsilon=-0.1)
