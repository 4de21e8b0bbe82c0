"""What a training step minimises: an objective object, ``objective.loss(model, batch) ->
(loss, metrics)``, which the training loop calls whatever the objective is.

- :class:`SFT`: the decoder's mean next-token loss (its fused cross-entropy).
- :class:`DPO`, :class:`CPO` (SimPO and AlphaPO among its loss types), :class:`ORPO`,
  :class:`KTO`: preference objectives over rows that hold a pair each
  (:mod:`jaxfuse.posttrain.data`): the policy's per-token log-probabilities from the fused head
  (:meth:`jaxfuse.models.Decoder.token_log_probs`, no ``[tokens, V]`` logits), split into the
  chosen and the rejected completions, then the loss of :mod:`jaxfuse.posttrain.losses`. DPO
  reads the reference model's per-token log-probabilities from the batch (``ref_logps``),
  computed once before training (:func:`reference_log_probs`).

- :class:`Distill`: a teacher's LM head distilled into the model's on SFT rows, neither
  model's logits materialized; the teacher's variables ride along as :attr:`Distill.constants`.

Every objective states how micro-batches of a step combine (``token_weighted``: SFT weighs every
target token alike across them; the preference losses are means over pairs, so each
micro-batch's loss weighs the same) and whether it needs a reference (``needs_reference``).

Example:
  >>> objective = make_objective("dpo", beta=0.1, loss_type="sigmoid")
  >>> objective.name, objective.needs_reference, objective.token_weighted
  ('dpo', True, False)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfuse.posttrain import losses
from jaxfuse.data.packing import IGNORE_INDEX
from jaxfuse.posttrain.data import pair_masks

__all__ = ["CPO", "DPO", "GRPO", "KTO", "OBJECTIVES", "ORPO", "SFT", "Distill", "DistillTopK",
           "Objective", "grpo_token_loss", "make_objective", "pair_log_probs",
           "reference_log_probs", "split_pairs"]


class Objective:
  """The interface: ``loss(model, batch) -> (scalar loss, {name: scalar})``."""
  name = "objective"
  needs_reference = False
  token_weighted = False
  # The metrics the progress bar shows, by their names in ``loss``'s metrics.
  progress_metrics: tuple[str, ...] = ()

  def loss(self, model, batch: dict) -> tuple[jax.Array, dict[str, jax.Array]]:
    raise NotImplementedError

  def check(self) -> None:
    """Raises ValueError for options the loss refuses (before anything is built)."""


@dataclasses.dataclass(frozen=True)
class SFT(Objective):
  """Supervised fine-tuning: the model's mean cross-entropy over the batch's targets."""
  name = "sft"
  token_weighted = True

  def loss(self, model, batch):
    return model(**batch), {}


def pair_log_probs(model, batch: dict, *, temperature: float = 1.0):
  """``(token_logps, mask)`` ``[2B, seq]`` of preference rows ``[B, seq]``: the policy's
  per-token log-probabilities on the chosen completions (rows ``0..B-1``) and on the rejected
  ones (rows ``B..2B-1``), 0 elsewhere, and their masks: TRL's batch layout."""
  logps = model.token_log_probs(batch["tokens"], batch["targets"], batch.get("positions"),
                                batch.get("segment_ids"), temperature=temperature)
  return split_pairs(logps, batch)


def split_pairs(token_values, batch):
  """Per-token values ``[B, seq]`` of preference rows as ``[2B, seq]``: chosen, then rejected."""
  chosen, rejected = pair_masks(batch["targets"], batch["segment_ids"])
  mask = jnp.concatenate([chosen, rejected]).astype(jnp.float32)
  values = jnp.concatenate([token_values, token_values]) * mask
  return values, mask


