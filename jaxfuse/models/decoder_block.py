"""One decoder block and its pieces: attention, MLP, norms (Hugging Face's parameter names).

A :class:`Block` is made of pieces, each built by a function of the config here
(:func:`make_attention`, :func:`make_mlp`, :func:`make_norm`), so that a model family changes a
piece, not the block: the pieces hold the parameters and call :mod:`jaxfuse.blocks` and
:mod:`jaxfuse.ops`; the block only says how they are wired (:data:`NORMS`: the norms before
and/or after attention and the MLP, and the residual adds).

``fused`` chooses how a piece computes, never what parameters it has: jaxfuse's fused ops, or
the same computation from plain flax/jax parts (the baseline every figure is measured
against). Every value a recomputation policy may keep is named (:mod:`jaxfuse.ops.names`).

A layer's attention is full or sliding-window (:meth:`DecoderConfig.layer_kind`), with its own
rotary embedding where the family has two (Gemma 3). A block learns its layer's index when it
runs: a Python int when the blocks are unrolled, a traced one when they are scanned, where
layers of different kinds take their branch by ``lax.switch``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxfuse import nnx as jnnx
from jaxfuse import ops, parallel
from jaxfuse.blocks import attention as attention_blocks
from jaxfuse.blocks import moe as moe_blocks
from jaxfuse.blocks.linear import HIGHEST, project
from jaxfuse.models import decoding
from jaxfuse.models.axes import HEADS, KV_HEADS, STREAM
from jaxfuse.models.config import DecoderConfig
from jaxfuse.ops import names
from jaxfuse.remat.recompute import recompute

# The norms of a block by placement, Hugging Face's names: before attention, after it, before
# the MLP, after it (None: no such norm).
NORMS = {
    "pre": ("input_layernorm", None, "post_attention_layernorm", None),
    "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"),
    "post": (None, "post_attention_layernorm", None, "post_feedforward_layernorm"),
}


def make_linear(cfg: DecoderConfig, n_in: int, n_out: int, use_bias: bool, rngs: nnx.Rngs):
  """An ``nnx.Linear`` (kernel ``[in, out]``) initialized as the config says; it may later get
  a LoRA adapter (:func:`jaxfuse.nnx.apply_lora`), which :func:`_project` adds."""
  return nnx.Linear(n_in, n_out, use_bias=use_bias, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                    precision=HIGHEST, rngs=rngs,
                    kernel_init=nnx.initializers.normal(cfg.initializer_range))


def _project(linear: nnx.Linear, x: jax.Array, fused: bool) -> jax.Array:
  """``x @ kernel + bias``, plus ``scale * (x @ lora_a) @ lora_b`` where ``linear`` has a LoRA
  adapter: jaxfuse's dense or LoRA op (:func:`jaxfuse.blocks.linear.project`), or the plain
  ``nnx.Linear`` call and the adapter's two products."""
  adapter = jnnx.adapter_of(linear)
  if not fused:
    y = linear(x)
    return y if adapter is None else y + adapter.delta(x.astype(y.dtype), linear.precision)
  return project(x, linear.kernel[...], None if linear.bias is None else linear.bias[...],
                 adapter=adapter)


def by_kind(cfg: DecoderConfig, index, fn):
  """``fn(kind)`` for layer ``index``'s attention kind (``"full"`` or ``"sliding"``): called
  once when ``index`` is a Python int, else a ``lax.switch`` over the kinds the layers have."""
  kinds = sorted(set(cfg.layer_kinds))
  if isinstance(index, int) or len(kinds) == 1:
    return fn(kinds[0] if len(kinds) == 1 else cfg.layer_kind(index))
  table = jnp.asarray([kinds.index(k) for k in cfg.layer_kinds], jnp.int32)
  return jax.lax.switch(table[index], [functools.partial(fn, k) for k in kinds])


