"""Argument checks and normalization shared by attention, its reference and its tuning."""

from __future__ import annotations

import math
import numbers

import jax.numpy as jnp

from jaxfuse.ops import checks


def default_scale(scale, d):
  """``scale`` as a float; None gives ``1 / sqrt(head_dim)`` (1 for an empty head dim)."""
  if scale is None:
    return 1.0 / math.sqrt(d) if d else 1.0
  if not isinstance(scale, numbers.Real) or isinstance(scale, bool):
    raise TypeError(f"attention: scale must be a Python float or None, got {type(scale).__name__}")
  return float(scale)


def check(op, q, k, v, segment_ids, kv_lengths, bias):
  """Raises for bad shapes or dtypes; every message names ``op`` and the argument."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    checks.floating(op, name, x)
    checks.rank(op, name, x, 4)
  checks.same_dtype(op, ("q", "k", "v"), (q, k, v))
  checks.same_shape(op, ("k", "v"), (k, v))
  b, _, hq, d = q.shape
  checks.dim(op, "k", k, 0, b, "the batch size of q")
  checks.dim(op, "k", k, 3, d, "the head dim of q")
  hkv = k.shape[2]
  if hkv == 0 or hq % hkv:
    raise ValueError(f"{op}: the kv heads of k (axis 2, {hkv}) must divide the heads of q "
                     f"(axis 2, {hq}), got q {tuple(q.shape)} and k {tuple(k.shape)}")
  tq, tk = q.shape[1], k.shape[1]
  if segment_ids is not None:
    pair = segment_ids if isinstance(segment_ids, (tuple, list)) else None
    if pair is not None:
      if len(pair) != 2:
        raise ValueError(f"{op}: segment_ids must be an array or a pair (q_segment_ids, "
                         f"kv_segment_ids), got {len(pair)} entries")
      for name, x, t in (("q_segment_ids", pair[0], tq), ("kv_segment_ids", pair[1], tk)):
        _check_int(op, f"segment_ids ({name})", x, (b, t))
    else:
      if tq != tk:
        raise ValueError(f"{op}: segment_ids as one array needs q and k of one length, got "
                         f"{tq} and {tk}; pass (q_segment_ids, kv_segment_ids)")
      _check_int(op, "segment_ids", segment_ids, (b, tq))
  if kv_lengths is not None:
    _check_int(op, "kv_lengths", kv_lengths, (b,))
  if bias is not None:
    checks.floating(op, "bias", bias)
    checks.rank(op, "bias", bias, 4)
    want = (b, hq, tq, tk)
    if any(n not in (1, w) for n, w in zip(bias.shape, want)):
      raise ValueError(f"{op}: bias must have shape [batch | 1, heads | 1, q_len | 1, "
                       f"kv_len | 1] = {want} or 1 per axis, got shape {tuple(bias.shape)}")


def _check_int(op, name, x, shape):
  dtype = getattr(x, "dtype", None)
  if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
    got = jnp.dtype(dtype).name if dtype is not None else type(x).__name__
    raise TypeError(f"{op}: {name} must be an integer array, got {got}")
  if tuple(x.shape) != tuple(shape):
    raise ValueError(f"{op}: {name} must have shape {tuple(shape)}, got {tuple(x.shape)}")


def segments(segment_ids, tq, tk):
  """``(q_segment_ids, kv_segment_ids)`` as int32, or None."""
  if segment_ids is None:
    return None
  if isinstance(segment_ids, (tuple, list)):
    return jnp.asarray(segment_ids[0], jnp.int32), jnp.asarray(segment_ids[1], jnp.int32)
  ids = jnp.asarray(segment_ids, jnp.int32)
  return ids, ids


def expand_bias(bias, tq, tk):
  """Materializes broadcast query/key axes; batch and head broadcasting stays implicit."""
  shape = (bias.shape[0], bias.shape[1], tq, tk)
  return bias if bias.shape == shape else jnp.broadcast_to(bias, shape)



CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")


def causal_alignment(op, causal) -> str | None:
  """``causal`` as None (no causal mask), ``"top_left"`` (``True``) or ``"bottom_right"``."""
  if causal is False or causal is None:
    return None
  if causal is True:
    return "top_left"
  if isinstance(causal, str) and causal in CAUSAL_ALIGNMENTS:
    return causal
  raise ValueError(f"{op}: causal must be a bool, 'top_left' or 'bottom_right', got {causal!r}")


def check_window_and_softcap(op, sliding_window, logit_softcap, causal) -> None:
  """A sliding window is a positive int that needs a causal mask; a soft-cap a positive float."""
  if sliding_window is not None:
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, numbers.Integral) \
        or sliding_window < 1:
      raise ValueError(f"{op}: sliding_window must be None or a positive int, got "
                       f"{sliding_window!r}")
    if causal is None:
      raise ValueError(f"{op}: sliding_window needs a causal mask (causal=True or "
                       f"'bottom_right')")
  if logit_softcap is not None and (isinstance(logit_softcap, bool)
                                    or not isinstance(logit_softcap, numbers.Real)
                                    or not logit_softcap > 0):
    raise ValueError(f"{op}: logit_softcap must be None or a positive float, got "
                     f"{logit_softcap!r}")
