"""Fused linear cross-entropy: the language-model loss without the [tokens, vocab] logits.

``linear_cross_entropy(h, weight, labels)`` is ``cross_entropy(h @ weight.T + bias, labels)``
computed chunk by chunk over the tokens, so that at most one chunk of logits (``chunk_size x V``)
exists at any time, in the forward and in the backward:

- forward: each chunk's logits are made, reduced to a logsumexp, the target logit, the sum of
  the logits (for label smoothing) and the argmax (for accuracy), and dropped. The Pallas and
  Triton kernels never write logits at all: they walk the vocabulary in tiles with an online
  logsumexp.
- backward (the default, ``grad_in_forward=False``): the backward keeps only the inputs and the
  per-token logsumexp (4 bytes a token). It recomputes each chunk's logits from ``h`` and
  ``weight``, turns them into the chunk's logit gradient and multiplies that into ``dh`` and
  ``dweight``: four matmuls in all instead of three.
- ``grad_in_forward=True`` (as Liger-Kernel does): the forward computes ``dh``, ``dweight`` and
  ``dbias`` along with the loss, three matmuls in all, and the backward only scales them by the
  incoming cotangent. The backward then keeps those gradients alive: ``h``'s and ``weight``'s
  size instead of a few bytes a token. It needs a scalar loss (``reduction="mean"`` or
  ``"sum"``), and the returned logsumexp carries no gradient in this mode.

Derivatives: reverse mode to any order. ``jax.grad`` of a function of ``jax.grad`` and
Hessian-vector products by forward over reverse (``jax.jvp(jax.grad(f), ...)``) differentiate
the backward pass, whose kernels take the derivative of their XLA twins
(:func:`jaxfuse.ops.base.kernel_call`); with ``grad_in_forward=True`` they differentiate the
forward pass that computed the gradients. Second-order gradients recompute the logits in XLA
and keep every chunk's intermediates for their own backward (several times the full logits):
they are for small problems and checks, not for the memory savings above. Forward mode on the
op itself (``jax.jvp(linear_cross_entropy, ...)``) is not supported: the op is a
``jax.custom_vjp`` function, for which JAX raises a TypeError.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax import lax

from jaxfuse.ops import base, checks, partitioning
from jaxfuse.ops.cross_entropy import sharded, xla
from jaxfuse.ops.cross_entropy.xla import linear_cross_entropy_reference, linear_logits

LINEAR_CROSS_ENTROPY = base.Op("linear_cross_entropy", "cross_entropy")

_REDUCTIONS = ("mean", "sum", "none")
# Elements of logits per chunk when chunk_size is None (the chunk's logits take 4x this in
# bytes): large enough that the chunk's matmuls run at full speed, small enough to stay near
# the caches. Measured on CPU with the xent benchmark.
_CHUNK_ELEMENTS = 1 << 25
_MIN_CHUNK, _MAX_CHUNK = 8, 4096

__all__ = ["LINEAR_CROSS_ENTROPY", "linear_cross_entropy", "linear_cross_entropy_reference",
           "linear_logits"]


# Checks and config ----------------------------------------------------------------------------


def check_head(op: str, h, weight, labels, bias, logit_softcap, chunk_size,
               labels_name: str = "labels") -> None:
  """The checks every op on the LM head shares, naming ``op`` and the argument."""
  checks.floating(op, "h", h)
  checks.floating(op, "weight", weight)
  checks.rank(op, "weight", weight, 2)
  if h.ndim < 1:
    raise ValueError(f"{op}: h must have rank >= 1 ([..., D]), got shape {tuple(h.shape)}")
  checks.same_dtype(op, ("h", "weight"), (h, weight))
  checks.dim(op, "weight", weight, 1, h.shape[-1], "h's last axis, D")
  if weight.shape[0] < 1:
    raise ValueError(f"{op}: the vocabulary (weight.shape[0], V) must be at least 1, got weight "
                     f"of shape {tuple(weight.shape)}")
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise TypeError(f"{op}: {labels_name} must have an integer dtype, got "
                    f"{jnp.dtype(labels.dtype).name}")
  if tuple(labels.shape) != tuple(h.shape[:-1]):
    raise ValueError(f"{op}: {labels_name} must have shape h.shape[:-1] = "
                     f"{tuple(h.shape[:-1])}, got shape {tuple(labels.shape)}")
  vocab = weight.shape[0]
  if bias is not None:
    checks.floating(op, "bias", bias)
    checks.same_dtype(op, ("h", "bias"), (h, bias))
    if tuple(bias.shape) != (vocab,):
      raise ValueError(f"{op}: bias must have shape (V,) = ({vocab},), got shape "
                       f"{tuple(bias.shape)}")
  if logit_softcap is not None and not float(logit_softcap) > 0.0:
    raise ValueError(f"{op}: logit_softcap must be None or > 0, got {logit_softcap!r}")
  if chunk_size is not None and (not isinstance(chunk_size, (int, np.integer))
                                 or isinstance(chunk_size, bool) or chunk_size < 1):
    raise ValueError(f"{op}: chunk_size must be None or a positive int, got {chunk_size!r}")


def _check(h, weight, labels, bias, reduction, label_smoothing, z_loss, logit_softcap,
           chunk_size):
  op = LINEAR_CROSS_ENTROPY.name
  check_head(op, h, weight, labels, bias, logit_softcap, chunk_size)
  if reduction not in _REDUCTIONS:
    raise ValueError(f"{op}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
  if not 0.0 <= float(label_smoothing) <= 1.0:
    raise ValueError(f"{op}: label_smoothing must be in [0, 1], got {label_smoothing!r}")
  if float(z_loss) < 0.0:
    raise ValueError(f"{op}: z_loss must be >= 0, got {z_loss!r}")


def check_label_range(labels, vocab, ignore_index, op: str = LINEAR_CROSS_ENTROPY.name,
                      labels_name: str = "labels"):
  """Concrete labels are checked; traced ones cannot be (their loss is NaN, see the docs)."""
  try:
    values = np.asarray(labels)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return
  bad = (values != ignore_index) & ((values < 0) | (values >= vocab))
  if bad.any():
    first = values[bad].flat[0]
    raise ValueError(f"{op}: {labels_name} must be in [0, {vocab}) "
                     f"(V = weight.shape[0]) or ignore_index={ignore_index}; got "
                     f"{int(bad.sum())} out of range, e.g. {int(first)}")


@dataclasses.dataclass(frozen=True)
class _Config(base.Config):
  """Static settings shared by the forward and the backward."""

  vocab: int
  ignore_index: int
  label_smoothing: float
  z_loss: float
  softcap: float | None
  chunk: int         # tokens per chunk of logits
  accuracy: bool     # the argmax is needed
  has_bias: bool
  scale: float | None = None   # the soft-capped logits times this (an inverse temperature)
  entropy: bool = False        # the third statistic is sum(p * z), not sum(z)


def _config(n, vocab, *, ignore_index, label_smoothing, z_loss, logit_softcap, chunk_size,
            grad_in_forward, reduction, return_accuracy, has_bias, implementation) -> _Config:
  op = LINEAR_CROSS_ENTROPY
  if grad_in_forward and reduction == "none":
    raise ValueError(f"{op.name}: grad_in_forward=True needs a scalar loss (reduction 'mean' "
                     f"or 'sum'), got reduction='none'")
  return op.config(implementation, _Config, facts={"grad_in_forward": bool(grad_in_forward)},
                   vocab=vocab, ignore_index=int(ignore_index),
                   label_smoothing=float(label_smoothing), z_loss=float(z_loss),
                   softcap=None if logit_softcap is None else float(logit_softcap),
                   chunk=chunk_tokens(n, vocab, chunk_size), accuracy=bool(return_accuracy),
                   has_bias=has_bias)


def chunk_tokens(n: int, vocab: int, chunk_size: int | None) -> int:
  """Tokens per chunk of logits: ``chunk_size``, or about ``2**25 / vocab`` (at least 8) split
  evenly over the ``n`` tokens, a multiple of 8 so that little padding is needed."""
  if chunk_size is None:
    target = max(_MIN_CHUNK, min(_MAX_CHUNK, _CHUNK_ELEMENTS // vocab))
    count = -(-n // target)
    chunk_size = -(-(-(-n // max(count, 1))) // 8) * 8
  return int(max(1, min(chunk_size, n)))


# The op ---------------------------------------------------------------------------------------


def linear_cross_entropy(h: jax.Array, weight: jax.Array, labels: jax.Array, *,
                         bias: jax.Array | None = None, ignore_index: int = -100,
                         reduction: str = "mean", label_smoothing: float = 0.0,
                         z_loss: float = 0.0, logit_softcap: float | None = None,
                         chunk_size: int | None = None, grad_in_forward: bool = False,
                         return_lse: bool = False, return_accuracy: bool = False,
                         implementation: str | None = None):
  """Cross-entropy of ``h @ weight.T + bias`` against ``labels``, one chunk of logits at a time.

  Matches ``torch.nn.functional.cross_entropy(h @ weight.T + bias, labels, ignore_index=...,
  label_smoothing=..., reduction=...)``, with two additions: ``z_loss * logsumexp**2`` per token
  (reduced like the loss) and logit soft-capping ``cap * tanh(logits / cap)`` before the softmax.

  Args:
    h: hidden states ``[..., D]``, float32, bfloat16 or float16.
    weight: the output embedding ``[V, D]`` (the tied-embedding layout), h's dtype; ``V >= 1``.
    labels: integer targets of shape ``h.shape[:-1]``, in ``[0, V)`` or ``ignore_index``.
    bias: optional ``[V]`` bias, h's dtype.
    ignore_index: label value that contributes no loss and no gradient.
    reduction: ``"mean"`` over the labels that are not ignored (NaN when all are ignored, as
      in torch, with zero gradients), ``"sum"``, or ``"none"`` (per-token losses, zero where
      ignored).
    label_smoothing: torch's: ``(1 - eps) * nll + eps * mean_v(-log_softmax)``.
    z_loss: coefficient of ``logsumexp(logits)**2`` added to each token's loss.
    logit_softcap: if set, logits become ``cap * tanh(logits / cap)`` before the softmax.
    chunk_size: tokens per chunk (default: about 2**25 / V, at least 8, split evenly over the
      tokens). Memory for logits is ``chunk_size * V`` floats.
    grad_in_forward: compute the gradients in the forward pass (3 matmuls instead of 4; the
      backward keeps ``dh``, ``dweight``, ``dbias``). Needs ``reduction`` ``"mean"``/``"sum"``
      and ``implementation="xla"``; the logsumexp it returns carries no gradient.
    return_lse: also return the per-token logsumexp (float32, shape ``labels.shape``).
    return_accuracy: also return the argmax accuracy, reduced like the loss over the labels
      that are not ignored (``"none"``: 1.0 where the argmax is the label, else 0.0).
    implementation: ``None`` (the fastest here), ``"pallas"``, ``"triton"`` or ``"xla"``.

  Returns:
    The loss in float32 (a scalar, or ``labels.shape`` for ``"none"``). With ``return_lse`` or
    ``return_accuracy``: ``(loss, aux)`` where ``aux`` is a dict with keys ``"lse"`` and/or
    ``"accuracy"``. A NaN loss from out-of-range labels (see Raises) comes with NaN gradients.

  Raises:
    ValueError: bad shapes (an empty vocabulary, ``weight.shape[0] == 0``, included), options,
      or (for concrete labels) labels outside ``[0, V)`` that are not ``ignore_index``. Under
      ``jit`` labels cannot be checked: a token whose label is out of range gets a NaN loss
      (so a ``"mean"`` or ``"sum"`` loss is NaN) and a NaN logit gradient, so ``dh`` is NaN
      on its row and ``dweight`` and ``dbias`` are NaN, in every implementation and mode.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxfuse.ops import linear_cross_entropy
    >>> h = jax.random.normal(jax.random.key(0), (2, 8, 16))
    >>> w = jax.random.normal(jax.random.key(1), (1000, 16)) * 0.1
    >>> y = jax.random.randint(jax.random.key(2), (2, 8), 0, 1000)
    >>> loss, grads = jax.value_and_grad(linear_cross_entropy, argnums=(0, 1))(h, w, y)
    >>> loss.shape, grads[1].shape
    ((), (1000, 16))
  """
  labels = checks.as_array(labels)
  _check(h, weight, labels, bias, reduction, label_smoothing, z_loss, logit_softcap, chunk_size)
  n, vocab = math.prod(labels.shape), weight.shape[0]
  cfg = _config(n, vocab, ignore_index=ignore_index, label_smoothing=label_smoothing,
                z_loss=z_loss, logit_softcap=logit_softcap, chunk_size=chunk_size,
                grad_in_forward=grad_in_forward, reduction=reduction,
                return_accuracy=return_accuracy, has_bias=bias is not None,
                implementation=implementation)
  check_label_range(labels, vocab, ignore_index)
  h2, labels1 = h.reshape(n, h.shape[-1]), labels.reshape(n).astype(jnp.int32)
  valid = labels1 != ignore_index
  with jax.named_scope(f"jaxfuse.linear_cross_entropy[{cfg.impl}]"):
    if grad_in_forward:
      count = jnp.sum(valid).astype(jnp.float32)
      weights = valid.astype(jnp.float32)
      if reduction == "mean":
        weights = jnp.where(count > 0, weights / jnp.maximum(count, 1.0), 0.0)
      total, lse, correct, bad = _lce_grad_in_forward(h2, weight, bias, labels1, weights, cfg)
      empty = (count == 0) if reduction == "mean" else False
      loss = jnp.where(bad | empty, jnp.nan, total)
    else:
      per_token, lse, correct = _lce(h2, weight, bias, labels1, cfg)
      loss = xla.reduce(per_token, valid, reduction)
  lead = labels.shape
  if reduction == "none":
    loss = loss.reshape(lead)
  if not (return_lse or return_accuracy):
    return loss
  aux = {}
  if return_lse:
    aux["lse"] = lse.reshape(lead)
  if return_accuracy:
    hits = jnp.where(valid, correct, 0.0)
    shape = lead if reduction == "none" else ()
    aux["accuracy"] = xla.reduce(hits, valid, reduction).reshape(shape)
  return loss, aux


# Forward and backward (each on one device's share: see sharded.py) ----------------------------


def token_stats(h, weight, bias, labels, cfg):
  """``(lse, target, sum, argmax)`` per token (float32, and int32 for the argmax)."""
  twin = functools.partial(xla.stats, cfg=cfg, every=cfg.on_kernels)
  kernel = functools.partial(sharded.stats_shard, cfg=cfg)
  return base.kernel_call(kernel, twin, h, weight, bias, labels, rule=sharded.rule(cfg, "stats"))


def head_backward(h, weight, bias, labels, lse, a, b, c, cfg):
  """Recomputes each chunk's logits, forms its logit gradient and multiplies it out."""
  kernel = functools.partial(sharded.backward_shard, cfg=cfg)
  twin = functools.partial(sharded.backward_shard, cfg=cfg, axes={"v": ()})
  return base.kernel_call(kernel, twin, h, weight, bias, labels, lse, a, b, c,
                          rule=sharded.rule(cfg, "backward"))


