"""What a multi-head attention layer does between its projections: rotary position embedding
of the queries and keys, then :func:`dot_product_attention`. The NNX and Linen modules call
this one function, so they cannot drift apart."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfuse.ops.flash_attention.op import dot_product_attention
from jaxfuse.ops.rotary import rotary_embedding


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
    >>> from jaxfuse.ops.flash_attention.heads import attend_projected
    >>> q = jnp.ones((2, 5, 4, 8))
    >>> attend_projected(q, q, q, self_attention=True, rotary=True, is_causal=True).shape
    (2, 5, 4, 8)
  """
  if rotary:
    if positions is None:
      positions = jnp.arange(query.shape[-3])
    if kv_positions is None:
      kv_positions = positions if self_attention else jnp.arange(key.shape[-3])
    query = rotary_embedding(query, positions, base=rotary_base)
    key = rotary_embedding(key, kv_positions, base=rotary_base)
  key, value = key.astype(query.dtype), value.astype(query.dtype)
  return dot_product_attention(query, key, value, mask=mask, is_causal=is_causal,
                               segment_ids=segment_ids, kv_lengths=kv_lengths,
                               implementation=implementation)
