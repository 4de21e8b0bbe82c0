"""A LLaMA-family decoder language model (LLaMA, Mistral, Qwen2) built from jaxfuse parts.

``Decoder(cfg, rngs=...)`` is a stack of pre-norm blocks: RMSNorm, attention (grouped-query,
rotary, causal, optionally a sliding window), RMSNorm, a SwiGLU MLP; then a final RMSNorm and
the LM head. ``fused`` chooses how it computes, never what parameters it has:

- ``fused=True``: the residual add and the next RMSNorm are one op (:func:`add_rms_norm`); the
  attention is :func:`jaxfuse.ops.attention` (saves its output and log-sum-exp, never the
  scores); the MLP is :class:`jaxfuse.nnx.GatedMLP` (recomputes its hidden activation); the head
  is :class:`jaxfuse.nnx.LMHead` (the fused linear cross-entropy: no ``[tokens, V]`` logits).
- ``fused=False``: the same model from plain flax/jax parts: ``nnx.RMSNorm``,
  ``jax.nn.dot_product_attention``, a SwiGLU of ``nnx.Linear`` calls, full logits and
  ``optax.softmax_cross_entropy_with_integer_labels``. It is the baseline every figure is
  measured against; :func:`nnx.state` of one loads into the other.

The parameter tree follows Hugging Face's names (``layers[i].self_attn.q_proj``,
``mlp.gate_proj``, ``input_layernorm``, ...), so :mod:`jaxfuse.interop` maps it one to one.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from flax import nnx
  >>> from jaxfuse.models import Decoder, DecoderConfig
  >>> cfg = DecoderConfig(vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
  ...                     mlp_dim=128)
  >>> model = Decoder(cfg, rngs=nnx.Rngs(0))
  >>> tokens = jnp.zeros((2, 16), jnp.int32)
  >>> model(tokens, next_token_targets(tokens)).shape   # the mean loss
  ()
  >>> model.logits(tokens).shape
  (2, 16, 256)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jax.ad_checkpoint import checkpoint_name

from jaxfuse import nnx as jnnx
from jaxfuse import parallel
from jaxfuse.models.config import DecoderConfig
from jaxfuse.ops import dense, names, rotary_embedding
from jaxfuse.ops.flash_attention import attention
from jaxfuse.remat.layers import LayerStack, stacked

IGNORE_INDEX = -100
_HIGHEST = jax.lax.Precision.HIGHEST

# The logical axes of the parameters (the end of each parameter's path; see
# jaxfuse.parallel.annotate): Megatron's tensor parallelism (q/k/v, gate and up split by their
# outputs, o and down by their inputs, the vocabulary split in the embedding and head) and
# FSDP over d_model. Norm scales are replicated.
PARAM_AXES = {
    r"embed_tokens\.embedding": ("vocab", "embed"),
    r"q_proj\.kernel": ("embed", "heads"),
    r"q_proj\.bias": ("heads",),
    r"[kv]_proj\.kernel": ("embed", "kv_heads"),
    r"[kv]_proj\.bias": ("kv_heads",),
    r"o_proj\.kernel": ("heads", "embed"),
    r"o_proj\.bias": ("embed",),
    r"(gate|up)_proj\.kernel": ("embed", "mlp"),
    r"(gate|up)_proj\.bias": ("mlp",),
    r"down_proj\.kernel": ("mlp", "embed"),
    r"down_proj\.bias": ("embed",),
    r"lm_head\.kernel": ("vocab", "embed"),
    r"lm_head\.bias": ("vocab",),
    r"scale": ("norm",),
}

# The logical axes of the activations (jaxfuse.parallel.constrain): the residual stream, which
# sequence parallelism splits over the sequence between the blocks' projections, and the
# heads inside attention.
STREAM = ("batch", "residual_seq", "act_embed")
HEADS = ("batch", "seq", "act_heads", None)
KV_HEADS = ("batch", "seq", "act_kv_heads", None)
FULL_SEQ = ("batch", "seq", "act_embed")


def next_token_targets(tokens: jax.Array, ignore_index: int = IGNORE_INDEX) -> jax.Array:
  """``targets[:, t] = tokens[:, t + 1]``, with ``ignore_index`` at the last position: the
  language-model targets (Hugging Face's ``labels=input_ids`` shifts them the same way)."""
  pad = jnp.full(tokens.shape[:-1] + (1,), ignore_index, tokens.dtype)
  return jnp.concatenate([tokens[..., 1:], pad], axis=-1)


def _linear(cfg: DecoderConfig, n_in: int, n_out: int, use_bias: bool, rngs: nnx.Rngs):
  return nnx.Linear(n_in, n_out, use_bias=use_bias, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                    precision=_HIGHEST, rngs=rngs,
                    kernel_init=nnx.initializers.normal(cfg.initializer_range))


def _project(linear: nnx.Linear, x: jax.Array, fused: bool) -> jax.Array:
  """``x @ kernel + bias``: jaxfuse's dense (its weight gradient in XLA:CPU's fast layout), or
  the plain ``nnx.Linear`` call."""
  if not fused:
    return linear(x)
  kernel = linear.kernel[...].astype(x.dtype)
  bias = None if linear.bias is None else linear.bias[...].astype(x.dtype)
  return dense(x, kernel, bias, precision=_HIGHEST)


class Attention(nnx.Module):
  """Grouped-query self-attention with rotary embeddings; HF's ``self_attn`` parameters."""

  def __init__(self, cfg: DecoderConfig, *, fused: bool, implementation: str | None,
               rngs: nnx.Rngs):
    hd = cfg.head_dim
    self.cfg = cfg
    self.fused = fused
    self.implementation = implementation
    self.q_proj = _linear(cfg, cfg.d_model, cfg.num_heads * hd, cfg.qkv_bias, rngs)
    self.k_proj = _linear(cfg, cfg.d_model, cfg.kv_heads * hd, cfg.qkv_bias, rngs)
    self.v_proj = _linear(cfg, cfg.d_model, cfg.kv_heads * hd, cfg.qkv_bias, rngs)
    self.o_proj = _linear(cfg, cfg.num_heads * hd, cfg.d_model, cfg.o_bias, rngs)

  def _qkv(self, x):
    """The column-parallel q, k and v projections: under a mesh their outputs are split by
    heads. With sequence parallelism their input is gathered over the sequence first, and the
    backward pass gathers it again instead of keeping the whole sequence on every device
    (Megatron's choice; the MLP's recomputed block does the same)."""

    def project(x):
      return tuple(parallel.constrain(_project(proj, x, self.fused), ..., axis)
                   for proj, axis in ((self.q_proj, "act_heads"), (self.k_proj, "act_kv_heads"),
                                      (self.v_proj, "act_kv_heads")))

    if parallel.mesh_size("residual_seq") > parallel.mesh_size("seq"):
      project = jax.checkpoint(project, policy=jax.checkpoint_policies.nothing_saveable)
    return project(x)

  def _heads(self, x, positions):
    cfg, hd = self.cfg, self.cfg.head_dim
    lead = x.shape[:-1]
    q, k, v = self._qkv(x)
    q = q.reshape(*lead, cfg.num_heads, hd)
    k, v = k.reshape(*lead, cfg.kv_heads, hd), v.reshape(*lead, cfg.kv_heads, hd)
    q = parallel.constrain(rotary_embedding(q, positions, base=cfg.rope_theta), *HEADS)
    k = parallel.constrain(rotary_embedding(k, positions, base=cfg.rope_theta), *KV_HEADS)
    v = parallel.constrain(v, *KV_HEADS)
    if not self.fused:   # jaxfuse's attention names its own inputs
      q, k, v = (checkpoint_name(x, n) for x, n in ((q, names.ATTN_Q), (k, names.ATTN_K),
                                                   (v, names.ATTN_V)))
    return q, k, v

  def _out(self, o):
    o = parallel.constrain(o, *HEADS)
    o = parallel.constrain(o.reshape(*o.shape[:-2], -1), ..., "act_heads")   # row-parallel
    out = _project(self.o_proj, o, self.fused)
    return checkpoint_name(parallel.constrain(out, *STREAM), names.ATTN_PROJ)

  def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """Causal attention of ``x`` at ``positions`` (in zig-zag order when the sequence is split
    over the mesh: see :meth:`Decoder.sequence_order`)."""
    q, k, v = self._heads(x, positions)
    window = self.cfg.sliding_window
    if parallel.mesh_size("seq") > 1:
      if not self.fused or window is not None:
        raise ValueError("Decoder: a sequence split over the mesh (context parallelism) runs "
                         "jaxfuse's ring attention: it needs fused=True and no sliding window")
      o = parallel.context_parallel_attention(q, k, v, causal=True,
                                              implementation=self.implementation)
    elif self.fused:
      o = attention(q, k, v, causal=True, sliding_window=window,
                    implementation=self.implementation)
    else:
      local = None if window is None else (window - 1, 0)
      o = checkpoint_name(
          jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=local,
                                       implementation="xla"), names.ATTN_OUT)
    return self._out(o)

  def decode(self, x: jax.Array, positions: jax.Array, cache: dict, length: jax.Array):
    """Attention of ``x`` (``t`` new tokens at ``positions``) over the cached keys and values
    ``[0, length)`` and its own; returns the output and the cache with its keys and values."""
    q, k, v = self._heads(x, positions)
    t = x.shape[-2]
    keys = jax.lax.dynamic_update_slice_in_dim(cache["k"], k.astype(cache["k"].dtype), length,
                                               axis=1)
    values = jax.lax.dynamic_update_slice_in_dim(cache["v"], v.astype(cache["v"].dtype), length,
                                                 axis=1)
    kv_lengths = jnp.full(x.shape[:1], length + t, jnp.int32)
    o = attention(q, keys.astype(q.dtype), values.astype(q.dtype), causal="bottom_right",
                  kv_lengths=kv_lengths, sliding_window=self.cfg.sliding_window,
                  implementation=self.implementation)
    return self._out(o), {"k": keys, "v": values}


