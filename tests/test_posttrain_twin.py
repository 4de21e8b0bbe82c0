"""Preference objectives on whole models against TRL: a tiny Llama and a tiny Qwen3 that
``transformers`` wrote, the same preference pairs, and TRL 1.16's own ``DPOTrainer._compute_loss``
run on the Hugging Face model (a stand-in wraps it to return the per-token log-probabilities
TRL's fused LM head would: ``log_softmax(logits)`` at the labels, 0 where they are -100).

jaxfuse's side is the trainer's: the pairs read by
:func:`jaxfuse.posttrain.data.read_preference_rows`
(chosen and rejected packed into one row with segment ids), the policy's per-token
log-probabilities from the fused head (:func:`jaxfuse.posttrain.objectives.pair_log_probs`),
the reference's from :func:`~jaxfuse.posttrain.objectives.reference_log_probs` of a second
checkpoint. For every loss type the loss and the gradient of every parameter agree within 1e-5
relative (the gradient's error relative to its largest entry, per parameter). The gradient of
each loss type is the model's VJP (compiled once) of the loss's gradient with respect to the
per-token log-probabilities, which is what the chain rule makes of ``jax.grad`` of the whole;
one loss type also runs as ``jax.grad`` of :class:`~jaxfuse.posttrain.objectives.DPO`'s loss.
"""

import json
import types
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxfuse import data, interop
from jaxfuse.posttrain import dpo_loss, sequence_logps
from jaxfuse.posttrain.data import read_preference_rows
from jaxfuse.posttrain.objectives import DPO, pair_log_probs, reference_log_probs
from jaxfuse.testing.checkpoints import write_tiny_checkpoint
from tests.test_preference_losses import CASES

transformers = pytest.importorskip("transformers")
pytest.importorskip("trl")

RTOL = 1e-5
RTOL_DISCOPOP = 3e-5
SEQ = 48
PAIRS = 4


def _pairs():
  animals = ["cat", "dog", "fox", "owl"]
  rows = []
  for i in range(PAIRS):
    a, b = i + 2, 2 * i + 1
    rows.append({"prompt": f"What is {a} plus {b}?", "chosen": f" It is {a + b}.",
                 "rejected": f" It is {a + b + 1}, a {animals[i]}" + " or" * i + "."})
  return rows


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def setup(request, tmp_path_factory):
  """``(policy directory, reference directory, rows)``: two checkpoints of one family (the
  reference with other weights) and the pairs as rows."""
  root = tmp_path_factory.mktemp(request.param)
  policy = write_tiny_checkpoint(root / "policy", family=request.param, seed=0,
                                 initializer_range=0.15)
  reference = write_tiny_checkpoint(root / "reference", family=request.param, seed=1,
                                    initializer_range=0.15)
  path = root / "pairs.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in _pairs()))
  rows = read_preference_rows(path, data.load_tokenizer(policy), seq=SEQ)
  return policy, reference, rows


def _trl_batch(rows):
  """TRL's padded batch of the same pairs: ``[2B, T]`` input ids (chosen sequences, then
  rejected), attention and completion masks."""
  sequences, completions = [], []
  for side in (1, 2):
    for r in range(len(rows)):
      where = rows.segment_ids[r] == side
      ids, targets = rows.tokens[r][where], rows.targets[r][where]
      completion = np.zeros(len(ids), np.int64)
      completion[1:] = targets[:-1] != -100
      sequences.append(ids)
      completions.append(completion)
  length = max(len(s) for s in sequences)

  def pad(xs):
    return torch.tensor(np.stack([np.pad(x, (0, length - len(x))) for x in xs]))

  attention = pad([np.ones(len(s), np.int64) for s in sequences])
  return {"input_ids": pad(sequences).long(), "attention_mask": attention.long(),
          "completion_mask": pad(completions).long()}


