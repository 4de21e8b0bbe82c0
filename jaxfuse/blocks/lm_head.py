"""The language-model head over arrays: ``logits = h @ weight.T + bias`` and their loss, fused.

The weight is ``[V, D]`` (the layout of an embedding table, so a head can be tied to one). The
computation dtype is ``dtype``, or the weight's: ``h``, the weight and the bias are cast to it.

Example:
  >>> import jax.numpy as jnp
  >>> from jaxfuse.blocks import lm_head
  >>> h, weight = jnp.ones((2, 3, 4)), jnp.zeros((10, 4))
  >>> lm_head.logits(h[:, -1:], weight).shape       # materialized: a small slice of h
  (2, 1, 10)
  >>> lm_head.loss(h, weight, jnp.zeros((2, 3), jnp.int32)).round(4)   # log(10)
  Array(2.3026, dtype=float32)
"""

from __future__ import annotations

from typing import Any

import jax

from jaxfuse.ops import cross_entropy

Array = jax.Array


def cast(h: Array, weight: Array, bias: Array | None, dtype: Any = None) -> tuple:
  """``(h, weight, bias)`` in the computation dtype (default: the weight's)."""
  dtype = dtype or weight.dtype
  return h.astype(dtype), weight.astype(dtype), None if bias is None else bias.astype(dtype)


def loss(h: Array, weight: Array, labels: Array, bias: Array | None = None, *,
         dtype: Any = None, **options) -> Array:
  """:func:`jaxfuse.ops.linear_cross_entropy` of the head: the ``[tokens, V]`` logits never
  exist beyond a chunk; ``options`` are that op's (``ignore_index``, ``reduction``,
  ``label_smoothing``, ``z_loss``, ``logit_softcap``, ``chunk_size``, ``grad_in_forward``,
  ``implementation``)."""
  h, weight, bias = cast(h, weight, bias, dtype)
  return cross_entropy.linear_cross_entropy(h, weight, labels, bias=bias, **options)


def log_probs(h: Array, weight: Array, tokens: Array, bias: Array | None = None, *,
              dtype: Any = None, **options):
  """:func:`jaxfuse.ops.linear_log_probs` of the head: per-token ``log p(token)`` (and with
  ``return_entropy`` the entropies) without the ``[tokens, V]`` logits; ``options`` are that
  op's (``temperature``, ``logit_softcap``, ``ignore_index``, ``return_entropy``,
  ``chunk_size``, ``implementation``)."""
  h, weight, bias = cast(h, weight, bias, dtype)
  return cross_entropy.linear_log_probs(h, weight, tokens, bias=bias, **options)


def logits(h: Array, weight: Array, bias: Array | None = None, *, dtype: Any = None) -> Array:
  """Float32 logits ``h @ weight.T + bias`` (materialized: use on few positions)."""
  return cross_entropy.linear_logits(*cast(h, weight, bias, dtype))
