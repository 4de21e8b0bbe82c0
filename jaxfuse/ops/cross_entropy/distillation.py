"""Fused distillation losses on two LM heads, without the [tokens, vocab] logits of either.

``linear_distillation_loss(h_student, w_student, h_teacher, w_teacher, mask)`` is TRL's
generalized Jensen-Shannon divergence (``GKDTrainer.generalized_jsd_loss`` of TRL 1.16, the GKD
paper's Eq. 1) between the student's and the teacher's next-token distributions,
``softmax(softcap(h @ w.T + bias) / temperature)`` of each head:

- ``beta = 0``: the forward KL, ``KL(teacher || student) = sum_v p_t (log p_t - log p_s)``;
- ``beta = 1``: the reverse KL, ``KL(student || teacher)``;
- in between: ``beta * KL(p_t || m) + (1 - beta) * KL(p_s || m)`` with the mixture
  ``m = beta * p_t + (1 - beta) * p_s``, taken in log space (``logaddexp``) as TRL takes it.
  (Its limits at 0 and 1 are 0, not the KLs: TRL switches to the KLs there, and so does this.)

Both heads are walked in one pass, chunk by chunk over the tokens: each chunk makes its
``[chunk, V]`` logits of the student and of the teacher, reduces them to the two logsumexps and
the token's divergence, and drops them. The mixture needs both distributions normalized, so a
chunk holds its whole rows (walking the vocabulary in tiles would take a second pass over the
tiles for the mixture's terms).

- backward: keeps the inputs and the two per-token logsumexps (8 bytes a token), tagged
  ``distill.student_lse`` and ``distill.teacher_lse`` (:mod:`jaxfuse.ops.names`); recomputes
  each chunk's logits of both heads and multiplies the student's logit gradient,
  ``p_s * (q - E_{p_s}[q])`` with ``q = (1 - beta) * (log p_s - log m)`` (``log p_s - log
  p_t`` at ``beta = 1``; ``p_s - p_t`` at ``beta = 0``), into ``dh_student``, ``dw_student``
  and ``dstudent_bias``.
- ``grad_in_forward=True`` (Liger-Kernel's way, for a scalar loss): each chunk's logits of both
  heads are made once, in the forward, which also multiplies the student's logit gradient into
  ``dh_student``, ``dw_student`` and ``dstudent_bias``; the backward keeps those (the student's
  sizes) and scales them by the loss's cotangent. Four ``N·D·V`` products of a student and a
  teacher head instead of six (the teacher's being recomputed in the backward otherwise).
- the teacher gets no gradient: its arrays are treated as constants (``jax.lax.stop_gradient``
  semantics; TRL runs its teacher under ``torch.no_grad()``), and their cotangents are zeros.

``linear_topk_distillation_loss`` is the cheaper alternative for a teacher whose top-k
log-probabilities were stored (an offline teacher): the forward KL against the teacher
renormalised over its k words, the student's log-probabilities at those k ids taken from its
full softmax, chunk by chunk (one head walked, no teacher matmul at all).
:func:`topk_distillation_loss` is the same loss on log-probabilities already computed.

Implementations: XLA only (``implementation=None`` or ``"xla"``); there are no Pallas or Triton
kernels for these losses yet, and no partitioning rule of their own (over a mesh, XLA
partitions their jnp as it would any other). Derivatives: reverse mode to any order (the
backward is plain jnp; Hessian-vector products of ``linear_distillation_loss`` are tested
against TRL's double backward); forward mode on the op itself raises, as for every
``jax.custom_vjp`` function.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import SymbolicZero

from jaxfuse.ops import base, checks, names, partitioning
from jaxfuse.ops.cross_entropy import op as ce
from jaxfuse.ops.cross_entropy import xla

LINEAR_DISTILLATION_LOSS = base.Op("linear_distillation_loss", None, base.KERNEL_GPU_ORDER)
# An XLA-only function outside the registry: the same checks and config, no op-table entry.
_LINEAR_TOPK = base.Op("linear_topk_distillation_loss", None, register=False)
_TOPK = "topk_distillation_loss"

REDUCTIONS = ("batchmean", "sum", "mean", "none")
# beta, the temperature and the soft-caps are static: Python (or numpy) numbers.
_NUMBERS = (int, float, np.integer, np.floating)

__all__ = ["LINEAR_DISTILLATION_LOSS", "linear_distillation_loss",
           "linear_distillation_loss_reference", "linear_topk_distillation_loss",
           "topk_distillation_loss"]


# The reference --------------------------------------------------------------------------------


def _full_logits(h, weight, bias, softcap, temperature):
  logits = xla.linear_logits(h, weight, bias)
  if softcap is not None:
    logits = softcap * jnp.tanh(logits / softcap)
  return logits / temperature


def _valid_of(mask, labels, ignore_index, shape):
  if mask is not None:
    return mask
  if labels is not None:
    return labels != ignore_index
  return jnp.ones(shape, bool)


def _reduce(per_token, valid, reduction, terms, summed=False):
  """TRL's reductions of the per-token losses (0 where masked): ``terms`` elements a token
  for ``"mean"`` (the vocabulary, or the k of a top-k loss). ``summed``: ``per_token`` is
  already their sum."""
  if reduction == "none":
    return per_token
  total = per_token if summed else jnp.sum(per_token)
  count = jnp.sum(valid).astype(jnp.float32)
  if reduction == "sum":
    return total
  if reduction == "batchmean":
    return total / jnp.maximum(count, 1.0)
  return total / (count * terms)   # "mean": NaN with no token, as torch's mean of nothing


def linear_distillation_loss_reference(h_student, w_student, h_teacher, w_teacher, mask=None, *,
                                       labels=None, ignore_index=-100, beta=0.5,
                                       temperature=1.0, student_bias=None, teacher_bias=None,
                                       student_logit_softcap=None, teacher_logit_softcap=None,
                                       reduction="batchmean"):
  """Plain-jnp :func:`linear_distillation_loss` with the full logits of both heads (float32).

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxfuse.ops import linear_distillation_loss_reference
    >>> h, w = jnp.ones((2, 4)), jnp.eye(3, 4)
    >>> float(linear_distillation_loss_reference(h, w, h, w))   # one head twice: no divergence
    0.0
  """
  s = _full_logits(h_student, w_student, student_bias, student_logit_softcap, temperature)
  t = lax.stop_gradient(_full_logits(h_teacher, w_teacher, teacher_bias, teacher_logit_softcap,
                                     temperature))
  logp_s, logp_t = jax.nn.log_softmax(s, axis=-1), jax.nn.log_softmax(t, axis=-1)
  per_token = jnp.sum(_divergence_terms(logp_s, logp_t, float(beta)), axis=-1)
  valid = _valid_of(mask, labels, ignore_index, per_token.shape)
  per_token = jnp.where(valid, per_token, 0.0)
  return _reduce(per_token, valid, reduction, w_student.shape[0])


def _divergence_terms(logp_s, logp_t, beta):
  """The per-word terms of TRL's generalized JSD (``F.kl_div(x, y, log_target=True)`` is
  ``exp(y) * (y - x)``), from the two log-softmaxes."""
  if beta == 0.0:
    return jnp.exp(logp_t) * (logp_t - logp_s)
  if beta == 1.0:
    return jnp.exp(logp_s) * (logp_s - logp_t)
  mixture = jnp.logaddexp(logp_s + math.log1p(-beta), logp_t + math.log(beta))
  return (beta * jnp.exp(logp_t) * (logp_t - mixture)
          + (1.0 - beta) * jnp.exp(logp_s) * (logp_s - mixture))


# Checks and config ----------------------------------------------------------------------------


def _check_head(op, who, h, weight, bias, softcap):
  """The checks of one head: ``h_<who>``, ``w_<who>`` and ``<who>_bias``."""
  hn, wn, bn = f"h_{who}", f"w_{who}", f"{who}_bias"
  checks.floating(op, hn, h)
  checks.floating(op, wn, weight)
  checks.rank(op, wn, weight, 2)
  if h.ndim < 1:
    raise ValueError(f"{op}: {hn} must have rank >= 1 ([..., D]), got shape {tuple(h.shape)}")
  checks.same_dtype(op, (hn, wn), (h, weight))
  checks.dim(op, wn, weight, 1, h.shape[-1], f"{hn}'s last axis, D")
  if weight.shape[0] < 1:
    raise ValueError(f"{op}: the vocabulary ({wn}.shape[0], V) must be at least 1, got {wn} "
                     f"of shape {tuple(weight.shape)}")
  if bias is not None:
    checks.floating(op, bn, bias)
    checks.same_dtype(op, (hn, bn), (h, bias))
    if tuple(bias.shape) != (weight.shape[0],):
      raise ValueError(f"{op}: {bn} must have shape (V,) = ({weight.shape[0]},), got shape "
                       f"{tuple(bias.shape)}")
  _check_softcap(op, f"{who}_logit_softcap", softcap)


def _check_softcap(op, name, softcap):
  if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, _NUMBERS)
                              or not math.isfinite(softcap) or not softcap > 0):
    raise ValueError(f"{op}: {name} must be None or a finite number > 0, got {softcap!r}")


def _check_mask(op, mask, labels, lead):
  """The token selection: a boolean ``mask`` or integer ``labels``, of the tokens' shape."""
  if mask is not None and labels is not None:
    raise ValueError(f"{op}: pass mask or labels, not both")
  if mask is not None and mask.dtype != jnp.bool_:
    raise TypeError(f"{op}: mask must be boolean (True: the token counts), got "
                    f"{jnp.dtype(mask.dtype).name}; pass integer labels as labels=")
  if labels is not None and not jnp.issubdtype(labels.dtype, jnp.integer):
    raise TypeError(f"{op}: labels must have an integer dtype, got "
                    f"{jnp.dtype(labels.dtype).name}")
  for name, x in (("mask", mask), ("labels", labels)):
    if x is not None and tuple(x.shape) != tuple(lead):
      raise ValueError(f"{op}: {name} must have shape h_student.shape[:-1] = {tuple(lead)}, "
                       f"got shape {tuple(x.shape)}")


