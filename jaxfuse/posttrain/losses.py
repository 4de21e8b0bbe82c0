"""Preference and policy-gradient losses as pure functions of per-token log-probabilities and
completion masks.

The per-token log-probabilities come from the LM head without its logits
(:func:`jaxfuse.ops.linear_log_probs`); these functions turn them into a loss and the metrics
TRL logs. The batch layout of the paired losses is TRL's: the chosen completions, then the
rejected ones, ``[2B, T]``; KTO's is unpaired, ``[B, T]`` with a label per row.

Read from TRL 1.16.0, as that version computes them; the tests run TRL's own code on the same
log-probabilities and compare the losses, the metrics and the gradients:

* :func:`dpo_loss` from ``trl/trainer/dpo_trainer.py`` (``DPOTrainer._compute_loss``): every
  loss type, their weighted sum, ``beta``, ``label_smoothing``, the f-divergences, ``ld_alpha``
  (length desensitization) and ``discopop_tau``;
* :func:`cpo_loss` (CPO, SimPO, AlphaPO) from ``trl/experimental/cpo/cpo_trainer.py`` and
  ``cpo_config.py``;
* :func:`orpo_loss` from ``trl/experimental/orpo/orpo_trainer.py``;
* :func:`kto_loss` from ``trl/trainer/kto_trainer.py`` (``KTOTrainer._compute_loss``; the
  ``trl.experimental.kto`` names are deprecated aliases of it);
* :func:`grpo_loss` (GRPO, Dr. GRPO, DAPO, BNPO, GSPO's sequence-level ratios, CISPO, SAPO,
  LUSPO, VESPO) from ``trl/trainer/grpo_trainer.py`` (``GRPOTrainer._compute_loss``).

TRL's ``logits/chosen`` and ``logits/rejected`` metrics (means of the logits) are not computed:
these functions never see the logits.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

# TRL 1.16.0's DPO loss types, in the order its error message lists them.
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair",
                  "sppo_hard", "aot", "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft",
                  "sigmoid_norm")
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
# The loss types whose f-DPO generalization is valid (TRL refuses the others with another
# divergence than reverse KL).
F_DIVERGENCE_LOSS_TYPES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust",
                           "discopop", "sft")

# TRL 1.16.0's CPO loss types (``CPOConfig.loss_type``); "alphapo" is its shorthand for "simpo"
# without the NLL term.
CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo", "alphapo")
# TRL 1.16.0's KTO loss types (``KTOConfig.loss_type``).
KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")

__all__ = ["CPO_LOSS_TYPES", "DPO_LOSS_TYPES", "F_DIVERGENCES", "GRPO_LOSS_TYPES",
           "IMPORTANCE_SAMPLING_LEVELS", "KTO_LOSS_TYPES", "GRPOTerms", "cpo_loss", "dpo_loss",
           "grpo_loss", "grpo_token_weights", "kto_loss", "orpo_loss", "sequence_logps"]


def sequence_logps(token_logps: jax.Array, mask: jax.Array,
                   ld_alpha: float | None = None) -> jax.Array:
  """Per-sequence log-probabilities ``[2B]`` of per-token ones ``[2B, T]`` over ``mask``: their
  sum, or with ``ld_alpha`` (LD-DPO) the sum over the tokens a chosen and its rejected
  completion share in length plus ``ld_alpha`` times the sum over the longer one's tail.

  Example:
    >>> import jax.numpy as jnp
    >>> logps = jnp.array([[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0]])
    >>> mask = jnp.array([[1, 1, 1], [1, 1, 0]])
    >>> sequence_logps(logps, mask), sequence_logps(logps, mask, ld_alpha=0.5)
    (Array([-6., -2.], dtype=float32), Array([-4.5, -2. ], dtype=float32))
  """
  mask = mask.astype(token_logps.dtype)
  token_logps = token_logps * mask
  if ld_alpha is None:
    return jnp.sum(token_logps, axis=1)
  position = jnp.cumsum(mask, axis=1)
  lengths = jnp.sum(mask, axis=1)
  chosen, rejected = jnp.split(lengths, 2)
  shared = jnp.tile(jnp.minimum(chosen, rejected), 2)[:, None]
  shared_mask = (position > 0) & (position <= shared)
  tail_mask = position > shared
  return (jnp.sum(token_logps * shared_mask, axis=1)
          + ld_alpha * jnp.sum(token_logps * tail_mask, axis=1))


def _check_pairs(name, token_logps, mask):
  """``token_logps`` ``[2B, T]`` (B >= 1) and ``mask`` of its shape."""
  shape = tuple(token_logps.shape)
  if len(shape) != 2 or shape[0] == 0 or shape[0] % 2:
    raise ValueError(f"{name}: token_logps must be [2B, T], the B chosen completions then their "
                     f"B rejected ones, got shape {shape}")
  if tuple(mask.shape) != shape:
    raise ValueError(f"{name}: mask must have token_logps' shape {shape}, got "
                     f"{tuple(mask.shape)}")


def _check(loss_types, loss_weights, beta, label_smoothing, f_divergence_type):
  unknown = [t for t in loss_types if t not in DPO_LOSS_TYPES]
  if unknown or not loss_types:
    raise ValueError(f"dpo_loss: loss_type must be one or more of {DPO_LOSS_TYPES}, got "
                     f"{unknown or loss_types!r}")
  if len(loss_weights) != len(loss_types):
    raise ValueError(f"dpo_loss: loss_weights must give one weight per loss type "
                     f"({len(loss_types)}), got {len(loss_weights)}")
  if not beta > 0:
    raise ValueError(f"dpo_loss: beta must be > 0, got {beta!r}")
  if f_divergence_type not in F_DIVERGENCES:
    raise ValueError(f"dpo_loss: f_divergence_type must be one of {F_DIVERGENCES}, got "
                     f"{f_divergence_type!r}")
  if f_divergence_type != "reverse_kl" and not set(loss_types) <= set(F_DIVERGENCE_LOSS_TYPES):
    raise ValueError(f"dpo_loss: f_divergence_type={f_divergence_type!r} takes only the loss "
                     f"types {F_DIVERGENCE_LOSS_TYPES}, got {tuple(loss_types)}")
  if "exo_pair" in loss_types and label_smoothing == 0.0:
    raise ValueError("dpo_loss: loss_type 'exo_pair' needs label_smoothing > 0 (its target "
                     "distribution is (1 - eps, eps))")


def _scores(logratios, f_divergence_type, alpha):
  """f'(t) of the log-ratios ``log t`` for the f-divergence (f-DPO)."""
  if f_divergence_type == "reverse_kl":
    return logratios
  if f_divergence_type == "forward_kl":
    return 1 - jnp.exp(-logratios)
  if f_divergence_type == "js_divergence":
    return math.log(2) + jax.nn.log_sigmoid(logratios)
  if abs(alpha - 1.0) < 1e-6:   # the limit is log t: reverse KL
    return logratios
  return (jnp.exp(jnp.minimum((alpha - 1.0) * logratios, 80.0)) - 1.0) / (alpha - 1.0)


