"""One decoder block and its pieces: attention, MLP, norms (Hugging Face's parameter names).

A :class:`Block` is made of four pieces, each built by a function of the config here
(:func:`make_attention`, :func:`make_mlp`, :func:`make_norm`), so that a model family changes a
piece, not the block: the pieces hold the parameters and call :mod:`jaxfuse.blocks` and
:mod:`jaxfuse.ops`; the block only says how they are wired (pre-norm, the residual adds).

``fused`` chooses how a piece computes, never what parameters it has: jaxfuse's fused ops, or
the same computation from plain flax/jax parts (the baseline every figure is measured
against). Every value a recomputation policy may keep is named (:mod:`jaxfuse.ops.names`).
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxfuse import nnx as jnnx
from jaxfuse import parallel
from jaxfuse.blocks import attention as attention_blocks
from jaxfuse.blocks.linear import HIGHEST, project
from jaxfuse.models import decoding
from jaxfuse.models.axes import HEADS, KV_HEADS, STREAM
from jaxfuse.models.config import DecoderConfig
from jaxfuse.ops import names


def make_linear(cfg: DecoderConfig, n_in: int, n_out: int, use_bias: bool, rngs: nnx.Rngs):
  """An ``nnx.Linear`` (kernel ``[in, out]``) initialized as the config says."""
  return nnx.Linear(n_in, n_out, use_bias=use_bias, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                    precision=HIGHEST, rngs=rngs,
                    kernel_init=nnx.initializers.normal(cfg.initializer_range))


def _project(linear: nnx.Linear, x: jax.Array, fused: bool) -> jax.Array:
  """``x @ kernel + bias``: jaxfuse's dense (:func:`jaxfuse.blocks.linear.project`), or the
  plain ``nnx.Linear`` call."""
  if not fused:
    return linear(x)
  return project(x, linear.kernel[...], None if linear.bias is None else linear.bias[...])


class Attention(nnx.Module):
  """Grouped-query self-attention with rotary embeddings; HF's ``self_attn`` parameters."""

  def __init__(self, cfg: DecoderConfig, *, fused: bool, implementation: str | None,
               rngs: nnx.Rngs):
    hd = cfg.head_dim
    self.cfg = cfg
    self.fused = fused
    self.implementation = implementation
    self.q_proj = make_linear(cfg, cfg.d_model, cfg.num_heads * hd, cfg.qkv_bias, rngs)
    self.k_proj = make_linear(cfg, cfg.d_model, cfg.kv_heads * hd, cfg.qkv_bias, rngs)
    self.v_proj = make_linear(cfg, cfg.d_model, cfg.kv_heads * hd, cfg.qkv_bias, rngs)
    self.o_proj = make_linear(cfg, cfg.num_heads * hd, cfg.d_model, cfg.o_bias, rngs)

  def _qkv(self, x):
    """The column-parallel q, k and v projections: under a mesh their outputs are split by
    heads. With sequence parallelism their input is gathered over the sequence first, and the
    backward pass gathers it again instead of keeping the whole sequence on every device
    (Megatron's choice; the MLP's recomputed block does the same)."""

    def project_all(x):
      return tuple(parallel.constrain(_project(proj, x, self.fused), ..., axis)
                   for proj, axis in ((self.q_proj, "act_heads"), (self.k_proj, "act_kv_heads"),
                                      (self.v_proj, "act_kv_heads")))

    if parallel.mesh_size("residual_seq") > parallel.mesh_size("seq"):
      project_all = jax.checkpoint(project_all, policy=jax.checkpoint_policies.nothing_saveable)
    return project_all(x)

  def heads(self, x: jax.Array, positions: jax.Array):
    """The rotated queries and keys, and the values, ``[batch, seq, heads, head_dim]``, of
    ``x`` at ``positions``."""
    cfg = self.cfg
    q, k, v = self._qkv(x)
    q, k = attention_blocks.rotate(attention_blocks.split_heads(q, cfg.num_heads),
                                   attention_blocks.split_heads(k, cfg.kv_heads),
                                   base=cfg.rope_theta, positions=positions)
    q = parallel.constrain(q, *HEADS)
    k = parallel.constrain(k, *KV_HEADS)
    v = parallel.constrain(attention_blocks.split_heads(v, cfg.kv_heads), *KV_HEADS)
    if not self.fused:   # jaxfuse's attention names its own inputs
      q, k, v = (checkpoint_name(x, n) for x, n in ((q, names.ATTN_Q), (k, names.ATTN_K),
                                                   (v, names.ATTN_V)))
    return q, k, v

  def out(self, o: jax.Array) -> jax.Array:
    """The row-parallel output projection of the attention's heads ``o``."""
    o = parallel.constrain(o, *HEADS)
    o = parallel.constrain(attention_blocks.merge_heads(o), ..., "act_heads")
    out = _project(self.o_proj, o, self.fused)
    return checkpoint_name(parallel.constrain(out, *STREAM), names.ATTN_PROJ)

  def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """Causal attention of ``x`` at ``positions`` (in zig-zag order when the sequence is split
    over the mesh: see :meth:`jaxfuse.models.Decoder.sequence_order`)."""
    q, k, v = self.heads(x, positions)
    o = attention_blocks.causal_attention(q, k, v, fused=self.fused,
                                          sliding_window=self.cfg.sliding_window,
                                          implementation=self.implementation)
    return self.out(o)

  def decode(self, x: jax.Array, positions: jax.Array, cache: dict, length: jax.Array):
    """Attention of ``x`` over the KV cache: see :func:`jaxfuse.models.decoding.attend_cached`."""
    return decoding.attend_cached(self, x, positions, cache, length)


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


