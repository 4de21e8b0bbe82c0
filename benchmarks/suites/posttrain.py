"""Post-training losses on the LM head, forward + backward, from the hidden states: a DPO step,
a distillation step and a GRPO step. Every row times one step (the loss and the gradients of the
policy's or student's hidden states ``h`` and head ``W``) and reports the bytes its backward
keeps.

Shapes (``Shape``): ``pairs`` preference pairs of ``seq`` tokens each, so ``2·pairs`` sequences
and ``N = 2·pairs·seq`` tokens; the first quarter of every sequence is its prompt (no loss).
``--quick``: 2 pairs × 2 × 256 tokens, d_model 256, V 8192; full: 2 × 2 × 1024 tokens (4096),
d_model 1024, V 32000. The distillation teacher is twice as wide as the student.

``dpo ...`` cases: the policy's hidden states ``h [N, D]`` (the chosen sequences, then their
rejected ones), its head ``W [V, D]``, target tokens (-100 on the prompts) and the reference's
per-sequence log-probabilities ``[2·pairs]``, precomputed (an input, like TRL's
``precompute_ref_log_probs``): the sigmoid DPO loss with ``beta = 0.1``.

- ``jaxfuse-<impl>``: :func:`jaxfuse.ops.linear_log_probs` (``implementation=None``; the row is
  named after what it picks here) reshaped to ``[2·pairs, seq]``, then
  :func:`jaxfuse.posttrain.dpo_loss`.
- ``jax-unfused``: the full ``[N, V]`` logits (:func:`jaxfuse.ops.linear_log_probs_reference`:
  log_softmax of ``h @ W.T``, gathered), then the same ``dpo_loss``.
- ``torch-eager`` (the error reference) and ``torch-compile``: ``logits = h @ W.T``, TRL's
  ``selective_log_softmax`` (``trl.trainer.utils``) masked on the prompts, per-sequence sums and
  TRL's sigmoid DPO formula (``-logsigmoid(beta · Δ)``, averaged over the pairs).
- ``trl-chunked``: TRL's fused LM head, ``trl.kernels.ChunkedLogProbFunction``, as
  ``add_fused_lm_head`` calls it off Triton devices (every position scored, the prompts masked
  after), then the same formula: what TRL's ``DPOTrainer`` runs.
- ``liger-kernel``: ``liger_kernel.chunked_loss.LigerFusedLinearDPOLoss(beta=0.1)``. It takes
  no precomputed reference log-probabilities: with ``use_ref_model=True`` it gets the
  reference's hidden states and head and computes them in its step under ``no_grad`` (one more
  ``N × D × V`` product and log-softmax than the other rows). The precomputed input of the other
  rows is that reference head's log-probabilities, so every loss is the same.

``distill ...`` cases: the student's ``h_s [N, Ds]``, ``W_s [V, Ds]``, the teacher's
``h_t [N, Dt]``, ``W_t [V, Dt]`` (constants: no gradient) and labels (-100 on the prompts): TRL
GKD's generalized JSD with ``beta = 0.5``, temperature 1, ``batchmean`` over the labelled tokens.

- ``jaxfuse-<impl>``: :func:`jaxfuse.ops.linear_distillation_loss` with ``grad_in_forward=True``
  (what the trainer's ``Distill`` objective runs, the Decoder's default); skipped with a note
  where it cannot be imported.
- ``jax-unfused``: both heads' full logits, log-softmaxes and the JSD's terms.
- ``torch-eager`` and ``torch-compile``: ``GKDTrainer.generalized_jsd_loss``
  (``trl.experimental.gkd``) on both heads' full logits, the teacher's under ``no_grad``.
- ``trl-chunked``: ``trl.kernels.chunked_divergence.ChunkedDivergenceFunction``, reduced as
  TRL's ``DistillationTrainer`` does off Triton devices (prompts masked after, sum over the
  labelled tokens divided by their number).
- ``liger-kernel``: ``liger_kernel.chunked_loss.LigerFusedLinearJSDLoss(weight_hard_loss=0,
  weight_soft_loss=1, beta=0.5)``: Liger 0.8's ``beta`` is TRL's (0: forward KL, 1: reverse KL,
  the mixture ``(1 - beta)·p_s + beta·p_t``), and its soft loss is divided by the labelled tokens
  (``batchmean``). It still computes the student's cross-entropy at weight 0.

``grpo ...`` cases: ``2·pairs`` completions of ``seq`` tokens (the first quarter a prompt: no
loss), the policy's ``h [N, D]`` and ``W [V, D]``, the sampling policy's and the reference's
per-token log-probabilities (inputs, near the policy's: ratios leave the clipping range) and an
advantage a completion: TRL's GRPO loss, its default ``dapo`` type, ``epsilon = 0.2``, the k3 KL
at ``beta = 0.04``.

- ``jaxfuse-xla``: what the trainer's GRPO objective runs, each token's term and its gradient in
  the one pass over the logits (:func:`jaxfuse.ops.cross_entropy.token_loss.linear_token_loss`
  with :func:`jaxfuse.posttrain.objectives.grpo_token_loss`).
- ``jax-unfused``: the full logits' log-probabilities, then :func:`jaxfuse.posttrain.grpo_loss`.
- ``torch-eager`` and ``torch-compile``: ``logits = h @ W.T``, TRL's ``selective_log_softmax``
  and ``GRPOTrainer._compute_loss``'s dapo formula (transcribed); ``trl-chunked``: the same on
  ``ChunkedLogProbFunction``'s log-probabilities.
- ``liger-kernel``: ``LigerFusedLinearGRPOLoss(beta=0.04, loss_type="dapo")`` with the same
  precomputed reference and old log-probabilities.

Liger's rows compute the gradients in the forward and keep them for the backward
(``torch.func`` inside an autograd Function): their losses are checked against jaxfuse's (the
plain-JAX row's where jaxfuse's cannot run) at ``SMALL``, and every row's loss against
torch-eager's (relative ``LOSS_RTOL``), before timing; a row that disagrees is not timed. At ``FULL`` that check is near float32's rounding: the loss takes differences of
per-sequence log-probabilities of about -8.4e3, summed in float32, and every row's loss was
within 4e-5 to 7e-5 (relative) of a float64 one (jaxfuse's -4.0e-5, torch-eager's +4.9e-5).
``torch.func`` refuses ``saved_tensors_hooks``, so Liger's residual bytes are the tensors its
output's autograd graph holds (:func:`graph_residual_bytes`); the tests check that this gives
the hooks' figure on the eager rows.

Every matmul is float32 at full precision. Figures: ``time_ms`` (interleaved rounds), ``ratio``
(to the fastest row other than jaxfuse's), ``residual_bytes``, XLA's cost analysis and temp
memory of the JAX rows, and errors (loss; ``dh`` and ``dW``) against torch-eager. Each note
gives the loss's relative difference from torch-eager's and the residual bytes over
torch-eager's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from benchmarks import records as rec
from benchmarks.records import Record
from jaxfuse.ops import base, linear_log_probs, linear_log_probs_reference
from jaxfuse.ops.cross_entropy.token_loss import linear_token_loss
from jaxfuse.posttrain import dpo_loss, losses
from jaxfuse.posttrain.objectives import grpo_token_loss

SUITE = "posttrain"
REFERENCE = "torch-eager"
BASELINE = "jax-unfused"
DPO_BETA = 0.1
JSD_BETA, TEMPERATURE = 0.5, 1.0
# GRPO: TRL's default loss type, a KL to a precomputed reference, old log-probabilities given
# (several updates a batch of rollouts: ratios other than 1, clipping at work).
GRPO_LOSS, GRPO_BETA, GRPO_EPSILON = "dapo", 0.04, 0.2
IGNORE = -100
# Every row's loss against torch-eager's before timing (float32).
LOSS_RTOL = 1e-4
# The torch rows, in the order of the tables.
TORCH_ROWS = ("torch-eager", "torch-compile", "trl-chunked", "liger-kernel")
# TRL's vocabulary tile of its fused LM head (trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE).
TRL_VOCAB_CHUNK = 32768
_HIGHEST = jax.lax.Precision.HIGHEST

GRAPH_RESIDUAL_SOURCE = ("tensors held by the output's autograd graph (grad_fn._saved_* and "
                         "custom Functions' saved_tensors, beyond the inputs): torch.func inside "
                         "the forward refuses saved_tensors_hooks")
ERROR_SOURCE = f"the timed step's own outputs (loss; dh, dW) against {REFERENCE}"


@dataclasses.dataclass(frozen=True)
class Shape:
  """``pairs`` preference pairs of ``seq`` tokens (``2·pairs`` sequences), the policy's or
  student's hidden size, the vocabulary and the teacher's hidden size."""

  pairs: int
  seq: int
  d_model: int
  vocab: int
  teacher_d_model: int

  @property
  def sequences(self) -> int:
    return 2 * self.pairs

  @property
  def tokens(self) -> int:
    return self.sequences * self.seq

  @property
  def prompt(self) -> int:
    """Prompt tokens at the start of every sequence: a quarter."""
    return self.seq // 4

  def case(self, problem: str) -> str:
    if problem == "dpo":
      return (f"dpo pairs={self.pairs} T={self.seq} N={self.tokens} D={self.d_model} "
              f"V={self.vocab}")
    if problem == "grpo":
      return (f"grpo completions={self.sequences} T={self.seq} N={self.tokens} "
              f"D={self.d_model} V={self.vocab}")
    return (f"distill seqs={self.sequences} T={self.seq} N={self.tokens} Ds={self.d_model} "
            f"Dt={self.teacher_d_model} V={self.vocab}")


QUICK = Shape(pairs=2, seq=256, d_model=256, vocab=8192, teacher_d_model=512)
FULL = Shape(pairs=2, seq=1024, d_model=1024, vocab=32000, teacher_d_model=2048)
SMALL = Shape(pairs=2, seq=32, d_model=32, vocab=512, teacher_d_model=64)
PROBLEMS = ("dpo", "distill", "grpo")


# Inputs -----------------------------------------------------------------------------------------


def _mask(shape: Shape) -> np.ndarray:
  """``[2·pairs, seq]``: True on the completions."""
  mask = np.ones((shape.sequences, shape.seq), bool)
  mask[:, :shape.prompt] = False
  return mask


def inputs(shape: Shape, problem: str, seed: int = 0) -> dict[str, np.ndarray]:
  """float32 hidden states ``randn``, heads ``randn / sqrt(D)``, tokens with -100 on the
  prompts (``tokens``) and the mask; for DPO a reference head near the policy's and its
  per-sequence log-probabilities (``ref``, computed here once)."""
  rng = np.random.default_rng(seed)
  n, d, v = shape.tokens, shape.d_model, shape.vocab

  def normal(*s, scale=1.0):
    return (scale * rng.standard_normal(s)).astype(np.float32)

  mask = _mask(shape)
  tokens = np.where(mask.reshape(-1), rng.integers(0, v, n), IGNORE).astype(np.int32)
  out = {"h": normal(n, d), "w": normal(v, d, scale=d ** -0.5), "tokens": tokens, "mask": mask}
  if problem == "dpo":
    out["h_ref"] = out["h"] + normal(n, d, scale=0.1)
    out["w_ref"] = out["w"] + normal(v, d, scale=0.1 * d ** -0.5)
    logp = linear_log_probs_reference(jnp.asarray(out["h_ref"]), jnp.asarray(out["w_ref"]),
                                      jnp.asarray(tokens))
    out["ref"] = np.asarray(jnp.sum(logp.reshape(mask.shape) * mask, axis=1), np.float32)
  elif problem == "grpo":   # the sampler's and the reference's log-probabilities near the policy's
    logp = np.asarray(linear_log_probs_reference(jnp.asarray(out["h"]), jnp.asarray(out["w"]),
                                                 jnp.asarray(tokens)))
    logp = logp.reshape(mask.shape)
    out["old"] = np.where(mask, logp + normal(*mask.shape, scale=0.2), 0.0).astype(np.float32)
    out["ref"] = np.where(mask, logp + normal(*mask.shape, scale=0.2), 0.0).astype(np.float32)
    out["advantages"] = normal(shape.sequences)
  else:
    dt = shape.teacher_d_model
    out["h_t"], out["w_t"] = normal(n, dt), normal(v, dt, scale=dt ** -0.5)
  return out


# The JAX rows -----------------------------------------------------------------------------------


def _jax_dpo(log_probs: Callable, shape: Shape) -> Callable:
  def loss(h, w, tokens, mask, ref):
    logp = log_probs(h, w, tokens).reshape(shape.sequences, shape.seq)
    return dpo_loss(logp, ref, mask, beta=DPO_BETA)[0]
  return loss


GRPO_TERMS = losses.GRPOTerms(loss_type=GRPO_LOSS, beta=GRPO_BETA, epsilon_low=GRPO_EPSILON,
                              epsilon_high=GRPO_EPSILON)


def _jax_grpo(shape: Shape, fused: bool) -> Callable:
  """TRL's GRPO loss of the completions: by the fused token loss as the trainer's GRPO
  objective takes it (each token's term and its gradient in the one pass over the logits), or
  by the full logits' log-probabilities and :func:`jaxfuse.posttrain.grpo_loss`."""
  fn = grpo_token_loss(GRPO_TERMS, True, True)

  def loss(h, w, tokens, mask, old, ref, advantages):
    m = mask.astype(jnp.float32)
    if fused:
      weights = losses.grpo_token_weights(m, GRPO_LOSS)
      adv = jnp.broadcast_to(advantages[:, None], m.shape)
      return linear_token_loss(h, w, tokens, fn, adv.reshape(-1), weights.reshape(-1),
                               old.reshape(-1), ref.reshape(-1))
    logp = linear_log_probs_reference(h, w, tokens).reshape(m.shape)
    return losses.grpo_loss(logp, old, advantages, m, ref_logps=ref, beta=GRPO_BETA,
                            loss_type=GRPO_LOSS, epsilon=GRPO_EPSILON)[0]
  return loss


def plain_jsd(h_s, w_s, h_t, w_t, tokens):
  """TRL GKD's generalized JSD (``batchmean``) on both heads' full logits, in plain jnp."""
  s = jnp.dot(h_s, w_s.T, precision=_HIGHEST) / TEMPERATURE
  t = jax.lax.stop_gradient(jnp.dot(h_t, w_t.T, precision=_HIGHEST)) / TEMPERATURE
  logp_s, logp_t = jax.nn.log_softmax(s, axis=-1), jax.nn.log_softmax(t, axis=-1)
  mixture = jnp.logaddexp(logp_s + math.log1p(-JSD_BETA), logp_t + math.log(JSD_BETA))
  per_token = jnp.sum(JSD_BETA * jnp.exp(logp_t) * (logp_t - mixture)
                      + (1 - JSD_BETA) * jnp.exp(logp_s) * (logp_s - mixture), axis=-1)
  valid = tokens != IGNORE
  return jnp.sum(jnp.where(valid, per_token, 0.0)) / jnp.maximum(jnp.sum(valid), 1)


def distillation_op() -> tuple[Callable | None, str | None]:
  """``(jaxfuse.ops.linear_distillation_loss, None)``, or ``(None, why not)``."""
  try:
    from jaxfuse.ops import linear_distillation_loss
  except Exception as e:  # noqa: BLE001 - any import failure skips the row with its reason.
    return None, f"not run: jaxfuse.ops.linear_distillation_loss is not importable ({e!r:.120})"
  return linear_distillation_loss, None


def _jaxfuse_row(op_name: str) -> str:
  return harness.jaxfuse_row(base.REGISTRY[op_name].resolve(None))


def jax_rows(shape: Shape, problem: str) -> tuple[dict[str, Callable], dict[str, str]]:
  """``({row: loss of (h, w, *constants)}, {row: why it has no loss})``."""
  if problem == "dpo":
    return {_jaxfuse_row("linear_log_probs"): _jax_dpo(linear_log_probs, shape),
            BASELINE: _jax_dpo(linear_log_probs_reference, shape)}, {}
  if problem == "grpo":
    return {"jaxfuse-xla": _jax_grpo(shape, True), BASELINE: _jax_grpo(shape, False)}, {}
  op, why = distillation_op()
  rows, skipped = {}, {}
  if op is None:
    skipped["jaxfuse-xla"] = why
  else:
    rows[_jaxfuse_row("linear_distillation_loss")] = (
        lambda h_s, w_s, h_t, w_t, tokens: op(h_s, w_s, h_t, w_t, labels=tokens, beta=JSD_BETA,
                                              temperature=TEMPERATURE, reduction="batchmean",
                                              grad_in_forward=True))
  rows[BASELINE] = plain_jsd
  return rows, skipped


GRPO_KEYS = ("h", "w", "tokens", "mask", "old", "ref", "advantages")


def jax_args(x: dict, problem: str) -> tuple:
  if problem == "dpo":
    return tuple(jnp.asarray(x[k]) for k in ("h", "w", "tokens", "mask", "ref"))
  if problem == "grpo":
    return tuple(jnp.asarray(x[k]) for k in GRPO_KEYS)
  return tuple(jnp.asarray(x[k]) for k in ("h", "w", "h_t", "w_t", "tokens"))


# The torch rows ---------------------------------------------------------------------------------


def _sigmoid_dpo(per_token_logps, mask, ref):
  """TRL's sigmoid DPO loss of masked per-token log-probabilities ``[2B, T]``."""
  import torch.nn.functional as F  # noqa: N812

  logps = (per_token_logps * mask).sum(dim=1)
  chosen, rejected = logps.chunk(2, dim=0)
  ref_chosen, ref_rejected = ref.chunk(2, dim=0)
  delta = (chosen - ref_chosen) - (rejected - ref_rejected)
  return (-F.logsigmoid(DPO_BETA * delta)).mean()


def _torch_dpo(shape: Shape) -> Callable:
  from trl.trainer.utils import selective_log_softmax

  def loss(h, w, tokens, mask, ref):
    logits = (h @ w.T).view(shape.sequences, shape.seq, -1)
    logp = selective_log_softmax(logits, tokens.view(mask.shape), row_mask=mask)
    return _sigmoid_dpo(logp, mask, ref)
  return loss


def _trl_chunked_dpo(shape: Shape) -> Callable:
  from trl.kernels import ChunkedLogProbFunction

  def loss(h, w, tokens, mask, ref):
    logp = ChunkedLogProbFunction.apply(h, w, None, tokens, 1.0, TRL_VOCAB_CHUNK, None, 1.0,
                                        ("log_probs",))[0]
    return _sigmoid_dpo(logp.view(mask.shape).masked_fill(~mask, 0), mask, ref)
  return loss


def _liger_dpo(shape: Shape, compiled: bool) -> Callable:
  from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss

  module = LigerFusedLinearDPOLoss(ignore_index=IGNORE, beta=DPO_BETA, use_ref_model=True,
                                   compiled=compiled)
  rows = (shape.sequences, shape.seq, -1)

  def loss(h, w, tokens, h_ref, w_ref):
    return module(w, h.view(rows), tokens.view(rows[:2]), ref_input=h_ref.view(rows),
                  ref_weight=w_ref)[0]
  return loss


def _gkd_jsd(shape: Shape) -> Callable:
  import torch

  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # trl.experimental's import warning
    from trl.experimental.gkd import GKDTrainer

  rows = (shape.sequences, shape.seq, -1)

  def loss(h_s, w_s, h_t, w_t, tokens):
    student = (h_s @ w_s.T).view(rows)
    with torch.no_grad():
      teacher = (h_t @ w_t.T).view(rows)
    return GKDTrainer.generalized_jsd_loss(student, teacher, labels=tokens.view(rows[:2]),
                                           beta=JSD_BETA, temperature=TEMPERATURE,
                                           reduction="batchmean")
  return loss


def _trl_chunked_jsd(shape: Shape) -> Callable:
  from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

  def loss(h_s, w_s, h_t, w_t, tokens):
    valid = tokens != IGNORE
    per_token, _ = ChunkedDivergenceFunction.apply(h_s, w_s, None, h_t, w_t, None, JSD_BETA,
                                                   TEMPERATURE)
    return per_token.masked_fill(~valid, 0).sum() / valid.sum().clamp(min=1)
  return loss


def _liger_jsd(shape: Shape, compiled: bool) -> Callable:
  from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

  module = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=JSD_BETA,
                                   ignore_index=IGNORE, temperature=TEMPERATURE,
                                   compiled=compiled)
  return lambda h_s, w_s, h_t, w_t, tokens: module(h_s, w_s, h_t, w_t, tokens)