# The custom VJP -------------------------------------------------------------------------------


@partitioning.matching_vma
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _lce(h, weight, bias, labels, cfg):
  return _lce_fwd(h, weight, bias, labels, cfg)[0]


def _lce_fwd(h, weight, bias, labels, cfg):
  lse, target, sumz, amax = token_stats(h, weight, bias, labels, cfg)
  loss, correct = xla.per_token(labels, lse, target, sumz, amax, cfg)
  # Residuals: the inputs and 4 bytes a token. Logits are recomputed chunk by chunk.
  return (loss, lse, correct), (h, weight, bias, labels, lse)


def _lce_bwd(cfg, residuals, cotangents):
  h, weight, bias, labels, lse = residuals
  g_loss, g_lse, _ = cotangents
  a, b, c = xla.token_coefficients(labels, lse, g_loss, g_lse, cfg)
  dh, dw, db = head_backward(h, weight, bias, labels, lse, a, b, c, cfg)
  return dh, dw, db, None


# Plain defvjp: optimize_remat=True breaks reverse over reverse.
_lce.defvjp(_lce_fwd, _lce_bwd)


# Gradients in the forward (Liger-Kernel's way) ------------------------------------------------


@partitioning.matching_vma
@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _lce_grad_in_forward(h, weight, bias, labels, weights, cfg):
  return _gif_outputs(h, weight, bias, labels, weights, cfg)[0]


