"""Decoding with a KV cache: the cache, one step of the decoder over it, and :func:`generate`.

The cache holds, per layer, the keys and values ``[batch, max_len, kv_heads, head_dim]`` of the
tokens fed so far, and their number ``length``: one for the whole batch, or one a row
(``[batch]``) once :func:`decode` has been given each row's number of real tokens (right-padded
rows of different lengths). Each step computes keys and values for its own tokens only and
attends over the cached ones and its own (:func:`attend_cached`); the prefix is never
recomputed. :meth:`jaxfuse.models.Decoder.init_cache` and
:meth:`jaxfuse.models.Decoder.decode` call these functions.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfuse.ops.flash_attention import attention


def init_cache(cfg, batch: int, max_len: int | None = None, dtype: Any = None) -> dict:
  """An empty KV cache of a :class:`jaxfuse.models.DecoderConfig` for ``batch`` sequences of up
  to ``max_len`` tokens (default ``cfg.max_seq_len``)."""
  max_len = max_len or cfg.max_seq_len
  dtype = dtype or cfg.dtype
  shape = (batch, max_len, cfg.kv_heads, cfg.head_dim)
  layers = [{"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
            for _ in range(cfg.num_layers)]
  return {"layers": layers, "length": jnp.zeros((), jnp.int32)}


def attend_cached(attn, x: jax.Array, positions: jax.Array, cache: dict, length: jax.Array,
                  kind: str = "full") -> tuple[jax.Array, dict]:
  """Attention of ``x`` (``t`` new tokens at ``positions``) over the cached keys and values
  ``[0, length)`` and its own, by a :class:`jaxfuse.models.Attention` ``attn`` of a layer of
  ``kind``; returns the output and the layer's cache with the new keys and values written at
  ``length``. ``length`` is a scalar or one a row (``[batch]``: each row writes at, and
  attends over, its own length). A sliding-window layer skips the key tiles before its
  window."""
  cfg = attn.cfg
  q, k, v = attn.heads(x, positions, kind)
  t = x.shape[-2]

  def write(cached, new):
    new = new.astype(cached.dtype)
    if jnp.ndim(length) == 0:
      return jax.lax.dynamic_update_slice_in_dim(cached, new, length, axis=1)
    row_write = jax.vmap(lambda c, n, at: jax.lax.dynamic_update_slice_in_dim(c, n, at, axis=0))
    return row_write(cached, new, length)

  keys, values = write(cache["k"], k), write(cache["v"], v)
  kv_lengths = jnp.broadcast_to(length + t, x.shape[:1]).astype(jnp.int32)
  o = attention(q, keys.astype(q.dtype), values.astype(q.dtype), causal="bottom_right",
                kv_lengths=kv_lengths, sliding_window=cfg.window(kind),
                scale=cfg.attention_scale, logit_softcap=cfg.attn_logit_softcap,
                implementation=attn.implementation)
  return attn.out(o), {"k": keys, "v": values}


def decode_block(block, h: jax.Array, positions: jax.Array, cache: dict, length: jax.Array,
                 kind: str = "full") -> tuple[jax.Array, dict]:
  """A :class:`jaxfuse.models.Block` of a layer of ``kind`` on the residual stream ``h`` of
  the new tokens, with its attention over the layer's ``cache``; returns the stream and the
  updated layer cache."""
  before_attn, after_attn, before_mlp, after_mlp = block._norms()
  a, cache = block.self_attn.decode(before_attn(h) if before_attn else h, positions, cache,
                                    length, kind)
  h = h + (after_attn(a) if after_attn else a)
  m = block.mlp(before_mlp(h) if before_mlp else h)
  return h + (after_mlp(m) if after_mlp else m), cache


def decode(model, tokens: jax.Array, cache: dict,
           lengths: jax.Array | None = None) -> tuple[jax.Array, dict]:
  """Feeds ``tokens [batch, t]`` to a :class:`jaxfuse.models.Decoder` after the cached ones;
  returns the float32 logits of the last of them ``[batch, V]`` and the updated cache.

  ``lengths [batch]``: the rows are right-padded, row ``b``'s real tokens are the first
  ``lengths[b]``. The logits are then those of each row's last real token, and the cache holds
  a length a row (its length plus ``lengths[b]``): each row's next tokens go at its own
  position and attend over its own keys only. The padding's keys, written past a row's length,
  are never attended to by real tokens, and later tokens overwrite them."""
  length = cache["length"]
  t = tokens.shape[-1]
  positions = jnp.expand_dims(length, -1) + jnp.arange(t)   # [t], or [batch, t] a row each
  h = model.embed(tokens)
  layers = []
  for i, kv in enumerate(cache["layers"]):
    h, kv = decode_block(model.layer(i), h, positions, kv, length, model.cfg.layer_kind(i))
    layers.append(kv)
  if lengths is None:
    last, length = h[:, -1:], length + t
  else:
    lengths = jnp.asarray(lengths, jnp.int32)
    last = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)
    length = length + lengths
  logits = model.logits_from_hidden(model.norm(last))[:, 0]
  return logits, {"layers": layers, "length": length}


def recompute_position(cfg) -> int | None:
  """The position whose token makes :func:`generate` recompute the cache from the start, or
  None. With longrope (Phi-3) the rotation switches from the short to the long factors once a
  sequence passes the original length; transformers' ``generate`` then re-encodes the whole
  sequence at the first token past it, so that every cached key is rotated by the long
  factors, and :func:`generate` does the same."""
  rope = cfg.rope()
  return rope.param("original_max_position_embeddings") if rope.rope_type == "longrope" else None


def generate(model, prompt: jax.Array, steps: int, key: jax.Array, *,
             temperature: float = 1.0, max_len: int | None = None) -> jax.Array:
  """Samples ``steps`` tokens after ``prompt [batch, t]`` with the KV cache; returns
  ``[batch, t + steps]``. ``temperature=0`` takes the argmax.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxfuse.models import Decoder, DecoderConfig, generate
    >>> cfg = DecoderConfig(vocab_size=32, d_model=16, num_layers=1, num_heads=2, mlp_dim=32)
    >>> model = Decoder(cfg, rngs=nnx.Rngs(0))
    >>> generate(model, jnp.zeros((1, 3), jnp.int32), 5, jax.random.key(0)).shape
    (1, 8)
  """
  batch, t = prompt.shape
  max_len = max_len or t + steps
  if t + steps > max_len:
    raise ValueError(f"generate: prompt ({t}) + steps ({steps}) exceed max_len ({max_len})")
  graphdef, state = nnx.split(model)
  recompute = recompute_position(model.cfg)
  reset = recompute - t if recompute is not None and t <= recompute < t + steps else None

  def pick(logits, key):
    if temperature == 0:
      return jnp.argmax(logits, axis=-1).astype(prompt.dtype)
    return jax.random.categorical(key, logits / temperature).astype(prompt.dtype)

  @jax.jit
  def run(state, prompt, key):
    m = nnx.merge(graphdef, state)
    logits, cache = m.decode(prompt, m.init_cache(batch, max_len))
    keys = jax.random.split(key, steps)
    out = jnp.zeros((batch, t + steps), prompt.dtype).at[:, :t].set(prompt)

    def step(carry, xs):
      logits, cache, out = carry
      i, key = xs
      token = pick(logits, key)
      out = jax.lax.dynamic_update_slice_in_dim(out, token[:, None], t + i, axis=1)
      logits, cache = m.decode(token[:, None], cache)
      return (logits, cache, out), None

    carry = (logits, cache, out)
    if reset is None:
      return jax.lax.scan(step, carry, (jnp.arange(steps), keys))[0][2]
    carry = jax.lax.scan(step, carry, (jnp.arange(reset), keys[:reset]))[0]
    logits, cache, out = carry
    out = out.at[:, t + reset].set(pick(logits, keys[reset]))
    # The whole sequence so far, re-encoded into a fresh cache.
    logits, cache = m.decode(out[:, :t + reset + 1], m.init_cache(batch, max_len))
    rest = jnp.arange(reset + 1, steps)
    return jax.lax.scan(step, (logits, cache, out), (rest, keys[reset + 1:]))[0][2]

  return run(state, prompt, key)