def _trl_grpo_loss(per_token_logps, mask, old, ref, advantages):
  """TRL 1.16's ``GRPOTrainer._compute_loss`` for the dapo loss with a KL (one process, no
  accumulation: the divisor is the batch's completion tokens), on per-token log-probabilities."""
  import torch

  coef_1 = torch.exp(per_token_logps - old)
  coef_2 = torch.clamp(coef_1, 1 - GRPO_EPSILON, 1 + GRPO_EPSILON)
  adv = advantages.unsqueeze(1)
  per_token = -torch.min(coef_1 * adv, coef_2 * adv)
  kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
  per_token = per_token + GRPO_BETA * kl
  m = mask.to(per_token.dtype)
  return (per_token * m).sum() / m.sum().clamp(min=1.0)


def _torch_grpo(shape: Shape) -> Callable:
  from trl.trainer.utils import selective_log_softmax

  def loss(h, w, tokens, mask, old, ref, advantages):
    logits = (h @ w.T).view(shape.sequences, shape.seq, -1)
    logp = selective_log_softmax(logits, tokens.view(mask.shape))
    return _trl_grpo_loss(logp, mask, old, ref, advantages)
  return loss


def _trl_chunked_grpo(shape: Shape) -> Callable:
  from trl.kernels import ChunkedLogProbFunction

  def loss(h, w, tokens, mask, old, ref, advantages):
    logp = ChunkedLogProbFunction.apply(h, w, None, tokens, 1.0, TRL_VOCAB_CHUNK, None, 1.0,
                                        ("log_probs",))[0]
    return _trl_grpo_loss(logp.view(mask.shape), mask, old, ref, advantages)
  return loss