def make_norm(cfg: DecoderConfig, fused: bool, implementation: str | None, rngs: nnx.Rngs):
  """The RMSNorm of ``d_model`` features: jaxfuse's (with ``add``, the residual add fused) or
  flax's."""
  if fused:
    return jnnx.RMSNorm(cfg.d_model, epsilon=cfg.rms_norm_eps, dtype=cfg.dtype,
                        param_dtype=cfg.param_dtype, implementation=implementation, rngs=rngs)
  return _PlainRMSNorm(cfg.d_model, epsilon=cfg.rms_norm_eps, dtype=cfg.dtype,
                       param_dtype=cfg.param_dtype, rngs=rngs)


def make_attention(cfg: DecoderConfig, fused: bool, implementation: str | None,
                   rngs: nnx.Rngs) -> Attention:
  """A block's self-attention."""
  return Attention(cfg, fused=fused, implementation=implementation, rngs=rngs)


def make_mlp(cfg: DecoderConfig, fused: bool, implementation: str | None, rngs: nnx.Rngs) -> MLP:
  """A block's MLP (a Mixture-of-Experts layer takes its place: ``x -> y`` of one shape)."""
  return MLP(cfg, fused=fused, implementation=implementation, rngs=rngs)


class Block(nnx.Module):
  """One pre-norm decoder block (HF's ``LlamaDecoderLayer`` parameters)."""

  def __init__(self, cfg: DecoderConfig, *, fused: bool, implementation: str | None,
               rngs: nnx.Rngs):
    self.fused = fused
    self.input_layernorm = make_norm(cfg, fused, implementation, rngs)
    self.self_attn = make_attention(cfg, fused, implementation, rngs)
    self.post_attention_layernorm = make_norm(cfg, fused, implementation, rngs)
    self.mlp = make_mlp(cfg, fused, implementation, rngs)

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
    """One block on the carry of :meth:`jaxfuse.models.Decoder.hidden`: ``(pending, stream)``
    when fused (a tuple), the residual stream otherwise."""
    if isinstance(carry, tuple):
      return self.fused_call(*carry, positions)
    if self.fused:
      return self.stream_call(carry, positions)
    return self(checkpoint_name(carry, names.BLOCK_INPUT), positions)


__all__ = ["Attention", "Block", "MLP", "make_attention", "make_linear", "make_mlp",
           "make_norm"]