def dpo_loss(token_logps: jax.Array, ref_logps: jax.Array, mask: jax.Array, *,
             beta: float = 0.1, loss_type: str | Sequence[str] = "sigmoid",
             loss_weights: Sequence[float] | None = None, label_smoothing: float = 0.0,
             f_divergence_type: str = "reverse_kl", f_alpha_divergence_coef: float = 1.0,
             ld_alpha: float | None = None, discopop_tau: float = 0.05,
             reference_free: bool = False) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The DPO loss (and its variants) of a batch of preference pairs, as TRL 1.16.0's
  ``DPOTrainer`` computes it, and the metrics it logs.

  Args:
    token_logps: the policy's per-token log-probabilities ``[2B, T]``: the ``B`` chosen
      completions, then their ``B`` rejected ones (TRL's ``per_token_logps``: of each token
      given the ones before it).
    ref_logps: the reference model's per-sequence log-probabilities ``[2B]`` (the same order;
      ignored with ``reference_free``).
    mask: ``[2B, T]``, 1 on the completion's tokens (TRL's shifted completion mask).
    beta: the KL coefficient.
    loss_type: a loss type of :data:`DPO_LOSS_TYPES`, or several, summed with
      ``loss_weights`` (default: 1 each).
    label_smoothing: the label noise of ``robust``, ``exo_pair``, ``aot`` and ``aot_unpaired``.
    f_divergence_type, f_alpha_divergence_coef: f-DPO's divergence (:data:`F_DIVERGENCES`) and
      the alpha-divergence's alpha.
    ld_alpha: LD-DPO's weight of the longer completion's tail (None: plain sums).
    discopop_tau: DiscoPOP's temperature.
    reference_free: a reference whose log-probabilities are all 0 (the policy's log-ratios
      are its log-probabilities).

  Returns:
    ``(loss, metrics)``: the scalar loss and TRL's metrics of the batch, ``rewards/chosen``,
    ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen`` and
    ``logps/rejected`` (means over the pairs; the rewards are ``beta`` times the log-ratios).

  Raises:
    ValueError: an unknown loss type or divergence, a divergence a loss type does not take,
      ``exo_pair`` without label smoothing, or shapes other than these.

  Example:
    >>> import jax.numpy as jnp
    >>> logps = jnp.log(jnp.array([[0.5, 0.5], [0.2, 0.5]]))   # chosen, then rejected
    >>> loss, metrics = dpo_loss(logps, jnp.log(jnp.array([0.25, 0.25])), jnp.ones((2, 2)),
    ...                          beta=1.0)
    >>> float(loss), float(metrics["rewards/margins"])   # -log sigmoid(log(0.25 / 0.1))
    (0.3364..., 0.9162...)
  """
  loss_types = (loss_type,) if isinstance(loss_type, str) else tuple(loss_type)
  loss_weights = tuple(loss_weights) if loss_weights is not None else (1.0,) * len(loss_types)
  _check(loss_types, loss_weights, beta, label_smoothing, f_divergence_type)
  _check_pairs("dpo_loss", token_logps, mask)
  if not reference_free and tuple(ref_logps.shape) != token_logps.shape[:1]:
    raise ValueError(f"dpo_loss: ref_logps must be [2B] = {token_logps.shape[:1]}, got "
                     f"{tuple(ref_logps.shape)}")
  mask = mask.astype(token_logps.dtype)
  logps = sequence_logps(token_logps, mask, ld_alpha)
  chosen_logps, rejected_logps = jnp.split(logps, 2)
  ref = jnp.zeros_like(logps) if reference_free else ref_logps.astype(logps.dtype)
  ref_chosen, ref_rejected = jnp.split(ref, 2)
  chosen_logratios = chosen_logps - ref_chosen
  rejected_logratios = rejected_logps - ref_rejected
  chosen_scores = _scores(chosen_logratios, f_divergence_type, f_alpha_divergence_coef)
  rejected_scores = _scores(rejected_logratios, f_divergence_type, f_alpha_divergence_coef)
  delta = chosen_scores - rejected_scores
  chosen_tokens, rejected_tokens = (jnp.maximum(n, 1.0) for n in jnp.split(mask.sum(1), 2))
  log_sigmoid, sigmoid = jax.nn.log_sigmoid, jax.nn.sigmoid
  eps = label_smoothing

  def per_sequence(kind):
    if kind == "sigmoid":
      return -log_sigmoid(beta * delta)
    if kind == "hinge":
      return jax.nn.relu(1 - beta * delta)
    if kind == "ipo":   # per-token averages: TRL's length normalization, as the IPO authors use
      ipo = chosen_scores / chosen_tokens - rejected_scores / rejected_tokens
      return (ipo - 1 / (2 * beta)) ** 2
    if kind == "exo_pair":
      return (sigmoid(beta * delta) * (log_sigmoid(beta * delta) - math.log1p(-eps))
              + sigmoid(-beta * delta) * (log_sigmoid(-beta * delta) - math.log(eps)))
    if kind == "nca_pair":
      return (-log_sigmoid(beta * chosen_logratios) - 0.5 * log_sigmoid(-beta * chosen_logratios)
              - 0.5 * log_sigmoid(-beta * rejected_logratios))
    if kind == "robust":
      return ((-(1 - eps) * log_sigmoid(beta * delta) + eps * log_sigmoid(-beta * delta))
              / (1 - 2 * eps))
    if kind == "bco_pair":
      return -log_sigmoid(beta * chosen_logratios) - log_sigmoid(-beta * rejected_logratios)
    if kind == "sppo_hard":
      return (chosen_logratios - 0.5 / beta) ** 2 + (rejected_logratios + 0.5 / beta) ** 2
    if kind in ("aot", "aot_unpaired"):
      if kind == "aot":
        d = jnp.sort(chosen_logps - rejected_logps) - jnp.sort(ref_chosen - ref_rejected)
      else:
        d = jnp.sort(chosen_logratios) - jnp.sort(rejected_logratios)
      return -log_sigmoid(beta * d) * (1 - eps) - log_sigmoid(-beta * d) * eps
    if kind == "apo_zero":
      return 1 - sigmoid(beta * chosen_logratios) + sigmoid(beta * rejected_logratios)
    if kind == "apo_down":
      return (sigmoid(beta * chosen_logratios)
              + 1 - sigmoid(beta * (chosen_logratios - rejected_logratios)))
    if kind == "discopop":
      logits = beta * delta
      mix = sigmoid(logits / discopop_tau)
      return -log_sigmoid(logits) * (1 - mix) + jnp.exp(-logits) * mix
    if kind == "sft":   # the chosen completions' mean token NLL, the same for every pair
      chosen_token_logps, _ = jnp.split(token_logps * mask, 2)
      chosen_mask, _ = jnp.split(mask, 2)
      nll = -jnp.sum(chosen_token_logps) / jnp.sum(chosen_mask)
      return jnp.broadcast_to(nll, chosen_logps.shape)
    # sigmoid_norm
    d = chosen_scores / chosen_tokens - rejected_scores / rejected_tokens
    return -log_sigmoid(beta * d)

  loss = sum(jnp.mean(per_sequence(kind)) * weight
             for kind, weight in zip(loss_types, loss_weights))
  return loss, _pair_metrics(beta * chosen_logratios, beta * rejected_logratios, chosen_logps,
                             rejected_logps)


def _mean_logps(token_logps, mask):
  """Per-sequence means of the per-token log-probabilities over ``mask`` (float)."""
  return jnp.sum(token_logps * mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1.0)


def _chosen_nll(token_logps, mask):
  """The chosen completions' NLL: ``-log p`` averaged over all their tokens of ``mask`` together
  (``torch.nn.CrossEntropyLoss``'s mean over the tokens not ignored)."""
  chosen_logps, _ = jnp.split(token_logps * mask, 2)
  chosen_mask, _ = jnp.split(mask, 2)
  return -jnp.sum(chosen_logps) / jnp.maximum(jnp.sum(chosen_mask), 1.0)


def _pair_metrics(chosen_rewards, rejected_rewards, chosen_logps, rejected_logps):
  """TRL's metrics of a batch of pairs: the mean rewards, their margin and accuracy, and the
  mean log-probabilities (no gradient)."""
  chosen_rewards = jax.lax.stop_gradient(chosen_rewards)
  rejected_rewards = jax.lax.stop_gradient(rejected_rewards)
  return {
      "rewards/chosen": jnp.mean(chosen_rewards),
      "rewards/rejected": jnp.mean(rejected_rewards),
      "rewards/accuracies": jnp.mean((chosen_rewards > rejected_rewards).astype(jnp.float32)),
      "rewards/margins": jnp.mean(chosen_rewards - rejected_rewards),
      "logps/chosen": jnp.mean(jax.lax.stop_gradient(chosen_logps)),
      "logps/rejected": jnp.mean(jax.lax.stop_gradient(rejected_logps)),
  }


def cpo_loss(token_logps: jax.Array, mask: jax.Array, *, beta: float = 0.1,
             loss_type: str = "sigmoid", label_smoothing: float = 0.0, simpo_gamma: float = 0.5,
             cpo_alpha: float = 1.0, alpha: float = 0.0
             ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The CPO loss (and SimPO's, AlphaPO's) of a batch of preference pairs, without a reference
  model, as TRL 1.16.0's ``CPOTrainer`` computes it (``trl/experimental/cpo/cpo_trainer.py``:
  ``cpo_loss``, ``concatenated_forward``, ``get_batch_loss_metrics``; ``cpo_config.py``).

  The loss is ``mean(losses) + cpo_alpha * nll``: the preference loss of the pairs' sequence
  log-probabilities (sums over ``mask``; per-token means for ``ipo`` and ``simpo``), and the
  chosen completions' NLL, ``-log p`` averaged over all their completion tokens together (TRL's
  cross-entropy over the chosen labels, its prompt tokens ignored; 0 when ``cpo_alpha`` is 0).

  TRL has no SimPO trainer: SimPO is ``loss_type="simpo", cpo_alpha=0.0`` (CPO-SimPO keeps
  ``cpo_alpha > 0``), and ``loss_type="alphapo"`` is TRL's shorthand for it: ``CPOConfig``
  turns it into ``"simpo"`` with ``cpo_alpha=0.0`` whatever ``cpo_alpha`` says, and ``alpha``
  stays as given (AlphaPO's reward shape needs ``alpha != 0``).

  Args:
    token_logps: the policy's per-token log-probabilities ``[2B, T]``: the ``B`` chosen
      completions, then their ``B`` rejected ones (of each token given the ones before it).
    mask: ``[2B, T]``, 1 on the completion's tokens (TRL's shifted labels that are not -100).
    beta: the temperature of the preference loss (IPO's regularization tau).
    loss_type: one of :data:`CPO_LOSS_TYPES`.
    label_smoothing: the label noise of ``sigmoid`` and ``simpo`` (``hinge`` and ``ipo``
      ignore it, as TRL does after a warning).
    simpo_gamma: SimPO's target reward margin (``simpo`` only).
    cpo_alpha: the weight of the chosen NLL.
    alpha: AlphaPO's reward shape, for every loss type: rewards ``(1 - p ** -alpha) / alpha``
      of the sequence probabilities ``p`` in place of their logs (0: the logs).

  Returns:
    ``(loss, metrics)``: the scalar loss and TRL's metrics, ``rewards/chosen``,
    ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins`` (the rewards are ``beta``
    times the sequence log-probabilities, or AlphaPO's), ``logps/chosen``, ``logps/rejected``
    (means over the pairs) and ``nll_loss``.

  Raises:
    ValueError: an unknown loss type, ``beta <= 0``, or shapes other than these.

  Example:
    >>> import jax.numpy as jnp
    >>> logps = jnp.log(jnp.array([[0.5, 0.5], [0.2, 0.5]]))   # chosen, then rejected
    >>> loss, metrics = cpo_loss(logps, jnp.ones((2, 2)), beta=1.0)
    >>> float(loss), float(metrics["nll_loss"])   # -log sigmoid(log(0.25 / 0.1)) + log 2
    (1.0296..., 0.6931...)
  """
  _check_pairs("cpo_loss", token_logps, mask)
  if loss_type not in CPO_LOSS_TYPES:
    raise ValueError(f"cpo_loss: loss_type must be one of {CPO_LOSS_TYPES}, got {loss_type!r}")
  if not beta > 0:
    raise ValueError(f"cpo_loss: beta must be > 0, got {beta!r}")
  if loss_type == "alphapo":   # CPOConfig.__post_init__
    loss_type, cpo_alpha = "simpo", 0.0
  mask = mask.astype(token_logps.dtype)
  if loss_type in ("ipo", "simpo"):
    logps = _mean_logps(token_logps, mask)
  else:
    logps = jnp.sum(token_logps * mask, axis=1)
  chosen_logps, rejected_logps = jnp.split(logps, 2)
  if alpha != 0.0:   # (1 - p ** -alpha) / alpha, with p ** -alpha = exp(-alpha log p)
    chosen_rewards = (1 - jnp.exp(-alpha * chosen_logps)) / alpha
    rejected_rewards = (1 - jnp.exp(-alpha * rejected_logps)) / alpha
  else:
    chosen_rewards, rejected_rewards = chosen_logps, rejected_logps
  logits = chosen_rewards - rejected_rewards
  if loss_type == "simpo":
    logits = logits - simpo_gamma / beta
  if loss_type in ("sigmoid", "simpo"):
    losses = (-jax.nn.log_sigmoid(beta * logits) * (1 - label_smoothing)
              - jax.nn.log_sigmoid(-beta * logits) * label_smoothing)
  elif loss_type == "hinge":
    losses = jax.nn.relu(1 - beta * logits)
  else:   # ipo
    losses = (logits - 1 / (2 * beta)) ** 2
  nll = jnp.zeros((), logps.dtype) if cpo_alpha == 0 else _chosen_nll(token_logps, mask)
  loss = jnp.mean(losses) + cpo_alpha * nll
  metrics = _pair_metrics(beta * chosen_rewards, beta * rejected_rewards, chosen_logps,
                          rejected_logps)
  metrics["nll_loss"] = jax.lax.stop_gradient(nll)
  return loss, metrics


def _log1mexp(x):
  """``log(1 - exp(x))`` for ``x < 0``, branching at ``-log 2`` as TRL's ``log1mexp`` does (each
  branch on inputs clamped to its side, so that the other's gradient stays finite)."""
  t = -math.log(2)
  return jnp.where(x < t, jnp.log1p(-jnp.exp(jnp.minimum(x, t))),
                   jnp.log(-jnp.expm1(jnp.maximum(x, t))))


def orpo_loss(token_logps: jax.Array, mask: jax.Array, *, beta: float = 0.1,
              nll_mask: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The ORPO loss of a batch of preference pairs, as TRL 1.16.0's ``ORPOTrainer`` computes it
  (``trl/experimental/orpo/orpo_trainer.py``: ``odds_ratio_loss``, ``concatenated_forward``,
  ``get_batch_loss_metrics``): the chosen NLL minus ``beta`` times the mean log-sigmoid of the
  log odds ratio of the completions' per-token mean log-probabilities ``l``,
  ``(l_c - l_r) - (log(1 - exp(l_c)) - log(1 - exp(l_r)))``.

  TRL's NLL covers the chosen sequence's prompt as well as its completion: every token but the
  first of the attention mask. Pass that as ``nll_mask`` (with ``token_logps`` over the prompt
  too) to get TRL's value; without it, the NLL covers the completions only (``mask``).

  Args:
    token_logps: the policy's per-token log-probabilities ``[2B, T]``: the ``B`` chosen
      sequences, then their ``B`` rejected ones (of each token given the ones before it).
    mask: ``[2B, T]``, 1 on the completion's tokens (TRL's shifted labels that are not -100).
    beta: the weight of the odds-ratio term (the paper's lambda).
    nll_mask: ``[2B, T]``, 1 on the tokens of the NLL (its rejected half is unused); TRL's is
      the attention mask without its first position. None: ``mask``.

  Returns:
    ``(loss, metrics)``: the scalar loss and TRL's metrics, ``rewards/chosen``,
    ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins`` (``beta`` times the mean
    log-probabilities), ``logps/chosen``, ``logps/rejected`` (the mean log-probabilities, means
    over the pairs), ``nll_loss``, ``log_odds_ratio`` (the mean log-sigmoid of the log odds
    ratios) and ``log_odds_chosen`` (the mean log odds ratio).

  Raises:
    ValueError: ``beta < 0``, or shapes other than these.

  Example:
    >>> import jax.numpy as jnp
    >>> logps = jnp.log(jnp.array([[0.5, 0.5], [0.2, 0.2]]))   # chosen, then rejected
    >>> loss, metrics = orpo_loss(logps, jnp.ones((2, 2)), beta=1.0)
    >>> float(metrics["log_odds_chosen"]), float(loss)   # log(1 / 0.25) and log 2 - log(0.8)
    (1.3862..., 0.9162...)
  """
  _check_pairs("orpo_loss", token_logps, mask)
  if nll_mask is not None and tuple(nll_mask.shape) != tuple(token_logps.shape):
    raise ValueError(f"orpo_loss: nll_mask must have token_logps' shape "
                     f"{tuple(token_logps.shape)}, got {tuple(nll_mask.shape)}")
  if not beta >= 0:
    raise ValueError(f"orpo_loss: beta must be >= 0, got {beta!r}")
  mask = mask.astype(token_logps.dtype)
  nll_mask = mask if nll_mask is None else nll_mask.astype(token_logps.dtype)
  chosen_logps, rejected_logps = jnp.split(_mean_logps(token_logps, mask), 2)
  log_odds = (chosen_logps - rejected_logps) - (_log1mexp(chosen_logps)
                                                 - _log1mexp(rejected_logps))
  ratio = jax.nn.log_sigmoid(log_odds)
  nll = _chosen_nll(token_logps, nll_mask)
  loss = nll - beta * jnp.mean(ratio)
  metrics = _pair_metrics(beta * chosen_logps, beta * rejected_logps, chosen_logps,
                          rejected_logps)
  metrics["nll_loss"] = jax.lax.stop_gradient(nll)
  metrics["log_odds_ratio"] = jnp.mean(jax.lax.stop_gradient(ratio))
  metrics["log_odds_chosen"] = jnp.mean(jax.lax.stop_gradient(log_odds))
  return loss, metrics


def kto_loss(token_logps: jax.Array, mask: jax.Array, labels: jax.Array, ref_logps: jax.Array,
             kl_logps: jax.Array | None = None, ref_kl_logps: jax.Array | None = None, *,
             beta: float = 0.1, desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
             loss_type: str = "kto") -> tuple[jax.Array, dict[str, jax.Array]]:
  """The KTO loss of a batch of unpaired completions labelled desirable or not, as TRL 1.16.0's
  ``KTOTrainer`` computes it (``trl/trainer/kto_trainer.py``: ``_compute_loss``,
  ``_prepare_dataset``; ``trl.experimental.kto`` re-exports it).

  Each row's loss is ``desirable_weight * (1 - sigmoid(beta * (r - kl)))`` for a desirable
  completion, ``undesirable_weight * (1 - sigmoid(beta * (kl - r)))`` otherwise, of its
  log-ratio ``r`` (policy minus reference sequence log-probability); the loss is their mean over
  the whole batch, both labels together. ``kl`` is the mean of ``kl_logps - ref_kl_logps``,
  clamped at 0 and without gradient. ``apo_zero_unpaired`` (unpaired APO-zero) has no KL term:
  ``1 - sigmoid(beta * r)`` and ``sigmoid(beta * r)``.

  The KL term is estimated on mismatched pairs: TRL pairs each row's prompt with the previous
  row's completion, the first row with the last's, ``(x_1, y_n), (x_2, y_1), ..., (x_n,
  y_{n-1})`` (``jnp.roll(completions, 1, axis=0)``), within each batch of
  ``per_device_train_batch_size`` consecutive rows (hence its sequential sampling and batches of
  at least 2 rows), and scores them without gradient.

  Args:
    token_logps: the policy's per-token log-probabilities ``[B, T]`` (of each token given the
      ones before it).
    mask: ``[B, T]``, 1 on the completion's tokens (TRL's shifted completion mask).
    labels: ``[B]`` booleans, True for the desirable completions.
    ref_logps: the reference model's per-sequence log-probabilities ``[B]``.
    kl_logps, ref_kl_logps: the policy's and the reference model's per-sequence
      log-probabilities ``[B]`` of the mismatched pairs (``kto`` only; ignored otherwise).
    beta: the KL coefficient.
    desirable_weight, undesirable_weight: the weights of the desirable and the undesirable
      rows' losses.
    loss_type: one of :data:`KTO_LOSS_TYPES`.

  Returns:
    ``(loss, metrics)``: the scalar loss and TRL's metrics, ``kl`` (0 without a KL term),
    ``rewards/chosen``, ``logps/chosen`` (means over the desirable rows; the rewards are
    ``beta`` times the log-ratios), ``rewards/rejected``, ``logps/rejected`` (over the others)
    and ``rewards/margins`` (their difference); NaN where the batch has no such row (TRL logs
    nothing then).

  Raises:
    ValueError: an unknown loss type, ``beta <= 0``, labels that are not booleans, ``kto``
      without ``kl_logps`` and ``ref_kl_logps`` or with a single row, or shapes other than
      these.

  Example:
    >>> import jax.numpy as jnp
    >>> logps = jnp.log(jnp.array([[0.5, 0.5], [0.2, 0.5]]))
    >>> labels = jnp.array([True, False])
    >>> ref = jnp.log(jnp.array([0.25, 0.25]))
    >>> loss, metrics = kto_loss(logps, jnp.ones((2, 2)), labels, ref, ref, ref, beta=1.0)
    >>> float(loss), float(metrics["rewards/margins"])   # (1 - 1 / 2 + 1 - 2.5 / 3.5) / 2
    (0.3928..., 0.9162...)
  """
  shape = tuple(token_logps.shape)
  if len(shape) != 2 or shape[0] == 0:
    raise ValueError(f"kto_loss: token_logps must be [B, T], got shape {shape}")
  rows = shape[:1]
  for name, array, want in (("mask", mask, shape), ("labels", labels, rows),
                            ("ref_logps", ref_logps, rows)):
    if tuple(array.shape) != want:
      raise ValueError(f"kto_loss: {name} must have shape {want}, got {tuple(array.shape)}")
  if labels.dtype != jnp.bool_:
    raise ValueError(f"kto_loss: labels must be booleans (True: desirable), got {labels.dtype}")
  if loss_type not in KTO_LOSS_TYPES:
    raise ValueError(f"kto_loss: loss_type must be one of {KTO_LOSS_TYPES}, got {loss_type!r}")
  if not beta > 0:
    raise ValueError(f"kto_loss: beta must be > 0, got {beta!r}")
  mask = mask.astype(token_logps.dtype)
  logps = jnp.sum(token_logps * mask, axis=1)
  logratios = logps - ref_logps.astype(logps.dtype)
  if loss_type == "kto":
    if kl_logps is None or ref_kl_logps is None:
      raise ValueError("kto_loss: loss_type 'kto' needs kl_logps and ref_kl_logps, the "
                       "log-probabilities of the mismatched (prompt, completion) pairs")
    for name, array in (("kl_logps", kl_logps), ("ref_kl_logps", ref_kl_logps)):
      if tuple(array.shape) != rows:
        raise ValueError(f"kto_loss: {name} must have shape {rows}, got {tuple(array.shape)}")
    if rows[0] < 2:
      raise ValueError("kto_loss: loss_type 'kto' needs a batch of at least 2 rows (with one, "
                       "the KL estimate is the row's own log-ratio)")
    kl = jnp.mean(kl_logps.astype(logps.dtype) - ref_kl_logps.astype(logps.dtype))
    kl = jax.lax.stop_gradient(jnp.maximum(kl, 0.0))
    chosen_losses = 1 - jax.nn.sigmoid(beta * (logratios - kl))
    rejected_losses = 1 - jax.nn.sigmoid(beta * (kl - logratios))
  else:   # apo_zero_unpaired
    kl = jnp.zeros((), logps.dtype)
    chosen_losses = 1 - jax.nn.sigmoid(beta * logratios)
    rejected_losses = jax.nn.sigmoid(beta * logratios)
  losses = jnp.where(labels, desirable_weight * chosen_losses,
                     undesirable_weight * rejected_losses)
  loss = jnp.mean(losses)

  rewards = beta * jax.lax.stop_gradient(logratios)
  logps = jax.lax.stop_gradient(logps)

  def mean_over(rows_mask, values):
    count = jnp.sum(rows_mask)
    total = jnp.sum(jnp.where(rows_mask, values, 0.0))
    return jnp.where(count > 0, total / jnp.maximum(count, 1), jnp.nan)

  metrics = {
      "kl": kl,
      "rewards/chosen": mean_over(labels, rewards),
      "logps/chosen": mean_over(labels, logps),
      "rewards/rejected": mean_over(~labels, rewards),
      "logps/rejected": mean_over(~labels, logps),
  }
  metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
  return loss, metrics


# GRPO and its successors ----------------------------------------------------------------------

# TRL 1.16.0's GRPO loss types (``GRPOConfig.loss_type``; "dapo" is its default).
GRPO_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
# The loss types whose ratio is clipped to [1 - epsilon, 1 + epsilon_high].
_CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


def _masked_mean(x, mask):
  """The mean of ``x`` over the tokens of ``mask`` (one value a sequence: over the sequences)."""
  if x.shape[-1] == 1:
    return jnp.mean(x)
  return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _check_grpo(loss_type, importance_sampling_level, beta, ref_logps, epsilon, epsilon_high,
                delta):
  if loss_type not in GRPO_LOSS_TYPES:
    raise ValueError(f"grpo_loss: unknown loss_type {loss_type!r}; TRL 1.16's are "
                     f"{GRPO_LOSS_TYPES}")
  if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
    raise ValueError(f"grpo_loss: importance_sampling_level must be one of "
                     f"{IMPORTANCE_SAMPLING_LEVELS}, got {importance_sampling_level!r}")
  if beta != 0.0 and ref_logps is None:
    raise ValueError("grpo_loss: beta != 0 needs ref_logps (the reference's per-token "
                     "log-probabilities) for the KL term")
  if not epsilon >= 0 or (epsilon_high is not None and not epsilon_high >= 0):
    raise ValueError(f"grpo_loss: epsilon and epsilon_high must be >= 0, got {epsilon} and "
                     f"{epsilon_high}")
  if delta is not None and loss_type not in _CLIPPED:
    raise ValueError(f"grpo_loss: delta (two-sided clipping) applies to the loss types "
                     f"{_CLIPPED}, not {loss_type!r}")


def _vespo_weights(advantages, log_ratio, mask, k_pos, lambda_pos, k_neg, lambda_neg):
  """VESPO's gamma weights of the sequence-level ratio ``w``, ``phi(w) = e^lambda w^k
  e^(-lambda w)`` (``phi(1) = 1``), constants of the gradient (TRL's ``get_gamma_weights``)."""
  low = math.log(1e-8)
  seq = jnp.sum(jnp.clip(log_ratio, -20.0, 20.0) * mask, axis=-1, keepdims=True)
  log_w = jnp.clip(seq, low, 20.0)
  nonneg = advantages >= 0
  k = jnp.where(nonneg, k_pos, k_neg)
  lam = jnp.maximum(jnp.where(nonneg, lambda_pos, lambda_neg), 1e-4)
  phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))
  phi = jnp.where(jnp.isfinite(phi), phi, 0.0)
  return jax.lax.stop_gradient(phi)