class RMSNorm(nnx.Module):
  """The decoder's RMSNorm (parameter ``scale``; Hugging Face's ``weight``): jaxfuse's fused
  norm, or the plain formula (flax's has no offset); with the family's ``1 + w``
  (``norm_scale_offset``), the scale and its offset added in float32 as Gemma's norms do."""

  def __init__(self, cfg: DecoderConfig, features: int, *, fused: bool,
               implementation: str | None, rngs: nnx.Rngs):
    init = nnx.initializers.zeros if cfg.norm_scale_offset else nnx.initializers.ones
    self.scale = nnx.Param(init(rngs.params(), (features,), cfg.param_dtype))
    self.eps, self.offset, self.dtype = cfg.rms_norm_eps, cfg.norm_scale_offset, cfg.dtype
    self.fused, self.implementation = fused, implementation

  def _scale(self):
    scale = self.scale[...]
    if self.offset:
      return scale.astype(jnp.float32) + self.offset
    return scale.astype(self.dtype or scale.dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x.astype(self.dtype or x.dtype)
    if self.fused:
      return ops.rms_norm(x, self._scale(), eps=self.eps, implementation=self.implementation)
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return checkpoint_name((y * self._scale()).astype(x.dtype), names.NORM_OUT)

  def add(self, x: jax.Array, residual: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(norm(x + residual), x + residual)``, in one kernel when fused."""
    if self.fused:
      dtype = self.dtype or x.dtype
      return ops.add_rms_norm(x.astype(dtype), residual.astype(dtype), self._scale(),
                              eps=self.eps, implementation=self.implementation)
    z = x + residual
    return self(z), z


class _PlainRMSNorm(nnx.RMSNorm):
  """flax's RMSNorm with its output named ``norm.out`` (jaxfuse's norms name their own): the
  baseline's norm where the family has no scale offset."""

  def __call__(self, x, mask=None):
    return checkpoint_name(super().__call__(x, mask), names.NORM_OUT)


def make_norm(cfg: DecoderConfig, fused: bool, implementation: str | None, rngs: nnx.Rngs,
              features: int | None = None) -> RMSNorm | nnx.RMSNorm:
  """An RMSNorm of ``features`` (default ``d_model``): :class:`RMSNorm`, or flax's own in the
  plain-flax baseline of a family without a scale offset."""
  features = features or cfg.d_model
  if not fused and not cfg.norm_scale_offset:
    return _PlainRMSNorm(features, epsilon=cfg.rms_norm_eps, dtype=cfg.dtype,
                         param_dtype=cfg.param_dtype, rngs=rngs)
  return RMSNorm(cfg, features, fused=fused, implementation=implementation, rngs=rngs)


class Attention(nnx.Module):
  """Grouped-query self-attention with rotary embeddings, optionally RMSNorms of the queries
  and keys (``q_norm``, ``k_norm``) before the rotation; Hugging Face's ``self_attn``
  parameters."""

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
    if cfg.qk_norm is not None:
      whole = cfg.qk_norm == "projection"
      self.q_norm = make_norm(cfg, fused, implementation, rngs,
                              hd * (cfg.num_heads if whole else 1))
      self.k_norm = make_norm(cfg, fused, implementation, rngs,
                              hd * (cfg.kv_heads if whole else 1))

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

  def _rotate(self, x, norm, heads, cos, sin):
    """Heads ``x`` (``[..., seq, heads * head_dim]``) normalized as the config says and
    rotated: one fused op (:func:`jaxfuse.ops.qk_norm_rope`) where there is a norm, else
    :func:`jaxfuse.ops.rotary_embedding`."""
    cfg = self.cfg
    if norm is None:
      return ops.rotary_embedding(attention_blocks.split_heads(x, heads), cos=cos, sin=sin)
    if self.fused:
      return ops.qk_norm_rope(attention_blocks.split_heads(x, heads), norm.scale[...], cos, sin,
                              eps=cfg.rms_norm_eps, scale_offset=cfg.norm_scale_offset,
                              over=cfg.qk_norm, implementation=self.implementation)
    if cfg.qk_norm == "projection":
      return ops.rotary_embedding(attention_blocks.split_heads(norm(x), heads), cos=cos, sin=sin)
    return ops.rotary_embedding(norm(attention_blocks.split_heads(x, heads)), cos=cos, sin=sin)

  def heads(self, x: jax.Array, positions: jax.Array, kind: str = "full"):
    """The rotated queries and keys, and the values, ``[batch, seq, heads, head_dim]``, of
    ``x`` at ``positions``, in a layer of ``kind``."""
    cfg = self.cfg
    q, k, v = self._qkv(x)
    cos, sin = cfg.rope(kind).cos_sin(positions)
    q = self._rotate(q, getattr(self, "q_norm", None), cfg.num_heads, cos, sin)
    k = self._rotate(k, getattr(self, "k_norm", None), cfg.kv_heads, cos, sin)
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

  def attend(self, kind: str, x: jax.Array, positions: jax.Array,
             segment_ids: jax.Array | None = None) -> jax.Array:
    """Causal attention of ``x`` at ``positions`` in a layer of ``kind``, within the segments
    of ``segment_ids`` (packed documents) where given."""
    cfg = self.cfg
    q, k, v = self.heads(x, positions, kind)
    o = attention_blocks.causal_attention(q, k, v, fused=self.fused,
                                          sliding_window=cfg.window(kind),
                                          scale=cfg.attention_scale,
                                          logit_softcap=cfg.attn_logit_softcap,
                                          segment_ids=segment_ids,
                                          implementation=self.implementation)
    return self.out(o)

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None,
               index=0) -> jax.Array:
    """Causal attention of ``x`` at ``positions`` (in zig-zag order when the sequence is split
    over the mesh: see :meth:`jaxfuse.models.Decoder.sequence_order`) in layer ``index``, each
    token seeing only its own segment of ``segment_ids`` where given."""
    return by_kind(self.cfg, index, lambda kind: self.attend(kind, x, positions, segment_ids))

  def decode(self, x: jax.Array, positions: jax.Array, cache: dict, length: jax.Array,
             kind: str = "full"):
    """Attention of ``x`` over the KV cache: see :func:`jaxfuse.models.decoding.attend_cached`."""
    return decoding.attend_cached(self, x, positions, cache, length, kind)


