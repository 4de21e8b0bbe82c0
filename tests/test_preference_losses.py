"""jaxfuse.posttrain.dpo_loss against TRL's own code: ``DPOTrainer._compute_loss`` of the
installed TRL, run on CPU on the same per-token log-probabilities (a stand-in model returns
them, as TRL's fused LM head would), for every loss type and option; the loss, TRL's logged
metrics and the gradient of the loss with respect to every per-token log-probability."""

import types
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxfuse.posttrain import DPO_LOSS_TYPES, dpo_loss, sequence_logps

B, T = 4, 7


def _batch(seed=0):
  """Per-token log-probabilities ``[2B, T]`` (chosen, then rejected), completion masks of
  different lengths (a shared prompt position first, then the completion), and reference
  per-sequence log-probabilities."""
  rng = np.random.default_rng(seed)
  logps = -np.abs(rng.standard_normal((2 * B, T))) - 0.1
  lengths = np.concatenate([rng.integers(2, T + 1, B), rng.integers(1, T + 1, B)])
  mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float64)
  ref = (logps * mask).sum(1) + rng.standard_normal(2 * B) * 0.5
  return logps, mask, ref


def _trl(logps, mask, ref, *, loss_type, beta, loss_weights=None, label_smoothing=0.0,
         f_divergence_type="reverse_kl", f_alpha_divergence_coef=1.0, ld_alpha=None,
         discopop_tau=0.05):
  """TRL's ``DPOTrainer._compute_loss`` on these log-probabilities: its loss, metrics and the
  gradient of its loss with respect to ``logps`` (float64)."""
  from trl.trainer.dpo_trainer import DPOTrainer

  trainer = DPOTrainer.__new__(DPOTrainer)
  trainer.beta = beta
  trainer.loss_types = list(loss_type)
  trainer.loss_weights = list(loss_weights or [1.0] * len(loss_type))
  trainer.label_smoothing = label_smoothing
  trainer.f_divergence_type = f_divergence_type
  trainer.f_alpha_divergence_coef = f_alpha_divergence_coef
  trainer.ld_alpha = ld_alpha
  trainer.use_weighting = False
  trainer.precompute_ref_logps = True
  trainer.aux_loss_enabled = False
  trainer.args = types.SimpleNamespace(discopop_tau=discopop_tau)
  trainer._metrics = defaultdict(lambda: defaultdict(list))
  trainer._total_train_tokens = 0
  trainer._tp_size = 1
  trainer.model = types.SimpleNamespace(training=True)
  trainer.accelerator = types.SimpleNamespace(device="cpu", gather=lambda x: x,
                                              gather_for_metrics=lambda x: x)
  # float64, but for the alpha-divergence, whose clamp TRL looks up for 16- and 32-bit floats.
  dtype = torch.float32 if f_divergence_type == "alpha_divergence" else torch.float64
  leaf = torch.tensor(logps, dtype=dtype, requires_grad=True)
  zeros = torch.zeros(logps.shape, dtype=dtype)

  def model(labels, **_):   # what TRL's fused LM head returns: 0 where labels are -100
    return types.SimpleNamespace(log_probs=leaf * (labels[:, 1:] != -100), entropy=zeros,
                                 mean_logits=zeros,
                                 is_top1=torch.zeros(logps.shape, dtype=torch.bool))

  completion = torch.tensor(np.concatenate([np.zeros((2 * B, 1)), mask], 1), dtype=torch.long)
  ref = torch.tensor(ref, dtype=dtype)
  inputs = {"input_ids": torch.ones((2 * B, T + 1), dtype=torch.long),
            "attention_mask": torch.ones((2 * B, T + 1), dtype=torch.long),
            "completion_mask": completion, "ref_chosen_logps": ref[:B],
            "ref_rejected_logps": ref[B:]}
  loss = DPOTrainer._compute_loss(trainer, model, inputs, False)
  loss.backward()
  metrics = {k: v[0] for k, v in trainer._metrics["train"].items()}
  return float(loss.detach()), metrics, leaf.grad.numpy()