@dataclasses.dataclass(frozen=True)
class DPO(Objective):
  """Direct preference optimisation and its variants (:func:`jaxfuse.posttrain.dpo_loss`'s
  options); the reference's log-probabilities come in the batch as ``ref_logps``."""
  beta: float = 0.1
  loss_type: str | tuple[str, ...] = "sigmoid"
  loss_weights: tuple[float, ...] | None = None
  label_smoothing: float = 0.0
  ld_alpha: float | None = None
  reference_free: bool = False
  name = "dpo"
  progress_metrics = ("rewards/margins", "rewards/accuracies")

  @property
  def needs_reference(self) -> bool:
    return not self.reference_free

  def check(self):
    jax.eval_shape(lambda: losses.dpo_loss(
        jnp.zeros((2, 1)), jnp.zeros(2), jnp.ones((2, 1)), beta=self.beta,
        loss_type=self.loss_type, loss_weights=self.loss_weights,
        label_smoothing=self.label_smoothing, ld_alpha=self.ld_alpha,
        reference_free=self.reference_free))

  def loss(self, model, batch):
    token_logps, mask = pair_log_probs(model, batch)
    if self.reference_free:
      ref = jnp.zeros(mask.shape[0], jnp.float32)
    else:
      ref_tokens, _ = split_pairs(batch["ref_logps"], batch)
      ref = losses.sequence_logps(ref_tokens, mask, self.ld_alpha)
    return losses.dpo_loss(token_logps, jax.lax.stop_gradient(ref), mask, beta=self.beta,
                           loss_type=self.loss_type, loss_weights=self.loss_weights,
                           label_smoothing=self.label_smoothing, ld_alpha=self.ld_alpha,
                           reference_free=self.reference_free)


@dataclasses.dataclass(frozen=True)
class CPO(Objective):
  """Contrastive preference optimisation (:func:`jaxfuse.posttrain.cpo_loss`): no reference;
  ``loss_type="simpo"`` is SimPO (length-normalised, with the margin ``simpo_gamma``)."""
  beta: float = 0.1
  loss_type: str = "sigmoid"
  label_smoothing: float = 0.0
  simpo_gamma: float = 0.5
  cpo_alpha: float = 1.0
  name = "cpo"
  progress_metrics = ("rewards/margins", "rewards/accuracies")

  def check(self):
    jax.eval_shape(lambda: losses.cpo_loss(
        jnp.zeros((2, 1)), jnp.ones((2, 1)), beta=self.beta, loss_type=self.loss_type,
        label_smoothing=self.label_smoothing, simpo_gamma=self.simpo_gamma,
        cpo_alpha=self.cpo_alpha))

  def loss(self, model, batch):
    token_logps, mask = pair_log_probs(model, batch)
    return losses.cpo_loss(token_logps, mask, beta=self.beta, loss_type=self.loss_type,
                           label_smoothing=self.label_smoothing, simpo_gamma=self.simpo_gamma,
                           cpo_alpha=self.cpo_alpha)


@dataclasses.dataclass(frozen=True)
class ORPO(Objective):
  """Odds-ratio preference optimisation (:func:`jaxfuse.posttrain.orpo_loss`): no reference."""
  beta: float = 0.1
  name = "orpo"
  progress_metrics = ("rewards/margins", "rewards/accuracies")

  def check(self):
    jax.eval_shape(lambda: losses.orpo_loss(jnp.zeros((2, 1)), jnp.ones((2, 1)),
                                            beta=self.beta))

  def loss(self, model, batch):
    # TRL's NLL covers the chosen sequence's prompt too: the log-probabilities of every next
    # token of each sequence, of which the completions' make the odds ratio.
    every = sequence_targets(batch["tokens"], batch["segment_ids"])
    logps = model.token_log_probs(batch["tokens"], every, batch.get("positions"),
                                  batch.get("segment_ids"))
    token_logps, nll_mask = split_pairs(logps, {**batch, "targets": every})
    _, mask = split_pairs(logps, batch)   # the completions'
    return losses.orpo_loss(token_logps, mask, beta=self.beta, nll_mask=nll_mask)


def sequence_targets(tokens, segment_ids):
  """Every next token of the same sequence as a target (``IGNORE_INDEX`` at each sequence's
  last token and on padding): the targets of an NLL over prompt and completion."""
  same = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] > 0)
  nxt = jnp.where(same, tokens[:, 1:], IGNORE_INDEX)
  return jnp.concatenate([nxt, jnp.full_like(tokens[:, :1], IGNORE_INDEX)], axis=1)