class MLP(jnnx.GatedMLP):
  """The gated MLP: ``down_proj(act(gate_proj(x)) * up_proj(x))`` (SwiGLU, Gemma's GeLU-tanh);
  the fused path is :class:`jaxfuse.nnx.GatedMLP`'s, the unfused one calls the ``nnx.Linear``
  submodules (and their LoRA adapters, where they have them: see :func:`_project`)."""

  def __init__(self, cfg: DecoderConfig, *, fused: bool, implementation: str | None,
               rngs: nnx.Rngs):
    super().__init__(cfg.d_model, cfg.mlp_dim, activation=cfg.activation,
                     use_bias=cfg.mlp_bias, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                     implementation=implementation,
                     kernel_init=nnx.initializers.normal(cfg.initializer_range), rngs=rngs)
    self.fused = fused

  def __call__(self, x: jax.Array) -> jax.Array:
    if self.fused:
      return parallel.constrain(super().__call__(x), *STREAM)
    gate = checkpoint_name(_project(self.gate_proj, x, False), names.MLP_GATE)
    up = checkpoint_name(_project(self.up_proj, x, False), names.MLP_UP)
    hidden = checkpoint_name(ops.activations.get(self.activation)(gate) * up, names.MLP_HIDDEN)
    down = _project(self.down_proj, hidden, False)
    return checkpoint_name(parallel.constrain(down, *STREAM), names.MLP_DOWN)


class Experts(nnx.Module):
  """A MoE layer's experts: gated MLPs without biases, their kernels stacked on a leading
  expert axis (``gate_proj``, ``up_proj``: ``[E, d_model, f]``; ``down_proj``: ``[E, f,
  d_model]``), the layout of :func:`jaxfuse.ops.grouped_matmul`."""

  def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
    init = nnx.initializers.normal(cfg.initializer_range)
    e, d, f = cfg.num_experts, cfg.d_model, cfg.expert_mlp_dim
    self.gate_proj = nnx.Param(init(rngs.params(), (e, d, f), cfg.param_dtype))
    self.up_proj = nnx.Param(init(rngs.params(), (e, d, f), cfg.param_dtype))
    self.down_proj = nnx.Param(init(rngs.params(), (e, f, d), cfg.param_dtype))