def _liger_grpo(shape: Shape, compiled: bool) -> Callable:
  from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

  module = LigerFusedLinearGRPOLoss(beta=GRPO_BETA, compiled=compiled, use_ref_model=True,
                                    epsilon_low=GRPO_EPSILON, epsilon_high=GRPO_EPSILON,
                                    loss_type=GRPO_LOSS)
  rows = (shape.sequences, shape.seq, -1)

  def loss(h, w, tokens, mask, old, ref, advantages):
    return module(h.view(rows), w, tokens.view(rows[:2]), mask.long(), advantages,
                  ref_per_token_logps=ref, old_per_token_logps=old)[0]
  return loss


def torch_args(x: dict, problem: str, row: str) -> list:
  """A torch row's arguments: ``h`` and ``w`` first (the differentiated ones)."""
  import torch

  t = harness.to_torch
  if problem == "grpo":   # the prompts' -100 become 0: every position is scored, masked after
    return [t(x["h"]), t(x["w"]), t(np.maximum(x["tokens"], 0), dtype=torch.long),
            t(x["mask"]), t(x["old"]), t(x["ref"]), t(x["advantages"])]
  if problem == "distill":
    return [t(x["h"]), t(x["w"]), t(x["h_t"]), t(x["w_t"]), t(x["tokens"], dtype=torch.long)]
  if row == "liger-kernel":
    return [t(x["h"]), t(x["w"]), t(x["tokens"], dtype=torch.long), t(x["h_ref"]),
            t(x["w_ref"])]
  # TRL's per-token functions gather every position: the prompts' -100 become 0, masked after.
  tokens = np.maximum(x["tokens"], 0)
  return [t(x["h"]), t(x["w"]), t(tokens, dtype=torch.long), t(x["mask"]), t(x["ref"])]