@dataclasses.dataclass(frozen=True)
class KTO(Objective):
  """Kahneman-Tversky optimisation (:func:`jaxfuse.posttrain.kto_loss`) on unpaired completions
  labelled desirable or not: rows of :func:`jaxfuse.posttrain.data.read_kto_rows`, the
  completion as segment 1 and its mismatched pair (the KL estimate's) as segment 2; the
  reference's per-token log-probabilities come in the batch as ``ref_logps``."""
  beta: float = 0.1
  loss_type: str = "kto"
  desirable_weight: float = 1.0
  undesirable_weight: float = 1.0
  name = "kto"
  needs_reference = True
  progress_metrics = ("rewards/margins", "kl")

  def check(self):
    jax.eval_shape(lambda: losses.kto_loss(
        jnp.zeros((2, 1)), jnp.ones((2, 1)), jnp.array([True, False]), jnp.zeros(2),
        jnp.zeros(2), jnp.zeros(2), beta=self.beta, desirable_weight=self.desirable_weight,
        undesirable_weight=self.undesirable_weight, loss_type=self.loss_type))

  def loss(self, model, batch):
    logps = model.token_log_probs(batch["tokens"], batch["targets"], batch.get("positions"),
                                  batch.get("segment_ids"))
    completion, mismatched = (m.astype(jnp.float32)
                              for m in pair_masks(batch["targets"], batch["segment_ids"]))
    ref = batch["ref_logps"]
    return losses.kto_loss(
        logps * completion, completion, batch["labels"][:, 0] > 0,
        jax.lax.stop_gradient(jnp.sum(ref * completion, 1)),
        jnp.sum(logps * mismatched, 1), jax.lax.stop_gradient(jnp.sum(ref * mismatched, 1)),
        beta=self.beta, desirable_weight=self.desirable_weight,
        undesirable_weight=self.undesirable_weight, loss_type=self.loss_type)


@dataclasses.dataclass(eq=False)
class Distill(Objective):
  """Knowledge distillation from a teacher's LM head into the model's: TRL's generalized JSD
  (``beta`` 0: forward KL, 1: reverse KL; GKD's off-policy, supervised form) on the batch's
  target positions, fused so that neither model's ``[tokens, V]`` logits exist
  (:func:`jaxfuse.ops.linear_distillation_loss`, its gradients computed in the forward when the
  model's ``grad_in_forward`` is set, as for SFT's loss). The teacher (a
  :class:`~jaxfuse.models.Decoder` over the same vocabulary) is frozen; its variables are the
  objective's :attr:`constants`, which the training step takes as an argument."""
  teacher: Any = None   # the teacher's graph definition
  constants: Any = None   # the teacher's variables
  beta: float = 0.5
  temperature: float = 1.0
  name = "distill"

  @classmethod
  def of(cls, teacher, **options) -> Distill:
    """The objective distilling ``teacher`` (a :class:`~jaxfuse.models.Decoder`)."""
    graphdef, state = nnx.split(teacher)
    return cls(teacher=graphdef, constants=state, **options)

  def check(self):
    if not 0 <= self.beta <= 1:
      raise ValueError(f"--beta of --objective distill must be in [0, 1] (0: forward KL, 1: "
                       f"reverse KL), got {self.beta}")
    if not self.temperature > 0:
      raise ValueError(f"--distill-temperature must be > 0, got {self.temperature}")

  def check_models(self, model, where: str = "--teacher") -> None:
    """Refuses a teacher whose vocabulary differs from the student's ``model``."""
    teacher = nnx.merge(self.teacher, self.constants)
    if teacher.cfg.vocab_size != model.cfg.vocab_size:
      raise ValueError(f"{where}: a teacher whose vocabulary differs from the student's: "
                       f"{teacher.cfg.vocab_size} words against {model.cfg.vocab_size}")

  def loss(self, model, batch, constants=None):
    from jaxfuse.blocks import lm_head
    from jaxfuse.ops import linear_distillation_loss, linear_distillation_loss_reference

    teacher = nnx.merge(self.teacher, self.constants if constants is None else constants)
    args = (batch["tokens"], batch.get("positions"), batch.get("segment_ids"))
    h_t = jax.lax.stop_gradient(teacher.hidden(*args))
    h_s = model.hidden(*args)
    student = lm_head.cast(h_s, model.lm_head.weight, model.lm_head._bias, model.lm_head.dtype)
    taught = lm_head.cast(h_t, teacher.lm_head.weight, teacher.lm_head._bias,
                          teacher.lm_head.dtype)
    fn = linear_distillation_loss if model.fused else linear_distillation_loss_reference
    loss = fn(student[0], student[1], taught[0], jax.lax.stop_gradient(taught[1]),
              labels=batch["targets"], beta=self.beta, temperature=self.temperature,
              student_bias=student[2], teacher_bias=taught[2],
              student_logit_softcap=model.cfg.final_logit_softcap,
              teacher_logit_softcap=teacher.cfg.final_logit_softcap,
              **({"grad_in_forward": model.grad_in_forward} if model.fused else {}))
    return loss, {}