@dataclasses.dataclass(frozen=True)
class GRPOTerms:
  """The options of :func:`grpo_loss` that make its per-token terms (hashable: a static
  argument). :meth:`terms` computes them; where :attr:`token_separable`, each token's term
  depends on its own log-probability only, and the loss is their sum weighted by
  :func:`grpo_token_weights` (what :func:`jaxfuse.ops.cross_entropy.token_loss.linear_token_loss`
  needs to take the gradient in its forward)."""

  loss_type: str = "dapo"
  beta: float = 0.0
  epsilon_low: float = 0.2
  epsilon_high: float = 0.2
  delta: float | None = None
  importance_sampling_level: str = "token"
  use_bias_correction_kl: bool = False
  sapo_temperature_pos: float = 1.0
  sapo_temperature_neg: float = 1.05
  vespo: tuple = (2.0, 3.0, 3.0, 2.0)

  @property
  def token_separable(self) -> bool:
    return (self.importance_sampling_level == "token"
            and self.loss_type not in ("luspo", "vespo"))

  def terms(self, logps, old, adv, ref, mask=None):
    """``(per_token, ratio, kl, phi)``: each token's loss term (its KL included), the
    importance ratio, the k3 KL (None without ``beta``) and VESPO's weights (else None)."""
    log_ratio = logps - old
    if self.importance_sampling_level == "token":
      log_weights = log_ratio
    else:
      log_weights = (jnp.sum(log_ratio * mask, -1)
                     / jnp.maximum(jnp.sum(mask, -1), 1.0))[:, None]
    ratio = jnp.exp(log_weights)
    kl = phi = None
    if self.beta != 0.0:
      ref = jax.lax.stop_gradient(ref)
      kl = jnp.exp(ref - logps) - (ref - logps) - 1.0
      if self.use_bias_correction_kl:
        kl = kl * ratio
    if self.loss_type == "cispo":
      per_token = -jax.lax.stop_gradient(jnp.minimum(ratio, self.epsilon_high)) * adv * logps
    elif self.loss_type in _CLIPPED:
      clipped = jnp.clip(ratio, 1.0 - self.epsilon_low, 1.0 + self.epsilon_high)
      capped = ratio if self.delta is None else jnp.minimum(ratio, self.delta)
      per_token = -jnp.minimum(capped * adv, clipped * adv)
    elif self.loss_type == "sapo":
      tau = jnp.where(adv > 0, self.sapo_temperature_pos, self.sapo_temperature_neg)
      per_token = -jax.nn.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * adv
    else:   # vespo
      phi = _vespo_weights(adv, log_ratio, mask, *self.vespo)
      per_token = -phi * adv * logps
    if kl is not None:
      per_token = per_token + self.beta * kl
    return per_token, ratio, kl, phi


