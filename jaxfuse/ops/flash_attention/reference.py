"""The plain ``softmax(q kᵀ · scale + bias) v`` with the full score matrix: the oracle of the
tests, the unfused baseline of the benchmarks, and the derivative of the kernels for
second-order gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxfuse.ops.flash_attention import arguments

_HIGHEST = lax.Precision.HIGHEST
_NEG_INF = -jnp.inf
_LOG2E = 1.4426950408889634

def attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, *, causal=False,
                        scale: float | None = None, segment_ids=None,
                        kv_lengths: jax.Array | None = None, bias: jax.Array | None = None,
                        sliding_window: int | None = None,
                        logit_softcap: float | None = None) -> jax.Array:
  """Plain ``softmax(q kᵀ · scale + bias) v`` with the full score matrix (O(N²) memory).

  Same arguments and semantics as :func:`attention` (fully masked rows give zeros); computed in
  float32 and differentiated by JAX. It is the unfused baseline and the tests' oracle.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxfuse.ops import attention_reference
    >>> x = jnp.ones((1, 3, 2, 4))
    >>> attention_reference(x, x, x, causal=True).shape
    (1, 3, 2, 4)
  """
  op = "attention_reference"
  arguments.check(op, q, k, v, segment_ids, kv_lengths, bias)
  causal = arguments.causal_alignment(op, causal)
  arguments.check_window_and_softcap(op, sliding_window, logit_softcap, causal)
  scale = arguments.default_scale(scale, q.shape[-1])
  return _attend(q, k, v, arguments.segments(segment_ids, q.shape[1], k.shape[1]), kv_lengths,
                 bias, causal=causal, scale=scale, window=sliding_window,
                 softcap=logit_softcap)[0]


def forward_with_lse(q, k, v, q_seg, kv_seg, kv_lengths, bias, *, causal, scale: float,
                     window=None, softcap=None, base2: bool = False):
  """``(o, lse)`` as the attention kernels return them: ``lse`` is float32
  ``[batch, heads, q_len]``, in base 2 with ``base2`` (the Pallas kernels'), ``+inf`` for rows
  that see no key."""
  segments = None if q_seg is None else (q_seg, kv_seg)
  o, lse = _attend(q, k, v, segments, kv_lengths, bias, causal=causal, scale=scale,
                   window=window, softcap=softcap)
  return o, (lse * _LOG2E if base2 else lse)


def _attend(q, k, v, segments, kv_lengths, bias, *, causal, scale, window=None, softcap=None):
  """``(o, lse)`` with ``causal`` None, ``"top_left"`` or ``"bottom_right"``."""
  b, tq, hq, d = q.shape
  tk, hkv = k.shape[1], k.shape[2]
  cd = jnp.promote_types(q.dtype, jnp.float32)
  qg = q.astype(cd).reshape(b, tq, hkv, hq // hkv, d)
  s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(cd), precision=_HIGHEST) * scale
  s = s.reshape(b, hq, tq, tk)
  if softcap is not None:
    s = softcap * jnp.tanh(s / softcap)
  if bias is not None:
    s = s + bias.astype(cd)
  mask = _dense_mask(b, tq, tk, causal, segments, kv_lengths, window)
  if mask is not None:
    s = jnp.where(mask, s, _NEG_INF)
  m = lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
  m = jnp.where(jnp.isneginf(m), 0.0, m)
  p = jnp.exp(s - m)
  l = jnp.sum(p, axis=-1, keepdims=True)
  empty = l == 0
  p = p / jnp.where(empty, 1.0, l)
  lse = jnp.where(empty, jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))[..., 0]
  pg = p.reshape(b, hkv, hq // hkv, tq, tk)
  o = jnp.einsum("bhgqk,bkhd->bqhgd", pg, v.astype(cd), precision=_HIGHEST)
  return o.reshape(b, tq, hq, d).astype(q.dtype), lse.astype(jnp.float32)


def _dense_mask(b, tq, tk, causal, segments, kv_lengths, window=None):
  """The [b, 1, tq, tk] boolean mask of the reference, or None."""
  mask = None

  def both(m, new):
    return new if m is None else m & new

  if causal is not None:
    offset = jnp.zeros((b,), jnp.int32)
    if causal == "bottom_right":
      kv_len = jnp.full((b,), tk) if kv_lengths is None else jnp.minimum(kv_lengths, tk)
      offset = (kv_len - tq).astype(jnp.int32)
    row = jnp.arange(tq)[None, :, None] + offset[:, None, None]     # [b, tq, 1]
    key = jnp.arange(tk)[None, None, :]
    visible = key <= row
    if window is not None:
      visible = visible & (key > row - window)
    mask = both(mask, visible[:, None])
  if segments is not None:
    q_seg, kv_seg = segments
    mask = both(mask, (q_seg[:, :, None] == kv_seg[:, None, :])[:, None])
  if kv_lengths is not None:
    mask = both(mask, (jnp.arange(tk)[None, :] < kv_lengths[:, None])[:, None, None, :])
  if mask is not None:
    mask = jnp.broadcast_to(mask, (b, 1, tq, tk))
  return mask