@dataclasses.dataclass(frozen=True)
class DistillTopK(Objective):
  """Distillation from a teacher's stored top-k log-probabilities (the batch's
  ``teacher_ids`` and ``teacher_logps``, ``[batch, seq, k]``): the forward KL from the teacher
  renormalised over its k words (:func:`jaxfuse.ops.linear_topk_distillation_loss`), no teacher
  held while training. With k the whole vocabulary it is :class:`Distill`'s ``beta=0``."""
  temperature: float = 1.0
  name = "distill"

  def loss(self, model, batch):
    from jaxfuse.blocks import lm_head
    from jaxfuse.ops import linear_topk_distillation_loss

    h = model.hidden(batch["tokens"], batch.get("positions"), batch.get("segment_ids"))
    h, weight, bias = lm_head.cast(h, model.lm_head.weight, model.lm_head._bias,
                                   model.lm_head.dtype)
    loss = linear_topk_distillation_loss(
        h, weight, batch["teacher_ids"], batch["teacher_logps"], labels=batch["targets"],
        temperature=self.temperature, student_bias=bias,
        student_logit_softcap=model.cfg.final_logit_softcap)
    return loss, {}


@dataclasses.dataclass(frozen=True)
class GRPO(Objective):
  """The GRPO-family policy loss (:func:`jaxfuse.posttrain.grpo_loss`) on rows of rollouts
  (:func:`jaxfuse.posttrain.grpo.rollout_batch`): the policy's per-token log-probabilities of
  the completions from the fused head at the sampling ``temperature`` (no ``[tokens, V]``
  logits), the row's ``advantages`` (``[B, seq]``, one value a row), and, where the batch holds
  them, ``old_logps`` (the sampling policy's, with several updates a batch of rollouts) and
  ``ref_logps`` (the reference's, with ``beta``).

  ``dapo``, ``cispo`` and ``vespo`` divide by the completion tokens of the whole batch, so
  micro-batches weigh by their tokens (``token_weighted``); the other loss types are means over
  rows (or their local tokens, ``bnpo``), and each micro-batch weighs alike."""
  beta: float = 0.0
  loss_type: str = "dapo"
  epsilon: float = 0.2
  epsilon_high: float | None = None
  delta: float | None = None
  importance_sampling_level: str = "token"
  temperature: float = 1.0
  max_completion_length: int | None = None
  name = "grpo"
  progress_metrics = ("reward", "completion_length")

  @property
  def token_weighted(self) -> bool:
    return self.loss_type in ("dapo", "cispo", "vespo")

  def check(self):
    jax.eval_shape(lambda: self._loss(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.ones((2, 3)),
                                      {"ref_logps": jnp.zeros((2, 3))}, None))
    if not self.temperature > 0:
      raise ValueError(f"--temperature must be > 0 for --objective grpo's log-probabilities, "
                       f"got {self.temperature}")

  def _loss(self, logps, entropy, mask, batch, advantages):
    adv = jnp.zeros(logps.shape[:1]) if advantages is None else advantages
    return losses.grpo_loss(
        logps, batch.get("old_logps"), adv, mask, ref_logps=batch.get("ref_logps"),
        beta=self.beta, loss_type=self.loss_type, epsilon=self.epsilon,
        epsilon_high=self.epsilon_high, delta=self.delta,
        importance_sampling_level=self.importance_sampling_level,
        max_completion_length=self.max_completion_length,
        num_items_in_batch=batch.get("total_targets"), entropies=entropy)

  @property
  def terms(self) -> losses.GRPOTerms:
    """The per-token terms of this loss (:class:`jaxfuse.posttrain.losses.GRPOTerms`)."""
    eps_high = self.epsilon if self.epsilon_high is None else self.epsilon_high
    return losses.GRPOTerms(loss_type=self.loss_type, beta=float(self.beta),
                            epsilon_low=float(self.epsilon), epsilon_high=float(eps_high),
                            delta=None if self.delta is None else float(self.delta),
                            importance_sampling_level=self.importance_sampling_level)

  def loss(self, model, batch):
    mask = (batch["targets"] != IGNORE_INDEX).astype(jnp.float32)
    advantages = batch["advantages"][:, 0]
    if model.fused and self.terms.token_separable:
      return self._fused_loss(model, batch, mask, advantages)
    logps, entropy = model.token_log_probs(
        batch["tokens"], batch["targets"], batch.get("positions"), batch.get("segment_ids"),
        temperature=self.temperature, return_entropy=True)
    return self._loss(logps, entropy, mask, batch, advantages)

  def _fused_loss(self, model, batch, mask, advantages):
    """Token-level losses: each token's term from its own log-probability, the gradients taken
    in the one pass over the logits (:func:`jaxfuse.ops.cross_entropy.token_loss
    .linear_token_loss`); the metrics from the log-probabilities it returns."""
    from jaxfuse.blocks import lm_head
    from jaxfuse.ops.cross_entropy.token_loss import linear_token_loss

    h = model.hidden(batch["tokens"], batch.get("positions"), batch.get("segment_ids"))
    h, weight, bias = lm_head.cast(h, model.lm_head.weight, model.lm_head._bias,
                                   model.lm_head.dtype)
    weights = losses.grpo_token_weights(mask, self.loss_type, self.max_completion_length,
                                        batch.get("total_targets"))
    extra = [batch[k] for k in ("old_logps", "ref_logps") if k in batch and (
        k == "old_logps" or self.beta != 0.0)]
    fn = grpo_token_loss(self.terms, "old_logps" in batch, self.beta != 0.0)
    loss, (logps, entropy) = linear_token_loss(
        h, weight, batch["targets"], fn, batch["advantages"], weights, *extra, bias=bias,
        temperature=self.temperature, logit_softcap=model.cfg.final_logit_softcap,
        ignore_index=IGNORE_INDEX, chunk_size=model.lm_head.loss_options.get("chunk_size"),
        return_aux=True)
    return loss, self._loss(logps, entropy, mask, batch, advantages)[1]


