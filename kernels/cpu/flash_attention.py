"""Flash attention forward and backward kernels for CPUs (``flash_attention.cc``).

The signatures of :mod:`jaxfuse.kernels.pallas.flash_attention`, on ``[batch, seq, heads,
head_dim]`` arrays of float32, bfloat16 or float16 (float32 math), with the causal masks (both
alignments), sliding windows, segment ids, kv lengths, logit soft-capping and grouped-query
heads; an additive ``bias`` is refused (``None`` then runs XLA's algorithm). The log-sum-exp is
in base 2, as the GPU kernels'.

The forward walks each 64-row query tile over the key tiles it can see with the online
softmax; the backward walks each key tile of a kv head over the query tiles that see it and
writes ``dq``, ``dk`` and ``dv`` from that one pass. The products run on 64-wide tiles in
registers, over float32 copies of the operands (transposed where a product needs it), so XLA's
layout copies and the ``[Tq, Tk]`` intermediates of the per-tile algorithm never reach memory.
Work is split over XLA's intra-op threads by (batch, head, query tile) in the forward and by
(batch, kv head) in the backward, each kv head's key tiles split further where there are fewer
heads than two per thread.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import Library

_TARGETS = ("jaxfuse_attention_forward", "jaxfuse_attention_backward")
LIBRARY = Library("flash_attention", _TARGETS)
ready = LIBRARY.ready   # asked by implementation=None (False, warned, where it cannot load)
_CAUSAL = {None: 0, False: 0, True: 1, "top_left": 1, "bottom_right": 2}
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def refuses(*, has_bias: bool = False, dtype=None, **_) -> str | None:
  """Why these kernels cannot take a call (None: they can): a bias, or a dtype they lack."""
  if has_bias:
    return "takes no bias (causal masks, windows, segment ids and kv lengths cost nothing)"
  if dtype is not None and jnp.dtype(dtype) not in tuple(map(jnp.dtype, DTYPES)):
    return f"takes float32, bfloat16 or float16, got {jnp.dtype(dtype).name}"
  return None


def _ints(x):
  return jnp.zeros((0,), jnp.int32) if x is None else jnp.asarray(x, jnp.int32)


def _attributes(causal, scale, window, softcap):
  return dict(causal=np.int32(_CAUSAL[causal]), window=np.int64(window or 0),
              scale=np.float32(scale), softcap=np.float32(softcap or 0.0), base2=True)


def _check(bias):
  if bias is not None:
    raise NotImplementedError("attention (cpu): " + refuses(has_bias=True))


def _forward(q, k, v, q_seg, kv_seg, kv_lengths, *, with_lse, causal, scale, window, softcap):
  LIBRARY.load()
  lse_shape = q.shape[:-3] + (q.shape[-2], q.shape[-3]) if with_lse else (0,)
  outs = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(lse_shape, jnp.float32))
  return jax.ffi.ffi_call("jaxfuse_attention_forward", outs, vmap_method="broadcast_all")(
      q, k, v, _ints(q_seg), _ints(kv_seg), _ints(kv_lengths),
      **_attributes(causal, scale, window, softcap))


def forward(q, k, v, q_seg, kv_seg, kv_lengths, bias, *, causal, scale: float, blocks=None,
            window: int | None = None, softcap: float | None = None):
  """``(o, lse)``: ``lse`` float32 ``[batch, heads, q_len]`` in base 2, ``+inf`` for rows that
  see no key (their ``o`` is zero)."""
  del blocks
  _check(bias)
  return _forward(q, k, v, q_seg, kv_seg, kv_lengths, with_lse=True, causal=causal,
                  scale=scale, window=window, softcap=softcap)


def forward_output(q, k, v, q_seg, kv_seg, kv_lengths, bias, *, causal, scale: float,
                   blocks=None, window: int | None = None, softcap: float | None = None):
  """The output alone (no log-sum-exp is written)."""
  del blocks
  _check(bias)
  return _forward(q, k, v, q_seg, kv_seg, kv_lengths, with_lse=False, causal=causal,
                  scale=scale, window=window, softcap=softcap)[0]


def backward(q, k, v, q_seg, kv_seg, kv_lengths, bias, o, lse, do, *, causal, scale: float,
             blocks=None, window: int | None = None, softcap: float | None = None):
  """``(dq, dk, dv, None)`` from the output ``o``, its base-2 log-sum-exp ``lse`` (which may
  span more keys than ``k``) and the output gradient ``do``."""
  del blocks
  _check(bias)
  LIBRARY.load()
  outs = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
  dq, dk, dv = jax.ffi.ffi_call("jaxfuse_attention_backward", outs, vmap_method="broadcast_all")(
      q, k, v, _ints(q_seg), _ints(kv_seg), _ints(kv_lengths), o, lse.astype(jnp.float32),
      do.astype(q.dtype), **_attributes(causal, scale, window, softcap))
  return dq, dk, dv, None