def _check_options(op, temperature, reduction, chunk_size):
  if isinstance(temperature, bool) or not isinstance(temperature, _NUMBERS) \
      or not math.isfinite(temperature) or not temperature > 0:
    raise ValueError(f"{op}: temperature must be a finite number > 0, got {temperature!r}")
  if reduction not in REDUCTIONS:
    raise ValueError(f"{op}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
  if chunk_size is not None and (not isinstance(chunk_size, (int, np.integer))
                                 or isinstance(chunk_size, bool) or chunk_size < 1):
    raise ValueError(f"{op}: chunk_size must be None or a positive int, got {chunk_size!r}")


def _check(h_student, w_student, h_teacher, w_teacher, mask, labels, beta, temperature,
           student_bias, teacher_bias, student_softcap, teacher_softcap, reduction, chunk_size):
  op = LINEAR_DISTILLATION_LOSS.name
  _check_head(op, "student", h_student, w_student, student_bias, student_softcap)
  _check_head(op, "teacher", h_teacher, w_teacher, teacher_bias, teacher_softcap)
  if w_teacher.shape[0] != w_student.shape[0]:
    raise ValueError(
        f"{op}: w_teacher scores {w_teacher.shape[0]} words (w_teacher.shape[0]) and w_student "
        f"{w_student.shape[0]} (w_student.shape[0]): a teacher whose vocabulary differs from "
        f"the student's is not supported (both heads must score the same V words, in the same "
        f"order; slice a padded head to the shared words)")
  if tuple(h_teacher.shape[:-1]) != tuple(h_student.shape[:-1]):
    raise ValueError(f"{op}: h_teacher must have the tokens' shape h_student.shape[:-1] = "
                     f"{tuple(h_student.shape[:-1])} before its last axis, got shape "
                     f"{tuple(h_teacher.shape)}")
  _check_mask(op, mask, labels, h_student.shape[:-1])
  if isinstance(beta, bool) or not isinstance(beta, _NUMBERS) or not 0.0 <= beta <= 1.0:
    raise ValueError(f"{op}: beta must be a number in [0, 1] (0: forward KL, 1: reverse KL), "
                     f"got {beta!r}")
  _check_options(op, temperature, reduction, chunk_size)


@dataclasses.dataclass(frozen=True)
class _Head:
  """One head's logit transform, as :func:`xla.chunk_logits` reads it."""

  softcap: float | None
  scale: float | None


@dataclasses.dataclass(frozen=True)
class _Config(base.Config):
  """Static settings shared by the forward and the backward."""

  vocab: int
  beta: float
  scale: float | None             # 1 / temperature (None at 1)
  student_softcap: float | None
  teacher_softcap: float | None
  chunk: int                      # tokens per chunk of logits
  select: str                     # the tokens' selection: "all", "mask" or "labels"
  ignore_index: int

  @property
  def student(self) -> _Head:
    return _Head(self.student_softcap, self.scale)

  @property
  def teacher(self) -> _Head:
    return _Head(self.teacher_softcap, self.scale)


def _select(mask, labels):
  """``(array, kind)``: what the custom_vjp reads to know which tokens count (the labels
  themselves, so that the backward keeps no mask of its own)."""
  if mask is not None:
    return mask, "mask"
  if labels is not None:
    return labels, "labels"
  return None, "all"


def _config(op, implementation, n, vocab, *, beta, temperature, student_softcap, teacher_softcap,
            chunk_size, select, ignore_index, heads=2) -> _Config:
  return op.config(implementation, _Config, vocab=vocab, beta=float(beta),
                   scale=None if temperature == 1 else 1.0 / float(temperature),
                   student_softcap=None if student_softcap is None else float(student_softcap),
                   teacher_softcap=None if teacher_softcap is None else float(teacher_softcap),
                   # Each chunk holds the logits of `heads` heads: as many fewer tokens.
                   chunk=ce.chunk_tokens(n, heads * vocab, chunk_size), select=select,
                   ignore_index=int(ignore_index))


# The op ---------------------------------------------------------------------------------------


def linear_distillation_loss(h_student: jax.Array, w_student: jax.Array, h_teacher: jax.Array,
                             w_teacher: jax.Array, mask: jax.Array | None = None, *,
                             labels: jax.Array | None = None, ignore_index: int = -100,
                             beta: float = 0.5, temperature: float = 1.0,
                             student_bias: jax.Array | None = None,
                             teacher_bias: jax.Array | None = None,
                             student_logit_softcap: float | None = None,
                             teacher_logit_softcap: float | None = None,
                             reduction: str = "batchmean", chunk_size: int | None = None,
                             grad_in_forward: bool = False,
                             implementation: str | None = None) -> jax.Array:
  """TRL's generalized JSD between a student's and a teacher's LM heads, one chunk of logits of
  each at a time.

  Matches ``GKDTrainer.generalized_jsd_loss(student_logits, teacher_logits, labels, beta,
  temperature, reduction)`` of TRL 1.16 on the full logits ``softcap(h @ w.T + bias)`` of each
  head (its ``num_items_in_batch`` is ``reduction="sum"`` divided by the caller). Liger-Kernel's
  ``LigerFusedLinearJSDLoss`` (0.8) takes ``beta`` the same way (0: forward KL, 1: reverse KL);
  with ``weight_hard_loss=0, weight_soft_loss=1`` it is ``reduction="batchmean"``.

  Args:
    h_student: the student's hidden states ``[..., Ds]``, float32, bfloat16 or float16.
    w_student: the student's output embedding ``[V, Ds]``, h_student's dtype.
    h_teacher: the teacher's hidden states ``[..., Dt]`` at the same tokens (its own dtype and
      hidden size).
    w_teacher: the teacher's output embedding ``[V, Dt]``, h_teacher's dtype, over the same
      ``V`` words.
    mask: optional boolean ``h_student.shape[:-1]``: the tokens that count (completions).
    labels: instead of ``mask``, integer labels of that shape as TRL passes them: the tokens
      equal to ``ignore_index`` do not count (the values are not read otherwise).
    ignore_index: the label of the tokens that do not count.
    beta: a number in ``[0, 1]``: 0 is ``KL(teacher || student)``, 1 is ``KL(student ||
      teacher)``, in between the generalized JSD.
    temperature: both heads' logits (after their soft-caps) are divided by it (> 0).
    student_bias, teacher_bias: optional ``[V]`` biases, each in its head's dtype.
    student_logit_softcap, teacher_logit_softcap: if set, that head's logits become
      ``cap * tanh(logits / cap)`` first (Gemma 2), as the model computes them.
    reduction: TRL's: ``"batchmean"`` (the sum over the tokens that count, divided by their
      number, at least 1), ``"sum"``, ``"mean"`` (the sum divided by ``tokens * V``, TRL's
      mean over every word's term; NaN when no token counts, with zero gradients) or
      ``"none"``: per-token divergences, ``h_student.shape[:-1]``, 0 where masked (TRL's
      ``"none"`` returns the per-word terms ``[tokens, V]``, whose sums these are). Without
      ``mask`` and ``labels`` every token counts (TRL's ``"batchmean"`` without labels divides by
      the logits' first axis instead: the same for ``[tokens, V]`` logits).
    chunk_size: tokens per chunk (default: about ``2**24 / V``); a chunk's ``[chunk, V]`` logits
      of both heads are the most that exists at a time.
    grad_in_forward: compute the student's gradients in the forward pass, as Liger-Kernel does
      (each chunk's logits of both heads made once instead of twice: the teacher's head is the
      costly one; the backward only scales them), keeping ``dh_student``, ``dw_student`` and
      ``dstudent_bias`` (their inputs' sizes) instead of the two logsumexps. Needs a scalar
      loss (not ``reduction="none"``); the gradients are computed whether asked for or not.
    implementation: ``None`` or ``"xla"`` (no Pallas or Triton kernels yet).

  Returns:
    The float32 loss: a scalar, or ``h_student.shape[:-1]`` for ``"none"``. Its gradient reaches
    ``h_student``, ``w_student`` and ``student_bias``; the teacher's arrays get zeros.

  Raises:
    ValueError: a teacher whose vocabulary differs from the student's, ``beta`` outside
      ``[0, 1]``, a temperature that is not > 0, mismatched shapes, bad options.
    TypeError: non-floating heads, dtypes that differ within a head, a non-boolean ``mask``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxfuse.ops import linear_distillation_loss
    >>> k = jax.random.split(jax.random.key(0), 4)
    >>> hs, ws = jax.random.normal(k[0], (2, 8, 16)), 0.1 * jax.random.normal(k[1], (500, 16))
    >>> ht, wt = jax.random.normal(k[2], (2, 8, 32)), 0.1 * jax.random.normal(k[3], (500, 32))
    >>> mask = jnp.arange(8) >= 3                      # the completion: its last 5 tokens
    >>> loss, (dh, dw) = jax.value_and_grad(linear_distillation_loss, argnums=(0, 1))(
    ...     hs, ws, ht, wt, jnp.broadcast_to(mask, (2, 8)), beta=0.5, temperature=0.9)
    >>> loss.shape, bool(loss > 0), dw.shape, bool((dh[:, :3] == 0).all())
    ((), True, (500, 16), True)
  """
  mask = None if mask is None else checks.as_array(mask)
  labels = None if labels is None else checks.as_array(labels)
  _check(h_student, w_student, h_teacher, w_teacher, mask, labels, beta, temperature,
         student_bias, teacher_bias, student_logit_softcap, teacher_logit_softcap, reduction,
         chunk_size)
  if grad_in_forward and reduction == "none":
    raise ValueError(f"{LINEAR_DISTILLATION_LOSS.name}: grad_in_forward=True needs a scalar loss "
                     f"(reduction 'batchmean', 'sum' or 'mean'), got reduction='none'")
  lead = h_student.shape[:-1]
  n, vocab = math.prod(lead), w_student.shape[0]
  sel, kind = _select(mask, labels)
  cfg = _config(LINEAR_DISTILLATION_LOSS, implementation, n, vocab, beta=beta,
                temperature=temperature, student_softcap=student_logit_softcap,
                teacher_softcap=teacher_logit_softcap, chunk_size=chunk_size, select=kind,
                ignore_index=ignore_index)
  hs = h_student.reshape(n, h_student.shape[-1])
  ht = h_teacher.reshape(n, h_teacher.shape[-1])
  sel = None if sel is None else sel.reshape(n)
  with jax.named_scope(f"jaxfuse.linear_distillation_loss[{cfg.impl}]"):
    valid = _valid_of(mask, labels, ignore_index, lead).reshape(n)
    if grad_in_forward:
      # The divergences' sum, then the reduction's scalar factor (outside: its cotangent is
      # what the backward scales the kept gradients by).
      total = _distill_grad_in_forward(hs, w_student, student_bias, ht, w_teacher, teacher_bias,
                                       sel, cfg)
      loss = _reduce(total, valid, reduction, vocab, summed=True)
    else:
      per_token = _distill(hs, w_student, student_bias, ht, w_teacher, teacher_bias, sel, cfg)
      loss = _reduce(per_token, valid, reduction, vocab)
  return loss.reshape(lead) if reduction == "none" else loss


# Forward and backward -------------------------------------------------------------------------


def _valid(sel, cfg):
  """Which rows of a chunk count (None: all of them)."""
  if cfg.select == "labels":
    return sel != cfg.ignore_index
  return sel if cfg.select == "mask" else None


def _chunked_select(sel, cfg):
  if sel is None:
    return None
  return xla.chunked(sel, cfg, cfg.ignore_index if cfg.select == "labels" else False)


def _lse(z):
  m = lax.stop_gradient(jnp.max(z, axis=-1))
  return m + jnp.log(jnp.sum(jnp.exp(z - m[:, None]), axis=-1))


def _chunk_forward(hs, ws, bs, ht, wt, bt, sel, cfg):
  """One chunk's ``(student lse, teacher lse, divergence)`` per token (0 where masked)."""
  s = xla.chunk_logits(hs, ws, bs, cfg.student)
  t = xla.chunk_logits(ht, wt, bt, cfg.teacher)
  lse_s, lse_t = _lse(s), _lse(t)
  div = jnp.sum(_divergence_terms(s - lse_s[:, None], t - lse_t[:, None], cfg.beta), axis=-1)
  valid = _valid(sel, cfg)
  return lse_s, lse_t, div if valid is None else jnp.where(valid, div, 0.0)


def _forward(hs, ws, bs, ht, wt, bt, sel, cfg):
  ht, wt, bt = _opaque(ht, wt, bt)

  def chunk(xs):
    hc, tc, sc = xs
    return _chunk_forward(hc, ws, bs, tc, wt, bt, sc, cfg)

  outs = lax.map(chunk, (xla.chunked(hs, cfg), xla.chunked(ht, cfg), _chunked_select(sel, cfg)))
  n = hs.shape[0]
  return tuple(o.reshape(-1)[:n] for o in outs)


def _opaque(*teacher):
  """The teacher's arrays behind an optimization barrier: a teacher closed over by a jitted
  function is a constant, and XLA would otherwise evaluate its whole head while compiling
  (constant folding: minutes for a realistic head)."""
  return lax.optimization_barrier(teacher)


def _through_head(dz, z, head):
  """The gradient of the transformed logits ``z`` taken back to the raw ones: through the
  temperature's scale and the soft-cap's ``1 - tanh**2``."""
  if head.scale is not None:
    dz = dz * head.scale
  if head.softcap is not None:
    t = z * (1.0 / (head.softcap * (head.scale if head.scale is not None else 1.0)))
    dz = dz * (1.0 - t * t)
  return dz


def _student_logit_grad(s, t, lse_s, lse_t, g, cfg):
  """The student's raw logits' gradient of ``g * divergence`` per row."""
  logp_s, logp_t = s - lse_s[:, None], t - lse_t[:, None]
  p_s = jnp.exp(logp_s)
  beta = cfg.beta
  if beta == 0.0:   # d KL(t || s) / ds = p_s - p_t
    dz = p_s - jnp.exp(logp_t)
  else:             # d sum_v p_s q_v / ds with d q / d p_s folded in: p_s * (q - E_{p_s}[q])
    if beta == 1.0:
      q = logp_s - logp_t
    else:
      mixture = jnp.logaddexp(logp_s + math.log1p(-beta), logp_t + math.log(beta))
      q = (1.0 - beta) * (logp_s - mixture)
    dz = p_s * (q - jnp.sum(p_s * q, axis=-1, keepdims=True))
  return _through_head(dz * g[:, None], s, cfg.student)


def _student_grads(dz, hc, w_mm, dw, db, has_bias):
  """A chunk's student logit gradient ``dz`` into its ``dh``, added into ``dw`` and ``db``."""
  cd = jnp.float32
  dhc = jnp.dot(dz, w_mm, precision=xla.HIGHEST, preferred_element_type=cd)
  dw = dw + lax.dot_general(dz, hc.astype(cd), (((0,), (0,)), ((), ())),
                            precision=xla.HIGHEST, preferred_element_type=cd)
  if has_bias:
    db = db + jnp.sum(dz, axis=0)
  return dhc, dw, db


def _backward(hs, ws, bs, ht, wt, bt, sel, lse_s, lse_t, g, cfg):
  ht, wt, bt = _opaque(ht, wt, bt)
  n, d = hs.shape
  cd = jnp.float32
  w_mm = ws.astype(cd)

  def step(carry, xs):
    dw, db = carry
    hc, tc, sc, ls, lt, gc = xs
    valid = _valid(sc, cfg)
    if valid is not None:
      gc = jnp.where(valid, gc, 0.0)
    s = xla.chunk_logits(hc, ws, bs, cfg.student)
    t = xla.chunk_logits(tc, wt, bt, cfg.teacher)
    dz = _student_logit_grad(s, t, ls, lt, gc, cfg)
    dhc, dw, db = _student_grads(dz, hc, w_mm, dw, db, bs is not None)
    return (dw, db), dhc.astype(hs.dtype)

  xs = (xla.chunked(hs, cfg), xla.chunked(ht, cfg), _chunked_select(sel, cfg),
        xla.chunked(lse_s, cfg), xla.chunked(lse_t, cfg), xla.chunked(g.astype(cd), cfg))
  init = (jnp.zeros(ws.shape, cd), jnp.zeros((cfg.vocab,) if bs is not None else (), cd))
  init = partitioning.vary_like(init, hs, ws, bs, ht, wt, bt, lse_s, lse_t, g)
  (dw, db), dh = lax.scan(step, init, xs)
  dh = dh.reshape(-1, d)[:n]
  return dh, dw.astype(ws.dtype), None if bs is None else db.astype(bs.dtype)


# The custom VJP -------------------------------------------------------------------------------


@partitioning.matching_vma
@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _distill(hs, ws, bs, ht, wt, bt, sel, cfg):
  return _distill_fwd(hs, ws, bs, ht, wt, bt, sel, cfg)[0]


def _distill_fwd(hs, ws, bs, ht, wt, bt, sel, cfg):
  lse_s, lse_t, per_token = cfg.run("distill_forward", functools.partial(_forward, cfg=cfg),
                                    hs, ws, bs, ht, wt, bt, sel)
  lse_s = checkpoint_name(lse_s, names.DISTILL_STUDENT_LSE)
  lse_t = checkpoint_name(lse_t, names.DISTILL_TEACHER_LSE)
  # Residuals: the inputs, and per token the two logsumexps. Both heads' logits are recomputed
  # chunk by chunk.
  return per_token, (hs, ws, bs, ht, wt, bt, sel, lse_s, lse_t)


def _distill_bwd(cfg, residuals, g):
  hs, ws, bs, ht, wt, bt, sel, lse_s, lse_t = residuals
  dh, dw, db = cfg.run("distill_backward", functools.partial(_backward, cfg=cfg),
                       hs, ws, bs, ht, wt, bt, sel, lse_s, lse_t, g)
  # The teacher is a constant: no gradient reaches it (zeros), nor the selection.
  return dh, dw, db, None, None, None, None


# Plain defvjp: optimize_remat=True breaks reverse over reverse.
_distill.defvjp(_distill_fwd, _distill_bwd)


# Gradients in the forward -----------------------------------------------------------------------


def _forward_with_grads(hs, ws, bs, ht, wt, bt, sel, cfg):
  """The divergences' sum over the tokens that count and its gradients ``(dh, dw, db)`` for the
  student, each chunk's logits of both heads made once."""
  ht, wt, bt = _opaque(ht, wt, bt)
  n, d = hs.shape
  cd = jnp.float32
  w_mm = ws.astype(cd)

  def step(carry, xs):
    total, dw, db = carry
    hc, tc, sc = xs
    s = xla.chunk_logits(hc, ws, bs, cfg.student)
    t = xla.chunk_logits(tc, wt, bt, cfg.teacher)
    lse_s, lse_t = _lse(s), _lse(t)
    div = jnp.sum(_divergence_terms(s - lse_s[:, None], t - lse_t[:, None], cfg.beta), axis=-1)
    valid = _valid(sc, cfg)
    ones = jnp.ones_like(div) if valid is None else valid.astype(cd)
    div = div if valid is None else jnp.where(valid, div, 0.0)
    dz = _student_logit_grad(s, t, lse_s, lse_t, ones, cfg)
    dhc, dw, db = _student_grads(dz, hc, w_mm, dw, db, bs is not None)
    return (total + jnp.sum(div), dw, db), dhc.astype(hs.dtype)

  xs = (xla.chunked(hs, cfg), xla.chunked(ht, cfg), _chunked_select(sel, cfg))
  init = (jnp.zeros((), cd), jnp.zeros(ws.shape, cd),
          jnp.zeros((cfg.vocab,) if bs is not None else (), cd))
  init = partitioning.vary_like(init, hs, ws, bs, ht, wt, bt)
  (total, dw, db), dh = lax.scan(step, init, xs)
  dh = dh.reshape(-1, d)[:n]
  return total, (dh, dw.astype(ws.dtype), None if bs is None else db.astype(bs.dtype))


@partitioning.matching_vma
@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _distill_grad_in_forward(hs, ws, bs, ht, wt, bt, sel, cfg):
  return _forward_with_grads(hs, ws, bs, ht, wt, bt, sel, cfg)[0]


def _gif_fwd(hs, ws, bs, ht, wt, bt, sel, cfg):
  value = lambda x: None if x is None else x.value  # noqa: E731
  total, grads = cfg.run("distill_grad_in_forward",
                         functools.partial(_forward_with_grads, cfg=cfg),
                         *(value(x) for x in (hs, ws, bs, ht, wt, bt, sel)))
  # Residuals: the student's gradients of the differentiated inputs (a frozen head, as under
  # LoRA, keeps none and XLA drops its product); the backward scales them.
  return total, tuple(g if x is not None and x.perturbed else None
                      for g, x in zip(grads, (hs, ws, bs)))


def _gif_bwd(cfg, residuals, g):
  if isinstance(g, SymbolicZero):
    return (None,) * 7
  scale = lambda x: None if x is None else (x * g).astype(x.dtype)  # noqa: E731
  # The teacher is a constant: no gradient reaches it, nor the selection.
  return (*(scale(x) for x in residuals), None, None, None, None)


# Plain defvjp (optimize_remat=True breaks reverse over reverse), with symbolic zeros.
_distill_grad_in_forward.defvjp(_gif_fwd, _gif_bwd, symbolic_zeros=True)


# Top-k distillation ---------------------------------------------------------------------------


def _teacher_topk(teacher, valid):
  """The teacher renormalised over its k words, ``(q, log q)`` (a masked row's entries are
  replaced by zeros, so that no NaN of theirs reaches a gradient)."""
  teacher = lax.stop_gradient(jnp.where(valid[..., None], teacher.astype(jnp.float32), 0.0))
  log_q = jax.nn.log_softmax(teacher, axis=-1)
  return jnp.exp(log_q), log_q


def _topk_kl(q, log_q, student):
  """``sum_k q_k (log q_k - student_k)`` per row; words with ``q = 0`` (``-inf``) count 0."""
  return jnp.sum(jnp.where(q > 0, q * (log_q - student), 0.0), axis=-1)


def topk_distillation_loss(student_topk_logps: jax.Array, teacher_topk_logps: jax.Array,
                           mask: jax.Array | None = None, *, labels: jax.Array | None = None,
                           ignore_index: int = -100, reduction: str = "batchmean") -> jax.Array:
  """The forward KL from a teacher's stored top-k log-probabilities, renormalised over its k
  words, to the student's log-probabilities at those words.

  Per token, with ``q = softmax(teacher_topk_logps)`` over the k (the teacher restricted to its
  top k and renormalised: the mass it put elsewhere is not stored, and renormalising keeps
  ``q`` a distribution) and ``log p`` the student's log-probabilities at the same ids from its
  *full* softmax over the vocabulary (not renormalised: the student is pulled towards the
  teacher's top k, and loses by putting mass elsewhere): ``sum_k q_k (log q_k - log p_k)``,
  the cross-entropy against ``q`` minus ``q``'s entropy, so 0 exactly when the student's
  distribution is ``q`` on those words and 0 elsewhere. Entries of ``-inf`` (fewer than k words
  stored) count as absent. For a temperature ``T``, pass the student's log-probabilities at
  ``T`` and the teacher's divided by ``T``: renormalised, they are the teacher's tempered
  distribution restricted to its top k. The teacher gets no gradient.

  Args:
    student_topk_logps: ``[..., k]`` the student's log-probabilities at the teacher's ids.
    teacher_topk_logps: ``[..., k]`` the teacher's log-probabilities (any offset: they are
      renormalised), the student's shape.
    mask, labels, ignore_index: which tokens count, as :func:`linear_distillation_loss` takes
      them (of the shape ``student_topk_logps.shape[:-1]``).
    reduction: as :func:`linear_distillation_loss`'s, with ``"mean"`` over ``tokens * k``.

  Returns:
    The float32 loss: a scalar, or ``student_topk_logps.shape[:-1]`` for ``"none"``.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxfuse.ops import topk_distillation_loss
    >>> teacher = jnp.log(jnp.array([[0.5, 0.3], [0.6, 0.2]]))   # renormalised: 5/8, 3/8, ...
    >>> student = jnp.log(jnp.array([[5 / 8, 3 / 8], [3 / 4, 1 / 4]]))   # the same: no loss
    >>> round(float(topk_distillation_loss(student, teacher)), 6)
    0.0
  """
  student_topk_logps = checks.as_array(student_topk_logps)
  teacher_topk_logps = checks.as_array(teacher_topk_logps)
  mask = None if mask is None else checks.as_array(mask)
  labels = None if labels is None else checks.as_array(labels)
  op = _TOPK
  checks.floating(op, "student_topk_logps", student_topk_logps)
  checks.floating(op, "teacher_topk_logps", teacher_topk_logps)
  if student_topk_logps.ndim < 1 or student_topk_logps.shape[-1] < 1:
    raise ValueError(f"{op}: student_topk_logps must have shape [..., k] with k >= 1, got "
                     f"shape {tuple(student_topk_logps.shape)}")
  checks.same_shape(op, ("student_topk_logps", "teacher_topk_logps"),
                    (student_topk_logps, teacher_topk_logps))
  lead = student_topk_logps.shape[:-1]
  _check_mask(op, mask, labels, lead)
  if reduction not in REDUCTIONS:
    raise ValueError(f"{op}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
  with jax.named_scope(f"jaxfuse.{op}"):
    valid = _valid_of(mask, labels, ignore_index, lead)
    q, log_q = _teacher_topk(teacher_topk_logps, valid)
    per_token = _topk_kl(q, log_q, student_topk_logps.astype(jnp.float32))
    per_token = jnp.where(valid, per_token, 0.0)
    return _reduce(per_token, valid, reduction, student_topk_logps.shape[-1])


def linear_topk_distillation_loss(h_student: jax.Array, w_student: jax.Array,
                                  teacher_topk_ids: jax.Array, teacher_topk_logps: jax.Array,
                                  mask: jax.Array | None = None, *,
                                  labels: jax.Array | None = None, ignore_index: int = -100,
                                  temperature: float = 1.0,
                                  student_bias: jax.Array | None = None,
                                  student_logit_softcap: float | None = None,
                                  reduction: str = "batchmean",
                                  chunk_size: int | None = None) -> jax.Array:
  """:func:`topk_distillation_loss` on the student's LM head: its log-probabilities at the
  teacher's top-k ids computed one chunk of logits at a time, never ``[tokens, V]``.

  Each chunk makes its student logits, reduces them to the logsumexp and the k logits at the
  ids, and with the teacher's renormalised log-probabilities to the token's KL; the backward
  keeps the inputs and the logsumexp (4 bytes a token, ``distill.student_lse``) and recomputes
  each chunk's logits, whose gradient is ``g * (p - scatter(q at ids))``. The temperature
  divides the student's logits (after the soft-cap) and the teacher's stored log-probabilities
  (before the renormalisation over the k). XLA only; the teacher gets no gradient.

  Args:
    h_student: hidden states ``[..., D]``; w_student: ``[V, D]``, h_student's dtype.
    teacher_topk_ids: integer ``[..., k]``: the teacher's top-k word ids, in ``[0, V)`` at the
      tokens that count (concrete ones are checked; traced ones out of range give NaN).
    teacher_topk_logps: ``[..., k]`` floating: the teacher's log-probabilities at those ids, at
      temperature 1, as stored.
    mask, labels, ignore_index, reduction: as :func:`topk_distillation_loss` takes them.
    temperature: > 0; student_bias: optional ``[V]``; student_logit_softcap: optional cap.
    chunk_size: tokens per chunk (default: about ``2**25 / V``).

  Returns:
    The float32 loss; its gradient reaches ``h_student``, ``w_student`` and ``student_bias``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxfuse.ops import linear_topk_distillation_loss
    >>> h, w = jax.random.normal(jax.random.key(0), (6, 16)), jnp.zeros((100, 16))
    >>> ids = jnp.broadcast_to(jnp.arange(4), (6, 4))
    >>> teacher = jnp.log(jnp.full((6, 4), 0.25))
    >>> float(linear_topk_distillation_loss(h, w, ids, teacher))   # log(100 / 4): uniform
    3.218...
  """
  teacher_topk_ids = checks.as_array(teacher_topk_ids)
  teacher_topk_logps = checks.as_array(teacher_topk_logps)
  mask = None if mask is None else checks.as_array(mask)
  labels = None if labels is None else checks.as_array(labels)
  op = _LINEAR_TOPK.name
  _check_head(op, "student", h_student, w_student, student_bias, student_logit_softcap)
  lead = h_student.shape[:-1]
  if not jnp.issubdtype(teacher_topk_ids.dtype, jnp.integer):
    raise TypeError(f"{op}: teacher_topk_ids must have an integer dtype, got "
                    f"{jnp.dtype(teacher_topk_ids.dtype).name}")
  if (teacher_topk_ids.ndim != len(lead) + 1 or tuple(teacher_topk_ids.shape[:-1]) != lead
      or teacher_topk_ids.shape[-1] < 1):
    raise ValueError(f"{op}: teacher_topk_ids must have shape h_student.shape[:-1] + (k,) = "
                     f"{tuple(lead)} + (k,) with k >= 1, got shape "
                     f"{tuple(teacher_topk_ids.shape)}")
  checks.floating(op, "teacher_topk_logps", teacher_topk_logps)
  if tuple(teacher_topk_logps.shape) != tuple(teacher_topk_ids.shape):
    raise ValueError(f"{op}: teacher_topk_logps must have teacher_topk_ids' shape "
                     f"{tuple(teacher_topk_ids.shape)}, got shape "
                     f"{tuple(teacher_topk_logps.shape)}")
  _check_mask(op, mask, labels, lead)
  _check_options(op, temperature, reduction, chunk_size)
  n, vocab, k = math.prod(lead), w_student.shape[0], teacher_topk_ids.shape[-1]
  sel, kind = _select(mask, labels)
  valid = _valid_of(mask, labels, ignore_index, lead)
  _check_ids(op, teacher_topk_ids, valid, vocab)
  cfg = _config(_LINEAR_TOPK, "xla", n, vocab, beta=0.0, temperature=temperature,
                student_softcap=student_logit_softcap, teacher_softcap=None,
                chunk_size=chunk_size, select=kind, ignore_index=ignore_index, heads=1)
  h2 = h_student.reshape(n, h_student.shape[-1])
  ids, teacher = teacher_topk_ids.reshape(n, k).astype(jnp.int32), teacher_topk_logps.reshape(n, k)
  sel = None if sel is None else sel.reshape(n)
  with jax.named_scope(f"jaxfuse.{op}"):
    per_token = _linear_topk(h2, w_student, student_bias, ids, teacher, sel, cfg)
    loss = _reduce(per_token, valid.reshape(n), reduction, k)
  return loss.reshape(lead) if reduction == "none" else loss


def _check_ids(op, ids, valid, vocab):
  """Concrete ids of the tokens that count are checked; traced ones cannot be (NaN)."""
  try:
    values, counted = np.asarray(ids), np.asarray(valid)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return
  bad = counted[..., None] & ((values < 0) | (values >= vocab))
  if bad.any():
    raise ValueError(f"{op}: teacher_topk_ids must be in [0, {vocab}) (V = w_student.shape[0]) "
                     f"at the tokens that count; got {int(bad.sum())} out of range, e.g. "
                     f"{int(values[bad].flat[0])}")


def _topk_chunk(hc, weight, bias, ids, teacher, sc, cfg):
  """One chunk's student logits, the ids (in range, or 0) with a NaN factor for those out of
  range at the rows that count, the teacher's ``(q, log q)`` and which rows count."""
  z = xla.chunk_logits(hc, weight, bias, cfg.student)
  valid = _valid(sc, cfg)
  valid = jnp.ones(ids.shape[:1], bool) if valid is None else valid
  in_range = (ids >= 0) & (ids < cfg.vocab)
  bad = jnp.where(valid & ~jnp.all(in_range, axis=-1), jnp.nan, 0.0)
  if cfg.scale is not None:
    teacher = teacher * cfg.scale
  q, log_q = _teacher_topk(teacher, valid)
  return z, jnp.where(in_range, ids, 0), bad, q, log_q, valid


def _linear_topk_forward(h, weight, bias, ids, teacher, sel, cfg):
  def chunk(xs):
    hc, ic, tc, sc = xs
    z, ic, bad, q, log_q, valid = _topk_chunk(hc, weight, bias, ic, tc, sc, cfg)
    lse = _lse(z)
    logp = jnp.take_along_axis(z, ic, axis=1) - lse[:, None]
    return lse, jnp.where(valid, _topk_kl(q, log_q, logp) + bad, 0.0)

  outs = lax.map(chunk, (xla.chunked(h, cfg), xla.chunked(ids, cfg), xla.chunked(teacher, cfg),
                         _chunked_select(sel, cfg)))
  n = h.shape[0]
  return tuple(o.reshape(-1)[:n] for o in outs)


def _linear_topk_backward(h, weight, bias, ids, teacher, sel, lse, g, cfg):
  n, d = h.shape
  cd = jnp.float32
  w_mm = weight.astype(cd)

  def step(carry, xs):
    dw, db = carry
    hc, ic, tc, sc, lc, gc = xs
    z, ic, bad, q, _, valid = _topk_chunk(hc, weight, bias, ic, tc, sc, cfg)
    gc = jnp.where(valid, gc, 0.0) + bad
    # d/dz of sum_k q_k (log q_k - z_k + lse) = p * sum_k q_k - scatter(q at ids).
    rows = lax.broadcasted_iota(jnp.int32, ic.shape, 0)
    dz = jnp.exp(z - lc[:, None]) * jnp.sum(q, axis=-1, keepdims=True)
    dz = dz.at[rows, ic].add(-q) * gc[:, None]
    dz = _through_head(dz, z, cfg.student)
    dhc = jnp.dot(dz, w_mm, precision=xla.HIGHEST, preferred_element_type=cd)
    dw = dw + lax.dot_general(dz, hc.astype(cd), (((0,), (0,)), ((), ())),
                              precision=xla.HIGHEST, preferred_element_type=cd)
    if bias is not None:
      db = db + jnp.sum(dz, axis=0)
    return (dw, db), dhc.astype(h.dtype)

  xs = (xla.chunked(h, cfg), xla.chunked(ids, cfg), xla.chunked(teacher, cfg),
        _chunked_select(sel, cfg), xla.chunked(lse, cfg), xla.chunked(g.astype(cd), cfg))
  init = (jnp.zeros(weight.shape, cd), jnp.zeros((cfg.vocab,) if bias is not None else (), cd))
  init = partitioning.vary_like(init, h, weight, bias, teacher, lse, g)
  (dw, db), dh = lax.scan(step, init, xs)
  dh = dh.reshape(-1, d)[:n]
  return dh, dw.astype(weight.dtype), None if bias is None else db.astype(bias.dtype)


@partitioning.matching_vma
@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _linear_topk(h, weight, bias, ids, teacher, sel, cfg):
  return _linear_topk_fwd(h, weight, bias, ids, teacher, sel, cfg)[0]


def _linear_topk_fwd(h, weight, bias, ids, teacher, sel, cfg):
  lse, per_token = _linear_topk_forward(h, weight, bias, ids, teacher, sel, cfg)
  lse = checkpoint_name(lse, names.DISTILL_STUDENT_LSE)
  # Residuals: the inputs and the student's logsumexp per token; logits are recomputed, and so
  # is the teacher's renormalisation.
  return per_token, (h, weight, bias, ids, teacher, sel, lse)


def _linear_topk_bwd(cfg, residuals, g):
  h, weight, bias, ids, teacher, sel, lse = residuals
  dh, dw, db = _linear_topk_backward(h, weight, bias, ids, teacher, sel, lse, g, cfg)
  # The teacher's log-probabilities are constants: no gradient.
  return dh, dw, db, None, None, None


# Plain defvjp: optimize_remat=True breaks reverse over reverse.
_linear_topk.defvjp(_linear_topk_fwd, _linear_topk_bwd)