def _gif_outputs(h, weight, bias, labels, weights, cfg):
  kernel = functools.partial(sharded.grad_in_forward_shard, cfg=cfg)
  twin = functools.partial(sharded.grad_in_forward_shard, cfg=cfg, axes={"v": ()})
  total, lse, correct, bad, dh, dw, db = base.kernel_call(
      kernel, twin, h, weight, bias, labels, weights, rule=sharded.rule(cfg, "grad_in_forward"))
  return (total, lax.stop_gradient(lse), correct, bad > 0), (dh, dw, db)


def _gif_fwd(h, weight, bias, labels, weights, cfg):
  # With symbolic zeros, each input says whether it is differentiated: a frozen weight (a LoRA
  # run's head, say) keeps no gradient alive, and XLA drops its computation.
  value = lambda x: None if x is None else x.value  # noqa: E731
  out, grads = _gif_outputs(value(h), value(weight), value(bias), value(labels),
                            value(weights), cfg)
  # Residuals: the gradients themselves (h's, weight's and bias's size) of the differentiated
  # inputs; the backward scales them.
  return out, tuple(g if x is not None and x.perturbed else None
                    for g, x in zip(grads, (h, weight, bias)))


def _gif_bwd(cfg, residuals, cotangents):
  g = cotangents[0]
  if isinstance(g, SymbolicZero):
    return None, None, None, None, None
  scale = lambda x: None if x is None else (x * g).astype(x.dtype)  # noqa: E731
  return (*(scale(x) for x in residuals), None, None)


# Plain defvjp (optimize_remat=True breaks reverse over reverse), with symbolic zeros.
_lce_grad_in_forward.defvjp(_gif_fwd, _gif_bwd, symbolic_zeros=True)
