"""Flax NNX attention modules over :func:`jaxfuse.ops.dot_product_attention`.

:class:`MultiHeadAttention` takes the constructor options and has the parameters (``query``,
``key``, ``value``, ``out``; ``query_ln``, ``key_ln`` with ``normalize_qk``) of
:class:`flax.nnx.MultiHeadAttention`, so a state dict moves between the two unchanged. What it
adds: the attention itself saves only its output and log-sum-exp for the backward pass, and an
optional rotary position embedding. What it leaves out: attention dropout and the decode
cache (``decode`` must be False).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import initializers

from jaxfuse.blocks import attention as blocks
from jaxfuse.blocks.torch_names import attention_torch_params

Initializer = Callable[..., jax.Array]
default_kernel_init = initializers.lecun_normal()


class MultiHeadAttention(nnx.Module):
  """Multi-head (and grouped-query) attention whose backward recomputes the scores.

  Args:
    num_heads: query heads; they divide ``qkv_features``.
    in_features: features of ``inputs_q``.
    qkv_features: features of the query, key and value projections (default ``in_features``).
    out_features: features of the output (default ``in_features``).
    num_kv_heads: key/value heads (default ``num_heads``); fewer gives grouped-query attention.
    in_kv_features: features of ``inputs_k`` and ``inputs_v`` (default ``in_features``).
    dtype: the computation dtype (default: inferred from inputs and parameters).
    param_dtype: the parameters' dtype.
    precision: of the projections.
    kernel_init, bias_init: initializers of the projections' kernels and biases.
    out_kernel_init, out_bias_init: of the output projection (default: the above).
    use_bias: whether the projections have biases.
    decode: must be False or None (no autoregressive cache).
    normalize_qk: layer-normalize queries and keys per head (ViT-22B).
    rotary: apply rotary position embeddings to queries and keys.
    rotary_base: RoPE's wavelength base.
    implementation: of :func:`jaxfuse.ops.attention` (None: the fastest here).
    rngs: for the initializers.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import jaxfuse.nnx
    >>> layer = jaxfuse.nnx.MultiHeadAttention(num_heads=4, in_features=32, num_kv_heads=2,
    ...                                        rotary=True, rngs=nnx.Rngs(0))
    >>> x = jnp.ones((2, 10, 32))
    >>> layer(x, is_causal=True).shape
    (2, 10, 32)
  """

  def __init__(
      self,
      num_heads: int,
      in_features: int,
      qkv_features: int | None = None,
      out_features: int | None = None,
      num_kv_heads: int | None = None,
      in_kv_features: int | None = None,
      *,
      dtype=None,
      param_dtype=jnp.float32,
      precision=None,
      kernel_init: Initializer = default_kernel_init,
      out_kernel_init: Initializer | None = None,
      bias_init: Initializer = initializers.zeros_init(),
      out_bias_init: Initializer | None = None,
      use_bias: bool = True,
      decode: bool | None = None,
      normalize_qk: bool = False,
      rotary: bool = False,
      rotary_base: float = 10000.0,
      implementation: str | None = None,
      rngs: nnx.Rngs,
  ):
    if decode:
      raise NotImplementedError("MultiHeadAttention: decode=True (an autoregressive cache) is "
                                "not supported; use flax.nnx.MultiHeadAttention for decoding")
    self.num_heads = num_heads
    self.in_features = in_features
    self.qkv_features = qkv_features if qkv_features is not None else in_features
    self.out_features = out_features if out_features is not None else in_features
    self.in_kv_features = in_kv_features if in_kv_features is not None else in_features
    self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
    self.head_dim = blocks.head_dim("MultiHeadAttention", num_heads, self.num_kv_heads,
                                    self.qkv_features, rotary=rotary)
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.use_bias = use_bias
    self.decode = decode
    self.normalize_qk = normalize_qk
    self.rotary = rotary
    self.rotary_base = rotary_base
    self.implementation = implementation

    def projection(in_features, heads):
      return nnx.LinearGeneral(in_features, (heads, self.head_dim), dtype=dtype,
                               param_dtype=param_dtype, kernel_init=kernel_init,
                               bias_init=bias_init, use_bias=use_bias, precision=precision,
                               rngs=rngs)

    self.query = projection(self.in_features, self.num_heads)
    self.key = projection(self.in_kv_features, self.num_kv_heads)
    self.value = projection(self.in_kv_features, self.num_kv_heads)
    if normalize_qk:
      self.query_ln = nnx.LayerNorm(self.head_dim, use_bias=False, dtype=dtype,
                                    param_dtype=param_dtype, rngs=rngs)
      self.key_ln = nnx.LayerNorm(self.head_dim, use_bias=False, dtype=dtype,
                                  param_dtype=param_dtype, rngs=rngs)
    else:
      self.query_ln = nnx.data(None)
      self.key_ln = nnx.data(None)
    self.out = nnx.LinearGeneral((self.num_heads, self.head_dim), self.out_features, axis=(-2, -1),
                                 kernel_init=out_kernel_init or kernel_init,
                                 bias_init=out_bias_init or bias_init, use_bias=use_bias,
                                 dtype=dtype, param_dtype=param_dtype, precision=precision,
                                 rngs=rngs)

  def __call__(self, inputs_q: jax.Array, inputs_k: jax.Array | None = None,
               inputs_v: jax.Array | None = None, *, mask: jax.Array | None = None,
               is_causal: bool = False, segment_ids=None, kv_lengths: jax.Array | None = None,
               positions: jax.Array | None = None, kv_positions: jax.Array | None = None,
               deterministic: bool | None = None, decode: bool | None = None) -> jax.Array:
    """Attends from ``inputs_q`` to ``inputs_k``/``inputs_v`` (default: ``inputs_q``).

    Args:
      inputs_q: ``[batch..., q_len, in_features]``.
      inputs_k, inputs_v: ``[batch..., kv_len, in_kv_features]``; ``inputs_v`` defaults to
        ``inputs_k``, which defaults to ``inputs_q``.
      mask: boolean, True = attend, broadcastable to ``[batch..., heads, q_len, kv_len]``
        (costs a score-sized bias; prefer the three below).
      is_causal: query ``i`` sees keys ``j <= i``.
      segment_ids: ``[batch..., seq]`` or a pair ``(q_ids, kv_ids)``.
      kv_lengths: ``[batch...]``: keys at or past it are padding.
      positions, kv_positions: rotary positions of the queries and keys (default
        ``arange``; ``kv_positions`` defaults to ``positions`` for self-attention).
      deterministic: accepted for flax compatibility; there is no dropout.
      decode: must be falsy.

    Returns:
      ``[batch..., q_len, out_features]``.
    """
    del deterministic  # no dropout
    if decode:
      raise NotImplementedError("MultiHeadAttention: decode=True is not supported")
    inputs_k, inputs_v, self_attention = blocks.key_value_inputs(
        "MultiHeadAttention", inputs_q, inputs_k, inputs_v)
    if inputs_q.shape[-1] != self.in_features:
      raise ValueError(f"MultiHeadAttention: inputs_q must have {self.in_features} features "
                       f"(last axis), got shape {inputs_q.shape}")
    query, key, value = self.query(inputs_q), self.key(inputs_k), self.value(inputs_v)
    if self.normalize_qk:
      query, key = self.query_ln(query), self.key_ln(key)
    x = blocks.attend_projected(query, key, value, self_attention=self_attention,
                                rotary=self.rotary, rotary_base=self.rotary_base,
                                positions=positions, kv_positions=kv_positions, mask=mask,
                                is_causal=is_causal, segment_ids=segment_ids,
                                kv_lengths=kv_lengths, implementation=self.implementation)
    return self.out(x)

  @property
  def TORCH_PARAMS(self) -> dict:  # noqa: N802 (the name every module's map has)
    """``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` torch ``nn.Linear`` weights (and biases)
    as Hugging Face's attention has them; see
    :func:`jaxfuse.blocks.torch_names.attention_torch_params`.

    Example:
      >>> from flax import nnx
      >>> import jaxfuse.nnx
      >>> layer = jaxfuse.nnx.MultiHeadAttention(num_heads=4, in_features=32, num_kv_heads=2,
      ...                                        use_bias=False, rngs=nnx.Rngs(0))
      >>> layer.TORCH_PARAMS[("key", "kernel")]   # [32, 2, 8] -> [2 * 8, 32]
      ('k_proj.weight', True, (1, 2))
    """
    return attention_torch_params(self.use_bias, self.normalize_qk)


class SelfAttention(MultiHeadAttention):
  """:class:`MultiHeadAttention` of a sequence over itself: ``layer(x, ...)``.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import jaxfuse.nnx
    >>> layer = jaxfuse.nnx.SelfAttention(num_heads=2, in_features=16, rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((3, 7, 16)), is_causal=True).shape
    (3, 7, 16)
  """

  def __call__(self, inputs_q: jax.Array, *, mask: jax.Array | None = None,
               is_causal: bool = False, segment_ids=None, kv_lengths: jax.Array | None = None,
               positions: jax.Array | None = None, deterministic: bool | None = None,
               decode: bool | None = None) -> jax.Array:
    return super().__call__(inputs_q, mask=mask, is_causal=is_causal, segment_ids=segment_ids,
                            kv_lengths=kv_lengths, positions=positions,
                            deterministic=deterministic, decode=decode)
