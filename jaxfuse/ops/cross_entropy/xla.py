"""The XLA side of :func:`linear_cross_entropy`: the reference with full logits, the chunking of
the tokens, and each chunk's statistics and logit gradient in plain jnp (the XLA
implementation, and the kernels' twins).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxfuse.ops import activations, base

HIGHEST = lax.Precision.HIGHEST


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
                   precision=HIGHEST)
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
  logits = lax.dot_general(h, weight, (((h.ndim - 1,), (1,)), ((), ())), precision=HIGHEST,
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
  return reduce(loss, valid, reduction)


def reduce(per_token, valid, reduction):
  if reduction == "none":
    return per_token
  total = jnp.sum(per_token)
  if reduction == "sum":
    return total
  return total / jnp.sum(valid).astype(total.dtype)


def pad_rows(x, rows, value=0):
  if x.shape[0] == rows:
    return x
  pad = [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1)
  return jnp.pad(x, pad, constant_values=value)


def chunked(x, cfg, value=0):
  """``x``'s rows in chunks of ``cfg.chunk`` (of fewer where a device holds fewer rows: the
  chunk was chosen for all of them), the last one padded with ``value``."""
  n = x.shape[0]
  chunk = max(1, min(cfg.chunk, n))
  count = -(-n // chunk)
  return pad_rows(x, count * chunk, value).reshape(count, chunk, *x.shape[1:])


def token_coefficients(labels, lse, g_loss, g_lse, cfg):
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


def per_token(labels, lse, target, sumz, amax, cfg):
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


def chunk_logits(h, weight, bias, cfg):
  """One chunk's float32 logits (soft-capped, then scaled, when the config says so)."""
  logits = lax.dot_general(h, weight, (((1,), (1,)), ((), ())), precision=HIGHEST,
                           preferred_element_type=jnp.float32)
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  if cfg.softcap is not None:
    logits = cfg.softcap * activations.tanh(logits / cfg.softcap)
  if cfg.scale is not None:
    logits = logits * cfg.scale
  return logits


def stats_from_logits(z, labels, cfg, *, every=False):
  """``(lse, target, sum, argmax)`` per token; the sum and the argmax are zeros unless label
  smoothing and accuracy (or ``every``) ask for them. With ``cfg.entropy`` the sum is the
  logits' mean under their softmax, ``sum(p * z)``. A label outside ``[0, V)`` gathers 0."""
  m = jnp.max(z, axis=-1)
  e = jnp.exp(z - m[:, None])
  s = jnp.sum(e, axis=-1)
  lse = m + jnp.log(s)
  in_range = (labels >= 0) & (labels < cfg.vocab)
  safe = jnp.clip(labels, 0, cfg.vocab - 1)
  target = jnp.take_along_axis(z, safe[:, None], axis=-1)[:, 0]
  target = jnp.where(in_range, target, 0.0)
  if cfg.entropy:
    sumz = jnp.sum(e * z, axis=-1) / s
  else:
    sumz = jnp.sum(z, axis=-1) if cfg.label_smoothing or every else jnp.zeros_like(lse)
  if cfg.accuracy or every:
    amax = jnp.argmax(z, axis=-1).astype(jnp.int32)
  else:
    amax = jnp.zeros_like(labels)
  return lse, target, sumz, amax


def logit_grad_from_logits(z, labels, lse, a, b, c, cfg):
  """The raw logits' gradient from the (soft-capped, scaled) logits ``z``: ``p * a - b *
  onehot(label) - c`` (``c`` with label smoothing), or ``p * (a + c * z) - b * onehot(label)``
  with ``cfg.entropy``, through the scale's and the soft-cap's derivatives."""
  p = jnp.exp(z - lse[:, None])
  hit = lax.broadcasted_iota(jnp.int32, z.shape, 1) == labels[:, None]
  dz = p * (a[:, None] + c[:, None] * z) if cfg.entropy else p * a[:, None]
  dz = dz - jnp.where(hit, b[:, None], 0.0)
  if cfg.label_smoothing:
    dz = dz - c[:, None]
  if cfg.scale is not None:
    dz = dz * cfg.scale
  if cfg.softcap is not None:
    t = z * (1.0 / (cfg.softcap * (cfg.scale if cfg.scale is not None else 1.0)))
    dz = dz * (1.0 - t * t)
  return dz


def stats(h, weight, bias, labels, *, cfg, every=False):
  """Per-token statistics, chunk by chunk (see :func:`stats_from_logits`); with
  ``every``, what the Pallas ``stats_forward`` kernel returns."""
  def chunk(xs):
    hc, yc = xs
    return stats_from_logits(chunk_logits(hc, weight, bias, cfg), yc, cfg, every=every)

  outs = lax.map(chunk, (chunked(h, cfg), chunked(labels, cfg, cfg.ignore_index)))
  n = h.shape[0]
  return tuple(o.reshape(-1)[:n] for o in outs)


def logit_grad(h, weight, bias, labels, lse, a, b, c, *, cfg, float32=False):
  """The logit gradient of a chunk of tokens, in h's dtype: what the Pallas ``logit_grad``
  kernel returns."""
  z = chunk_logits(h, weight, bias, cfg)
  out = logit_grad_from_logits(z, labels, lse, a, b, c, cfg)
  return out if float32 else out.astype(h.dtype)