def _hf_log_probs(model, batch):
  """What TRL's fused LM head returns: per-token log-probabilities ``[2B, T - 1]`` of the
  labels, 0 where they are -100."""
  logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
  labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)[:, 1:]
  logp = torch.log_softmax(logits[:, :-1].double(), -1)
  picked = logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
  return picked * (labels != -100)


def _trl_dpo(per_token, batch, ref, options):
  """TRL's ``DPOTrainer._compute_loss`` on the model's per-token log-probabilities."""
  from trl.trainer.dpo_trainer import DPOTrainer

  trainer = DPOTrainer.__new__(DPOTrainer)
  loss_type = options["loss_type"]
  trainer.beta = options["beta"]
  trainer.loss_types = list(loss_type)
  trainer.loss_weights = list(options.get("loss_weights") or [1.0] * len(loss_type))
  trainer.label_smoothing = options.get("label_smoothing", 0.0)
  trainer.f_divergence_type = options.get("f_divergence_type", "reverse_kl")
  trainer.f_alpha_divergence_coef = options.get("f_alpha_divergence_coef", 1.0)
  trainer.ld_alpha = options.get("ld_alpha")
  trainer.use_weighting = False
  trainer.precompute_ref_logps = True
  trainer.aux_loss_enabled = False
  trainer.args = types.SimpleNamespace(discopop_tau=options.get("discopop_tau", 0.05))
  trainer._metrics = defaultdict(lambda: defaultdict(list))
  trainer._total_train_tokens = 0
  trainer._tp_size = 1
  trainer.model = types.SimpleNamespace(training=True)
  trainer.accelerator = types.SimpleNamespace(device="cpu", gather=lambda x: x,
                                              gather_for_metrics=lambda x: x)
  # The alpha-divergence's clamp is looked up for 16- and 32-bit floats only.
  dtype = torch.float32 if trainer.f_divergence_type == "alpha_divergence" else torch.float64
  values = per_token.to(dtype)

  def model(labels, **_):
    zeros = torch.zeros(values.shape, dtype=dtype)
    return types.SimpleNamespace(log_probs=values, entropy=zeros, mean_logits=zeros,
                                 is_top1=torch.zeros(values.shape, dtype=torch.bool))

  b = len(ref) // 2
  ref = torch.tensor(ref, dtype=dtype)
  inputs = {**batch, "ref_chosen_logps": ref[:b], "ref_rejected_logps": ref[b:]}
  return DPOTrainer._compute_loss(trainer, model, inputs, False)


def _rel(ours, theirs) -> float:
  ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
  assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
  return float(np.max(np.abs(ours - theirs)) / max(np.max(np.abs(theirs)), 1e-30))


