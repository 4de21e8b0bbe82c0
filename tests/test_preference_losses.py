"""jaxfuse.posttrain's preference losses against TRL's own code, run on CPU on the same
per-token log-probabilities, for every loss type and option: ``DPOTrainer._compute_loss`` and
``KTOTrainer._compute_loss`` (a stand-in model returns the log-probabilities, as TRL's fused LM
head would), ``CPOTrainer`` and ``ORPOTrainer``'s ``get_batch_loss_metrics`` (a stand-in model
returns logits over two tokens whose log-softmax is them); the loss, TRL's logged metrics and the
gradient of the loss with respect to every per-token log-probability."""

import types
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxfuse.posttrain import (CPO_LOSS_TYPES, DPO_LOSS_TYPES, KTO_LOSS_TYPES, cpo_loss,
                               dpo_loss, kto_loss, orpo_loss, sequence_logps)

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


def test_dpo_wrong_shapes_are_named():
  logps, mask, ref = _batch()
  with pytest.raises(ValueError, match=r"token_logps must be \[2B, T\]"):
    dpo_loss(jnp.asarray(logps[1:]), jnp.asarray(ref[1:]), jnp.asarray(mask[1:]))
  with pytest.raises(ValueError, match="mask must have token_logps' shape"):
    dpo_loss(jnp.asarray(logps), jnp.asarray(ref), jnp.asarray(mask[:, 1:]))
  with pytest.raises(ValueError, match=r"ref_logps must be \[2B\]"):
    dpo_loss(jnp.asarray(logps), jnp.asarray(ref[:B]), jnp.asarray(mask))


# CPO and ORPO: TRL computes the log-probabilities from the logits itself. The stand-in model's
# logits are over two tokens, [log p, log(1 - p)], whose log-softmax at token 0 is log p: TRL's
# log-probabilities are `logps`, and its gradients with respect to them are `logps`'s.


def _sequences(seed=0, scale=1.0):
  """Per-token log-probabilities ``[2B, T]`` of sequences ``[2B, T + 1]``: a prompt (a pair's
  two share its length), a completion, padding. Also the completion masks and the attention
  masks without their first position, ``[2B, T]``, and the ``[2B, T + 1]`` ones TRL's batch
  takes."""
  rng = np.random.default_rng(seed)
  logps = scale * (-np.abs(rng.standard_normal((2 * B, T))) - 0.1)
  prompt = np.tile(rng.integers(1, 4, B), 2)
  completion = rng.integers(1, T + 2 - prompt)   # 1 to T + 1 - prompt tokens
  position = np.arange(T + 1)[None, :]
  attention = position < (prompt + completion)[:, None]
  labels = attention & (position >= prompt[:, None])
  return (logps, labels[:, 1:].astype(np.float64), attention[:, 1:].astype(np.float64),
          attention, labels)


def _trl_pairs(trainer_class, trainer, logps, attention, labels):
  """``trainer_class.get_batch_loss_metrics`` on these log-probabilities (float64): its loss,
  metrics and the gradient of its loss with respect to ``logps``."""
  trainer.is_encoder_decoder = False
  trainer.aux_loss_enabled = False
  trainer.accelerator = types.SimpleNamespace(device="cpu", gather_for_metrics=lambda x: x)
  leaf = torch.tensor(logps, dtype=torch.float64, requires_grad=True)

  def model(input_ids, **_):   # token 0 (every input id) has the log-probability `leaf`
    logits = torch.stack([leaf, torch.log(-torch.expm1(leaf))], -1)
    return types.SimpleNamespace(logits=torch.cat([logits, torch.zeros_like(logits[:, :1])], 1))

  batch = {}
  for name, rows in (("chosen", slice(None, B)), ("rejected", slice(B, None))):
    batch[f"{name}_input_ids"] = torch.zeros((B, T + 1), dtype=torch.long)
    batch[f"{name}_attention_mask"] = torch.tensor(attention[rows], dtype=torch.long)
    batch[f"{name}_labels"] = torch.where(torch.tensor(labels[rows]), 0, -100)
  loss, metrics = trainer_class.get_batch_loss_metrics(trainer, model, batch)
  loss.backward()
  return float(loss.detach()), {k: float(v) for k, v in metrics.items()}, leaf.grad.numpy()


