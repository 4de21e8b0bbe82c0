"""Flax Linen attention modules over :func:`jaxfuse.ops.dot_product_attention`.

:class:`MultiHeadDotProductAttention` (alias :class:`MultiHeadAttention`) and
:class:`SelfAttention` take the attributes and create the parameters (``query``, ``key``,
``value``, ``out``; ``query_ln``, ``key_ln`` with ``normalize_qk``) of their
:mod:`flax.linen` namesakes, so variables move between the two unchanged. They add
``num_kv_heads`` (grouped-query attention) and an optional rotary embedding; they leave out
attention dropout and the decode cache.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import linen as nn

from jaxfuse.blocks import attention as blocks
from jaxfuse.blocks.torch_names import attention_torch_params

Initializer = Callable[..., jax.Array]


class MultiHeadDotProductAttention(nn.Module):
  """Multi-head (and grouped-query) attention whose backward recomputes the scores.

  Attributes:
    num_heads: query heads; they divide ``qkv_features``.
    dtype: the computation dtype (default: inferred from inputs and parameters).
    param_dtype: the parameters' dtype.
    qkv_features: features of the projections (default: those of ``inputs_q``).
    out_features: features of the output (default: those of ``inputs_q``).
    num_kv_heads: key/value heads (default ``num_heads``); fewer gives grouped-query attention.
    precision: of the projections.
    kernel_init, bias_init, out_kernel_init, out_bias_init, use_bias: as in flax.
    decode: must be False (no autoregressive cache).
    normalize_qk: layer-normalize queries and keys per head.
    rotary: apply rotary position embeddings to queries and keys.
    rotary_base: RoPE's wavelength base.
    implementation: of :func:`jaxfuse.ops.attention` (None: the fastest here).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import jaxfuse.linen
    >>> layer = jaxfuse.linen.MultiHeadDotProductAttention(num_heads=4, qkv_features=32)
    >>> x = jnp.ones((2, 10, 32))
    >>> variables = layer.init(jax.random.key(0), x)
    >>> layer.apply(variables, x, is_causal=True).shape
    (2, 10, 32)
  """

  num_heads: int
  dtype: jnp.dtype | None = None
  param_dtype: jnp.dtype = jnp.float32
  qkv_features: int | None = None
  out_features: int | None = None
  num_kv_heads: int | None = None
  precision: jax.lax.PrecisionLike = None
  kernel_init: Initializer = nn.linear.default_kernel_init
  out_kernel_init: Initializer | None = None
  bias_init: Initializer = nn.initializers.zeros_init()
  out_bias_init: Initializer | None = None
  use_bias: bool = True
  decode: bool = False
  normalize_qk: bool = False
  rotary: bool = False
  rotary_base: float = 10000.0
  implementation: str | None = None

  @nn.compact
  def __call__(self, inputs_q: jax.Array, inputs_k: jax.Array | None = None,
               inputs_v: jax.Array | None = None, *, mask: jax.Array | None = None,
               is_causal: bool = False, segment_ids=None, kv_lengths: jax.Array | None = None,
               positions: jax.Array | None = None, kv_positions: jax.Array | None = None,
               deterministic: bool | None = None) -> jax.Array:
    """Attends from ``inputs_q`` to ``inputs_k``/``inputs_v`` (default: ``inputs_q``).

    ``inputs_q`` is ``[batch..., q_len, features]``, ``inputs_k`` and ``inputs_v``
    ``[batch..., kv_len, features]`` (``inputs_v`` defaults to ``inputs_k``, which defaults to
    ``inputs_q``); the other arguments are :func:`jaxfuse.blocks.attention.attend_projected`'s.
    ``deterministic`` is accepted for flax compatibility (there is no dropout).
    """
    del deterministic
    if self.decode:
      raise NotImplementedError("MultiHeadDotProductAttention: decode=True is not supported")
    owner = "MultiHeadDotProductAttention"
    inputs_k, inputs_v, self_attention = blocks.key_value_inputs(owner, inputs_q, inputs_k,
                                                                 inputs_v)
    features = self.out_features or inputs_q.shape[-1]
    num_kv_heads = self.num_kv_heads or self.num_heads
    head_dim = blocks.head_dim(owner, self.num_heads, num_kv_heads,
                               self.qkv_features or inputs_q.shape[-1], rotary=self.rotary)

    def dense(heads, name):
      return nn.DenseGeneral(features=(heads, head_dim), axis=-1, dtype=self.dtype,
                             param_dtype=self.param_dtype, kernel_init=self.kernel_init,
                             bias_init=self.bias_init, use_bias=self.use_bias,
                             precision=self.precision, name=name)

    query = dense(self.num_heads, "query")(inputs_q)
    key = dense(num_kv_heads, "key")(inputs_k)
    value = dense(num_kv_heads, "value")(inputs_v)
    if self.normalize_qk:
      query = nn.LayerNorm(name="query_ln", use_bias=False, dtype=self.dtype,
                           param_dtype=self.param_dtype)(query)
      key = nn.LayerNorm(name="key_ln", use_bias=False, dtype=self.dtype,
                         param_dtype=self.param_dtype)(key)
    x = blocks.attend_projected(query, key, value, self_attention=self_attention,
                                rotary=self.rotary, rotary_base=self.rotary_base,
                                positions=positions, kv_positions=kv_positions, mask=mask,
                                is_causal=is_causal, segment_ids=segment_ids,
                                kv_lengths=kv_lengths, implementation=self.implementation)
    return nn.DenseGeneral(features=features, axis=(-2, -1),
                           kernel_init=self.out_kernel_init or self.kernel_init,
                           bias_init=self.out_bias_init or self.bias_init,
                           use_bias=self.use_bias, dtype=self.dtype,
                           param_dtype=self.param_dtype, precision=self.precision,
                           name="out")(x)

  @property
  def TORCH_PARAMS(self) -> dict:  # noqa: N802 (the name every module's map has)
    """``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` torch ``nn.Linear`` weights (and biases),
    as :func:`jaxfuse.blocks.torch_names.attention_torch_params`."""
    return attention_torch_params(self.use_bias, self.normalize_qk)


class MultiHeadAttention(MultiHeadDotProductAttention):
  """Alias of :class:`MultiHeadDotProductAttention` (named ``MultiHeadAttention_<n>``)."""


class SelfAttention(MultiHeadDotProductAttention):
  """:class:`MultiHeadDotProductAttention` of a sequence over itself.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import jaxfuse.linen
    >>> layer = jaxfuse.linen.SelfAttention(num_heads=2)
    >>> x = jnp.ones((3, 7, 16))
    >>> layer.apply(layer.init(jax.random.key(0), x), x, is_causal=True).shape
    (3, 7, 16)
  """

  @nn.compact
  def __call__(self, inputs_q: jax.Array, *, mask: jax.Array | None = None,
               is_causal: bool = False, segment_ids=None, kv_lengths: jax.Array | None = None,
               positions: jax.Array | None = None,
               deterministic: bool | None = None) -> jax.Array:
    return super().__call__(inputs_q, mask=mask, is_causal=is_causal, segment_ids=segment_ids,
                            kv_lengths=kv_lengths, positions=positions,
                            deterministic=deterministic)
