"""Preference losses as pure functions of per-token log-probabilities and completion masks.

The per-token log-probabilities come from the LM head without its logits
(:func:`jaxfuse.ops.linear_log_probs`); these functions turn them into a loss and the metrics
TRL logs. The batch layout is TRL's: the chosen completions, then the rejected ones, ``[2B, T]``.

Read from TRL 1.16.0 (``trl/trainer/dpo_trainer.py``, ``DPOTrainer._compute_loss``): every loss
type, their weighted sum, ``beta``, ``label_smoothing``, the f-divergences, ``ld_alpha``
(length desensitization) and ``discopop_tau``, as that version computes them; the tests run
TRL's own code on the same log-probabilities and compare the losses and their gradients.
"""

from __future__ import annotations

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

__all__ = ["DPO_LOSS_TYPES", "F_DIVERGENCES", "dpo_loss", "sequence_logps"]


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
    ValueError: an unknown loss type or divergence, a divergence a loss type does not take, or
      ``exo_pair`` without label smoothing.

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
  chosen_rewards = beta * jax.lax.stop_gradient(chosen_logratios)
  rejected_rewards = beta * jax.lax.stop_gradient(rejected_logratios)
  metrics = {
      "rewards/chosen": jnp.mean(chosen_rewards),
      "rewards/rejected": jnp.mean(rejected_rewards),
      "rewards/accuracies": jnp.mean((chosen_rewards > rejected_rewards).astype(jnp.float32)),
      "rewards/margins": jnp.mean(chosen_rewards - rejected_rewards),
      "logps/chosen": jnp.mean(jax.lax.stop_gradient(chosen_logps)),
      "logps/rejected": jnp.mean(jax.lax.stop_gradient(rejected_logps)),
  }
  return loss, metrics