def torch_rows(shape: Shape, problem: str, *, compiled: bool = True
               ) -> tuple[dict[str, Callable], dict[str, str]]:
  """``({row: loss}, {row: note})``; ``compiled=False`` leaves out torch-compile and runs
  Liger's chunks eagerly (their default is torch.compile)."""
  import torch

  notes: dict[str, str] = {}
  rows: dict[str, Callable] = {}
  if problem == "dpo":
    eager, chunked, liger = _torch_dpo, _trl_chunked_dpo, _liger_dpo
  elif problem == "grpo":
    eager, chunked, liger = _torch_grpo, _trl_chunked_grpo, _liger_grpo
  else:
    eager, chunked, liger = _gkd_jsd, _trl_chunked_jsd, _liger_jsd
  rows["torch-eager"] = eager(shape)
  if compiled:
    rows["torch-compile"] = torch.compile(eager(shape))
  rows["trl-chunked"] = chunked(shape)
  rows["liger-kernel"] = liger(shape, compiled)
  if not compiled:
    notes["liger-kernel"] = "chunks run eagerly (compiled=False)"
  if problem == "dpo":
    notes["liger-kernel"] = _join(
        notes.get("liger-kernel"),
        "takes no precomputed reference: computes it from the reference head under no_grad "
        "(one N×D×V product more); gradients computed in the forward and kept")
  elif problem == "grpo":
    notes["liger-kernel"] = _join(notes.get("liger-kernel"),
                                  "gradients computed in the forward and kept")
  else:
    notes["liger-kernel"] = _join(
        notes.get("liger-kernel"),
        "beta as TRL's; weight_soft_loss=1, weight_hard_loss=0 (its cross-entropy still "
        "computed); gradients computed in the forward and kept")
  return rows, notes


