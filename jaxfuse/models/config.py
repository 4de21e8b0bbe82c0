"""The configuration of :class:`jaxfuse.models.Decoder`, and its mapping from and to Hugging
Face ``transformers`` configs (the families of :mod:`jaxfuse.models.families`).

Example:
  >>> from jaxfuse.models import DecoderConfig
  >>> cfg = DecoderConfig(vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
  ...                     mlp_dim=128)
  >>> cfg.head_dim, cfg.kv_heads, cfg.layer_kind(0)
  (16, 2, 'full')
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from jaxfuse.ops import names

NORM_PLACEMENTS = ("pre", "sandwich", "post")
QK_NORMS = (None, "head", "projection")
LAYER_TYPES = ("full_attention", "sliding_attention")


class UnsupportedConfigError(ValueError):
  """A Hugging Face config asks for something the decoder does not compute."""


def freeze(value):
  """``value`` hashable: dicts as sorted ``(key, value)`` tuples, lists as tuples."""
  if isinstance(value, Mapping):
    return tuple(sorted((k, freeze(v)) for k, v in value.items()))
  if isinstance(value, (list, tuple)):
    return tuple(freeze(v) for v in value)
  return value


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  """A decoder: blocks of attention (GQA, rotary) and a gated MLP, with the options of the
  open model families (:mod:`jaxfuse.models.families`).

  Attributes:
    vocab_size: V.
    d_model: the residual stream's width.
    num_layers: decoder blocks.
    num_heads: query heads.
    mlp_dim: the MLP's hidden width.
    num_kv_heads: key/value heads (default ``num_heads``; fewer gives GQA, 1 gives MQA).
    head_dim: per head (default ``d_model // num_heads``).
    rms_norm_eps: RMSNorm's epsilon.
    rope_theta: the rotary embedding's base.
    rope_type: the rotary embedding's scaling (:class:`jaxfuse.blocks.rope.Rope`): ``default``,
      ``linear``, ``dynamic``, ``llama3``, ``yarn`` or ``longrope``.
    rope_params: its other parameters, as sorted ``(key, value)`` pairs (``factor``, ...).
    rope_local_theta: the rotary base of the sliding-window layers, where it differs (Gemma 3).
    tie_embeddings: the LM head reads the input embedding table.
    qkv_bias: the q, k and v projections have biases (Qwen2).
    o_bias: the output projection has a bias (LLaMA's ``attention_bias``).
    mlp_bias: the MLP's projections have biases.
    sliding_window: each query of a sliding-window layer sees at most this many keys, itself
      included.
    layer_types: ``"full_attention"`` or ``"sliding_attention"`` per layer (None: every layer
      sliding when ``sliding_window`` is set, as Mistral, else full).
    qk_norm: RMSNorm of the queries and keys before the rotation: ``"head"`` (each head:
      Qwen3, Gemma 3) or ``"projection"`` (all heads together: OLMo 2); None: none.
    norm_placement: ``"pre"`` (a norm before attention and before the MLP: LLaMA),
      ``"sandwich"`` (before and after each: Gemma 2 and 3) or ``"post"`` (after each: OLMo 2).
    norm_scale_offset: the norms multiply by ``scale + offset`` (Gemma's ``1 + w``: 1.0).
    activation: the gated MLP's activation (``"silu"``; Gemma's ``"gelu_tanh"``).
    embed_scale: the embeddings are multiplied by ``sqrt(d_model)`` (in the model's dtype, as
      Gemma does).
    query_scale: attention's score scale (default ``1 / sqrt(head_dim)``; Gemma's
      ``query_pre_attn_scalar ** -0.5``).
    attn_logit_softcap: attention scores ``c * tanh(s / c)`` (Gemma 2).
    final_logit_softcap: the logits ``c * tanh(z / c)`` (Gemma 2).
    num_experts: the experts of each block's Mixture-of-Experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE):
      a router sends each token to ``experts_per_token`` of them (:mod:`jaxfuse.blocks.moe`);
      0: a dense MLP.
    experts_per_token: the top k of the routing.
    expert_mlp_dim: each expert's hidden width (default ``mlp_dim``).
    shared_expert_mlp_dim: the hidden width of a shared expert that every token goes through
      besides its routed ones, its output times a sigmoid gate of the token (Qwen2-MoE's
      ``shared_expert``, ``shared_expert_gate``); 0: none.
    router_renormalize: the top-k routing weights are divided by their sum (Mixtral; Qwen3-MoE's
      ``norm_topk_prob``).
    router_aux_loss_coef: the loss adds this times the load-balancing loss of every layer's
      routing (as ``transformers`` does with ``output_router_logits``); 0: none.
    router_z_loss_coef: the loss adds this times the router z-loss (ST-MoE); 0: none.
    capacity_factor: each expert takes at most ``ceil(capacity_factor * tokens * k / E)`` of a
      batch's token-expert pairs and drops the rest; None: dropless.
    expert_keep: the experts' products the fused MoE layer keeps for its backward, among
      ``"gate"`` and ``"up"`` (:func:`jaxfuse.ops.grouped_mlp`'s ``keep``); each saves one
      grouped product of the backward for ``[tokens * k, expert_mlp_dim]`` residuals. ``()``:
      the backward recomputes both. Not a Hugging Face field.
    model_type: the Hugging Face family it was read from or is written as.
    pad_token_id: the padding token, whose embedding row gets no gradient from the lookup
      (as torch's ``nn.Embedding(padding_idx=...)``); None: none.
    max_seq_len: the longest sequence (Hugging Face's ``max_position_embeddings``).
    initializer_range: the standard deviation of the weights' normal initializer.
    dtype: the computation dtype.
    param_dtype: the parameters' dtype.
  """

  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  mlp_dim: int
  num_kv_heads: int | None = None
  head_dim: int | None = None
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_type: str = "default"
  rope_params: tuple = ()
  rope_local_theta: float | None = None
  tie_embeddings: bool = False
  qkv_bias: bool = False
  o_bias: bool = False
  mlp_bias: bool = False
  sliding_window: int | None = None
  layer_types: tuple[str, ...] | None = None
  qk_norm: str | None = None
  norm_placement: str = "pre"
  norm_scale_offset: float = 0.0
  activation: str = "silu"
  embed_scale: bool = False
  query_scale: float | None = None
  attn_logit_softcap: float | None = None
  final_logit_softcap: float | None = None
  num_experts: int = 0
  experts_per_token: int = 2
  expert_mlp_dim: int | None = None
  shared_expert_mlp_dim: int = 0
  router_renormalize: bool = True
  router_aux_loss_coef: float = 0.0
  router_z_loss_coef: float = 0.0
  capacity_factor: float | None = None
  expert_keep: tuple[str, ...] = ()
  model_type: str = "llama"
  pad_token_id: int | None = None
  max_seq_len: int = 2048
  initializer_range: float = 0.02
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  def __post_init__(self):
    # Defaults that depend on other fields are resolved here, so that every config compares
    # equal to the same config spelled out.
    if self.num_kv_heads is None:
      object.__setattr__(self, "num_kv_heads", self.num_heads)
    if self.head_dim is None and isinstance(self.num_heads, int) and self.num_heads > 0 \
        and self.d_model % self.num_heads == 0:
      object.__setattr__(self, "head_dim", self.d_model // self.num_heads)
    object.__setattr__(self, "rope_params", freeze(dict(self.rope_params)))
    if self.layer_types is not None:
      object.__setattr__(self, "layer_types", tuple(self.layer_types))
    if self.num_experts and self.expert_mlp_dim is None:
      object.__setattr__(self, "expert_mlp_dim", self.mlp_dim)
    object.__setattr__(self, "expert_keep",
                       names.moe_products(self.expert_keep, "DecoderConfig: expert_keep"))
    self._check()

  def _check(self):
    def fail(message):
      raise ValueError(f"DecoderConfig: {message}")

    positive = ("vocab_size", "d_model", "num_layers", "num_heads", "mlp_dim", "max_seq_len")
    for name in positive:
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        fail(f"{name} must be a positive int, got {value!r}")
    for name in ("num_kv_heads", "head_dim", "sliding_window"):
      value = getattr(self, name)
      if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                or value < 1):
        fail(f"{name} must be None or a positive int, got {value!r}")
    if self.num_heads % self.kv_heads:
      fail(f"num_kv_heads ({self.kv_heads}) must divide num_heads ({self.num_heads})")
    if self.head_dim is None:
      fail(f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads}), or "
           f"give head_dim")
    if self.head_dim % 2:
      fail(f"the rotary embedding needs an even head_dim, got {self.head_dim}")
    if not self.rms_norm_eps >= 0 or not self.rope_theta > 0:
      fail(f"rms_norm_eps must be >= 0 and rope_theta > 0, got {self.rms_norm_eps} and "
           f"{self.rope_theta}")
    if self.norm_placement not in NORM_PLACEMENTS:
      fail(f"norm_placement must be one of {NORM_PLACEMENTS}, got {self.norm_placement!r}")
    if self.qk_norm not in QK_NORMS:
      fail(f"qk_norm must be one of {QK_NORMS}, got {self.qk_norm!r}")
    if self.layer_types is not None:
      if len(self.layer_types) != self.num_layers or set(self.layer_types) - set(LAYER_TYPES):
        fail(f"layer_types must give one of {LAYER_TYPES} per layer ({self.num_layers}), got "
             f"{self.layer_types}")
      if "sliding_attention" in self.layer_types and self.sliding_window is None:
        fail("sliding_attention layers need a sliding_window")
    for name in ("query_scale", "attn_logit_softcap", "final_logit_softcap"):
      value = getattr(self, name)
      if value is not None and not value > 0:
        fail(f"{name} must be None or > 0, got {value!r}")
    if isinstance(self.num_experts, bool) or not isinstance(self.num_experts, int) \
        or self.num_experts < 0:
      fail(f"num_experts must be an int >= 0, got {self.num_experts!r}")
    if self.num_experts:
      if not 1 <= self.experts_per_token <= self.num_experts:
        fail(f"experts_per_token must be in [1, num_experts={self.num_experts}], got "
             f"{self.experts_per_token!r}")
      if not isinstance(self.expert_mlp_dim, int) or self.expert_mlp_dim < 1:
        fail(f"expert_mlp_dim must be a positive int, got {self.expert_mlp_dim!r}")
      if self.mlp_bias:
        fail("mlp_bias: the experts have no biases")
    if isinstance(self.shared_expert_mlp_dim, bool) or not isinstance(
        self.shared_expert_mlp_dim, int) or self.shared_expert_mlp_dim < 0:
      fail(f"shared_expert_mlp_dim must be an int >= 0, got {self.shared_expert_mlp_dim!r}")
    if self.shared_expert_mlp_dim and not self.num_experts:
      fail("shared_expert_mlp_dim: a shared expert needs a Mixture of Experts (num_experts)")
    for name in ("router_aux_loss_coef", "router_z_loss_coef"):
      if not getattr(self, name) >= 0:
        fail(f"{name} must be >= 0, got {getattr(self, name)!r}")
    if self.capacity_factor is not None and not self.capacity_factor > 0:
      fail(f"capacity_factor must be None or > 0, got {self.capacity_factor!r}")
    self.rope()   # checks the rotary parameters

  @property
  def kv_heads(self) -> int:
    return self.num_kv_heads

  @property
  def moe(self) -> bool:
    """The blocks' MLPs are Mixtures of Experts."""
    return self.num_experts > 0

  def layer_kind(self, i: int) -> str:
    """``"sliding"`` or ``"full"``: the attention of layer ``i``."""
    if self.layer_types is None:
      return "full" if self.sliding_window is None else "sliding"
    return "sliding" if self.layer_types[i] == "sliding_attention" else "full"

  @property
  def layer_kinds(self) -> tuple[str, ...]:
    return tuple(self.layer_kind(i) for i in range(self.num_layers))

  def window(self, kind: str) -> int | None:
    """The sliding window of a layer of ``kind`` (None: full attention)."""
    return self.sliding_window if kind == "sliding" else None

  def rope(self, kind: str = "full"):
    """The rotary embedding of a layer of ``kind`` (:class:`jaxfuse.blocks.rope.Rope`): the
    sliding-window layers' own base, where the config has one, with the default rotation."""
    from jaxfuse.blocks.rope import Rope

    if kind == "sliding" and self.rope_local_theta is not None:
      return Rope(self.head_dim, "default", self.rope_local_theta, (), self.max_seq_len)
    return Rope(self.head_dim, self.rope_type, self.rope_theta, self.rope_params,
                self.max_seq_len)

  @property
  def attention_scale(self) -> float:
    return self.query_scale if self.query_scale is not None else 1.0 / math.sqrt(self.head_dim)

  def flops_per_token(self, seq: int, *, training: bool = True) -> float:
    """The model FLOPs of one token in a row of ``seq`` tokens: each matmul's 2 FLOPs per
    multiply-add (the projections, the MLP or the ``experts_per_token`` experts a token goes to
    with the router and any shared expert, the LM head) and attention's scores and weighted
    values over the keys a query sees (causal, within the window), as PaLM's appendix B counts
    them; times 3 with ``training`` (the backward pass computes two products for each of the
    forward's). Recomputation is not counted: this is the numerator of MFU, not of hardware
    utilization. Norms, rotations and softmax are left out (a few percent at most).

    Example:
      >>> cfg = DecoderConfig(vocab_size=256, d_model=64, num_layers=2, num_heads=4,
      ...                     mlp_dim=128)
      >>> cfg.flops_per_token(16, training=False)   # 2 x 98304 weights + 4 x 64 x 2 x 8.5 keys
      200960.0
    """
    q, kv, d = self.num_heads * self.head_dim, self.kv_heads * self.head_dim, self.d_model
    weights = 0
    for kind in self.layer_kinds:
      weights += d * q + 2 * d * kv + q * d
      if self.moe:
        weights += d * self.num_experts + 3 * d * self.expert_mlp_dim * self.experts_per_token
        weights += 3 * d * self.shared_expert_mlp_dim + (d if self.shared_expert_mlp_dim else 0)
      else:
        weights += 3 * d * self.mlp_dim
    weights += d * self.vocab_size
    keys = 0.0   # keys a query sees, summed over the layers (averaged over the row)
    for kind in self.layer_kinds:
      window = self.window(kind)
      keys += sum(min(i + 1, window or seq) for i in range(seq)) / seq
    forward = 2.0 * weights + 2.0 * 2.0 * self.num_heads * self.head_dim * keys
    return 3.0 * forward if training else forward

  def replace(self, **changes) -> DecoderConfig:
    return dataclasses.replace(self, **changes)

  def as_dict(self) -> dict:
    out = dataclasses.asdict(self)
    out["dtype"] = jnp.dtype(self.dtype).name
    out["param_dtype"] = jnp.dtype(self.param_dtype).name
    out["rope_params"] = _thaw(self.rope_params)
    return out

  @classmethod
  def from_dict(cls, values: Mapping) -> DecoderConfig:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
      raise ValueError(f"DecoderConfig: unknown fields {unknown}")
    values = dict(values)
    for name in ("dtype", "param_dtype"):
      if name in values:
        values[name] = jnp.dtype(values[name])
    return cls(**values)

  # Hugging Face -------------------------------------------------------------------------------

  @classmethod
  def from_hf(cls, hf_config, **overrides) -> DecoderConfig:
    """The config of a ``transformers`` config of a supported family (or its ``to_dict()``).

    Every field that changes what the model computes is either mapped or refused: a field the
    family does not map whose value differs from the family's default, or a mapped field with
    a value the decoder does not compute, raises :class:`UnsupportedConfigError` naming it.
    ``overrides`` set jaxfuse-only fields (``dtype``, ``param_dtype``, ``max_seq_len``).
    """
    from jaxfuse.models import families

    return cls(**families.read_hf(hf_config)).replace(**overrides)

  def to_hf(self, model_type: str | None = None):
    """The ``transformers`` config of this model as ``model_type`` (default: its own)."""
    from jaxfuse.models import families

    return families.write_hf(self, model_type or self.model_type)


def _thaw(value):
  """:func:`freeze` undone for a rope parameter table: pairs to a dict, tuples to lists."""
  if isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2
                                      and isinstance(p[0], str) for p in value):
    return {k: _thaw(v) for k, v in value}
  if isinstance(value, tuple):
    return [_thaw(v) for v in value]
  return value