def _trl_cpo(logps, attention, labels, output_dir, **options):
  """TRL's ``CPOTrainer`` configured by its own ``CPOConfig`` (which maps ``alphapo``)."""
  from trl.experimental.cpo import CPOConfig, CPOTrainer

  args = CPOConfig(output_dir=str(output_dir), bf16=False, report_to="none", **options)
  trainer = object.__new__(CPOTrainer)   # the attributes CPOTrainer.__init__ sets from args
  trainer.beta = args.beta
  trainer.label_smoothing = args.label_smoothing
  trainer.loss_type = args.loss_type
  trainer.cpo_alpha = args.cpo_alpha
  if args.loss_type == "simpo":
    trainer.simpo_gamma = args.simpo_gamma
  trainer.alpha = args.alpha
  trainer.pad_token_id = 0
  return _trl_pairs(CPOTrainer, trainer, logps, attention, labels)


def _trl_orpo(logps, attention, labels, *, beta):
  from trl.experimental.orpo import ORPOTrainer

  trainer = object.__new__(ORPOTrainer)
  trainer.beta = beta
  trainer.padding_value = 0
  return _trl_pairs(ORPOTrainer, trainer, logps, attention, labels)


def _ours_pairs(fn, logps, mask, **options):
  def loss(logps):
    return fn(logps, jnp.asarray(mask), **options)
  (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(logps))
  return float(value), {k: float(v) for k, v in metrics.items()}, np.asarray(grad)


def _assert_close(got, want, keys):
  got_loss, got_metrics, got_grad = got
  want_loss, want_metrics, want_grad = want
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5, atol=1e-6)
  scale = max(np.abs(want_grad).max(), 1e-12)
  np.testing.assert_allclose(got_grad, want_grad, rtol=1e-5, atol=1e-5 * scale)
  for key in keys:
    np.testing.assert_allclose(got_metrics[key], want_metrics[key], rtol=1e-5, atol=1e-5,
                               err_msg=key)


PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                "logps/chosen", "logps/rejected", "nll_loss")