class MLP(jnnx.GatedMLP):
  """LLaMA's SwiGLU MLP: ``down_proj(silu(gate_proj(x)) * up_proj(x))``; the fused path is
  :class:`jaxfuse.nnx.GatedMLP`'s, the unfused one calls the ``nnx.Linear`` submodules."""

  def __init__(self, cfg: DecoderConfig, *, fused: bool, implementation: str | None,
               rngs: nnx.Rngs):
    super().__init__(cfg.d_model, cfg.mlp_dim, use_bias=cfg.mlp_bias, dtype=cfg.dtype,
                     param_dtype=cfg.param_dtype, implementation=implementation,
                     kernel_init=nnx.initializers.normal(cfg.initializer_range), rngs=rngs)
    self.fused = fused

  def __call__(self, x: jax.Array) -> jax.Array:
    if self.fused:
      return parallel.constrain(super().__call__(x), *STREAM)
    gate = checkpoint_name(self.gate_proj(x), names.MLP_GATE)
    up = checkpoint_name(self.up_proj(x), names.MLP_UP)
    hidden = checkpoint_name(jax.nn.silu(gate) * up, names.MLP_HIDDEN)
    return checkpoint_name(parallel.constrain(self.down_proj(hidden), *STREAM), names.MLP_DOWN)


