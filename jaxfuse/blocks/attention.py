"""Attention blocks: what an attention layer does around the attention op, over arrays.

- :func:`head_dim` and :func:`key_value_inputs`: a multi-head attention layer's argument checks
  and defaults (the NNX and Linen modules raise the same errors);
- :func:`rotate`: rotary position embedding of the queries and keys;
- :func:`attend_projected`: :func:`rotate`, then :func:`jaxfuse.ops.dot_product_attention`,
  over projected heads (what :class:`jaxfuse.nnx.MultiHeadAttention` and its Linen twin do
  between their projections);
- :func:`split_heads`, :func:`merge_heads`: ``[..., heads * head_dim]`` to
  ``[..., heads, head_dim]`` and back (a decoder's projections are plain ``Linear`` layers);
- :func:`causal_attention`: a decoder's causal self-attention over projected heads: jaxfuse's
  fused op, ring attention where the mesh splits the sequence, or plain XLA (the baseline).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxfuse import parallel
from jaxfuse.ops import dot_product_attention, names, rotary_embedding
from jaxfuse.ops.flash_attention import attention, attention_reference


def head_dim(owner: str, num_heads: int, num_kv_heads: int, qkv_features: int, *,
             rotary: bool) -> int:
  """The head dim ``qkv_features // num_heads``, after checking that the heads divide.

  Raises:
    ValueError: ``num_kv_heads`` does not divide ``num_heads``, ``num_heads`` does not divide
      ``qkv_features``, or ``rotary`` with an odd head dim; the message starts with ``owner``.
  """
  if num_heads % num_kv_heads:
    raise ValueError(f"{owner}: num_heads ({num_heads}) must be divisible by num_kv_heads "
                     f"({num_kv_heads})")
  if qkv_features % num_heads:
    raise ValueError(f"{owner}: qkv_features ({qkv_features}) must be divisible by num_heads "
                     f"({num_heads})")
  dim = qkv_features // num_heads
  if rotary and dim % 2:
    raise ValueError(f"{owner}: rotary needs an even head dim, got {dim}")
  return dim


def key_value_inputs(owner: str, inputs_q: jax.Array, inputs_k: jax.Array | None,
                     inputs_v: jax.Array | None) -> tuple[jax.Array, jax.Array, bool]:
  """``(inputs_k, inputs_v, self_attention)``: ``inputs_v`` defaults to ``inputs_k``, which
  defaults to ``inputs_q`` (self-attention)."""
  self_attention = inputs_k is None
  if self_attention:
    if inputs_v is not None:
      raise ValueError(f"{owner}: inputs_k cannot be None if inputs_v is given")
    inputs_k = inputs_q
  return inputs_k, inputs_k if inputs_v is None else inputs_v, self_attention


def rotate(query: jax.Array, key: jax.Array, *, base: float = 10000.0,
           positions: jax.Array | None = None, kv_positions: jax.Array | None = None,
           self_attention: bool = True) -> tuple[jax.Array, jax.Array]:
  """Rotary embeddings of queries and keys ``[batch..., seq, heads, head_dim]`` at their
  positions (default ``arange``; the keys take the queries' in self-attention)."""
  if positions is None:
    positions = jnp.arange(query.shape[-3])
  if kv_positions is None:
    kv_positions = positions if self_attention else jnp.arange(key.shape[-3])
  return (rotary_embedding(query, positions, base=base),
          rotary_embedding(key, kv_positions, base=base))


def attend_projected(query: jax.Array, key: jax.Array, value: jax.Array, *, self_attention: bool,
                     rotary: bool = False, rotary_base: float = 10000.0,
                     positions: jax.Array | None = None, kv_positions: jax.Array | None = None,
                     mask: jax.Array | None = None, is_causal: bool = False, segment_ids=None,
                     kv_lengths: jax.Array | None = None,
                     implementation: str | None = None) -> jax.Array:
  """Attention over projected heads ``[batch..., seq, heads, head_dim]``.

  Args:
    query, key, value: the projections' outputs; key and value may have fewer heads.
    self_attention: keys come from the queries' sequence (``kv_positions`` then defaults to
      ``positions``).
    rotary, rotary_base: apply rotary embeddings to queries and keys, with this base.
    positions, kv_positions: their positions (default ``arange`` of each sequence).
    mask, is_causal, segment_ids, kv_lengths, implementation: as
      :func:`jaxfuse.ops.dot_product_attention` takes them.

  Returns:
    ``[batch..., q_len, heads, head_dim]`` in the queries' dtype (keys and values are cast to
    it).

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxfuse.blocks.attention import attend_projected
    >>> q = jnp.ones((2, 5, 4, 8))
    >>> attend_projected(q, q[..., :2, :], q[..., :2, :], self_attention=True, rotary=True,
    ...                  is_causal=True).shape   # 4 query heads, 2 key/value heads
    (2, 5, 4, 8)
  """
  if rotary:
    query, key = rotate(query, key, base=rotary_base, positions=positions,
                        kv_positions=kv_positions, self_attention=self_attention)
  key, value = key.astype(query.dtype), value.astype(query.dtype)
  return dot_product_attention(query, key, value, mask=mask, is_causal=is_causal,
                               segment_ids=segment_ids, kv_lengths=kv_lengths,
                               implementation=implementation)


def split_heads(x: jax.Array, num_heads: int) -> jax.Array:
  """``[..., heads * head_dim]`` as ``[..., heads, head_dim]``."""
  return x.reshape(*x.shape[:-1], num_heads, x.shape[-1] // num_heads)


def merge_heads(x: jax.Array) -> jax.Array:
  """``[..., heads, head_dim]`` as ``[..., heads * head_dim]``."""
  return x.reshape(*x.shape[:-2], -1)


def causal_attention(query: jax.Array, key: jax.Array, value: jax.Array, *, fused: bool,
                     sliding_window: int | None = None, scale: float | None = None,
                     logit_softcap: float | None = None, segment_ids: jax.Array | None = None,
                     implementation: str | None = None) -> jax.Array:
  """Causal self-attention of rotated heads ``[batch, seq, heads, head_dim]`` (keys and values
  may have fewer heads), each query seeing at most ``sliding_window`` keys (itself included),
  the scores scaled by ``scale`` (default ``1 / sqrt(head_dim)``) and soft-capped by
  ``logit_softcap``. With ``segment_ids`` ``[batch, seq]`` (packed documents), a query sees
  only the keys of its own segment.

  ``fused``: :func:`jaxfuse.ops.attention` (keeps its output and log-sum-exp, never the
  scores), or, where the mesh splits the sequence (context parallelism), jaxfuse's ring
  attention. Otherwise ``jax.nn.dot_product_attention`` in XLA (the scores written out, as
  :func:`jaxfuse.ops.attention_reference` does, with a soft-cap), its output named
  ``attn.out`` (the baseline).

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxfuse.blocks.attention import causal_attention
    >>> q, kv = jnp.ones((1, 6, 4, 8)), jnp.ones((1, 6, 2, 8))
    >>> causal_attention(q, kv, kv, fused=False, sliding_window=3).shape
    (1, 6, 4, 8)
  """
  if parallel.mesh_size("seq") > 1:
    if (not fused or sliding_window is not None or logit_softcap is not None
        or segment_ids is not None):
      raise ValueError("Decoder: a sequence split over the mesh (context parallelism) runs "
                       "jaxfuse's ring attention: it needs fused=True, no sliding window, no "
                       "logit soft-cap and no segment ids (packed documents)")
    return parallel.context_parallel_attention(query, key, value, causal=True, scale=scale,
                                               implementation=implementation)
  if fused:
    return attention(query, key, value, causal=True, scale=scale, sliding_window=sliding_window,
                     logit_softcap=logit_softcap, segment_ids=segment_ids,
                     implementation=implementation)
  if logit_softcap is not None:
    out = attention_reference(query, key, value, causal=True, scale=scale,
                              sliding_window=sliding_window, logit_softcap=logit_softcap,
                              segment_ids=segment_ids)
  else:
    local = None if sliding_window is None else (sliding_window - 1, 0)
    mask = (None if segment_ids is None
            else (segment_ids[:, None, :, None] == segment_ids[:, None, None, :]))
    out = jax.nn.dot_product_attention(query, key, value, mask=mask, is_causal=True,
                                       scale=scale, local_window_size=local,
                                       implementation="xla")
  return checkpoint_name(out, names.ATTN_OUT)
