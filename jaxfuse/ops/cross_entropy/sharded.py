"""The loss on one device's share: its tokens and its slice of the vocabulary.

:func:`jaxfuse.ops.linear_cross_entropy` partitions as :func:`rule` declares (through
:func:`jaxfuse.ops.base.kernel_call`): over the tokens, and over the vocabulary Megatron-style
(the weight ``[V, D]`` split on ``V``). Each device makes its slice's logits chunk by chunk
(kernels or XLA); the per-token logsumexp, target logit and logit sum are combined over the
slices with collectives on ``[tokens]`` vectors, never on logits, and ``dh`` is summed over the
slices. On one device the slice is the whole vocabulary and nothing is combined.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax

from jaxfuse.ops import partitioning
from jaxfuse.ops.cross_entropy import xla


def rule(cfg, kind: str) -> partitioning.Rule:
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


def vocab_slice(cfg, weight, labels, vocab_axes):
  """This device's vocabulary slice: its config (``vocab``: the slice's size) and the labels
  relative to it (labels of other slices fall outside ``[0, slice)`` and gather nothing)."""
  local = weight.shape[0]
  offset = lax.axis_index(vocab_axes) * local
  return dataclasses.replace(cfg, vocab=local), labels - offset


def combined_over_vocab(lse, target, sumz, vocab_axes, *, mean=False):
  """Per-token statistics of vocabulary slices combined over the slices (unchanged when the
  vocabulary is whole); with ``mean``, ``sumz`` is each slice's mean logit under its own
  softmax, combined weighted by the slices' shares of the whole softmax."""
  if not vocab_axes:
    return lse, target, sumz
  m = lax.pmax(lse, vocab_axes)
  whole = m + jnp.log(lax.psum(jnp.exp(lse - m), vocab_axes))
  sumz = lax.psum(jnp.exp(lse - whole) * sumz if mean else sumz, vocab_axes)
  return whole, lax.psum(target, vocab_axes), sumz


def stats_shard(h, weight, bias, labels, *, cfg, axes):
  """:func:`stats_kernel` of one device's tokens and vocabulary slice, combined over the slices."""
  vocab_axes = axes["v"]
  if vocab_axes:
    cfg, labels = vocab_slice(cfg, weight, labels, vocab_axes)
  lse, target, sumz, amax = stats_kernel(h, weight, bias, labels, cfg)
  return (*combined_over_vocab(lse, target, sumz, vocab_axes, mean=cfg.entropy), amax)


def stats_kernel(h, weight, bias, labels, cfg):
  """``(lse, target, sum, argmax)`` of one device's block, by the kernels (which always
  compute the argmax) or by XLA (which computes it where accuracy is asked for)."""
  return cfg.run("stats_forward", functools.partial(xla.stats, cfg=cfg, every=True), h, weight,
                 bias, labels, xla=functools.partial(xla.stats, cfg=cfg), softcap=cfg.softcap,
                 scale=cfg.scale, entropy=cfg.entropy)


def chunk_logit_grad(hc, weight, bias, yc, lse, a, b, c, cfg):
  """One chunk's logit gradient, its logits recomputed: in h's dtype (kernels) or float32
  (XLA, see :func:`logit_grad_dtype`)."""
  twin = functools.partial(xla.logit_grad, cfg=cfg)
  return cfg.run("logit_grad", twin, hc, weight, bias, yc, lse, a, b, c,
                 xla=functools.partial(xla.logit_grad, cfg=cfg, float32=True),
                 softcap=cfg.softcap, scale=cfg.scale, smoothing=bool(cfg.label_smoothing),
                 entropy=cfg.entropy)


def logit_grad_dtype(h, cfg):
  """The dtype :func:`chunk_logit_grad` returns, and the backward's products take: the kernels
  round the logit gradient to h's dtype; XLA keeps it in float32."""
  return h.dtype if cfg.on_kernels else jnp.float32