def test_every_dpo_loss_type_matches_trl_on_the_model(setup):
  policy_dir, reference_dir, rows = setup
  batch = {k: jnp.asarray(v) for k, v in rows.rows(np.arange(len(rows))).items()}
  model = interop.from_pretrained(policy_dir, dtype=jnp.float32)
  reference = interop.from_pretrained(reference_dir, dtype=jnp.float32)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  ref_tokens = jax.jit(lambda b: reference_log_probs(reference, b))(batch)
  trl_batch = _trl_batch(rows)
  hf_ref = transformers.AutoModelForCausalLM.from_pretrained(
      reference_dir, dtype=torch.float32, attn_implementation="eager").double()
  with torch.no_grad():
    hf_ref_tokens = _hf_log_probs(hf_ref, trl_batch)
  hf = transformers.AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32,
                                                         attn_implementation="eager").double()
  hf_params = dict(hf.named_parameters())
  per_token = _hf_log_probs(hf, trl_batch)

  # The policy's per-token log-probabilities as a function of the parameters, and its VJP.
  def policy(params):
    return pair_log_probs(nnx.merge(graphdef, params, rest), batch)[0]

  logps, vjp = jax.vjp(policy, params)
  vjp = jax.jit(vjp)
  _, mask = jax.jit(lambda p: pair_log_probs(nnx.merge(graphdef, p, rest), batch))(params)
  # The forward twins: per-sequence log-probabilities of the policy and of the reference.
  ref_tokens2 = jnp.concatenate([ref_tokens, ref_tokens]) * mask
  ours_ref = np.asarray(sequence_logps(ref_tokens2, mask))
  np.testing.assert_allclose(ours_ref, hf_ref_tokens.sum(1).numpy(), rtol=RTOL)
  np.testing.assert_allclose(np.asarray(sequence_logps(logps, mask)),
                             per_token.detach().sum(1).numpy(), rtol=RTOL)
  worst = {}
  for options in CASES:
    ld_alpha = options.get("ld_alpha")
    ref = np.asarray(sequence_logps(ref_tokens2, mask, ld_alpha), np.float64)
    loss_t = _trl_dpo(per_token, trl_batch, ref, options)
    want = torch.autograd.grad(loss_t, list(hf_params.values()), retain_graph=True)
    want = dict(zip(hf_params, want))

    def loss_of(token_logps, options=options, ref=ref):
      return dpo_loss(token_logps, jnp.asarray(ref, jnp.float32), mask, **options)[0]

    loss, cotangent = jax.value_and_grad(loss_of)(logps)
    (grads,) = vjp(cotangent)
    got = interop.hf_state_dict(nnx.merge(graphdef, grads, rest))
    assert sorted(got) == sorted(want)
    errors = {"loss": _rel(loss, loss_t.item())}
    errors |= {name: _rel(got[name], g.detach().numpy()) for name, g in want.items()}
    name = "+".join(options["loss_type"]) + "".join(
        f",{k}" for k in options if k not in ("loss_type", "beta"))
    worst[name] = max(errors.values())
  print("\nworst relative error per case: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
  # DiscoPOP's mix sigmoid(beta * delta / tau) at TRL's tau = 0.05 multiplies float32's
  # rounding of the log-ratios by up to beta / (4 tau) in the gradient: measured up to 1.7e-5
  # against the float64 model (Qwen3), where every other case is within 1e-5.
  bad = {k: e for k, e in worst.items() if not e <= (RTOL_DISCOPOP if k == "discopop" else RTOL)}
  assert not bad, f"relative errors above {RTOL}: {bad}"

  # The objective end to end: jax.grad of DPO's loss, the reference in the batch.
  objective = DPO(beta=0.3, loss_type="sigmoid")

  @jax.jit
  def objective_grads(params):
    return jax.grad(lambda p: objective.loss(nnx.merge(graphdef, p, rest),
                                             {**batch, "ref_logps": ref_tokens})[0])(params)

  got = interop.hf_state_dict(nnx.merge(graphdef, objective_grads(params), rest))
  ref = np.asarray(sequence_logps(ref_tokens2, mask), np.float64)
  loss_t = _trl_dpo(per_token, trl_batch, ref, {"loss_type": ("sigmoid",), "beta": 0.3})
  want = dict(zip(hf_params, torch.autograd.grad(loss_t, list(hf_params.values()))))
  for name, g in want.items():
    assert _rel(got[name], g.numpy()) <= RTOL, name


def _trl_pair_batch(rows):
  """TRL's CPO/ORPO batch of the same pairs: ``{chosen,rejected}_{input_ids,attention_mask,
  labels}``, right-padded, the labels -100 but on the completion."""
  batch = _trl_batch(rows)
  b = len(rows)
  labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
  out = {}
  for name, part in (("chosen", slice(None, b)), ("rejected", slice(b, None))):
    out[f"{name}_input_ids"] = batch["input_ids"][part]
    out[f"{name}_attention_mask"] = batch["attention_mask"][part]
    out[f"{name}_labels"] = labels[part]
  return out


def _trl_pair_loss(kind, hf, batch, options, output_dir):
  """TRL's ``CPOTrainer`` / ``ORPOTrainer.get_batch_loss_metrics`` on the Hugging Face model."""
  if kind == "cpo":
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    args = CPOConfig(output_dir=str(output_dir), bf16=False, report_to="none", **options)
    trainer = object.__new__(CPOTrainer)
    trainer.beta, trainer.label_smoothing = args.beta, args.label_smoothing
    trainer.loss_type, trainer.cpo_alpha, trainer.alpha = args.loss_type, args.cpo_alpha, args.alpha
    trainer.simpo_gamma = args.simpo_gamma
    trainer.pad_token_id = 0
    trainer_class = CPOTrainer
  else:
    from trl.experimental.orpo import ORPOTrainer

    trainer = object.__new__(ORPOTrainer)
    trainer.beta, trainer.padding_value = options["beta"], 0
    trainer_class = ORPOTrainer
  trainer.is_encoder_decoder = False
  trainer.aux_loss_enabled = False
  trainer.accelerator = types.SimpleNamespace(device="cpu", gather_for_metrics=lambda x: x)
  loss, _ = trainer_class.get_batch_loss_metrics(trainer, hf, batch)
  return loss


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
def test_cpo_simpo_and_orpo_match_trl_on_the_model(setup, tmp_path):
  from tests.test_preference_losses import CPO_CASES

  from jaxfuse.posttrain import cpo_loss
  from jaxfuse.posttrain.objectives import CPO, ORPO, make_objective

  policy_dir, _, rows = setup
  batch = {k: jnp.asarray(v) for k, v in rows.rows(np.arange(len(rows))).items()}
  model = interop.from_pretrained(policy_dir, dtype=jnp.float32)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  hf = transformers.AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32,
                                                         attn_implementation="eager").double()
  hf_params = dict(hf.named_parameters())
  trl_batch = _trl_pair_batch(rows)

  def compare(name, loss, grads, loss_t):
    want = dict(zip(hf_params, torch.autograd.grad(loss_t, list(hf_params.values()))))
    got = interop.hf_state_dict(nnx.merge(graphdef, grads, rest))
    assert sorted(got) == sorted(want)
    errors = {"loss": _rel(loss, loss_t.item())}
    errors |= {k: _rel(got[k], g.numpy()) for k, g in want.items()}
    bad = {k: e for k, e in errors.items() if not e <= RTOL}
    assert not bad, f"{name}: relative errors above {RTOL}: {bad}"
    return max(errors.values())

  def policy(params):
    return pair_log_probs(nnx.merge(graphdef, params, rest), batch)[0]

  logps, vjp = jax.vjp(policy, params)
  vjp = jax.jit(vjp)
  _, mask = pair_log_probs(model, batch)
  worst = {}
  for options in CPO_CASES:
    loss, cotangent = jax.value_and_grad(
        lambda t, o=options: cpo_loss(t, mask, **o)[0])(logps)
    name = ",".join(f"{k}={v}" for k, v in options.items())
    worst[name] = compare(name, loss, vjp(cotangent)[0],
                          _trl_pair_loss("cpo", hf, trl_batch, options, tmp_path))
  # The objectives end to end (jax.grad of their loss): SimPO as --objective simpo makes it,
  # and ORPO, whose NLL covers the chosen sequence's prompt too.
  for objective, kind, options in (
      (make_objective("simpo", beta=2.0, simpo_gamma=1.0), "cpo",
       {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 1.0, "cpo_alpha": 0.0}),
      (CPO(beta=0.3, loss_type="hinge"), "cpo", {"loss_type": "hinge", "beta": 0.3}),
      (ORPO(beta=0.2), "orpo", {"beta": 0.2}),
      (ORPO(beta=1.0), "orpo", {"beta": 1.0})):
    loss, grads = jax.jit(jax.value_and_grad(
        lambda p, o=objective: o.loss(nnx.merge(graphdef, p, rest), batch)[0]))(params)
    name = f"{objective.name} {options}"
    worst[name] = compare(name, loss, grads,
                          _trl_pair_loss(kind, hf, trl_batch, options, tmp_path))
  print("\nworst relative error per case: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))


def _trl_kto(hf, rows, ref, ref_kl, options):
  """TRL's ``KTOTrainer._compute_loss`` on the Hugging Face model (a stand-in returns what its
  fused LM head would), the mismatched pairs as its ``KL_`` inputs."""
  from trl.trainer.kto_trainer import KTOTrainer

  trainer = object.__new__(KTOTrainer)
  trainer.beta = options["beta"]
  trainer.loss_type = options.get("loss_type", "kto")
  trainer.desirable_weight = options.get("desirable_weight", 1.0)
  trainer.undesirable_weight = options.get("undesirable_weight", 1.0)
  trainer.calculate_KL = trainer.loss_type not in ["apo_zero_unpaired"]
  trainer.precompute_ref_logps = True
  trainer.aux_loss_enabled = False
  trainer._metrics = defaultdict(lambda: defaultdict(list))
  trainer._total_train_tokens = 0
  trainer._tp_size = 1
  trainer.model = types.SimpleNamespace(training=True)
  trainer.accelerator = types.SimpleNamespace(device="cpu", gather_for_metrics=lambda x: x)
  batch = _trl_batch(rows)   # the completions, then the mismatched pairs
  b = len(rows)

  def model(input_ids, attention_mask, labels, **_):
    logits = hf(input_ids=input_ids, attention_mask=attention_mask).logits
    logp = torch.log_softmax(logits[:, :-1].double(), -1)
    picked = logp.gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0]
    zeros = torch.zeros(picked.shape, dtype=picked.dtype)
    return types.SimpleNamespace(log_probs=picked * (labels[:, 1:] != -100), entropy=zeros,
                                 mean_logits=zeros)

  inputs = {"input_ids": batch["input_ids"][:b], "attention_mask": batch["attention_mask"][:b],
            "completion_mask": batch["completion_mask"][:b],
            "KL_input_ids": batch["input_ids"][b:],
            "KL_attention_mask": batch["attention_mask"][b:],
            "KL_completion_mask": batch["completion_mask"][b:],
            "label": torch.tensor(rows.labels[:, 0] > 0), "ref_logps": torch.tensor(ref),
            "ref_KL_logps": torch.tensor(ref_kl)}
  return KTOTrainer._compute_loss(trainer, model, inputs, False)