class MoE(nnx.Module):
  """A Mixture-of-Experts MLP in a block's place (Mixtral, Qwen2-MoE, Qwen3-MoE): a ``router``
  (``nnx.Linear`` ``[d_model, E]``, Hugging Face's ``mlp.gate``) sends each token to its top
  ``experts_per_token`` :class:`Experts` (:func:`jaxfuse.blocks.moe.moe_mlp`: tokens sorted by
  expert, grouped products, dropless unless the config has a ``capacity_factor``). With
  ``shared_expert_mlp_dim`` (Qwen2-MoE) every token also goes through ``shared_expert`` (an
  :class:`MLP`), its output times ``sigmoid(shared_expert_gate(x))``.

  Fused, the experts' MLP is one op (:func:`jaxfuse.ops.grouped_mlp`) and, while no policy of
  the model's decides (``recompute="activation"``, set by the model), the backward keeps only
  the router logits, the routing, the rows sent to the experts and the rows they send back
  (``moe.router``, ``moe.routing``, ``moe.routed``, ``moe.down``: the routing weights'
  gradient reads the last, which would otherwise cost the experts' whole forward again) and
  recomputes the experts' gate and up products once, or keeps those of them that
  ``cfg.expert_keep`` names (``moe.gate``, ``moe.up``); unfused, they are
  :func:`jax.lax.ragged_dot` and nothing is recomputed.
  """

  # What recompute="activation" keeps.
  KEEPS = (names.MOE_ROUTER, names.MOE_ROUTING, names.MOE_ROUTED, names.MOE_DOWN)

  def __init__(self, cfg: DecoderConfig, *, fused: bool, implementation: str | None,
               rngs: nnx.Rngs):
    self.cfg = cfg
    self.fused = fused
    self.implementation = implementation
    self.recompute = "activation"
    self.router = make_linear(cfg, cfg.d_model, cfg.num_experts, False, rngs)
    self.experts = Experts(cfg, rngs=rngs)
    if cfg.shared_expert_mlp_dim:
      shared = dataclasses.replace(cfg, mlp_dim=cfg.shared_expert_mlp_dim, mlp_bias=False)
      self.shared_expert = MLP(shared, fused=fused, implementation=implementation, rngs=rngs)
      self.shared_expert_gate = make_linear(cfg, cfg.d_model, 1, False, rngs)

  def routed(self, x: jax.Array, mask: jax.Array | None = None):
    """``(out, stats)``: the layer's output and its routing statistics
    (:func:`jaxfuse.blocks.moe.router_stats`, over the rows where ``mask`` is true)."""
    cfg = self.cfg
    x = x.astype(cfg.dtype or x.dtype)

    def layer(x, router, gate, up, down, mask):
      return moe_blocks.moe_mlp(x, router, gate, up, down, top_k=cfg.experts_per_token,
                                renormalize=cfg.router_renormalize, activation=cfg.activation,
                                capacity_factor=cfg.capacity_factor, mask=mask,
                                fused=self.fused, implementation=self.implementation,
                                keep=cfg.expert_keep)

    if self.fused and self.recompute == "activation":
      kept = [names.MOE_PRODUCTS[name] for name in cfg.expert_keep]
      layer = recompute(layer, policy=[*self.KEEPS, *kept])
    experts = self.experts
    out, stats = layer(x, self.router.kernel[...], experts.gate_proj[...], experts.up_proj[...],
                       experts.down_proj[...], mask)
    if self.cfg.shared_expert_mlp_dim:
      # As transformers' Qwen2-MoE: sigmoid(x @ w_gate) * shared_expert(x), in x's dtype.
      gate = jax.nn.sigmoid(_project(self.shared_expert_gate, x, self.fused))
      out = out + gate * self.shared_expert(x)
    return parallel.constrain(out, *STREAM), stats

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.routed(x)[0]


def make_attention(cfg: DecoderConfig, fused: bool, implementation: str | None,
                   rngs: nnx.Rngs) -> Attention:
  """A block's self-attention."""
  return Attention(cfg, fused=fused, implementation=implementation, rngs=rngs)


def make_mlp(cfg: DecoderConfig, fused: bool, implementation: str | None,
             rngs: nnx.Rngs) -> MLP | MoE:
  """A block's MLP: gated, or a Mixture of Experts (:class:`MoE`) where the config has
  experts."""
  if cfg.moe:
    return MoE(cfg, fused=fused, implementation=implementation, rngs=rngs)
  return MLP(cfg, fused=fused, implementation=implementation, rngs=rngs)


