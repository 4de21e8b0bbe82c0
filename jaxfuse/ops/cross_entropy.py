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
from jax import lax

from jaxfuse.ops import activations, base, checks, partitioning

LINEAR_CROSS_ENTROPY = base.Op("linear_cross_entropy", ("pallas", "triton", "xla"))

_REDUCTIONS = ("mean", "sum", "none")
_HIGHEST = lax.Precision.HIGHEST
# Elements of logits per chunk when chunk_size is None (the chunk's logits take 4x this in
# bytes): large enough that the chunk's matmuls run at full speed, small enough to stay near
# the caches. Measured on CPU with the xent benchmark.
_CHUNK_ELEMENTS = 1 << 25
_MIN_CHUNK, _MAX_CHUNK = 8, 4096


# Reference: full logits ------------------------------------------------------------------------


def linear_logits(h: jax.Array, weight: jax.Array, bias: jax.Array | None = None) -> jax.Array:
  """Float32 logits ``h @ weight.T + bias`` (weight ``[V, D]``), materialized: the LM heads'
  eval path, for a few positions (the loss never builds them).

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxfuse.ops import linear_logits
    >>> linear_logits(jnp.ones((2, 4)), jnp.eye(3, 4)).shape
    (2, 3)
  """
  out = jnp.einsum("...d,vd->...v", h, weight, preferred_element_type=jnp.float32,
                   precision=_HIGHEST)
  return out if bias is None else out + bias.astype(jnp.float32)


def linear_cross_entropy_reference(h, weight, labels, *, bias=None, ignore_index=-100,
                                   reduction="mean", label_smoothing=0.0, z_loss=0.0,
                                   logit_softcap=None):
  """Plain-jnp ``cross_entropy(h @ weight.T + bias, labels)`` with the full logits.

  The same semantics as :func:`linear_cross_entropy` (float32 result, torch's ignore_index,
  label smoothing and mean), for tests and as the unfused baseline.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxfuse.ops import linear_cross_entropy_reference
    >>> h, w = jnp.ones((2, 4)), jnp.eye(3, 4)
    >>> float(linear_cross_entropy_reference(h, w, jnp.array([0, 1])))  # doctest: +ELLIPSIS
    1.098...
  """
  cd = base.compute_dtype(h.dtype)
  logits = lax.dot_general(h, weight, (((h.ndim - 1,), (1,)), ((), ())), precision=_HIGHEST,
                           preferred_element_type=cd)
  if bias is not None:
    logits = logits + bias.astype(cd)
  if logit_softcap is not None:
    logits = logit_softcap * activations.tanh(logits / logit_softcap)
  lse = jax.nn.logsumexp(logits, axis=-1)
  valid = labels != ignore_index
  safe = jnp.where(valid, labels, 0)
  target = jnp.take_along_axis(logits, safe[..., None], axis=-1)[..., 0]
  loss = lse - (1.0 - label_smoothing) * target
  if label_smoothing:
    loss = loss - label_smoothing * jnp.mean(logits, axis=-1)
  if z_loss:
    loss = loss + z_loss * lse * lse
  loss = jnp.where(valid, loss, 0.0)
  return _reduce(loss, valid, reduction)


def _reduce(per_token, valid, reduction):
  if reduction == "none":
    return per_token
  total = jnp.sum(per_token)
  if reduction == "sum":
    return total
  return total / jnp.sum(valid).astype(total.dtype)


# Checks and config -----------------------------------------------------------------------------