def test_kto_matches_trl_on_the_model(setup, tmp_path):
  from jaxfuse.posttrain.data import read_kto_rows
  from jaxfuse.posttrain.objectives import KTO

  policy_dir, reference_dir, _ = setup
  records = [{"prompt": r["prompt"], "completion": r[k], "label": k == "chosen"}
             for r, k in zip(_pairs() * 2, ["chosen", "rejected", "rejected", "chosen"] * 2)]
  path = tmp_path / "kto.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  rows = read_kto_rows(path, data.load_tokenizer(policy_dir), seq=SEQ, group=4)
  batch = {k: jnp.asarray(v) for k, v in rows.rows(np.arange(len(rows))).items()}
  model = interop.from_pretrained(policy_dir, dtype=jnp.float32)
  reference = interop.from_pretrained(reference_dir, dtype=jnp.float32)
  batch["ref_logps"] = jax.jit(lambda b: reference_log_probs(reference, b))(batch)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  hf = transformers.AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32,
                                                         attn_implementation="eager").double()
  hf_params = dict(hf.named_parameters())
  completion = (rows.targets != -100) & (rows.segment_ids == 1)
  mismatched = (rows.targets != -100) & (rows.segment_ids == 2)
  ref_tokens = np.asarray(batch["ref_logps"], np.float64)
  ref, ref_kl = (ref_tokens * completion).sum(1), (ref_tokens * mismatched).sum(1)
  worst = {}
  for options in ({"beta": 0.3}, {"beta": 0.1, "desirable_weight": 1.33,
                                  "undesirable_weight": 0.75},
                  {"beta": 0.4, "loss_type": "apo_zero_unpaired", "desirable_weight": 0.8}):
    objective = KTO(**options)
    loss, grads = jax.jit(jax.value_and_grad(
        lambda p, o=objective: o.loss(nnx.merge(graphdef, p, rest), batch)[0]))(params)
    loss_t = _trl_kto(hf, rows, ref, ref_kl, options)
    want = dict(zip(hf_params, torch.autograd.grad(loss_t, list(hf_params.values()))))
    got = interop.hf_state_dict(nnx.merge(graphdef, grads, rest))
    errors = {"loss": _rel(loss, loss_t.item())}
    errors |= {k: _rel(got[k], g.numpy()) for k, g in want.items()}
    worst[str(options)] = max(errors.values())
    bad = {k: e for k, e in errors.items() if not e <= RTOL}
    assert not bad, f"{options}: relative errors above {RTOL}: {bad}"
  print("\nworst relative error per case: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))


def test_distillation_matches_trl_gkd_on_the_models(setup):
  """``--objective distill``'s loss (the teacher's and the student's heads fused) against TRL's
  ``GKDTrainer.generalized_jsd_loss`` on the Hugging Face models' full logits, on packed SFT
  rows (several documents a row, a completion-only loss): the loss and every student
  parameter's gradient, for forward KL, reverse KL and the JSD, with a temperature."""
  from trl.experimental.gkd import GKDTrainer

  from jaxfuse.posttrain.objectives import Distill
  from tests.test_finetune_twin import packed_mask

  policy_dir, teacher_dir, rows = setup
  # Packed SFT-style rows: the preference rows' two sequences are two documents of a row.
  batch = {k: jnp.asarray(v) for k, v in rows.rows(np.arange(len(rows))).items()}
  model = interop.from_pretrained(policy_dir, dtype=jnp.float32)
  teacher = interop.from_pretrained(teacher_dir, dtype=jnp.float32)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  hf = transformers.AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32,
                                                         attn_implementation="eager").double()
  hf_teacher = transformers.AutoModelForCausalLM.from_pretrained(
      teacher_dir, dtype=torch.float32, attn_implementation="eager").double()
  hf_params = dict(hf.named_parameters())
  tokens, targets, positions, segment_ids = (
      torch.from_numpy(np.asarray(batch[k]).astype(np.int64))
      for k in ("tokens", "targets", "positions", "segment_ids"))
  mask = packed_mask(segment_ids).double()
  with torch.no_grad():
    teacher_logits = hf_teacher(input_ids=tokens, attention_mask=mask,
                                position_ids=positions).logits
  worst = {}
  for beta, temperature in ((0.0, 1.0), (1.0, 1.0), (0.5, 1.0), (0.3, 2.0)):
    objective = Distill.of(teacher, beta=beta, temperature=temperature)
    loss, grads = jax.jit(jax.value_and_grad(
        lambda p, c, o=objective: o.loss(nnx.merge(graphdef, p, rest), batch, c)[0]))(
            params, objective.constants)
    logits = hf(input_ids=tokens, attention_mask=mask, position_ids=positions).logits
    loss_t = GKDTrainer.generalized_jsd_loss(logits, teacher_logits, labels=targets, beta=beta,
                                             temperature=temperature)
    want = dict(zip(hf_params, torch.autograd.grad(loss_t, list(hf_params.values()))))
    got = interop.hf_state_dict(nnx.merge(graphdef, grads, rest))
    errors = {"loss": _rel(loss, loss_t.item())}
    errors |= {k: _rel(got[k], g.numpy()) for k, g in want.items()}
    worst[f"beta={beta},T={temperature}"] = max(errors.values())
    bad = {k: e for k, e in errors.items() if not e <= RTOL}
    assert not bad, f"beta {beta}, temperature {temperature}: relative errors above {RTOL}: {bad}"
  print("\nworst relative error per case: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