def graph_residual_bytes(fn: Callable, t_args: Sequence, *, n_diff: int = 2) -> int:
  """Bytes of the tensors the autograd graph of ``fn(*t_args)`` holds for its backward, beyond
  its arguments: each node's ``_saved_*`` tensors (and lists of them) and a custom Function's
  ``saved_tensors``, each storage once. It also sees the Python scalars autograd wraps as 0-dim
  tensors (8 bytes each), which ``saved_tensors_hooks`` never gets."""
  import torch

  leaves = [a.detach().requires_grad_() for a in t_args[:n_diff]]
  out = fn(*leaves, *t_args[n_diff:])
  key = lambda t: (t.untyped_storage().data_ptr(), t.device.type)  # noqa: E731
  excluded = {key(t) for t in [*t_args, *leaves] if isinstance(t, torch.Tensor)}
  seen, found, stack = set(), {}, [out.grad_fn]
  while stack:
    node = stack.pop()
    if node is None or node in seen:
      continue
    seen.add(node)
    saved = [getattr(node, name) for name in dir(node) if name.startswith("_saved_")]
    try:
      saved += list(node.saved_tensors or ())
    except (AttributeError, RuntimeError):
      pass
    saved = [t for v in saved for t in (v if isinstance(v, (list, tuple)) else [v])]
    for t in saved:
      if isinstance(t, torch.Tensor) and key(t) not in excluded:
        found[key(t)] = t.untyped_storage().nbytes()
    stack += [f for f, _ in node.next_functions]
  return sum(found.values())


