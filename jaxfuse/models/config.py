"""The configuration of :class:`jaxfuse.models.Decoder`, and its mapping from and to Hugging
Face ``transformers`` configs (LLaMA, Mistral, Qwen2).

Example:
  >>> from jaxfuse.models import DecoderConfig
  >>> cfg = DecoderConfig(vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
  ...                     mlp_dim=128)
  >>> cfg.head_dim, cfg.kv_heads
  (16, 2)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

# Hugging Face model types whose configs map onto DecoderConfig.
HF_MODEL_TYPES = ("llama", "mistral", "qwen2")

# HF config fields that describe the model's computation, mapped onto DecoderConfig fields
# (several map to one; see DecoderConfig.from_hf for how each is read).
HF_SUPPORTED_FIELDS = frozenset({
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
    "rope_parameters", "rope_theta", "rope_scaling", "tie_word_embeddings", "attention_bias",
    "mlp_bias", "sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
    "attention_dropout", "pretraining_tp", "max_position_embeddings", "initializer_range",
})
# HF config fields that do not change what the model computes.
HF_IGNORED_FIELDS = frozenset({
    "transformers_version", "architectures", "output_hidden_states", "output_attentions",
    "return_dict", "dtype", "torch_dtype", "chunk_size_feed_forward", "is_encoder_decoder",
    "id2label", "label2id", "problem_type", "use_cache", "pad_token_id", "bos_token_id",
    "eos_token_id", "_name_or_path", "tokenizer_class", "prefix", "sep_token_id",
    "decoder_start_token_id", "task_specific_params", "finetuning_task", "tie_encoder_decoder",
    "add_cross_attention", "cross_attention_hidden_size", "is_decoder", "pruned_heads",
    "torchscript", "_attn_implementation_autoset", "_commit_hash", "bad_words_ids",
    "return_dict_in_generate", "tf_legacy_loss", "use_bfloat16",
})


class UnsupportedConfigError(ValueError):
  """A Hugging Face config asks for something the decoder does not compute."""


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  """A LLaMA-family decoder: pre-norm blocks of attention (GQA, rotary) and a SwiGLU MLP.

  Attributes:
    vocab_size: V.
    d_model: the residual stream's width.
    num_layers: decoder blocks.
    num_heads: query heads.
    num_kv_heads: key/value heads (default ``num_heads``; fewer gives GQA, 1 gives MQA).
    head_dim: per head (default ``d_model // num_heads``).
    mlp_dim: the MLP's hidden width.
    rms_norm_eps: RMSNorm's epsilon.
    rope_theta: the rotary embedding's base.
    tie_embeddings: the LM head reads the input embedding table.
    qkv_bias: the q, k and v projections have biases (Qwen2).
    o_bias: the output projection has a bias (LLaMA's ``attention_bias``).
    mlp_bias: the MLP's projections have biases.
    sliding_window: each query sees at most this many keys, itself included (Mistral).
    max_seq_len: the longest sequence the KV cache holds.
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
  tie_embeddings: bool = False
  qkv_bias: bool = False
  o_bias: bool = False
  mlp_bias: bool = False
  sliding_window: int | None = None
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
    positive = ("vocab_size", "d_model", "num_layers", "num_heads", "mlp_dim", "max_seq_len")
    for name in positive:
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"DecoderConfig: {name} must be a positive int, got {value!r}")
    for name in ("num_kv_heads", "head_dim", "sliding_window"):
      value = getattr(self, name)
      if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                or value < 1):
        raise ValueError(f"DecoderConfig: {name} must be None or a positive int, got {value!r}")
    if self.num_heads % self.kv_heads:
      raise ValueError(f"DecoderConfig: num_kv_heads ({self.kv_heads}) must divide num_heads "
                       f"({self.num_heads})")
    if self.head_dim is None:
      raise ValueError(f"DecoderConfig: d_model ({self.d_model}) must be divisible by "
                       f"num_heads ({self.num_heads}), or give head_dim")
    if self.head_dim % 2:
      raise ValueError(f"DecoderConfig: the rotary embedding needs an even head_dim, got "
                       f"{self.head_dim}")
    if not self.rms_norm_eps >= 0 or not self.rope_theta > 0:
      raise ValueError(f"DecoderConfig: rms_norm_eps must be >= 0 and rope_theta > 0, got "
                       f"{self.rms_norm_eps} and {self.rope_theta}")

  @property
  def kv_heads(self) -> int:
    return self.num_kv_heads

  def replace(self, **changes) -> DecoderConfig:
    return dataclasses.replace(self, **changes)

  def as_dict(self) -> dict:
    out = dataclasses.asdict(self)
    out["dtype"] = jnp.dtype(self.dtype).name
    out["param_dtype"] = jnp.dtype(self.param_dtype).name
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
    """The config of a ``transformers`` LLaMA, Mistral or Qwen2 config (or its ``to_dict()``).

    Every field that changes what the model computes is either mapped or refused: a field
    outside :data:`HF_SUPPORTED_FIELDS` and :data:`HF_IGNORED_FIELDS` whose value differs from
    the model type's default, or a supported field with a value the decoder does not compute
    (another activation, rope scaling, dropout, per-layer sliding windows), raises
    :class:`UnsupportedConfigError` naming it. ``overrides`` set jaxfuse-only fields
    (``dtype``, ``param_dtype``, ``max_seq_len``).
    """
    values = hf_config if isinstance(hf_config, Mapping) else hf_config.to_dict()
    model_type = values.get("model_type")
    if model_type not in HF_MODEL_TYPES:
      raise UnsupportedConfigError(f"model_type {model_type!r} is not supported; supported: "
                                   f"{HF_MODEL_TYPES}")
    defaults = _hf_defaults(model_type)
    for key, value in values.items():
      if key in HF_SUPPORTED_FIELDS or key in HF_IGNORED_FIELDS:
        continue
      if key not in defaults or defaults[key] != value:
        raise UnsupportedConfigError(f"HF config field {key!r} = {value!r} is not supported")

    def refuse(field, value, why):
      raise UnsupportedConfigError(f"HF config field {field!r} = {value!r}: {why}")

    get = lambda key, default=None: values.get(key, defaults.get(key, default))  # noqa: E731
    if get("hidden_act", "silu") != "silu":
      refuse("hidden_act", get("hidden_act"), "only 'silu' (SwiGLU) is supported")
    if get("attention_dropout", 0.0):
      refuse("attention_dropout", get("attention_dropout"), "dropout is not supported")
    if get("pretraining_tp", 1) != 1:
      refuse("pretraining_tp", get("pretraining_tp"), "only 1 is supported")
    rope = get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default" or get("rope_scaling"):
      refuse("rope_parameters", rope, "only the default rotary embedding is supported")
    theta = rope.get("rope_theta", get("rope_theta", 10000.0))
    sliding = None
    if model_type == "mistral":
      sliding = get("sliding_window")
    elif model_type == "qwen2" and get("use_sliding_window", False):
      refuse("use_sliding_window", True, "Qwen2's per-layer sliding windows are not supported")
    layer_types = get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types) and sliding is None:
      refuse("layer_types", layer_types, "only full attention layers are supported")
    heads = get("num_attention_heads")
    config = cls(
        vocab_size=get("vocab_size"), d_model=get("hidden_size"),
        num_layers=get("num_hidden_layers"), num_heads=heads,
        num_kv_heads=get("num_key_value_heads") or heads,
        head_dim=get("head_dim") or get("hidden_size") // heads, mlp_dim=get("intermediate_size"),
        rms_norm_eps=float(get("rms_norm_eps")), rope_theta=float(theta),
        tie_embeddings=bool(get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(get("attention_bias", False)),
        o_bias=model_type == "llama" and bool(get("attention_bias", False)),
        mlp_bias=bool(get("mlp_bias", False)), sliding_window=sliding,
        max_seq_len=int(get("max_position_embeddings", 2048)),
        initializer_range=float(get("initializer_range", 0.02)))
    return config.replace(**overrides)

  def to_hf(self, model_type: str = "llama"):
    """The ``transformers`` config of this model (``llama``, ``mistral`` or ``qwen2``)."""
    import transformers

    if model_type not in HF_MODEL_TYPES:
      raise ValueError(f"to_hf: model_type must be one of {HF_MODEL_TYPES}, got {model_type!r}")
    common = dict(vocab_size=self.vocab_size, hidden_size=self.d_model,
                  intermediate_size=self.mlp_dim, num_hidden_layers=self.num_layers,
                  num_attention_heads=self.num_heads, num_key_value_heads=self.kv_heads,
                  head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
                  rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
                  tie_word_embeddings=self.tie_embeddings, hidden_act="silu",
                  max_position_embeddings=self.max_seq_len,
                  initializer_range=self.initializer_range)
    if model_type == "llama":
      if self.qkv_bias != self.o_bias or self.sliding_window is not None:
        raise ValueError("to_hf: a LLaMA config has biases on all four attention projections or "
                         "none, and no sliding window")
      return transformers.LlamaConfig(**common, attention_bias=self.qkv_bias,
                                      mlp_bias=self.mlp_bias)
    if self.mlp_bias or self.o_bias:
      raise ValueError(f"to_hf: a {model_type} config has no MLP or output-projection bias")
    if model_type == "mistral":
      if self.qkv_bias:
        raise ValueError("to_hf: a Mistral config has no q/k/v biases")
      return transformers.MistralConfig(**common, sliding_window=self.sliding_window)
    if not self.qkv_bias or self.sliding_window is not None:
      raise ValueError("to_hf: a Qwen2 config has q/k/v biases and no sliding window here")
    return transformers.Qwen2Config(**common)


def _hf_defaults(model_type: str) -> dict:
  try:
    import transformers
  except ImportError:  # without transformers, only the fields above are known
    return {}
  cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
         "qwen2": transformers.Qwen2Config}[model_type]
  return cls().to_dict()