def _check(h, weight, labels, bias, reduction, label_smoothing, z_loss, logit_softcap,
           chunk_size):
  op = LINEAR_CROSS_ENTROPY.name
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
    raise TypeError(f"{op}: labels must have an integer dtype, got {jnp.dtype(labels.dtype).name}")
  if tuple(labels.shape) != tuple(h.shape[:-1]):
    raise ValueError(f"{op}: labels must have shape h.shape[:-1] = {tuple(h.shape[:-1])}, got "
                     f"shape {tuple(labels.shape)}")
  vocab = weight.shape[0]
  if bias is not None:
    checks.floating(op, "bias", bias)
    checks.same_dtype(op, ("h", "bias"), (h, bias))
    if tuple(bias.shape) != (vocab,):
      raise ValueError(f"{op}: bias must have shape (V,) = ({vocab},), got shape "
                       f"{tuple(bias.shape)}")
  if reduction not in _REDUCTIONS:
    raise ValueError(f"{op}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
  if not 0.0 <= float(label_smoothing) <= 1.0:
    raise ValueError(f"{op}: label_smoothing must be in [0, 1], got {label_smoothing!r}")
  if float(z_loss) < 0.0:
    raise ValueError(f"{op}: z_loss must be >= 0, got {z_loss!r}")
  if logit_softcap is not None and not float(logit_softcap) > 0.0:
    raise ValueError(f"{op}: logit_softcap must be None or > 0, got {logit_softcap!r}")
  if chunk_size is not None and (not isinstance(chunk_size, (int, np.integer))
                                 or isinstance(chunk_size, bool) or chunk_size < 1):
    raise ValueError(f"{op}: chunk_size must be None or a positive int, got {chunk_size!r}")


def _check_label_range(labels, vocab, ignore_index):
  """Concrete labels are checked; traced ones cannot be (their loss is NaN, see the docs)."""
  try:
    values = np.asarray(labels)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return
  bad = (values != ignore_index) & ((values < 0) | (values >= vocab))
  if bad.any():
    first = values[bad].flat[0]
    raise ValueError(f"{LINEAR_CROSS_ENTROPY.name}: labels must be in [0, {vocab}) "
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


def _config(n, vocab, *, ignore_index, label_smoothing, z_loss, logit_softcap, chunk_size,
            grad_in_forward, reduction, return_accuracy, has_bias, implementation) -> _Config:
  op = LINEAR_CROSS_ENTROPY
  backend = op.backend(implementation)
  if grad_in_forward:
    if reduction == "none":
      raise ValueError(f"{op.name}: grad_in_forward=True needs a scalar loss (reduction 'mean' "
                       f"or 'sum'), got reduction='none'")
    if backend["impl"] != "xla":
      raise ValueError(f"{op.name}: grad_in_forward=True is implemented with "
                       f"implementation='xla', got implementation={backend['impl']!r}")
  if chunk_size is None:
    target = max(_MIN_CHUNK, min(_MAX_CHUNK, _CHUNK_ELEMENTS // vocab))
    # Equal chunks, a multiple of 8 tokens, so that little padding is needed.
    count = -(-n // target)
    chunk_size = -(-(-(-n // max(count, 1))) // 8) * 8
  return _Config(**backend, vocab=vocab, ignore_index=int(ignore_index),
                 label_smoothing=float(label_smoothing), z_loss=float(z_loss),
                 softcap=None if logit_softcap is None else float(logit_softcap),
                 chunk=int(max(1, min(chunk_size, n))), accuracy=bool(return_accuracy),
                 has_bias=has_bias)


# The op ----------------------------------------------------------------------------------------


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
  _check_label_range(labels, vocab, ignore_index)
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
      loss = _reduce(per_token, valid, reduction)
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
    aux["accuracy"] = _reduce(hits, valid, reduction).reshape(lead if reduction == "none" else ())
  return loss, aux


# Chunking --------------------------------------------------------------------------------------


def _pad_rows(x, rows, value=0):
  if x.shape[0] == rows:
    return x
  pad = [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1)
  return jnp.pad(x, pad, constant_values=value)


def _chunked(x, cfg, value=0):
  """``x``'s rows in chunks of ``cfg.chunk`` (of fewer where a device holds fewer rows: the
  chunk was chosen for all of them), the last one padded with ``value``."""
  n = x.shape[0]
  chunk = max(1, min(cfg.chunk, n))
  count = -(-n // chunk)
  return _pad_rows(x, count * chunk, value).reshape(count, chunk, *x.shape[1:])


def _token_coefficients(labels, lse, g_loss, g_lse, cfg):
  """Per-token factors of the logit gradient: ``p * a - onehot(label) * b - c``.

  A label outside ``[0, V)`` that is not ignored (possible only under jit) has a NaN loss; its
  ``a`` is NaN too, so that its logit gradient, and with it every gradient, is NaN as well.
  """
  valid = labels != cfg.ignore_index
  g = jnp.where(valid, g_loss, 0.0)
  a = g * (1.0 + 2.0 * cfg.z_loss * lse) if cfg.z_loss else g
  if g_lse is not None:
    a = a + g_lse
  out_of_range = valid & ((labels < 0) | (labels >= cfg.vocab))
  a = jnp.where(out_of_range, jnp.nan, a)
  b = g * (1.0 - cfg.label_smoothing)
  c = g * (cfg.label_smoothing / cfg.vocab)
  return a, b, c


# The XLA implementation (and the kernels' twins) -----------------------------------------------


def _xla_logits(h, weight, bias, cfg):
  logits = lax.dot_general(h, weight, (((1,), (1,)), ((), ())), precision=_HIGHEST,
                           preferred_element_type=jnp.float32)
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  if cfg.softcap is not None:
    logits = cfg.softcap * activations.tanh(logits / cfg.softcap)
  return logits


def _xla_stats_from_logits(z, labels, cfg, *, every=False):
  """``(lse, target, sum, argmax)`` per token; the sum and the argmax are zeros unless label
  smoothing and accuracy (or ``every``) ask for them. A label outside ``[0, V)`` gathers 0."""
  m = jnp.max(z, axis=-1)
  lse = m + jnp.log(jnp.sum(jnp.exp(z - m[:, None]), axis=-1))
  in_range = (labels >= 0) & (labels < cfg.vocab)
  safe = jnp.clip(labels, 0, cfg.vocab - 1)
  target = jnp.take_along_axis(z, safe[:, None], axis=-1)[:, 0]
  target = jnp.where(in_range, target, 0.0)
  sumz = jnp.sum(z, axis=-1) if cfg.label_smoothing or every else jnp.zeros_like(lse)
  if cfg.accuracy or every:
    amax = jnp.argmax(z, axis=-1).astype(jnp.int32)
  else:
    amax = jnp.zeros_like(labels)
  return lse, target, sumz, amax


def _xla_logit_grad_from_logits(z, labels, lse, a, b, c, cfg):
  p = jnp.exp(z - lse[:, None])
  hit = lax.broadcasted_iota(jnp.int32, z.shape, 1) == labels[:, None]
  dz = p * a[:, None] - jnp.where(hit, b[:, None], 0.0)
  if cfg.label_smoothing:
    dz = dz - c[:, None]
  if cfg.softcap is not None:
    t = z * (1.0 / cfg.softcap)
    dz = dz * (1.0 - t * t)
  return dz


def _xla_stats(h, weight, bias, labels, *, cfg, every=False):
  """Per-token statistics, chunk by chunk (see :func:`_xla_stats_from_logits`); with
  ``every``, what the Pallas ``stats_forward`` kernel returns."""
  def chunk(xs):
    hc, yc = xs
    return _xla_stats_from_logits(_xla_logits(hc, weight, bias, cfg), yc, cfg, every=every)

  outs = lax.map(chunk, (_chunked(h, cfg), _chunked(labels, cfg, cfg.ignore_index)))
  n = h.shape[0]
  return tuple(o.reshape(-1)[:n] for o in outs)


def _xla_logit_grad(h, weight, bias, labels, lse, a, b, c, *, cfg):
  """The logit gradient of a chunk of tokens, in h's dtype: what the Pallas ``logit_grad``
  kernel returns."""
  z = _xla_logits(h, weight, bias, cfg)
  return _xla_logit_grad_from_logits(z, labels, lse, a, b, c, cfg).astype(h.dtype)


# Forward and backward --------------------------------------------------------------------------


def _rule(cfg, kind: str) -> partitioning.Rule:
  """How the chunked loss partitions: over the tokens, and over the vocabulary (the weight
  split Megatron-style): each device's logsumexp, target logit and logit sum are combined with
  collectives over ``[tokens]`` vectors (and, with the gradients in the forward, its ``dh``
  share summed over ``[tokens, d]``), never over logits. The hidden size stays whole, and so
  does the vocabulary where the argmax (accuracy) needs it.
  """
  rows, vec = ("n", "d"), ("n",)
  whole = ("d", "v") if cfg.accuracy else ("d",)
  if kind == "stats":
    return partitioning.Rule((rows, ("v", "d"), ("v",), vec), (vec,) * 4, whole=whole,
                             own=("v",))
  if kind == "backward":
    return partitioning.Rule((rows, ("v", "d"), ("v",)) + (vec,) * 5,
                             (rows, ("v", "d"), ("v",)), whole=whole, told=("v",))
  return partitioning.Rule((rows, ("v", "d"), ("v",), vec, vec),
                           ((), vec, vec, (), rows, ("v", "d"), ("v",)), whole=whole,
                           own=("v",))


def _vocab_shard(cfg, weight, labels, vocab_axes):
  """This device's vocabulary slice: its config (``vocab``: the slice's size) and the labels
  relative to it (labels of other slices fall outside ``[0, slice)`` and gather nothing)."""
  local = weight.shape[0]
  offset = lax.axis_index(vocab_axes) * local
  return dataclasses.replace(cfg, vocab=local), labels - offset


def _stats(h, weight, bias, labels, cfg):
  """``(lse, target, sum, argmax)`` per token (float32, and int32 for the argmax)."""
  twin = functools.partial(_xla_stats, cfg=cfg, every=cfg.impl != "xla")
  kernel = functools.partial(_stats_shard, cfg=cfg)
  return base.kernel_call(kernel, twin, h, weight, bias, labels, rule=_rule(cfg, "stats"))


def _stats_shard(h, weight, bias, labels, *, cfg, axes):
  """:func:`_stats` of one device's tokens and vocabulary slice, combined over the slices."""
  vocab_axes = axes["v"]
  if vocab_axes:
    cfg, labels = _vocab_shard(cfg, weight, labels, vocab_axes)
  lse, target, sumz, amax = _stats_kernel(h, weight, bias, labels, cfg)
  return (*_combined_over_vocab(lse, target, sumz, vocab_axes), amax)


def _combined_over_vocab(lse, target, sumz, vocab_axes):
  """Per-token statistics of vocabulary slices combined over the slices (unchanged when the
  vocabulary is whole)."""
  if not vocab_axes:
    return lse, target, sumz
  m = lax.pmax(lse, vocab_axes)
  lse = m + jnp.log(lax.psum(jnp.exp(lse - m), vocab_axes))
  return lse, lax.psum(target, vocab_axes), lax.psum(sumz, vocab_axes)


def _stats_kernel(h, weight, bias, labels, cfg):
  if cfg.impl == "pallas":
    from jaxfuse.kernels.pallas import cross_entropy as kernels

    return kernels.stats_forward(h, weight, bias, labels, softcap=cfg.softcap,
                                 interpret=cfg.interpret)
  if cfg.impl == "triton":
    from jaxfuse.kernels.triton import cross_entropy as triton_kernels

    return triton_kernels.stats_forward(h, weight, bias, labels, softcap=cfg.softcap)
  return _xla_stats(h, weight, bias, labels, cfg=cfg)


def _logit_grad(hc, weight, bias, yc, lse, a, b, c, cfg):
  """One chunk's logit gradient, its logits recomputed: in h's dtype (kernels) or float32."""
  if cfg.impl == "pallas":
    from jaxfuse.kernels.pallas import cross_entropy as kernels

    kernel = functools.partial(kernels.logit_grad, softcap=cfg.softcap,
                               smoothing=bool(cfg.label_smoothing), interpret=cfg.interpret)
    twin = functools.partial(_xla_logit_grad, cfg=cfg)
    return base.kernel_call(kernel, twin, hc, weight, bias, yc, lse, a, b, c)
  if cfg.impl == "triton":
    from jaxfuse.kernels.triton import cross_entropy as triton_kernels

    kernel = functools.partial(triton_kernels.logit_grad, softcap=cfg.softcap,
                               smoothing=bool(cfg.label_smoothing))
    twin = functools.partial(_xla_logit_grad, cfg=cfg)
    return base.kernel_call(kernel, twin, hc, weight, bias, yc, lse, a, b, c)
  z = _xla_logits(hc, weight, bias, cfg)
  return _xla_logit_grad_from_logits(z, yc, lse, a, b, c, cfg)


def _per_token(labels, lse, target, sumz, amax, cfg):
  valid = labels != cfg.ignore_index
  loss = lse - (1.0 - cfg.label_smoothing) * target
  if cfg.label_smoothing:
    loss = loss - (cfg.label_smoothing / cfg.vocab) * sumz
  if cfg.z_loss:
    loss = loss + cfg.z_loss * lse * lse
  in_range = (labels >= 0) & (labels < cfg.vocab)
  loss = jnp.where(valid, jnp.where(in_range, loss, jnp.nan), 0.0)
  correct = (amax == labels).astype(jnp.float32)
  return loss, correct


def _backward(h, weight, bias, labels, lse, a, b, c, cfg):
  """Recomputes each chunk's logits, forms its logit gradient and multiplies it out."""
  kernel = functools.partial(_backward_shard, cfg=cfg)
  twin = functools.partial(_backward_shard, cfg=cfg, axes={"v": ()})
  return base.kernel_call(kernel, twin, h, weight, bias, labels, lse, a, b, c,
                          rule=_rule(cfg, "backward"))


def _backward_shard(h, weight, bias, labels, lse, a, b, c, *, cfg, axes):
  """:func:`_backward` on one device's tokens and vocabulary slice: its ``dh`` is a partial
  sum over the slices, its ``dweight`` one over the tokens (the caller sums them)."""
  if axes["v"]:
    cfg, labels = _vocab_shard(cfg, weight, labels, axes["v"])
  n, d = h.shape
  cd = jnp.float32
  mm_dtype = cd if cfg.impl == "xla" else h.dtype
  w_mm = weight.astype(mm_dtype)

  def step(carry, xs):
    dw, db = carry
    hc, yc, lc, ac, bc, cc = xs
    dz = _logit_grad(hc, weight, bias, yc, lc, ac, bc, cc, cfg)
    dz_mm = dz.astype(mm_dtype)
    dhc = jnp.dot(dz_mm, w_mm, precision=_HIGHEST, preferred_element_type=cd)
    dw = dw + lax.dot_general(dz_mm, hc.astype(mm_dtype), (((0,), (0,)), ((), ())),
                              precision=_HIGHEST, preferred_element_type=cd)
    if cfg.has_bias:
      db = db + jnp.sum(dz, axis=0, dtype=cd)
    return (dw, db), dhc.astype(h.dtype)

  xs = (_chunked(h, cfg), _chunked(labels, cfg, cfg.ignore_index), _chunked(lse, cfg),
        _chunked(a, cfg), _chunked(b, cfg), _chunked(c, cfg))
  init = (jnp.zeros(weight.shape, cd), jnp.zeros((cfg.vocab,) if cfg.has_bias else (), cd))
  init = partitioning.vary_like(init, h, weight, bias, labels, lse, a, b, c)
  (dw, db), dh = lax.scan(step, init, xs)
  dh = dh.reshape(-1, d)[:n]
  db = db.astype(bias.dtype) if cfg.has_bias else None
  return dh, dw.astype(weight.dtype), db


# The custom VJP --------------------------------------------------------------------------------


@partitioning.matching_vma
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _lce(h, weight, bias, labels, cfg):
  return _lce_fwd(h, weight, bias, labels, cfg)[0]


def _lce_fwd(h, weight, bias, labels, cfg):
  lse, target, sumz, amax = _stats(h, weight, bias, labels, cfg)
  loss, correct = _per_token(labels, lse, target, sumz, amax, cfg)
  # Residuals: the inputs and 4 bytes a token. Logits are recomputed chunk by chunk.
  return (loss, lse, correct), (h, weight, bias, labels, lse)


def _lce_bwd(cfg, residuals, cotangents):
  h, weight, bias, labels, lse = residuals
  g_loss, g_lse, _ = cotangents
  a, b, c = _token_coefficients(labels, lse, g_loss, g_lse, cfg)
  dh, dw, db = _backward(h, weight, bias, labels, lse, a, b, c, cfg)
  return dh, dw, db, None


# Plain defvjp: optimize_remat=True breaks reverse over reverse.
_lce.defvjp(_lce_fwd, _lce_bwd)


# Gradients in the forward (Liger-Kernel's way) --------------------------------------------------


@partitioning.matching_vma
@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _lce_grad_in_forward(h, weight, bias, labels, weights, cfg):
  return _gif_fwd(h, weight, bias, labels, weights, cfg)[0]


def _gif_fwd(h, weight, bias, labels, weights, cfg):
  kernel = functools.partial(_gif_shard, cfg=cfg)
  twin = functools.partial(_gif_shard, cfg=cfg, axes={"v": ()})
  total, lse, correct, bad, dh, dw, db = base.kernel_call(
      kernel, twin, h, weight, bias, labels, weights, rule=_rule(cfg, "grad_in_forward"))
  out = (total, lax.stop_gradient(lse), correct, bad > 0)
  # Residuals: the gradients themselves (h's, weight's and bias's size); the backward scales them.
  return out, (dh, dw, db)


def _gif_shard(h, weight, bias, labels, weights, *, cfg, axes):
  """The loss and its gradients on one device's tokens (partial sums over the tokens for the
  total, ``dweight`` and ``dbias``) and vocabulary slice (each chunk's statistics and ``dh``
  combined over the slices); ``bad`` counts NaN losses."""
  n, d = h.shape
  cd = jnp.float32
  vocab_axes = axes["v"]
  local_cfg, local_labels = (_vocab_shard(cfg, weight, labels, vocab_axes) if vocab_axes
                             else (cfg, labels))

  def step(carry, xs):
    dw, db, total, bad = carry
    hc, yc, yc_local, wc = xs
    z = _xla_logits(hc, weight, bias, local_cfg)
    lse, target, sumz, amax = _xla_stats_from_logits(z, yc_local, local_cfg)
    lse, target, sumz = _combined_over_vocab(lse, target, sumz, vocab_axes)
    loss, correct = _per_token(yc, lse, target, sumz, amax, cfg)
    a, b, c = _token_coefficients(yc, lse, wc, None, cfg)
    dz = _xla_logit_grad_from_logits(z, yc_local, lse, a, b, c, local_cfg)
    dhc = jnp.dot(dz, weight.astype(cd), precision=_HIGHEST)
    if vocab_axes:
      dhc = lax.psum(dhc, vocab_axes)
    dw = dw + lax.dot_general(dz, hc.astype(cd), (((0,), (0,)), ((), ())), precision=_HIGHEST)
    if cfg.has_bias:
      db = db + jnp.sum(dz, axis=0)
    nan = jnp.isnan(loss)
    total = total + jnp.sum(jnp.where(nan, 0.0, loss) * wc)
    bad = bad | jnp.any(nan)
    return (dw, db, total, bad), (dhc.astype(h.dtype), lse, correct)

  init = (jnp.zeros(weight.shape, cd), jnp.zeros(weight.shape[:1] if cfg.has_bias else (), cd),
          jnp.zeros((), cd), jnp.zeros((), bool))
  init = partitioning.vary_like(init, h, weight, bias, labels, weights)
  xs = (_chunked(h, cfg), _chunked(labels, cfg, cfg.ignore_index),
        _chunked(local_labels, cfg, cfg.ignore_index), _chunked(weights, cfg))
  (dw, db, total, bad), (dh, lse, correct) = lax.scan(step, init, xs)
  dh = dh.reshape(-1, d)[:n]
  lse, correct = lse.reshape(-1)[:n], correct.reshape(-1)[:n]
  db = db.astype(bias.dtype) if cfg.has_bias else None
  return total, lse, correct, bad.astype(cd), dh, dw.astype(weight.dtype), db


def _gif_bwd(cfg, residuals, cotangents):
  dh, dw, db = residuals
  g = cotangents[0]
  scale = lambda x: None if x is None else (x * g).astype(x.dtype)  # noqa: E731
  return scale(dh), scale(dw), scale(db), None, None


# Plain defvjp: optimize_remat=True breaks reverse over reverse.
_lce_grad_in_forward.defvjp(_gif_fwd, _gif_bwd)