def backward_shard(h, weight, bias, labels, lse, a, b, c, *, cfg, axes):
  """The backward on one device's tokens and vocabulary slice: its ``dh`` is a partial
  sum over the slices, its ``dweight`` one over the tokens (the caller sums them)."""
  if axes["v"]:
    cfg, labels = vocab_slice(cfg, weight, labels, axes["v"])
  n, d = h.shape
  cd = jnp.float32
  mm_dtype = logit_grad_dtype(h, cfg)
  w_mm = weight.astype(mm_dtype)

  def step(carry, xs):
    dw, db = carry
    hc, yc, lc, ac, bc, cc = xs
    dz = chunk_logit_grad(hc, weight, bias, yc, lc, ac, bc, cc, cfg)
    dz_mm = dz.astype(mm_dtype)
    dhc = jnp.dot(dz_mm, w_mm, precision=xla.HIGHEST, preferred_element_type=cd)
    dw = dw + lax.dot_general(dz_mm, hc.astype(mm_dtype), (((0,), (0,)), ((), ())),
                              precision=xla.HIGHEST, preferred_element_type=cd)
    if cfg.has_bias:
      db = db + jnp.sum(dz, axis=0, dtype=cd)
    return (dw, db), dhc.astype(h.dtype)

  xs = (xla.chunked(h, cfg), xla.chunked(labels, cfg, cfg.ignore_index), xla.chunked(lse, cfg),
        xla.chunked(a, cfg), xla.chunked(b, cfg), xla.chunked(c, cfg))
  init = (jnp.zeros(weight.shape, cd), jnp.zeros((cfg.vocab,) if cfg.has_bias else (), cd))
  init = partitioning.vary_like(init, h, weight, bias, labels, lse, a, b, c)
  (dw, db), dh = lax.scan(step, init, xs)
  dh = dh.reshape(-1, d)[:n]
  db = db.astype(bias.dtype) if cfg.has_bias else None
  return dh, dw.astype(weight.dtype), db


def grad_in_forward_shard(h, weight, bias, labels, weights, *, cfg, axes):
  """The loss and its gradients on one device's tokens (partial sums over the tokens for the
  total, ``dweight`` and ``dbias``) and vocabulary slice (each chunk's statistics and ``dh``
  combined over the slices); ``bad`` counts NaN losses."""
  n, d = h.shape
  cd = jnp.float32
  vocab_axes = axes["v"]
  local_cfg, local_labels = (vocab_slice(cfg, weight, labels, vocab_axes) if vocab_axes
                             else (cfg, labels))

  def step(carry, xs):
    dw, db, total, bad = carry
    hc, yc, yc_local, wc = xs
    z = xla.chunk_logits(hc, weight, bias, local_cfg)
    lse, target, sumz, amax = xla.stats_from_logits(z, yc_local, local_cfg)
    lse, target, sumz = combined_over_vocab(lse, target, sumz, vocab_axes)
    loss, correct = xla.per_token(yc, lse, target, sumz, amax, cfg)
    a, b, c = xla.token_coefficients(yc, lse, wc, None, cfg)
    dz = xla.logit_grad_from_logits(z, yc_local, lse, a, b, c, local_cfg)
    dhc = jnp.dot(dz, weight.astype(cd), precision=xla.HIGHEST)
    if vocab_axes:
      dhc = lax.psum(dhc, vocab_axes)
    dw = dw + lax.dot_general(dz, hc.astype(cd), (((0,), (0,)), ((), ())), precision=xla.HIGHEST)
    if cfg.has_bias:
      db = db + jnp.sum(dz, axis=0)
    nan = jnp.isnan(loss)
    total = total + jnp.sum(jnp.where(nan, 0.0, loss) * wc)
    bad = bad | jnp.any(nan)
    return (dw, db, total, bad), (dhc.astype(h.dtype), lse, correct)

  init = (jnp.zeros(weight.shape, cd), jnp.zeros(weight.shape[:1] if cfg.has_bias else (), cd),
          jnp.zeros((), cd), jnp.zeros((), bool))
  init = partitioning.vary_like(init, h, weight, bias, labels, weights)
  xs = (xla.chunked(h, cfg), xla.chunked(labels, cfg, cfg.ignore_index),
        xla.chunked(local_labels, cfg, cfg.ignore_index), xla.chunked(weights, cfg))
  (dw, db, total, bad), (dh, lse, correct) = lax.scan(step, init, xs)
  dh = dh.reshape(-1, d)[:n]
  lse, correct = lse.reshape(-1)[:n], correct.reshape(-1)[:n]
  db = db.astype(bias.dtype) if cfg.has_bias else None
  return total, lse, correct, bad.astype(cd), dh, dw.astype(weight.dtype), db