def _ours(logps, mask, ref, **options):
  def loss(logps):
    return dpo_loss(logps, jnp.asarray(ref), jnp.asarray(mask), **options)
  (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(logps))
  return float(value), {k: float(v) for k, v in metrics.items()}, np.asarray(grad)


CASES = [{"loss_type": (t,), "beta": 0.3} for t in DPO_LOSS_TYPES if t != "exo_pair"] + [
    {"loss_type": ("exo_pair",), "beta": 0.3, "label_smoothing": 0.1},
    {"loss_type": ("robust",), "beta": 0.5, "label_smoothing": 0.2},
    {"loss_type": ("aot",), "beta": 0.5, "label_smoothing": 0.1},
    {"loss_type": ("sigmoid", "sft"), "beta": 0.2, "loss_weights": (0.7, 0.3)},
    {"loss_type": ("sigmoid",), "beta": 0.1, "ld_alpha": 0.5},
    {"loss_type": ("ipo",), "beta": 0.1, "ld_alpha": 0.3},
    {"loss_type": ("discopop",), "beta": 0.4, "discopop_tau": 0.2},
] + [{"loss_type": ("sigmoid", "hinge"), "beta": 0.2, "f_divergence_type": f,
      "f_alpha_divergence_coef": 0.5}
     for f in ("forward_kl", "js_divergence", "alpha_divergence")]


@pytest.mark.parametrize("options", CASES, ids=lambda o: "-".join(
    [*o["loss_type"], *(f"{k}={v}" for k, v in o.items() if k not in ("loss_type", "beta"))]))
def test_matches_trl_dpo_trainer(options):
  logps, mask, ref = _batch()
  want_loss, want_metrics, want_grad = _trl(logps, mask, ref, **options)
  got_loss, got_metrics, got_grad = _ours(logps.astype(np.float32), mask, ref, **options)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5, atol=1e-6)
  scale = max(np.abs(want_grad).max(), 1e-12)
  np.testing.assert_allclose(got_grad, want_grad, rtol=1e-5, atol=1e-5 * scale)
  for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
              "logps/chosen", "logps/rejected"):
    np.testing.assert_allclose(got_metrics[key], want_metrics[key], rtol=1e-5, atol=1e-5,
                               err_msg=key)


def test_reference_free_is_a_zero_reference():
  logps, mask, ref = _batch(1)
  free = _ours(logps, mask, ref, loss_type="sigmoid", beta=0.2, reference_free=True)
  zero = _ours(logps, mask, np.zeros_like(ref), loss_type="sigmoid", beta=0.2)
  assert free[0] == zero[0] and np.array_equal(free[2], zero[2])


def test_length_desensitized_sums():
  logps = jnp.array([[-1.0, -2.0, -3.0, -4.0], [-1.0, -1.0, 0.0, 0.0]])
  mask = jnp.array([[1, 1, 1, 1], [1, 1, 0, 0]])
  np.testing.assert_allclose(sequence_logps(logps, mask, ld_alpha=0.25),
                             [-3.0 + 0.25 * -7.0, -2.0])


@pytest.mark.parametrize("options,message", [
    ({"loss_type": "dpo"}, "loss_type must be one or more of"),
    ({"loss_type": ("sigmoid", "ipo"), "loss_weights": (1.0,)}, "one weight per loss type"),
    ({"beta": 0.0}, "beta must be > 0"),
    ({"f_divergence_type": "kl"}, "f_divergence_type must be one of"),
    ({"loss_type": "bco_pair", "f_divergence_type": "forward_kl"}, "takes only the loss types"),
    ({"loss_type": "exo_pair"}, "needs label_smoothing > 0"),
])
def test_bad_options_are_named(options, message):
  logps, mask, ref = _batch()
  with pytest.raises(ValueError, match=message):
    dpo_loss(jnp.asarray(logps), jnp.asarray(ref), jnp.asarray(mask), **options)