# Checks -----------------------------------------------------------------------------------------


def _loss(out) -> float:
  return float(harness.to_numpy(out[0]))


def relative(a: float, b: float) -> float:
  return abs(a - b) / max(abs(b), 1e-30)


@functools.cache
def liger_agreement(problem: str) -> tuple[str, float]:
  """``(row, relative difference)`` of Liger's loss (chunks run eagerly) from jaxfuse's (or the
  plain-JAX row's where jaxfuse's cannot run) at ``SMALL``."""
  x = inputs(SMALL, problem, seed=1)
  rows, _ = jax_rows(SMALL, problem)
  name = next(iter(rows))
  ours = float(rows[name](*jax_args(x, problem)))
  liger = {"dpo": _liger_dpo, "grpo": _liger_grpo, "distill": _liger_jsd}[problem](SMALL, False)
  theirs = float(liger(*torch_args(x, problem, "liger-kernel")))
  return name, relative(theirs, ours)


# One case ---------------------------------------------------------------------------------------


def _join(*parts: str | None) -> str | None:
  kept = [p for p in parts if p]
  return "; ".join(kept) if kept else None


def case_records(ctx, shape: Shape, problem: str, *, compiled: bool = True) -> list[Record]:
  """The records of one problem at one shape: each row's first step checked against
  torch-eager's loss, then every row that agrees timed interleaved; residual bytes, XLA's
  figures and errors."""
  case = shape.case(problem)
  ctx.step(f"{case}: inputs")
  x = inputs(shape, problem)
  j_rows, skipped = jax_rows(shape, problem)
  t_rows, t_notes = torch_rows(shape, problem, compiled=compiled)
  notes = {**skipped, **t_notes}
  order = [*skipped, *j_rows, *t_rows]
  args = jax_args(x, problem)
  steps, outputs, candidates = {}, {}, {}
  for name, loss in j_rows.items():
    ctx.step(f"{case}: {name} first step")
    steps[name] = harness.jax_step(loss, n_diff=2)
    outputs[name] = jax.block_until_ready(steps[name](args))
    candidates[name] = functools.partial(steps[name], args)
  t_args = {name: torch_args(x, problem, name) for name in t_rows}
  for name, loss in t_rows.items():
    ctx.step(f"{case}: {name} first step")
    step = harness.torch_step(loss, n_diff=2)
    try:
      outputs[name] = step(t_args[name])
    except Exception as e:  # noqa: BLE001 - a peer that cannot run here gets a note, no time.
      notes[name] = _join(notes.get(name), f"did not run: {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:120] if str(e) else ''}")
      continue
    candidates[name] = functools.partial(step, t_args[name])

  reference = outputs[REFERENCE]
  ref_loss = _loss(reference)
  agree = {}
  for name, out in outputs.items():
    agree[name] = relative(_loss(out), ref_loss)
    if not agree[name] <= LOSS_RTOL:
      candidates.pop(name, None)
      notes[name] = _join(notes.get(name), f"not timed: its loss differs from {REFERENCE}'s by "
                          f"{agree[name]:.1e} (relative) > {LOSS_RTOL:g}")
  if "liger-kernel" in outputs:
    against, diff = liger_agreement(problem)
    same = diff <= LOSS_RTOL
    notes["liger-kernel"] = _join(notes.get("liger-kernel"),
                                  f"loss {'=' if same else '!='} {against}'s at "
                                  f"{SMALL.case(problem)} ({diff:.1e} relative)"
                                  + ("" if same else "; not timed"))
    if not same:
      candidates.pop("liger-kernel", None)
  for name in j_rows:
    if name.startswith("jaxfuse"):
      notes[name] = _join(notes.get(name), "implementation=None")
  ctx.step(f"{case}: timing {len(candidates)} rows")
  times = ctx.time(candidates, warmup=1)

  ctx.step(f"{case}: residual bytes")
  residual, sources = {}, {}
  for name, loss in j_rows.items():
    residual[name] = harness.residual_bytes(loss, args, n_diff=2)
    sources[name] = rec.JAX_RESIDUAL_SOURCE
  for name, loss in t_rows.items():
    if name not in outputs:
      continue
    if name == "liger-kernel":
      residual[name] = graph_residual_bytes(loss, t_args[name])
      sources[name] = GRAPH_RESIDUAL_SOURCE
    else:
      residual[name] = harness.torch_residual_bytes(loss, t_args[name], n_diff=2)
      sources[name] = rec.TORCH_RESIDUAL_SOURCE

  records = []
  for name in order:
    r = Record(SUITE, case, name, ctx.platform, "float32", note=notes.get(name))
    records.append(r)
    r.set("time_ms", times.get(name), harness.time_source(times.get(name)))
    r.set("residual_bytes", residual.get(name), sources.get(name))
    if name in outputs and name != REFERENCE:
      harness.set_errors(r, harness.errors(outputs[name], reference), ERROR_SOURCE)
      r.reference = REFERENCE
    if name in steps:
      ctx.step(f"{case}: {name} compiled figures")
      harness.record_compiled_figures(r, steps[name], args)
  others = [r.impl for r in records if not r.impl.startswith("jaxfuse")]
  harness.ratio_to_fastest(records, others)
  torch_residual = residual.get(REFERENCE)
  for r in records:
    if r.impl in agree:
      r.add_note(f"loss vs {REFERENCE}: {agree[r.impl]:.1e} relative" if r.impl != REFERENCE
                 else None)
    if r.residual_bytes is not None and torch_residual and r.impl != REFERENCE:
      r.add_note(f"residual / {REFERENCE} = {r.residual_bytes / torch_residual:.3g}")
  return records