def grpo_token_weights(mask: jax.Array, loss_type: str, max_completion_length: int | None = None,
                       num_items_in_batch=None) -> jax.Array:
  """Each token's weight in a token-separable GRPO loss ``[B, T]``: the loss is
  ``sum(weights * per_token)`` (``grpo``, ``sapo``: ``1 / (B * length)``; ``bnpo``: ``1 /
  tokens``; ``dr_grpo``: ``1 / (B * max_completion_length)``; ``dapo``, ``cispo``: ``1 /
  num_items_in_batch``, as ``vespo``), 0 off the mask."""
  f32 = jnp.float32
  mask = mask.astype(f32)
  if loss_type in ("grpo", "sapo"):
    return mask / jnp.maximum(jnp.sum(mask, -1, keepdims=True), 1.0) / mask.shape[0]
  if loss_type == "bnpo":
    return mask / jnp.maximum(jnp.sum(mask), 1.0)
  if loss_type == "dr_grpo":
    length = mask.shape[1] if max_completion_length is None else max_completion_length
    return mask / (mask.shape[0] * length)
  items = jnp.sum(mask) if num_items_in_batch is None else num_items_in_batch
  return mask / jnp.maximum(jnp.asarray(items, f32), 1.0)


def grpo_loss(token_logps: jax.Array, old_logps: jax.Array | None, advantages: jax.Array,
              mask: jax.Array, *, ref_logps: jax.Array | None = None, beta: float = 0.0,
              loss_type: str = "dapo", epsilon: float = 0.2, epsilon_high: float | None = None,
              delta: float | None = None, importance_sampling_level: str = "token",
              use_bias_correction_kl: bool = False, max_completion_length: int | None = None,
              num_items_in_batch: jax.Array | float | None = None,
              sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05,
              vespo_k_pos: float = 2.0, vespo_lambda_pos: float = 3.0, vespo_k_neg: float = 3.0,
              vespo_lambda_neg: float = 2.0, entropies: jax.Array | None = None,
              ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The GRPO-family policy loss of completions ``[B, T]``, as TRL 1.16.0's
  ``GRPOTrainer._compute_loss`` computes it (``trl/trainer/grpo_trainer.py``), with its metrics.

  Per token, the importance ratio ``r = exp(log p - log p_old)`` (``"sequence"`` level, GSPO:
  the exponential of the sequence's mean log-ratio) and the advantage ``A`` of its completion:

  - ``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, ``luspo``: ``-min(r A, clip(r, 1 - epsilon, 1 +
    epsilon_high) A)`` (``delta``: ``r`` first capped at ``delta``, INTELLECT-2's two-sided
    clipping);
  - ``cispo``: ``-min(r, epsilon_high) A log p`` with the capped ratio a constant;
  - ``sapo``: ``-sigmoid(tau (r - 1)) 4 / tau A``, ``tau`` by the advantage's sign;
  - ``vespo``: ``-phi(w) A log p``, ``phi`` the gamma weight of the sequence's ratio ``w``;

  plus ``beta`` times the k3 estimate of ``KL(policy || reference)``, ``exp(ref - log p) - (ref -
  log p) - 1`` (times ``r`` with ``use_bias_correction_kl``). Aggregation: ``grpo`` and ``sapo``
  average each completion's tokens, then the completions; ``bnpo`` all tokens of the batch;
  ``dr_grpo`` divides the sum by ``B * max_completion_length``; ``dapo``, ``cispo`` and ``vespo``
  by ``num_items_in_batch`` (the completion tokens of the whole generation batch: pass it when
  a batch is split into micro-batches); ``luspo`` sums each completion's tokens and averages.

  Args:
    token_logps: the policy's log-probabilities of the completion tokens ``[B, T]``.
    old_logps: those of the policy that sampled them ``[B, T]``; None: the policy itself
      (one update per batch of rollouts: the ratio is 1, its gradient that of ``log p``).
    advantages: ``[B]`` (or ``[B, T]``) advantages.
    mask: ``[B, T]``, 1 on the completion tokens that count.
    ref_logps: the reference's log-probabilities ``[B, T]`` (needed when ``beta != 0``).
    beta, loss_type, epsilon, epsilon_high, delta, importance_sampling_level,
      use_bias_correction_kl, sapo_temperature_pos, sapo_temperature_neg, vespo_*: TRL's
      ``GRPOConfig`` options of the same names and defaults (``epsilon_high`` None: ``epsilon``).
    max_completion_length: ``dr_grpo``'s constant (default ``T``).
    num_items_in_batch: ``dapo``/``cispo``/``vespo``'s divisor (default: ``mask``'s sum).
    entropies: optional per-token entropies ``[B, T]``, reported as the ``entropy`` metric.

  Returns:
    ``(loss, metrics)``: the float32 loss and TRL's metrics (``kl`` with ``beta``, ``entropy``
    with ``entropies``, the clipped fractions ``clip_ratio/low_mean``, ``clip_ratio/high_mean``,
    ``clip_ratio/region_mean`` or ``cispo_clip_ratio``, ``vespo/phi_seq_mean``).

  Example:
    >>> import jax.numpy as jnp
    >>> logps = jnp.log(jnp.array([[0.5, 0.25], [0.5, 0.5]]))
    >>> loss, m = grpo_loss(logps, None, jnp.array([1.0, -1.0]), jnp.ones((2, 2)),
    ...                     loss_type="grpo")
    >>> float(loss), float(m["clip_ratio/region_mean"])   # ratio 1: -(A) averaged
    (0.0, 0.0)
  """
  _check_grpo(loss_type, importance_sampling_level, beta, ref_logps, epsilon, epsilon_high,
              delta)
  f32 = jnp.float32
  logps = token_logps.astype(f32)
  mask = mask.astype(f32)
  old = jax.lax.stop_gradient(logps) if old_logps is None else old_logps.astype(f32)
  adv = advantages.astype(f32)
  adv = adv[:, None] if adv.ndim == 1 else adv
  eps_low = float(epsilon)
  eps_high = float(epsilon if epsilon_high is None else epsilon_high)

  options = GRPOTerms(loss_type=loss_type, beta=float(beta), epsilon_low=eps_low,
                      epsilon_high=eps_high, delta=None if delta is None else float(delta),
                      importance_sampling_level=importance_sampling_level,
                      use_bias_correction_kl=bool(use_bias_correction_kl),
                      sapo_temperature_pos=float(sapo_temperature_pos),
                      sapo_temperature_neg=float(sapo_temperature_neg),
                      vespo=(vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg))
  ref = None if beta == 0.0 else ref_logps.astype(f32)
  per_token, ratio, kl, phi = options.terms(logps, old, adv, ref, mask)
  if loss_type == "luspo":   # each completion's sum, averaged
    loss = jnp.mean(jnp.sum(per_token * mask, -1))
  else:
    loss = jnp.sum(per_token * grpo_token_weights(mask, loss_type, max_completion_length,
                                                  num_items_in_batch))

  metrics = {}
  stop = jax.lax.stop_gradient
  if beta != 0.0:
    metrics["kl"] = _masked_mean(stop(kl), mask)
  if entropies is not None:
    metrics["entropy"] = _masked_mean(stop(entropies.astype(f32)), mask)
  r = stop(ratio)
  if loss_type in _CLIPPED:
    low = ((r < 1.0 - eps_low) & (adv < 0)).astype(f32)
    high = ((r > 1.0 + eps_high) & (adv > 0)).astype(f32)
    metrics["clip_ratio/low_mean"] = _masked_mean(low, mask)
    metrics["clip_ratio/high_mean"] = _masked_mean(high, mask)
    metrics["clip_ratio/region_mean"] = _masked_mean(jnp.maximum(low, high), mask)
  elif loss_type == "cispo":
    metrics["cispo_clip_ratio"] = _masked_mean(((r > eps_high) & (adv > 0)).astype(f32), mask)
  elif loss_type == "vespo":
    metrics["vespo/phi_seq_mean"] = _masked_mean(phi, mask)
  return loss, metrics
