"""The Hugging Face model families the decoder loads and writes, and how each maps onto
:class:`jaxfuse.models.DecoderConfig`.

:data:`FAMILIES` is the one list: :meth:`DecoderConfig.from_hf` and ``to_hf``,
:mod:`jaxfuse.interop` (parameter names, fused projections) and the README's table of supported
families read it. A family is its Hugging Face ``model_type``, ``*ForCausalLM`` class and config
class, what it needs beyond LLaMA, and which of its config fields it reads (every other field
that changes the computation is refused, named, when it differs from the family's default).

Example:
  >>> from jaxfuse.models import families
  >>> [f.model_type for f in families.FAMILIES]
  ['llama', 'mistral', 'qwen2', 'qwen3', 'gemma2', 'gemma3_text', 'phi3', 'olmo2', 'mixtral',
   'qwen2_moe', 'qwen3_moe']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from jaxfuse.models.config import DecoderConfig, UnsupportedConfigError

# Hugging Face activation names -> jaxfuse's (jaxfuse.ops.activations).
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}
_HF_ACTIVATION = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu",
                  "relu": "relu"}

# Fields every family reads.
COMMON_FIELDS = frozenset({
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "hidden_activation",
    "rms_norm_eps", "rope_parameters", "rope_theta", "rope_scaling", "tie_word_embeddings",
    "max_position_embeddings", "initializer_range", "attention_dropout", "pad_token_id",
})
# Fields that do not change what the model computes.
IGNORED_FIELDS = frozenset({
    "transformers_version", "architectures", "output_hidden_states", "output_attentions",
    "return_dict", "dtype", "torch_dtype", "chunk_size_feed_forward", "is_encoder_decoder",
    "id2label", "label2id", "problem_type", "use_cache", "bos_token_id",
    "eos_token_id", "_name_or_path", "tokenizer_class", "prefix", "sep_token_id",
    "decoder_start_token_id", "task_specific_params", "finetuning_task", "tie_encoder_decoder",
    "add_cross_attention", "cross_attention_hidden_size", "is_decoder", "pruned_heads",
    "torchscript", "_attn_implementation_autoset", "_commit_hash", "bad_words_ids",
    "return_dict_in_generate", "tf_legacy_loss", "use_bfloat16", "_sliding_window_pattern",
    "sliding_window_pattern", "cache_implementation",
})


class Fields:
  """A Hugging Face config's fields, read against its family's defaults; remembers what was
  read, so that what was not can be checked."""

  def __init__(self, values: Mapping, defaults: Mapping):
    self.values, self.defaults, self.read = values, defaults, set()

  def get(self, key: str, default=None):
    self.read.add(key)
    return self.values.get(key, self.defaults.get(key, default))

  @staticmethod
  def refuse(field: str, value, why: str):
    raise UnsupportedConfigError(f"HF config field {field!r} = {value!r}: {why}")

  def zero(self, *keys):
    """Refuses dropout (or another rate) that is not 0."""
    for key in keys:
      if self.get(key, 0.0):
        self.refuse(key, self.get(key), "dropout is not supported (only 0)")


@dataclasses.dataclass(frozen=True)
class Family:
  """A Hugging Face family.

  Attributes:
    model_type: Hugging Face's ``model_type``.
    architecture: its ``*ForCausalLM`` class.
    config_class: its config class in ``transformers``.
    needs: what it computes beyond LLaMA (the README's table).
    read: ``read(fields) -> dict`` of :class:`DecoderConfig` fields beyond the common ones.
    write: ``write(cfg) -> dict`` of the config class's arguments beyond the common ones.
    fields: the config fields ``read`` maps (beyond :data:`COMMON_FIELDS`).
    fused_projections: its checkpoints fuse q/k/v into ``qkv_proj`` and gate/up into
      ``gate_up_proj`` (Phi-3).
    experts: for a Mixture-of-Experts family, how its checkpoint files name each expert:
      ``(module, (gate, up, down))``, e.g. Mixtral's ``block_sparse_moe.experts.{e}.w1``
      (``transformers`` 5 holds them stacked, ``mlp.experts.gate_up_proj``, and writes them
      one by one); None: a dense family.
  """

  model_type: str
  architecture: str
  config_class: str
  needs: str
  read: Callable[[Fields], dict]
  write: Callable[[DecoderConfig], dict]
  fields: frozenset = frozenset()
  fused_projections: bool = False
  experts: tuple | None = None


# Per-family pieces ------------------------------------------------------------------------------


def _layer_types(f: Fields, *, window_default: bool) -> dict:
  """``sliding_window`` and ``layer_types`` (Qwen's ``use_sliding_window`` and
  ``max_window_layers``, Gemma's alternation)."""
  types = f.get("layer_types")
  window = f.get("sliding_window")
  if window_default is False and not f.get("use_sliding_window", False):
    window = None
  if types is not None:
    types = tuple(types)
    if "sliding_attention" not in types:
      window = None
    elif window is None:
      f.refuse("layer_types", types, "sliding_attention layers need a sliding_window")
  elif window is not None and f.values.get("model_type") in ("qwen2", "qwen3"):
    first = f.get("max_window_layers", 0)
    types = tuple("sliding_attention" if i >= first else "full_attention"
                  for i in range(f.get("num_hidden_layers")))
  if types is not None and len(set(types)) == 1:   # one kind: the window says which
    types = None
  return {"sliding_window": window, "layer_types": types}


def _attention_bias(f: Fields) -> dict:
  bias = bool(f.get("attention_bias", False))
  return {"qkv_bias": bias, "o_bias": bias}


def _gemma(f: Fields, *, qk_norm: str | None) -> dict:
  if f.get("use_bidirectional_attention", False):
    f.refuse("use_bidirectional_attention", True, "only causal attention is supported")
  scalar = f.get("query_pre_attn_scalar")
  return {"norm_placement": "sandwich", "norm_scale_offset": 1.0, "embed_scale": True,
          "query_scale": float(scalar) ** -0.5, "qk_norm": qk_norm,
          "attn_logit_softcap": f.get("attn_logit_softcapping"),
          "final_logit_softcap": f.get("final_logit_softcapping"),
          **_attention_bias(f), **_layer_types(f, window_default=True)}


def _write_gemma(cfg: DecoderConfig) -> dict:
  scalar = round(cfg.attention_scale ** -2)
  return {"query_pre_attn_scalar": scalar, "attn_logit_softcapping": cfg.attn_logit_softcap,
          "final_logit_softcapping": cfg.final_logit_softcap,
          "attention_bias": cfg.qkv_bias, "sliding_window": cfg.sliding_window,
          "layer_types": list(cfg.layer_types or ("full_attention",) * cfg.num_layers)}


def _write_types(cfg: DecoderConfig) -> dict:
  """Qwen's sliding-window fields: ``layer_types`` written out."""
  sliding = cfg.layer_types is not None and "sliding_attention" in cfg.layer_types
  out = {"use_sliding_window": sliding, "sliding_window": cfg.sliding_window if sliding else None}
  if cfg.layer_types is not None:
    out["layer_types"] = list(cfg.layer_types)
  return out


def _moe(f: Fields, num_experts: int, *, renormalize: bool) -> dict:
  """The Mixture-of-Experts fields: the auxiliary loss is the model's when ``transformers``
  adds it (``output_router_logits``)."""
  aux = float(f.get("router_aux_loss_coef", 0.001)) if f.get("output_router_logits") else 0.0
  return {"num_experts": int(num_experts), "experts_per_token": int(f.get("num_experts_per_tok")),
          "router_renormalize": bool(renormalize), "router_aux_loss_coef": aux}


def _write_moe(cfg: DecoderConfig) -> dict:
  return {"num_experts_per_tok": cfg.experts_per_token,
          "output_router_logits": cfg.router_aux_loss_coef > 0,
          "router_aux_loss_coef": cfg.router_aux_loss_coef or 0.001}


def _mixtral(f: Fields) -> dict:
  if f.get("router_jitter_noise", 0.0):
    f.refuse("router_jitter_noise", f.get("router_jitter_noise"),
             "the router's training noise is not supported (only 0)")
  return {"sliding_window": f.get("sliding_window"),
          **_moe(f, f.get("num_local_experts"), renormalize=True)}


def _write_mixtral(cfg: DecoderConfig) -> dict:
  return {"sliding_window": cfg.sliding_window, "num_local_experts": cfg.num_experts,
          **_write_moe(cfg)}


def _qwen_moe(f: Fields) -> dict:
  """The Mixture of Experts of Qwen2-MoE and Qwen3-MoE (every layer's: dense layers refused)."""
  experts = f.get("num_experts") or f.get("num_local_experts") or 0
  step, only = f.get("decoder_sparse_step", 1), list(f.get("mlp_only_layers") or [])
  dense = [i for i in range(f.get("num_hidden_layers"))
           if i in only or not experts or (i + 1) % step]
  if dense:
    field = "mlp_only_layers" if only else "decoder_sparse_step" if experts else "num_experts"
    f.refuse(field, f.get(field), f"layers {dense} would have dense MLPs; only models whose "
             f"every layer is a Mixture of Experts are supported")
  return {**_layer_types(f, window_default=False),
          "expert_mlp_dim": int(f.get("moe_intermediate_size")),
          **_moe(f, experts, renormalize=f.get("norm_topk_prob", False))}


def _write_qwen_moe(cfg: DecoderConfig) -> dict:
  return {**_write_types(cfg), "num_experts": cfg.num_experts,
          "moe_intermediate_size": cfg.expert_mlp_dim, "norm_topk_prob": cfg.router_renormalize,
          "decoder_sparse_step": 1, "mlp_only_layers": [], **_write_moe(cfg)}


def _qwen3_moe(f: Fields) -> dict:
  return {"qk_norm": "head", **_attention_bias(f), **_qwen_moe(f)}


def _write_qwen3_moe(cfg: DecoderConfig) -> dict:
  return {"attention_bias": cfg.qkv_bias, **_write_qwen_moe(cfg)}


def _qwen2_moe(f: Fields) -> dict:
  return {"qkv_bias": bool(f.get("qkv_bias", True)), **_qwen_moe(f),
          "shared_expert_mlp_dim": int(f.get("shared_expert_intermediate_size") or 0)}


def _write_qwen2_moe(cfg: DecoderConfig) -> dict:
  return {"qkv_bias": cfg.qkv_bias, **_write_qwen_moe(cfg),
          "shared_expert_intermediate_size": cfg.shared_expert_mlp_dim}


_MOE_FIELDS = frozenset({"num_experts_per_tok", "output_router_logits", "router_aux_loss_coef"})
_GEMMA_FIELDS = frozenset({"query_pre_attn_scalar", "attn_logit_softcapping",
                           "final_logit_softcapping", "attention_bias", "sliding_window",
                           "layer_types", "use_bidirectional_attention"})
_QWEN_FIELDS = frozenset({"sliding_window", "use_sliding_window", "max_window_layers",
                          "layer_types"})

FAMILIES: tuple[Family, ...] = (
    Family("llama", "LlamaForCausalLM", "LlamaConfig",
           "LLaMA 1-3.x: rotary scaling (linear, dynamic, llama3, yarn, longrope), tied "
           "embeddings (3.2 1B/3B), optional biases",
           lambda f: {**_attention_bias(f), "mlp_bias": bool(f.get("mlp_bias", False))},
           lambda cfg: {"attention_bias": cfg.qkv_bias, "mlp_bias": cfg.mlp_bias},
           frozenset({"attention_bias", "mlp_bias", "pretraining_tp"})),
    Family("mistral", "MistralForCausalLM", "MistralConfig",
           "a sliding window on every layer",
           lambda f: {"sliding_window": f.get("sliding_window")},
           lambda cfg: {"sliding_window": cfg.sliding_window}, frozenset({"sliding_window"})),
    Family("qwen2", "Qwen2ForCausalLM", "Qwen2Config",
           "q/k/v biases; sliding windows above max_window_layers",
           lambda f: {"qkv_bias": True, **_layer_types(f, window_default=False)},
           _write_types, _QWEN_FIELDS),
    Family("qwen3", "Qwen3ForCausalLM", "Qwen3Config",
           "per-head RMSNorm of q and k before the rotation (fused: qk_norm_rope), explicit "
           "head_dim",
           lambda f: {"qk_norm": "head", **_attention_bias(f),
                      **_layer_types(f, window_default=False)},
           lambda cfg: {"attention_bias": cfg.qkv_bias, **_write_types(cfg)},
           _QWEN_FIELDS | {"attention_bias"}),
    Family("gemma2", "Gemma2ForCausalLM", "Gemma2Config",
           "embeddings times sqrt(d_model), RMSNorm (1 + w), norms before and after attention "
           "and MLP, GeLU-tanh GLU, query_pre_attn_scalar, attention and final logit "
           "soft-caps, alternating sliding-window and global layers",
           lambda f: _gemma(f, qk_norm=None), _write_gemma, _GEMMA_FIELDS),
    Family("gemma3_text", "Gemma3ForCausalLM", "Gemma3TextConfig",
           "Gemma 2's, with per-head q/k norms (1 + w), a local rotary base for the "
           "sliding-window layers (5 of 6), no soft-caps",
           lambda f: _gemma(f, qk_norm="head"), _write_gemma, _GEMMA_FIELDS),
    Family("phi3", "Phi3ForCausalLM", "Phi3Config",
           "fused qkv_proj and gate_up_proj weights (split on load, fused on save), longrope "
           "for long contexts",
           lambda f: {"sliding_window": f.get("sliding_window")},
           lambda cfg: {"sliding_window": cfg.sliding_window},
           frozenset({"sliding_window", "original_max_position_embeddings", "resid_pdrop",
                      "embd_pdrop"}), fused_projections=True),
    Family("olmo2", "Olmo2ForCausalLM", "Olmo2Config",
           "norms after attention and MLP instead of before, RMSNorm of q and k over the whole "
           "projection",
           lambda f: {"norm_placement": "post", "qk_norm": "projection", **_attention_bias(f)},
           lambda cfg: {"attention_bias": cfg.qkv_bias}, frozenset({"attention_bias"})),
    Family("mixtral", "MixtralForCausalLM", "MixtralConfig",
           "Mixture of Experts: each block's MLP is num_local_experts SwiGLU experts, top-k "
           "softmax routing renormalized (grouped products over tokens sorted by expert), "
           "the load-balancing loss with output_router_logits; a sliding window",
           _mixtral, _write_mixtral,
           _MOE_FIELDS | {"sliding_window", "num_local_experts", "router_jitter_noise"},
           experts=("block_sparse_moe", ("w1", "w3", "w2"))),
    Family("qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig",
           "Qwen2's attention with a Mixture of Experts in every block (moe_intermediate_size "
           "wide, norm_topk_prob) and a shared expert every token goes through, gated by a "
           "sigmoid of the token; the load-balancing loss with output_router_logits; dense "
           "layers (mlp_only_layers, decoder_sparse_step) are refused",
           _qwen2_moe, _write_qwen2_moe,
           _MOE_FIELDS | _QWEN_FIELDS | {"qkv_bias", "num_experts", "moe_intermediate_size",
                                         "shared_expert_intermediate_size", "norm_topk_prob",
                                         "decoder_sparse_step", "mlp_only_layers"},
           experts=("mlp", ("gate_proj", "up_proj", "down_proj"))),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig",
           "Qwen3's attention with a Mixture of Experts in every block (moe_intermediate_size "
           "wide, norm_topk_prob), the load-balancing loss with output_router_logits; "
           "dense layers (mlp_only_layers, decoder_sparse_step) are refused",
           _qwen3_moe, _write_qwen3_moe,
           _MOE_FIELDS | {"attention_bias", "sliding_window", "use_sliding_window",
                          "num_experts", "num_local_experts", "moe_intermediate_size",
                          "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"},
           experts=("mlp", ("gate_proj", "up_proj", "down_proj"))),
)
BY_TYPE = {f.model_type: f for f in FAMILIES}
MODEL_TYPES = tuple(BY_TYPE)


def family(model_type: str) -> Family:
  """The family of ``model_type``; raises :class:`UnsupportedConfigError` naming the supported
  ones."""
  if model_type not in BY_TYPE:
    raise UnsupportedConfigError(f"model_type {model_type!r} is not supported; supported: "
                                 f"{MODEL_TYPES}")
  return BY_TYPE[model_type]


def _defaults(fam: Family) -> dict:
  try:
    import transformers
  except ImportError:  # without transformers, only the fields read are known
    return {}
  return getattr(transformers, fam.config_class)().to_dict()


# Reading and writing ----------------------------------------------------------------------------


def _rope(f: Fields, head_dim: int, max_positions: int) -> dict:
  """The rotary fields: ``rope_parameters`` (or the legacy ``rope_theta`` and
  ``rope_scaling``), per layer type where a family has two (Gemma 3)."""
  from jaxfuse.blocks.rope import Rope, UnsupportedRopeError

  params = f.get("rope_parameters") or {}
  legacy = f.get("rope_scaling")
  if legacy:
    params = {**params, **legacy}
  local = None
  if "full_attention" in params or "sliding_attention" in params:
    local = params.get("sliding_attention") or {}
    params = params.get("full_attention") or {}
  params = {"rope_theta": f.get("rope_theta", 10000.0), **params}
  original = f.get("original_max_position_embeddings")
  try:
    rope = Rope.from_hf(params, head_dim=head_dim, max_position_embeddings=max_positions,
                        original_max_position_embeddings=original)
    out = {"rope_type": rope.rope_type, "rope_theta": float(rope.theta),
           "rope_params": rope.params}
    if local is not None:
      local_rope = Rope.from_hf({"rope_theta": 10000.0, **local}, head_dim=head_dim,
                                max_position_embeddings=max_positions)
      if local_rope.rope_type != "default":
        f.refuse("rope_parameters", {"sliding_attention": local},
                 "the sliding-window layers' rotary embedding must be the default one")
      out["rope_local_theta"] = float(local_rope.theta)
  except UnsupportedRopeError as e:
    raise UnsupportedConfigError(f"HF config field 'rope_parameters': {e}") from e
  return out


def _pad(f: Fields) -> int | None:
  """The padding token: its embedding row gets no gradient from the lookup (torch's
  ``nn.Embedding(padding_idx=...)``), where it is inside the vocabulary."""
  pad = f.get("pad_token_id")
  return pad if pad is not None and 0 <= pad < f.get("vocab_size") else None


def read_hf(hf_config) -> dict:
  """:class:`DecoderConfig` fields of a ``transformers`` config (or its ``to_dict()``)."""
  values = hf_config if isinstance(hf_config, Mapping) else hf_config.to_dict()
  fam = family(values.get("model_type"))
  f = Fields(values, _defaults(fam))
  activation = f.get("hidden_activation") or f.get("hidden_act", "silu")
  if activation not in ACTIVATIONS:
    f.refuse("hidden_act", activation, f"supported: {sorted(ACTIVATIONS)}")
  f.zero("attention_dropout", "resid_pdrop", "embd_pdrop")
  if f.get("pretraining_tp", 1) != 1:
    f.refuse("pretraining_tp", f.get("pretraining_tp"), "only 1 is supported")
  heads = f.get("num_attention_heads")
  head_dim = f.get("head_dim") or f.get("hidden_size") // heads
  max_positions = int(f.get("max_position_embeddings", 2048))
  out = dict(
      vocab_size=f.get("vocab_size"), d_model=f.get("hidden_size"),
      num_layers=f.get("num_hidden_layers"), num_heads=heads,
      num_kv_heads=f.get("num_key_value_heads") or heads, head_dim=head_dim,
      mlp_dim=f.get("intermediate_size"), rms_norm_eps=float(f.get("rms_norm_eps")),
      tie_embeddings=bool(f.get("tie_word_embeddings", False)),
      activation=ACTIVATIONS[activation], max_seq_len=max_positions,
      initializer_range=float(f.get("initializer_range", 0.02)), model_type=fam.model_type,
      pad_token_id=_pad(f),
      **_rope(f, head_dim, max_positions))
  out.update(fam.read(f))
  known = COMMON_FIELDS | IGNORED_FIELDS | fam.fields | f.read
  for key, value in values.items():
    if key not in known and f.defaults.get(key, object()) != value:
      f.refuse(key, value, f"{fam.model_type} configs are read without it")
  return out


def write_hf(cfg: DecoderConfig, model_type: str):
  """The ``transformers`` config of ``cfg`` as ``model_type``; raises ValueError naming the
  first field the family cannot express (the written config, read back, must give ``cfg``)."""
  import transformers

  if model_type not in BY_TYPE:
    raise ValueError(f"to_hf: model_type must be one of {MODEL_TYPES}, got {model_type!r}")
  fam = BY_TYPE[model_type]
  rope = cfg.rope().to_hf()
  if cfg.rope_local_theta is not None:
    rope = {"full_attention": rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_theta}}
  common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
                intermediate_size=cfg.mlp_dim, num_hidden_layers=cfg.num_layers,
                num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.kv_heads,
                head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_parameters=rope,
                tie_word_embeddings=cfg.tie_embeddings,
                max_position_embeddings=cfg.max_seq_len,
                initializer_range=cfg.initializer_range, pad_token_id=cfg.pad_token_id)
  if model_type.startswith("gemma"):
    common["hidden_activation"] = _HF_ACTIVATION[cfg.activation]
  else:
    common["hidden_act"] = _HF_ACTIVATION[cfg.activation]
  if "original_max_position_embeddings" in dict(cfg.rope_params) and model_type == "phi3":
    common["original_max_position_embeddings"] = dict(cfg.rope_params)[
        "original_max_position_embeddings"]
  hf = getattr(transformers, fam.config_class)(**common, **fam.write(cfg))
  # What is not Hugging Face's to say: the dtypes and what the backward keeps.
  back = DecoderConfig(**read_hf(hf)).replace(dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                                              expert_keep=cfg.expert_keep)
  for field in dataclasses.fields(DecoderConfig):
    if field.name != "model_type" and getattr(back, field.name) != getattr(cfg, field.name):
      raise ValueError(f"to_hf: a {model_type} config cannot express {field.name}="
                       f"{getattr(cfg, field.name)!r} (it would read back as "
                       f"{getattr(back, field.name)!r})")
  return hf


def supported_table() -> str:
  """The README's table of supported families (Markdown), from :data:`FAMILIES`."""
  rows = ["| family (`model_type`) | transformers class | what it needs beyond LLaMA |",
          "|---|---|---|"]
  rows += [f"| `{f.model_type}` | `{f.architecture}` | {f.needs} |" for f in FAMILIES]
  return "\n".join(rows)


def write_readme(path: str, start: str = "<!-- families:start -->",
                 end: str = "<!-- families:end -->") -> None:
  """Rewrites the table between ``start`` and ``end`` in the file at ``path``."""
  from pathlib import Path

  text = Path(path).read_text()
  head, rest = text.split(start, 1)
  _, tail = rest.split(end, 1)
  Path(path).write_text(f"{head}{start}\n{supported_table()}\n{end}{tail}")


if __name__ == "__main__":   # python -m jaxfuse.models.families [README.md]
  import sys

  if len(sys.argv) > 1:
    write_readme(sys.argv[1])
  else:
    print(supported_table())