CPO_CASES = [{"loss_type": t, "beta": 0.3} for t in CPO_LOSS_TYPES] + [
    {"loss_type": "sigmoid", "beta": 0.2, "label_smoothing": 0.2},
    {"loss_type": "sigmoid", "beta": 0.2, "cpo_alpha": 0.0},
    {"loss_type": "hinge", "beta": 0.2, "label_smoothing": 0.2, "cpo_alpha": 0.5},
    {"loss_type": "ipo", "beta": 0.4, "alpha": 0.5},
    {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 1.0, "cpo_alpha": 0.0},   # SimPO
    {"loss_type": "simpo", "beta": 2.0, "label_smoothing": 0.1, "cpo_alpha": 0.5},
    {"loss_type": "alphapo", "beta": 2.5, "alpha": 0.25, "simpo_gamma": 0.8, "cpo_alpha": 1.0},
    {"loss_type": "sigmoid", "beta": 0.1, "alpha": -0.2},
]


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize("options", CPO_CASES,
                         ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_cpo_matches_trl_cpo_trainer(options, tmp_path):
  logps, mask, _, attention, labels = _sequences()
  want = _trl_cpo(logps, attention, labels, tmp_path, **options)
  got = _ours_pairs(cpo_loss, logps.astype(np.float32), mask, **options)
  _assert_close(got, want, PAIR_METRICS)


@pytest.mark.parametrize("beta,scale", [(0.1, 1.0), (0.5, 0.4), (1.0, 2.0)])
def test_orpo_matches_trl_orpo_trainer(beta, scale):
  logps, mask, nll_mask, attention, labels = _sequences(2, scale)
  want = _trl_orpo(logps, attention, labels, beta=beta)
  got = _ours_pairs(orpo_loss, logps.astype(np.float32), mask, beta=beta,
                    nll_mask=jnp.asarray(nll_mask))
  _assert_close(got, want, PAIR_METRICS + ("log_odds_ratio", "log_odds_chosen"))


def test_orpo_nll_defaults_to_the_completions():
  logps, mask, _, _, _ = _sequences(3)
  default = _ours_pairs(orpo_loss, logps, mask)
  explicit = _ours_pairs(orpo_loss, logps, mask, nll_mask=jnp.asarray(mask))
  assert default[0] == explicit[0] and np.array_equal(default[2], explicit[2])
  chosen = (logps * mask)[:B]
  np.testing.assert_allclose(default[1]["nll_loss"], -chosen.sum() / mask[:B].sum(), rtol=1e-6)


def _unpaired(seed=0, labels=None, kl_shift=1.0):
  """Per-token log-probabilities ``[B, T]``, completion masks, labels, reference log-probabilities
  and the policy's and the reference's ones of the mismatched pairs (``kl_shift`` apart on
  average)."""
  rng = np.random.default_rng(seed)
  logps = -np.abs(rng.standard_normal((B, T))) - 0.1
  mask = (np.arange(T)[None, :] < rng.integers(1, T + 1, B)[:, None]).astype(np.float64)
  labels = np.array([True, False, True, False] if labels is None else labels)
  ref = (logps * mask).sum(1) + rng.standard_normal(B) * 0.5
  kl = -rng.uniform(1.0, 6.0, B)
  ref_kl = kl - kl_shift + rng.standard_normal(B) * 0.3
  return logps, mask, labels, ref, kl, ref_kl


def _trl_kto(logps, mask, labels, ref, kl, ref_kl, *, loss_type, beta, desirable_weight=1.0,
             undesirable_weight=1.0):
  """TRL's ``KTOTrainer._compute_loss`` on these log-probabilities: its loss, metrics and the
  gradient of its loss with respect to ``logps`` (float64)."""
  from trl.trainer.kto_trainer import KTOTrainer

  trainer = object.__new__(KTOTrainer)
  trainer.beta = beta
  trainer.loss_type = loss_type
  trainer.desirable_weight = desirable_weight
  trainer.undesirable_weight = undesirable_weight
  trainer.calculate_KL = loss_type not in ["apo_zero_unpaired"]   # as KTOTrainer.__init__
  trainer.precompute_ref_logps = True
  trainer.aux_loss_enabled = False
  trainer._metrics = defaultdict(lambda: defaultdict(list))
  trainer._total_train_tokens = 0
  trainer._tp_size = 1
  trainer.model = types.SimpleNamespace(training=True)
  trainer.accelerator = types.SimpleNamespace(device="cpu", gather_for_metrics=lambda x: x)
  leaf = torch.tensor(logps, dtype=torch.float64, requires_grad=True)
  zeros = torch.zeros(logps.shape, dtype=torch.float64)
  kl_tokens = torch.tensor(np.concatenate([kl[:, None], np.zeros((B, T - 1))], 1))

  def model(input_ids, labels, **_):   # what TRL's fused LM head returns
    if bool((input_ids == 2).all()):   # the mismatched pairs: their sequence log-probabilities
      return types.SimpleNamespace(log_probs=kl_tokens)
    return types.SimpleNamespace(log_probs=leaf * (labels[:, 1:] != -100), entropy=zeros,
                                 mean_logits=zeros)

  completion = torch.tensor(np.concatenate([np.zeros((B, 1)), mask], 1), dtype=torch.long)
  ones = torch.ones((B, T + 1), dtype=torch.long)
  inputs = {"input_ids": ones, "attention_mask": ones, "completion_mask": completion,
            "KL_input_ids": 2 * ones, "KL_attention_mask": ones, "KL_completion_mask": ones,
            "label": torch.tensor(labels), "ref_logps": torch.tensor(ref),
            "ref_KL_logps": torch.tensor(ref_kl)}
  loss = KTOTrainer._compute_loss(trainer, model, inputs, False)
  loss.backward()
  metrics = {k: v[0] for k, v in trainer._metrics["train"].items()}
  return float(loss.detach()), metrics, leaf.grad.numpy()


KTO_METRICS = ("kl", "rewards/chosen", "logps/chosen", "rewards/rejected", "logps/rejected",
               "rewards/margins")
KTO_CASES = [({"loss_type": t, "beta": 0.3}, {}) for t in KTO_LOSS_TYPES] + [
    ({"loss_type": "kto", "beta": 0.1, "desirable_weight": 1.33, "undesirable_weight": 0.75}, {}),
    ({"loss_type": "kto", "beta": 0.5}, {"kl_shift": -1.0}),   # a negative estimate: KL 0
    ({"loss_type": "kto", "beta": 0.2}, {"labels": [True, True, False, True]}),
    ({"loss_type": "kto", "beta": 0.2, "undesirable_weight": 2.0}, {"labels": [True] * B}),
    ({"loss_type": "kto", "beta": 0.2, "desirable_weight": 0.5}, {"labels": [False] * B}),
    ({"loss_type": "apo_zero_unpaired", "beta": 0.4, "desirable_weight": 0.8,
      "undesirable_weight": 1.2}, {"labels": [False, True, True, True]}),
]


@pytest.mark.parametrize("options,data", KTO_CASES, ids=lambda o: "-".join(
    f"{k}={v}" for k, v in o.items()))
def test_kto_matches_trl_kto_trainer(options, data):
  logps, mask, labels, ref, kl, ref_kl = _unpaired(**data)
  want = _trl_kto(logps, mask, labels, ref, kl, ref_kl, **options)

  def loss(logps):
    return kto_loss(logps, jnp.asarray(mask), jnp.asarray(labels), jnp.asarray(ref),
                    jnp.asarray(kl), jnp.asarray(ref_kl), **options)
  (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(
      jnp.asarray(logps.astype(np.float32)))
  metrics = {k: float(v) for k, v in metrics.items()}
  present = [k for k in KTO_METRICS if k in want[1]]
  _assert_close((float(value), metrics, np.asarray(grad)), want, present)
  for key in set(KTO_METRICS) - set(present):   # TRL logs nothing without such rows
    assert np.isnan(metrics[key]), key
  if options["loss_type"] == "kto" and data.get("kl_shift", 1.0) < 0:
    assert want[1]["kl"] == 0.0


def test_kto_kl_has_no_gradient():
  logps, mask, labels, ref, kl, ref_kl = (jnp.asarray(a) for a in _unpaired())

  def loss(kl):
    return kto_loss(logps, mask, labels, ref, kl, ref_kl)[0]
  assert not np.any(np.asarray(jax.grad(loss)(kl)))


@pytest.mark.parametrize("fn,options,message", [
    (cpo_loss, {"loss_type": "dpo"}, "loss_type must be one of"),
    (cpo_loss, {"beta": 0.0}, "beta must be > 0"),
    (cpo_loss, {"rows": 3}, r"token_logps must be \[2B, T\]"),
    (cpo_loss, {"columns": 3}, "mask must have token_logps' shape"),
    (orpo_loss, {"beta": -0.1}, "beta must be >= 0"),
    (orpo_loss, {"rows": 5}, r"token_logps must be \[2B, T\]"),
    (orpo_loss, {"nll_mask": jnp.ones((B, T))}, "nll_mask must have token_logps' shape"),
])
def test_bad_pair_inputs_are_named(fn, options, message):
  logps, mask, _, _, _ = _sequences()
  rows, columns = options.pop("rows", 2 * B), options.pop("columns", T)
  with pytest.raises(ValueError, match=message):
    fn(jnp.asarray(logps[:rows]), jnp.asarray(mask[:rows, :columns]), **options)


@pytest.mark.parametrize("change,message", [
    ({"loss_type": "sigmoid"}, "loss_type must be one of"),
    ({"beta": -1.0}, "beta must be > 0"),
    ({"labels": np.array([1, 0, 1, 0])}, "labels must be booleans"),
    ({"labels": np.array([True, False])}, r"labels must have shape \(4,\)"),
    ({"mask": np.ones((B, T - 1))}, r"mask must have shape \(4, 7\)"),
    ({"ref": np.zeros(2 * B)}, r"ref_logps must have shape \(4,\)"),
    ({"kl": None}, "needs kl_logps and ref_kl_logps"),
    ({"ref_kl": np.zeros(B - 1)}, r"ref_kl_logps must have shape \(4,\)"),
    ({"logps": np.zeros(T)}, r"token_logps must be \[B, T\]"),
])
def test_bad_kto_inputs_are_named(change, message):
  logps, mask, labels, ref, kl, ref_kl = _unpaired()
  inputs = {"logps": logps, "mask": mask, "labels": labels, "ref": ref, "kl": kl,
            "ref_kl": ref_kl, **change}
  options = {k: inputs.pop(k) for k in ("loss_type", "beta") if k in inputs}
  arrays = [None if a is None else jnp.asarray(a) for a in inputs.values()]
  with pytest.raises(ValueError, match=message):
    kto_loss(*arrays, **options)


def test_kto_needs_two_rows():
  logps, mask, labels, ref, kl, ref_kl = (jnp.asarray(a[:1]) for a in _unpaired())
  with pytest.raises(ValueError, match="at least 2 rows"):
    kto_loss(logps, mask, labels, ref, kl, ref_kl)
  kto_loss(logps, mask, labels, ref, loss_type="apo_zero_unpaired")   # no KL term: fine