class _PlainRMSNorm(nnx.RMSNorm):
  """flax's RMSNorm with its output named ``norm.out`` (jaxfuse's norms name their own)."""

  def __call__(self, x, mask=None):
    return checkpoint_name(super().__call__(x, mask), names.NORM_OUT)


def _norm(cfg: DecoderConfig, fused: bool, implementation: str | None, rngs: nnx.Rngs):
  if fused:
    return jnnx.RMSNorm(cfg.d_model, epsilon=cfg.rms_norm_eps, dtype=cfg.dtype,
                        param_dtype=cfg.param_dtype, implementation=implementation, rngs=rngs)
  return _PlainRMSNorm(cfg.d_model, epsilon=cfg.rms_norm_eps, dtype=cfg.dtype,
                       param_dtype=cfg.param_dtype, rngs=rngs)


class Block(nnx.Module):
  """One pre-norm decoder block (HF's ``LlamaDecoderLayer`` parameters)."""

  def __init__(self, cfg: DecoderConfig, *, fused: bool, implementation: str | None,
               rngs: nnx.Rngs):
    self.fused = fused
    self.input_layernorm = _norm(cfg, fused, implementation, rngs)
    self.self_attn = Attention(cfg, fused=fused, implementation=implementation, rngs=rngs)
    self.post_attention_layernorm = _norm(cfg, fused, implementation, rngs)
    self.mlp = MLP(cfg, fused=fused, implementation=implementation, rngs=rngs)

  def __call__(self, h: jax.Array, positions: jax.Array) -> jax.Array:
    """The unfused block: ``h + attn(norm(h))``, then ``+ mlp(norm(.))``."""
    h = parallel.constrain(h, *STREAM)
    h = h + self.self_attn(self.input_layernorm(h), positions)
    return h + self.mlp(self.post_attention_layernorm(h))

  def fused_call(self, pending: jax.Array, stream: jax.Array,
                 positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The fused block: the residual stream is ``stream + pending``, where ``pending`` is the
    previous block's MLP output (zeros before the first block), added by this block's input
    RMSNorm in the same op. Returns this block's ``(pending, stream)``: each residual add is
    fused with the RMSNorm that follows it."""
    pending = checkpoint_name(parallel.constrain(pending, *STREAM), names.BLOCK_INPUT)
    stream = checkpoint_name(parallel.constrain(stream, *STREAM), names.BLOCK_INPUT)
    normed, stream = self.input_layernorm.add(pending, stream)
    a = self.self_attn(normed, positions)
    normed, stream = self.post_attention_layernorm.add(a, stream)
    return self.mlp(normed), stream

  def stream_call(self, h: jax.Array, positions: jax.Array) -> jax.Array:
    """The fused block on the whole residual stream ``h``: the post-attention add is fused
    with its RMSNorm; the MLP's output is added to the stream by itself. One array crosses the
    block's boundary (what a recomputed block keeps) instead of two."""
    h = checkpoint_name(parallel.constrain(h, *STREAM), names.BLOCK_INPUT)
    a = self.self_attn(self.input_layernorm(h), positions)
    normed, stream = self.post_attention_layernorm.add(a, h)
    return stream + self.mlp(normed)

  def step(self, carry, positions):
    """One block on the carry of :meth:`Decoder.hidden`: ``(pending, stream)`` when fused (a
    tuple), the residual stream otherwise."""
    if isinstance(carry, tuple):
      return self.fused_call(*carry, positions)
    if self.fused:
      return self.stream_call(carry, positions)
    return self(checkpoint_name(carry, names.BLOCK_INPUT), positions)


class Decoder(LayerStack, nnx.Module):
  """A decoder-only language model; see the module docstring.

  Args:
    cfg: the :class:`DecoderConfig`.
    fused: jaxfuse's fused ops (True) or plain flax/jax parts (False), on the same parameters.
    remat: what each block's backward keeps. ``None``: no recomputation beyond the ops' own
      (the fused MLP recomputes its hidden activation); ``"block"``: only the block's input
      (the same as ``"nothing"``); any policy :func:`jaxfuse.remat.resolve_policy` takes (a
      preset, a MaxText recipe, a list of names, a ``{name: "remat" | "device" | "offload"}``
      table), applied to every block; or a :class:`jaxfuse.remat.Plan`, one policy per block.
      Under a policy the blocks' ops keep nothing of their own accord: the policy decides, by
      the names of :mod:`jaxfuse.ops.names`; and the blocks pass one array between them (the
      residual stream, its last add not fused with the next RMSNorm), so that a block that
      keeps only its input keeps one array, not two.
    segments: ``None``, ``"sqrt"`` or a number of blocks: checkpoint segments of about
      √L blocks (each keeps only its input; Chen et al. 2016), see
      :mod:`jaxfuse.remat.layers`.
    scan_layers: stack the blocks' parameters on a leading layer axis (``nnx.vmap`` to create
      them) and run them as a ``jax.lax.scan``: the traced program, and so the compile time,
      stays the same size as the layers grow. :func:`stack_layers` and
      :func:`unstack_layers` convert the parameters between the two layouts.
    grad_in_forward: the fused head computes its gradients with the loss (three
      ``tokens x d_model x V`` matmuls, as the plain loss, and keeps ``dW`` and ``dh``), or, with
      False, recomputes the logits in the backward (four matmuls, keeps 4 bytes a token); see
      :func:`jaxfuse.ops.linear_cross_entropy`. A training step needs the gradient right after
      the loss, so the default is the faster one.
    implementation: passed to every jaxfuse op (None: the fastest here).
    rngs: for the initializers.
  """

  def __init__(self, cfg: DecoderConfig, *, fused: bool = True, remat=None,
               segments: str | int | None = None, scan_layers: bool = False,
               grad_in_forward: bool = True, implementation: str | None = None,
               rngs: nnx.Rngs):
    self.cfg = cfg
    self.fused = fused
    self.scan_layers = scan_layers
    self.grad_in_forward = grad_in_forward
    self.implementation = implementation
    self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype,
                                  param_dtype=cfg.param_dtype, rngs=rngs,
                                  embedding_init=nnx.initializers.normal(cfg.initializer_range))

    def block(rngs):
      return Block(cfg, fused=fused, implementation=implementation, rngs=rngs)

    if scan_layers:
      self.layers = stacked(block, cfg.num_layers, rngs)
    else:
      self.layers = nnx.List([block(rngs) for _ in range(cfg.num_layers)])
    self.norm = _norm(cfg, fused, implementation, rngs)
    self.lm_head = jnnx.LMHead(
        cfg.d_model, cfg.vocab_size, tie_to=self.embed_tokens if cfg.tie_embeddings else None,
        dtype=cfg.dtype, param_dtype=cfg.param_dtype, ignore_index=IGNORE_INDEX,
        kernel_init=nnx.initializers.normal(cfg.initializer_range),
        grad_in_forward=grad_in_forward, implementation=implementation, rngs=rngs)
    self.set_remat(remat, segments)
    parallel.annotate(self, PARAM_AXES)

  # Recomputation ------------------------------------------------------------------------------

  def with_layers(self, scan_layers: bool) -> Decoder:
    """This model with its blocks unrolled (``False``) or stacked for a scan (``True``), its
    parameters copied (:func:`stack_layers`, :func:`unstack_layers`)."""
    if scan_layers == self.scan_layers:
      return self
    other = nnx.eval_shape(lambda: Decoder(
        self.cfg, fused=self.fused, remat=self.remat, segments=self.segments,
        scan_layers=scan_layers, grad_in_forward=self.grad_in_forward,
        implementation=self.implementation, rngs=nnx.Rngs(0)))
    convert = stack_layers if scan_layers else unstack_layers
    state = nnx.state(other)
    nnx.replace_by_pure_dict(state, convert(nnx.state(self), self.cfg.num_layers))
    nnx.update(other, state)
    return other

  def block_carry(self, tokens: jax.Array) -> Any:
    """What the first block receives for ``tokens`` (the input of :meth:`Block.step`): when
    fused and no block is recomputed, ``(pending, stream)``, so that each residual add is fused
    with the RMSNorm after it across the blocks' boundary; otherwise the embedded tokens, the
    one array a recomputed block keeps."""
    h = parallel.constrain(self._embed(tokens), *STREAM)
    return (jnp.zeros_like(h), h) if self._pending_carry else h

  def _embed(self, tokens):
    """The embedded tokens: vocab-parallel where the mesh splits the vocabulary."""
    if parallel.mesh_size("vocab") == 1:
      return self.embed_tokens(tokens)
    table = self.embed_tokens.embedding[...]
    return parallel.embed(table.astype(self.cfg.dtype or table.dtype), tokens, STREAM)

  @property
  def _pending_carry(self) -> bool:
    return self.fused and self.segments is None and all(
        p is None for p in self.layer_policies)

  def remat_block(self, batch) -> tuple:
    """``(step, carry)`` for :func:`jaxfuse.remat.profile`: ``carry = step(self.layer(i),
    carry)`` runs block ``i``; ``batch`` is ``(tokens, ...)`` or the tokens."""
    tokens = batch[0] if isinstance(batch, (tuple, list)) else batch
    positions = jnp.arange(tokens.shape[-1])
    return (lambda block, carry: block.step(carry, positions)), self.block_carry(tokens)

  # Training -----------------------------------------------------------------------------------

  @staticmethod
  def sequence_order(length: int):
    """The order the blocks see a sequence of ``length`` in: None (as given) unless the mesh
    in context splits the sequence (context parallelism), then the zig-zag order of
    :func:`jaxfuse.parallel.zigzag_order`, which balances the causal ring attention."""
    parts = parallel.mesh_size("seq")
    return None if parts == 1 else parallel.zigzag_order(length, parts)

  def _hidden(self, tokens, positions):
    """The final hidden states in the blocks' order, with the positions the blocks saw."""
    if positions is None:
      positions = jnp.arange(tokens.shape[-1])
    order = self.sequence_order(tokens.shape[-1])
    if order is not None:
      tokens, positions = tokens[..., order], positions[..., order]
    carry = self.apply_blocks(self.block_carry(tokens), positions)
    if isinstance(carry, tuple):
      h = self.norm.add(*carry)[0]
    else:
      h = self.norm(carry)
    return parallel.constrain(h, *FULL_SEQ), order

  def hidden(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
    """The final normalized hidden states ``[batch, seq, d_model]``."""
    h, order = self._hidden(tokens, positions)
    return h if order is None else h[:, np.argsort(order)]

  def __call__(self, tokens: jax.Array, targets: jax.Array,
               positions: jax.Array | None = None) -> jax.Array:
    """The mean cross-entropy of ``targets`` (``IGNORE_INDEX`` where none; see
    :func:`next_token_targets`) given ``tokens``."""
    h, order = self._hidden(tokens, positions)
    if order is not None:
      # The targets in the blocks' order, and the tokens sequence-major: the sequence is split
      # over the mesh, so that flattening [seq, batch] into the loss's rows moves no data.
      targets = targets[..., order]
      h, targets = jnp.swapaxes(h, 0, 1), jnp.swapaxes(targets, 0, 1)
    if self.fused:
      return self.lm_head.loss(h, targets)
    logits = self.logits_from_hidden(h)
    valid = targets != IGNORE_INDEX
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(valid, targets, 0))
    return jnp.sum(jnp.where(valid, losses, 0.0)) / jnp.sum(valid)

  def logits_from_hidden(self, h: jax.Array) -> jax.Array:
    """Float32 logits of normalized hidden states (materialized: use on few positions)."""
    return self.lm_head.logits(h)

  def logits(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
    """Float32 logits ``[batch, seq, V]`` of every position (materialized)."""
    return self.logits_from_hidden(self.hidden(tokens, positions))

  # Decoding with a KV cache -------------------------------------------------------------------

  def init_cache(self, batch: int, max_len: int | None = None, dtype: Any = None) -> dict:
    """An empty KV cache for ``batch`` sequences of up to ``max_len`` tokens (default
    ``cfg.max_seq_len``): per layer, keys and values ``[batch, max_len, kv_heads, head_dim]``."""
    cfg = self.cfg
    max_len = max_len or cfg.max_seq_len
    dtype = dtype or cfg.dtype
    shape = (batch, max_len, cfg.kv_heads, cfg.head_dim)
    layers = [{"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
              for _ in range(cfg.num_layers)]
    return {"layers": layers, "length": jnp.zeros((), jnp.int32)}

  def decode(self, tokens: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
    """Feeds ``tokens [batch, t]`` after the cached ones; returns the float32 logits of the last
    of them ``[batch, V]`` and the updated cache. The prefix is never recomputed: each call
    computes keys and values for its own tokens only."""
    length = cache["length"]
    t = tokens.shape[-1]
    positions = length + jnp.arange(t)
    h = self.embed_tokens(tokens)
    layers = []
    for i, kv in enumerate(cache["layers"]):
      block = self.layer(i)
      a, kv = block.self_attn.decode(block.input_layernorm(h), positions, kv, length)
      h = h + a
      h = h + block.mlp(block.post_attention_layernorm(h))
      layers.append(kv)
    logits = self.logits_from_hidden(self.norm(h[:, -1:]))[:, 0]
    return logits, {"layers": layers, "length": length + t}


def generate(model: Decoder, prompt: jax.Array, steps: int, key: jax.Array, *,
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

  def pick(logits, key):
    if temperature == 0:
      return jnp.argmax(logits, axis=-1).astype(prompt.dtype)
    return jax.random.categorical(key, logits / temperature).astype(prompt.dtype)

  @jax.jit
  def run(state, prompt, key):
    m = nnx.merge(graphdef, state)
    logits, cache = m.decode(prompt, m.init_cache(batch, max_len))
    keys = jax.random.split(key, steps)

    def step(carry, key):
      logits, cache = carry
      token = pick(logits, key)
      logits, cache = m.decode(token[:, None], cache)
      return (logits, cache), token

    _, tokens = jax.lax.scan(step, (logits, cache), keys)
    return jnp.concatenate([prompt, tokens.T], axis=1)

  return run(state, prompt, key)


def stack_layers(state: nnx.State, num_layers: int) -> dict:
  """The state of an unrolled :class:`Decoder` (``nnx.state(model)``) as a pure dict with its
  blocks' parameters stacked, as ``Decoder(..., scan_layers=True)`` holds them (load it with
  ``nnx.replace_by_pure_dict``; :meth:`Decoder.with_layers` does it all).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxfuse.models import Decoder, DecoderConfig
    >>> cfg = DecoderConfig(vocab_size=32, d_model=16, num_layers=3, num_heads=2, mlp_dim=32)
    >>> plain = Decoder(cfg, rngs=nnx.Rngs(0))
    >>> scanned = plain.with_layers(scan_layers=True)
    >>> scanned.layers.mlp.up_proj.kernel.shape      # [layers, d_model, mlp_dim]
    (3, 16, 32)
    >>> tokens = jnp.zeros((1, 5), jnp.int32)
    >>> bool(jnp.allclose(plain.logits(tokens), scanned.logits(tokens), atol=1e-6))
    True
  """
  pure = nnx.to_pure_dict(state)
  layers = [pure["layers"][i] for i in range(num_layers)]
  pure["layers"] = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *layers)
  return pure


def unstack_layers(state: nnx.State, num_layers: int) -> dict:
  """The inverse of :func:`stack_layers`: per-block parameters ``layers[i]`` from stacked ones,
  as a pure dict for ``nnx.update`` of an unrolled :class:`Decoder`."""
  pure = nnx.to_pure_dict(state)
  stackd = pure["layers"]
  pure["layers"] = {i: jax.tree_util.tree_map(lambda x, i=i: x[i], stackd)
                    for i in range(num_layers)}
  return pure


__all__ = ["Attention", "Block", "Decoder", "MLP", "generate", "next_token_targets",
           "stack_layers", "unstack_layers"]