@functools.lru_cache(maxsize=64)
def grpo_token_loss(terms: losses.GRPOTerms, has_old: bool, has_ref: bool):
  """``fn(logp, advantage, weight, [old], [ref])``: a token's weighted GRPO term (one function
  object per options, so that the fused op compiles once for them)."""

  def fn(logp, advantage, weight, *rest):
    old = rest[0] if has_old else jax.lax.stop_gradient(logp)
    ref = rest[-1] if has_ref else None
    return weight * terms.terms(logp, old, advantage, ref)[0]

  return fn


OBJECTIVES = ("sft", "dpo", "cpo", "simpo", "orpo", "kto", "distill", "grpo")


def make_objective(name: str, **options: Any) -> Objective:
  """The objective ``name`` (:data:`OBJECTIVES`) with ``options`` (its dataclass fields; those
  that are None take the objective's default). ``simpo`` is :class:`CPO` with
  ``loss_type="simpo"`` and ``cpo_alpha=0`` by default, as TRL's SimPO recipe.

  Raises:
    ValueError: an unknown objective, or an option it does not take.
  """
  options = {k: v for k, v in options.items() if v is not None}
  if name == "simpo":
    name, options = "cpo", {"loss_type": "simpo", "cpo_alpha": 0.0, **options}
  kinds = {"sft": SFT, "dpo": DPO, "cpo": CPO, "orpo": ORPO, "kto": KTO, "distill": Distill,
           "grpo": GRPO}
  if name not in kinds:
    raise ValueError(f"--objective must be one of {', '.join(OBJECTIVES)}, got {name!r}")
  kind = kinds[name]
  known = {f.name for f in dataclasses.fields(kind)}
  unknown = sorted(set(options) - known)
  if unknown:
    raise ValueError(f"--objective {name} does not take "
                     f"{', '.join('--' + u.replace('_', '-') for u in unknown)}")
  if isinstance(options.get("loss_type"), str) and "," in options["loss_type"]:
    options["loss_type"] = tuple(options["loss_type"].split(","))
  objective = kind(**options)
  objective.check()
  return objective


def reference_log_probs(model, batch: dict) -> jax.Array:
  """The reference model's per-token log-probabilities ``[B, seq]`` of a batch's targets (0
  where none): what :class:`DPO` reads as ``ref_logps``."""
  return model.token_log_probs(batch["tokens"], batch["targets"], batch.get("positions"),
                               batch.get("segment_ids"))