# Suite entry points -----------------------------------------------------------------------------


def run(ctx) -> list[Record]:
  """The two problems at ``QUICK`` or ``FULL``; at ``FULL`` each in a fresh process, whose
  gigabytes of logits go back to the system when it ends."""
  if ctx.quick:
    return [r for problem in PROBLEMS for r in case_records(ctx, QUICK, problem)]
  return [r for problem in PROBLEMS
          for r in harness.in_fresh_process(case_records, ctx, FULL, problem)]


def headline(records) -> list[Record]:
  """Every row (one shape per run)."""
  return list(records)


def plot(records: Sequence[Record], path: str) -> None:
  """One row of panels per case: time over the fastest row other than jaxfuse's (log axis) and
  residual bytes (log axis, torch-eager's drawn across), one bar per row; ``n/a`` where a row
  has no figure."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib import ticker

  cases = list(dict.fromkeys(r.case for r in records))
  fig, axes = plt.subplots(len(cases), 2, figsize=(13, 4.4 * len(cases)), squeeze=False)
  for row, case in zip(axes, cases):
    mine = [r for r in records if r.case == case]
    xs = np.arange(len(mine))
    colors = [f"C{i}" for i in range(len(mine))]
    panels = (("time / fastest other row (log)", [r.ratio for r in mine],
               lambda v: f"{v:.2f}×"),
              ("residual bytes (MiB, log)",
               [None if r.residual_bytes is None else r.residual_bytes / 2**20 for r in mine],
               lambda v: f"{v:,.0f}" if v >= 100 else f"{v:.3g}"))
    for ax, (label, values, text) in zip(row, panels):
      finite = [v for v in values if v is not None and math.isfinite(v) and v > 0]
      ax.set_yscale("log")
      is_time = label.startswith("time")
      # Time bars grow from 1 (the fastest other row), residual bars from below the smallest.
      bottom = 1.0 if is_time else min(finite, default=1.0) / 2
      heights = [v - bottom if v is not None and math.isfinite(v) and v > 0 else 0.0
                 for v in values]
      ax.bar(xs, heights, 0.7, bottom=bottom, color=colors)
      for x, v in zip(xs, values):
        if v is None or not math.isfinite(v):
          ax.annotate("n/a", (x, 0.02), xycoords=("data", "axes fraction"), ha="center",
                      va="bottom", fontsize=8)
        else:
          ax.annotate("0" if v == 0 else text(v), (x, max(v, bottom)), ha="center",
                      va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
      if is_time:
        ax.set_ylim(min([*finite, 1.0]) / 1.3, max([*finite, 1.0]) * 1.5)
        ax.axhline(1.0, color="k", lw=0.7)
        ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda y, _: f"{y:g}×"))
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
      else:
        ax.set_ylim(bottom, max(finite, default=1.0) * 3)
        torch_row = next((r for r in mine if r.impl == REFERENCE and r.residual_bytes), None)
        if torch_row is not None:
          ax.axhline(torch_row.residual_bytes / 2**20, color="C3", lw=1.0, ls="--",
                     label=REFERENCE)
          ax.legend(fontsize=8, loc="upper right")
      ax.set_xticks(xs)
      ax.set_xticklabels([r.impl for r in mine], rotation=20, ha="right", fontsize=8)
      ax.set_ylabel(label, fontsize=9)
      ax.grid(axis="y", alpha=0.3, which="both")
    row[0].set_title(case, fontsize=10, loc="left")
  platform = records[0].platform if records else "?"
  fig.suptitle(f"posttrain: LM-head loss steps, forward + backward, on {platform}, float32")
  fig.tight_layout()
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plt.close(fig)


__all__ = ["FULL", "QUICK", "SMALL", "Shape", "case_records", "distillation_op",
           "graph_residual_bytes", "headline", "inputs", "jax_args", "jax_rows",
           "liger_agreement", "plain_jsd", "plot", "run", "torch_args", "torch_rows"]