class Block(nnx.Module):
  """One decoder block (Hugging Face's ``*DecoderLayer`` parameters): attention and the MLP,
  each with the residual add and the norms of the family's placement (:data:`NORMS`)."""

  def __init__(self, cfg: DecoderConfig, *, fused: bool, implementation: str | None,
               rngs: nnx.Rngs):
    self.fused = fused
    self.placement = cfg.norm_placement
    before_attn, after_attn, before_mlp, after_mlp = NORMS[cfg.norm_placement]
    if before_attn:
      setattr(self, before_attn, make_norm(cfg, fused, implementation, rngs))
    self.self_attn = make_attention(cfg, fused, implementation, rngs)
    for name in (after_attn, before_mlp, after_mlp):
      if name:
        setattr(self, name, make_norm(cfg, fused, implementation, rngs))
    self.mlp = make_mlp(cfg, fused, implementation, rngs)

  def _norms(self):
    return tuple(None if name is None else getattr(self, name)
                 for name in NORMS[self.placement])

  def _mlp(self, x: jax.Array, segment_ids, stats):
    """The MLP of ``x``, and the routing statistics ``stats`` with this layer's added (a MoE
    layer's; None: not collected). Padding (segment id 0) is left out of them."""
    if stats is None:
      return self.mlp(x), None
    mask = None if segment_ids is None else segment_ids != 0
    out, layer = self.mlp.routed(x, mask)
    return out, moe_blocks.add_stats(stats, layer)

  def __call__(self, h: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None,
               index=0, stats=None):
    """The block on the residual stream ``h``, one residual add after each of its halves;
    attention within the segments of ``segment_ids`` where given. With ``stats`` (a MoE
    block's routing statistics so far), returns ``(h, stats)``."""
    before_attn, after_attn, before_mlp, after_mlp = self._norms()
    h = parallel.constrain(h, *STREAM)
    a = self.self_attn(before_attn(h) if before_attn else h, positions, segment_ids, index)
    h = h + (after_attn(a) if after_attn else a)
    m, stats = self._mlp(before_mlp(h) if before_mlp else h, segment_ids, stats)
    h = h + (after_mlp(m) if after_mlp else m)
    return h if stats is None else (h, stats)

  def fused_call(self, pending: jax.Array, stream: jax.Array, positions: jax.Array,
                 segment_ids: jax.Array | None = None, index=0, stats=None):
    """The fused block of a family with norms before attention and the MLP: the residual
    stream is ``stream + pending``, where ``pending`` is the previous block's MLP output
    (zeros before the first block), added by this block's input norm in the same op. Returns
    this block's ``(pending, stream)``: each residual add is fused with the norm that follows
    it (and, with ``stats``, the routing statistics: ``((pending, stream), stats)``)."""
    before_attn, after_attn, before_mlp, after_mlp = self._norms()
    pending = checkpoint_name(parallel.constrain(pending, *STREAM), names.BLOCK_INPUT)
    stream = checkpoint_name(parallel.constrain(stream, *STREAM), names.BLOCK_INPUT)
    normed, stream = before_attn.add(pending, stream)
    a = self.self_attn(normed, positions, segment_ids, index)
    normed, stream = before_mlp.add(after_attn(a) if after_attn else a, stream)
    m, stats = self._mlp(normed, segment_ids, stats)
    out = ((after_mlp(m) if after_mlp else m), stream)
    return out if stats is None else (out, stats)

  def stream_call(self, h: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None,
                  index=0, stats=None):
    """The fused block on the whole residual stream ``h``: the add after attention is fused
    with the norm before the MLP (where there is one); the MLP's output is added to the stream
    by itself. One array crosses the block's boundary (what a recomputed block keeps) instead
    of two (with ``stats``, returns ``(h, stats)``)."""
    before_attn, after_attn, before_mlp, after_mlp = self._norms()
    h = checkpoint_name(parallel.constrain(h, *STREAM), names.BLOCK_INPUT)
    a = self.self_attn(before_attn(h) if before_attn else h, positions, segment_ids, index)
    a = after_attn(a) if after_attn else a
    if before_mlp is None:
      stream = h + a
      normed = stream
    else:
      normed, stream = before_mlp.add(a, h)
    m, stats = self._mlp(normed, segment_ids, stats)
    h = stream + (after_mlp(m) if after_mlp else m)
    return h if stats is None else (h, stats)

  @staticmethod
  def fuses_across(cfg: DecoderConfig) -> bool:
    """Whether a block's last add can be fused with the next block's first norm (the family
    has a norm before attention)."""
    return NORMS[cfg.norm_placement][0] is not None

  def step(self, carry, positions, segment_ids=None, index=0):
    """One block on the carry of :meth:`jaxfuse.models.Decoder.hidden`: ``(pending, stream)``
    when fused across blocks (a tuple), the residual stream otherwise, or, for a model with
    MoE blocks, ``{"h": either, "stats": the routing statistics so far}``; ``segment_ids`` (or
    None) those of packed documents; ``index`` is the layer's."""
    if isinstance(carry, dict):
      h, stats = self._step(carry["h"], positions, segment_ids, index, carry["stats"])
      return {"h": h, "stats": stats}
    return self._step(carry, positions, segment_ids, index)

  def _step(self, carry, positions, segment_ids, index, stats=None):
    if isinstance(carry, tuple):
      return self.fused_call(*carry, positions, segment_ids, index, stats)
    if self.fused:
      return self.stream_call(carry, positions, segment_ids, index, stats)
    return self(checkpoint_name(carry, names.BLOCK_INPUT), positions, segment_ids, index, stats)


__all__ = ["Attention", "Block", "Experts", "MLP", "MoE", "NORMS", "RMSNorm", "by_kind",
           "make_attention", "make_linear", "make_mlp", "make_norm"]
