"""Hugging Face checkpoints of the supported families (:mod:`jaxfuse.models.families`: LLaMA,
Mistral, Qwen2/3, Gemma 2/3, Phi-3, OLMo 2) to and from :class:`jaxfuse.models.Decoder`.

The decoder's parameters map one to one onto a ``*ForCausalLM`` state dict
(:func:`hf_param_map`): ``model.embed_tokens.weight``, per layer ``model.layers.{i}.`` the
norms of the family's placement (``input_layernorm``, ``post_attention_layernorm``,
``pre_feedforward_layernorm``, ``post_feedforward_layernorm``), ``self_attn.{q,k,v,o}_proj``
(and ``q_norm``, ``k_norm``), ``mlp.{gate,up,down}_proj``, then ``model.norm.weight`` and
``lm_head.weight`` (absent when the embeddings are tied). Linear weights are transposed (torch
``[out, in]``, flax ``[in, out]``); the rest keep their layout. Phi-3 checkpoints fuse q, k and v
into ``qkv_proj`` and gate and up into ``gate_up_proj``: they are split on load and fused on
save.

A Mixture-of-Experts block's MLP (Mixtral, Qwen2-MoE, Qwen3-MoE) is ``mlp.gate.weight`` (the
router), Qwen2-MoE's shared expert (``mlp.shared_expert.{gate,up,down}_proj.weight``,
``mlp.shared_expert_gate.weight``) and the experts, which come in two layouts, both read: ``transformers`` 5 holds them stacked
(``mlp.experts.gate_up_proj`` ``[E, 2f, d]``, gate rows first, and ``mlp.experts.down_proj``
``[E, d, f]``: what :func:`hf_state_dict` gives, as a live model's ``state_dict()``), and
its ``save_pretrained`` writes them one by one, as the families' original checkpoints have
them (Mixtral's ``block_sparse_moe.gate.weight`` and ``block_sparse_moe.experts.{e}.w1``,
``w3``, ``w2`` for gate, up and down; Qwen3-MoE's ``mlp.experts.{e}.gate_proj``, ...): what
:func:`save_pretrained` writes.

Checkpoint directories are read with ``safetensors`` alone (no ``transformers`` model class is
imported; ``transformers``' config classes supply the defaults of fields a ``config.json``
leaves out, when installed). Writing one for ``transformers`` uses its config class.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse.blocks import mlp as mlp_blocks
from jaxfuse.blocks import moe as moe_blocks
from jaxfuse.blocks import torch_names
from jaxfuse.interop import _torch_maps
from jaxfuse.interop._torch_maps import TorchParam

SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"

# safetensors dtype names -> numpy dtypes (bfloat16 is ml_dtypes', which jax uses).
_SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}
# Buffers some checkpoints carry that the config determines (the rotary inverse frequencies).
_DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)


def _decoder_class():
  from jaxfuse.models.decoder import Decoder

  return Decoder


def hf_param_map(cfg) -> dict[tuple, TorchParam]:
  """The decoder's parameter paths mapped to Hugging Face ``*ForCausalLM`` state-dict entries.

  Args:
    cfg: a :class:`jaxfuse.models.DecoderConfig`.

  Returns:
    ``{path: TorchParam}``; paths index the decoder (``("layers", 0, "mlp", "up_proj",
    "kernel")``); with tied embeddings there is no ``lm_head.weight`` entry.

  Example:
    >>> from jaxfuse.interop import hf_param_map
    >>> from jaxfuse.models import DecoderConfig
    >>> cfg = DecoderConfig(vocab_size=64, d_model=16, num_layers=1, num_heads=2, mlp_dim=32)
    >>> hf_param_map(cfg)[("layers", 0, "self_attn", "q_proj", "kernel")]
    TorchParam(key='model.layers.0.self_attn.q_proj.weight', transposed=True, flatten=None)
    >>> len(hf_param_map(cfg)), len(hf_param_map(cfg.replace(tie_embeddings=True)))
    (12, 11)
  """
  from jaxfuse.models.decoder_block import NORMS

  out = {("embed_tokens", "embedding"): ("model.embed_tokens.weight", False)}
  attention = {name: cfg.o_bias if name == "o_proj" else cfg.qkv_bias
               for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
  norm = torch_names.norm_torch_params(use_scale=True, use_bias=False)
  attention_params = torch_names.linear_torch_params(attention)
  if cfg.qk_norm is not None:
    for name in ("q_norm", "k_norm"):
      attention_params.update(torch_names.prefixed(norm, (name,), f"{name}."))
  for i in range(cfg.num_layers):
    layer, prefix = ("layers", i), f"model.layers.{i}."
    for name in NORMS[cfg.norm_placement]:
      if name is not None:
        out.update(torch_names.prefixed(norm, layer + (name,), prefix + name + "."))
    out.update(torch_names.prefixed(attention_params, layer + ("self_attn",),
                                    prefix + "self_attn."))
    mlp_params = (moe_blocks.torch_params(
                      shared_expert=bool(getattr(cfg, "shared_expert_mlp_dim", 0)))
                  if getattr(cfg, "num_experts", 0)
                  else mlp_blocks.torch_params(mlp_blocks.GATED, cfg.mlp_bias))
    out.update(torch_names.prefixed(mlp_params, layer + ("mlp",), prefix + "mlp."))
  out.update(torch_names.prefixed(norm, ("norm",), "model.norm."))
  if not cfg.tie_embeddings:
    out.update(torch_names.prefixed(torch_names.lm_head_torch_params(True, False), ("lm_head",),
                                    "lm_head."))
  return _torch_maps.entries(out)


# Phi-3's fused projections: the fused key -> the separate keys, in order, and how to size them.
_FUSED = {"self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                        "self_attn.v_proj.weight"),
          "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}


def _fused_sizes(cfg, fused_key: str) -> list[int]:
  if fused_key.startswith("self_attn"):
    return [cfg.num_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim,
            cfg.kv_heads * cfg.head_dim]
  return [cfg.mlp_dim, cfg.mlp_dim]


def _fuses_projections(cfg) -> bool:
  from jaxfuse.models import families

  return families.BY_TYPE[cfg.model_type].fused_projections


def split_fused(cfg, state_dict: Mapping) -> dict:
  """A Phi-3 state dict with ``qkv_proj`` and ``gate_up_proj`` split into the separate
  projections (their rows: q, k, v; gate, up); other families' unchanged."""
  if not _fuses_projections(cfg):
    return dict(state_dict)
  out = {}
  for key, value in state_dict.items():
    suffix = next((f for f in _FUSED if key.endswith(f)), None)
    if suffix is None:
      out[key] = value
      continue
    array = _torch_maps.to_numpy(value)
    sizes = _fused_sizes(cfg, suffix)
    if array.shape[0] != sum(sizes):
      raise ValueError(f"state_dict: {key} has {array.shape[0]} rows, the config's "
                       f"{' + '.join(map(str, sizes))}")
    prefix = key[:-len(suffix)]
    for name, part in zip(_FUSED[suffix], np.split(array, np.cumsum(sizes)[:-1])):
      out[prefix + name] = part
  return out


def fuse_projections(cfg, state_dict: Mapping) -> dict:
  """The inverse of :func:`split_fused`: Phi-3's fused ``qkv_proj`` and ``gate_up_proj``."""
  if not _fuses_projections(cfg):
    return dict(state_dict)
  out = dict(state_dict)
  for i in range(cfg.num_layers):
    prefix = f"model.layers.{i}."
    for fused, parts in _FUSED.items():
      arrays = [out.pop(prefix + p) for p in parts]
      torch_like = not isinstance(arrays[0], np.ndarray)
      if torch_like:
        import torch

        out[prefix + fused] = torch.cat(arrays, dim=0)
      else:
        out[prefix + fused] = np.concatenate(arrays, axis=0)
  return out


# Mixture-of-Experts layouts: hf_param_map's keys hold the experts stacked, gate and up apart
# (``mlp.experts.gate_proj`` [E, f, d], ``up_proj``, ``down_proj`` [E, d, f]).
_EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _cat(arrays, axis):
  if isinstance(arrays[0], np.ndarray):
    return np.concatenate(arrays, axis=axis)
  import torch

  return torch.cat(arrays, dim=axis)


def _stack(arrays):
  if isinstance(arrays[0], np.ndarray):
    return np.stack(arrays)
  import torch

  return torch.stack(arrays)


def _experts_layout(cfg):
  """``(module, (gate, up, down))``: how the family's checkpoint files name each expert."""
  from jaxfuse.models import families

  fam = families.BY_TYPE.get(cfg.model_type)
  return (fam.experts if fam is not None and fam.experts else
          ("mlp", _EXPERT_PROJECTIONS))


def stack_experts(cfg, state_dict: Mapping) -> dict:
  """A MoE checkpoint's experts in :func:`hf_param_map`'s layout, from either layout of the
  module docstring (other families' state dicts unchanged)."""
  if not getattr(cfg, "num_experts", 0):
    return dict(state_dict)
  out = dict(state_dict)
  module, files = _experts_layout(cfg)
  for i in range(cfg.num_layers):
    prefix = f"model.layers.{i}."
    fused = prefix + "mlp.experts.gate_up_proj"
    if fused in out:
      value = out.pop(fused)
      f = cfg.expert_mlp_dim
      if value.shape[1] != 2 * f:
        raise ValueError(f"state_dict: {fused} has {value.shape[1]} rows per expert, the "
                         f"config's 2 * {f}")
      out[prefix + "mlp.experts.gate_proj"] = value[:, :f]
      out[prefix + "mlp.experts.up_proj"] = value[:, f:]
    if f"{prefix}{module}.experts.0.{files[0]}.weight" in out:
      for ours, theirs in zip(_EXPERT_PROJECTIONS, files):
        keys = [f"{prefix}{module}.experts.{e}.{theirs}.weight" for e in range(cfg.num_experts)]
        missing = [k for k in keys if k not in out]
        if missing:
          raise ValueError(f"state_dict: missing keys {missing} (the config has "
                           f"{cfg.num_experts} experts)")
        out[f"{prefix}mlp.experts.{ours}"] = _stack([out.pop(k) for k in keys])
    if module != "mlp" and f"{prefix}{module}.gate.weight" in out:
      out[prefix + "mlp.gate.weight"] = out.pop(f"{prefix}{module}.gate.weight")
  return out


def fuse_experts(cfg, state_dict: Mapping) -> dict:
  """:func:`hf_param_map`'s experts as ``transformers`` 5 holds them: gate and up fused into
  ``mlp.experts.gate_up_proj`` (the inverse of :func:`stack_experts`)."""
  if not getattr(cfg, "num_experts", 0):
    return dict(state_dict)
  out = dict(state_dict)
  for i in range(cfg.num_layers):
    prefix = f"model.layers.{i}.mlp.experts."
    out[prefix + "gate_up_proj"] = _cat([out.pop(prefix + "gate_proj"),
                                         out.pop(prefix + "up_proj")], 1)
  return out


def experts_one_by_one(cfg, state_dict: Mapping) -> dict:
  """:func:`hf_param_map`'s experts one by one under the family's checkpoint names (as
  ``transformers``' ``save_pretrained`` writes them), the router under the same module."""
  if not getattr(cfg, "num_experts", 0):
    return dict(state_dict)
  out = dict(state_dict)
  module, files = _experts_layout(cfg)
  for i in range(cfg.num_layers):
    prefix = f"model.layers.{i}."
    for ours, theirs in zip(_EXPERT_PROJECTIONS, files):
      stacked = out.pop(f"{prefix}mlp.experts.{ours}")
      for e in range(cfg.num_experts):
        out[f"{prefix}{module}.experts.{e}.{theirs}.weight"] = np.ascontiguousarray(stacked[e])
    out[f"{prefix}{module}.gate.weight"] = out.pop(prefix + "mlp.gate.weight")
  return out


def decoder_params_or_none(module):
  """:func:`hf_param_map` of a :class:`jaxfuse.models.Decoder`'s config; None for another
  module."""
  if isinstance(module, _decoder_class()):
    return hf_param_map(module.cfg)
  return None


def _check_decoder(model, fn: str):
  if not isinstance(model, _decoder_class()):
    raise TypeError(f"{fn}: expected a jaxfuse.models.Decoder, got {type(model).__name__}")


def _canonical_keys(model, state_dict: Mapping) -> dict:
  """The state dict under ``*ForCausalLM`` keys: ``model.`` added where a base model's keys lack
  it, derived buffers dropped, and a tied ``lm_head.weight`` checked against the embedding and
  dropped."""
  out = {}
  for key, value in state_dict.items():
    if key.endswith(_DERIVED_SUFFIXES):
      continue
    if key != "lm_head.weight" and not key.startswith("model."):
      key = "model." + key
    if key in out:
      raise ValueError(f"state_dict: key {key!r} appears both with and without the 'model.' "
                       f"prefix")
    out[key] = value
  if model.cfg.tie_embeddings and "lm_head.weight" in out:
    head = _torch_maps.to_numpy(out.pop("lm_head.weight"))
    embedding = out.get("model.embed_tokens.weight")
    if embedding is not None and not np.array_equal(head, _torch_maps.to_numpy(embedding)):
      raise ValueError("state_dict['lm_head.weight'] differs from "
                       "state_dict['model.embed_tokens.weight'], but the config ties them "
                       "(tie_word_embeddings=True)")
  return out


def load_hf_state_dict(model, state_dict: Mapping, *, strict: bool = True) -> None:
  """Copies a Hugging Face state dict of a supported family into a decoder, in place.

  Args:
    model: a :class:`jaxfuse.models.Decoder` whose config matches the checkpoint's.
    state_dict: a ``*ForCausalLM`` (or base ``*Model``) ``state_dict()``, or the arrays of a
      ``safetensors`` checkpoint: torch tensors or arrays. Keys may lack the ``model.`` prefix.
      With tied embeddings, ``lm_head.weight`` may be absent or equal to the embedding.
      ``rotary_emb.inv_freq`` buffers are skipped (the config determines them).
    strict: refuse keys the decoder has no parameter for.

  Raises:
    ValueError: a key is missing or unknown, a shape does not match, or a tied
      ``lm_head.weight`` differs from the embedding; the message names the key.

  Example:
    >>> from flax import nnx
    >>> from jaxfuse import interop
    >>> from jaxfuse.models import Decoder, DecoderConfig
    >>> cfg = DecoderConfig(vocab_size=64, d_model=16, num_layers=1, num_heads=2, mlp_dim=32)
    >>> a, b = Decoder(cfg, rngs=nnx.Rngs(0)), Decoder(cfg, rngs=nnx.Rngs(1))
    >>> interop.load_hf_state_dict(b, interop.hf_state_dict(a))
    >>> bool((a.norm.scale[...] == b.norm.scale[...]).all())
    True
    >>> state = interop.hf_state_dict(a)
    >>> del state["model.norm.weight"]
    >>> interop.load_hf_state_dict(b, state)
    Traceback (most recent call last):
    ...
    ValueError: state_dict: missing keys ['model.norm.weight'], unexpected keys []
  """
  _check_decoder(model, "load_hf_state_dict")
  if getattr(model, "scan_layers", False):   # load per block, then stack
    from flax import nnx

    unrolled = model.with_layers(False)
    load_hf_state_dict(unrolled, state_dict, strict=strict)
    nnx.update(model, nnx.state(unrolled.with_layers(True)))
    return
  state_dict = stack_experts(model.cfg,
                             split_fused(model.cfg, _canonical_keys(model, state_dict)))
  _torch_maps.load_torch_state_dict(model, state_dict, strict=strict,
                                    mapping=hf_param_map(model.cfg))


def hf_state_dict(model, *, as_torch: bool = False) -> dict:
  """A decoder's parameters under Hugging Face ``*ForCausalLM`` keys and layouts.

  Args:
    model: a :class:`jaxfuse.models.Decoder`.
    as_torch: torch tensors (else numpy arrays).

  Returns:
    ``{key: array}``; with tied embeddings there is no ``lm_head.weight`` (as in a saved
    checkpoint: load it into a live ``transformers`` model with ``strict=False``, or re-tie).

  Example:
    >>> from flax import nnx
    >>> from jaxfuse import interop
    >>> from jaxfuse.models import Decoder, DecoderConfig
    >>> cfg = DecoderConfig(vocab_size=64, d_model=16, num_layers=1, num_heads=2, mlp_dim=32)
    >>> state = interop.hf_state_dict(Decoder(cfg, rngs=nnx.Rngs(0)))
    >>> state["model.layers.0.mlp.up_proj.weight"].shape, state["lm_head.weight"].shape
    ((32, 16), (64, 16))
  """
  _check_decoder(model, "hf_state_dict")
  if getattr(model, "scan_layers", False):
    model = model.with_layers(False)
  state = _torch_maps.torch_state_dict(model, as_torch=as_torch, mapping=hf_param_map(model.cfg))
  return fuse_experts(model.cfg, fuse_projections(model.cfg, state))


# Checkpoint files --------------------------------------------------------------------------------


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
  """The tensors of one ``.safetensors`` file as numpy arrays (bfloat16 as ``jnp.bfloat16``)."""
  import safetensors

  out = {}
  for name, view in safetensors.deserialize(Path(path).read_bytes()):
    dtype = _SAFETENSORS_DTYPES.get(view["dtype"])
    if dtype is None:
      raise ValueError(f"{path}: tensor {name!r} has dtype {view['dtype']}, which is not "
                       f"supported (supported: {sorted(_SAFETENSORS_DTYPES)})")
    out[name] = np.frombuffer(view["data"], dtype=dtype).reshape(view["shape"])
  return out


def read_checkpoint(directory: str | os.PathLike) -> dict[str, np.ndarray]:
  """The tensors of a ``save_pretrained`` directory: ``model.safetensors``, or the shards that
  ``model.safetensors.index.json`` lists.

  Raises:
    FileNotFoundError: neither file, or a shard the index names, exists.
    ValueError: a shard lacks a tensor the index assigns to it.
  """
  directory = Path(directory)
  single, index = directory / SAFETENSORS_NAME, directory / SAFETENSORS_INDEX_NAME
  if single.is_file():
    return read_safetensors(single)
  if not index.is_file():
    raise FileNotFoundError(f"{directory}: no {SAFETENSORS_NAME} or {SAFETENSORS_INDEX_NAME} "
                            f"(only safetensors checkpoints are read)")
  weight_map = json.loads(index.read_text())["weight_map"]
  out = {}
  for shard in sorted(set(weight_map.values())):
    if not (directory / shard).is_file():
      raise FileNotFoundError(f"{directory}: shard {shard} named in {SAFETENSORS_INDEX_NAME} "
                              f"does not exist")
    tensors = read_safetensors(directory / shard)
    for key, file in weight_map.items():
      if file == shard and key not in tensors:
        raise ValueError(f"{directory / shard}: has no tensor {key!r}, which "
                         f"{SAFETENSORS_INDEX_NAME} assigns to it")
    out.update(tensors)
  return out


# Models ------------------------------------------------------------------------------------------


def _decoder_from(cfg, state_dict: Mapping, *, fused: bool, remat, implementation,
                  scan_layers: bool = False):
  """A decoder with its parameters from ``state_dict``, without initializing them first."""
  from flax import nnx

  decoder = _decoder_class()
  model = nnx.eval_shape(lambda: decoder(cfg, fused=fused, remat=remat,
                                         implementation=implementation, rngs=nnx.Rngs(0)))
  load_hf_state_dict(model, state_dict)
  for path, leaf in nnx.to_flat_state(nnx.state(model)):
    if isinstance(leaf.get_value(), jax.ShapeDtypeStruct):
      raise ValueError(f"from_pretrained: the decoder's {'.'.join(map(str, path))} has no "
                       f"Hugging Face counterpart to load it from")
  return model.with_layers(scan_layers)


def from_pretrained(source, *, fused: bool = True, remat=None,
                    implementation: str | None = None, scan_layers: bool = False, **overrides):
  """A :class:`jaxfuse.models.Decoder` from a Hugging Face checkpoint of a supported family.

  Args:
    source: a ``save_pretrained`` directory (``config.json`` and ``model.safetensors``, or
      shards listed in ``model.safetensors.index.json``), or a live ``transformers``
      ``*ForCausalLM`` model.
    fused, remat, implementation, scan_layers: passed to the :class:`~jaxfuse.models.Decoder`.
    **overrides: :class:`~jaxfuse.models.DecoderConfig` fields set on the mapped config, e.g.
      ``dtype=jnp.bfloat16``, ``param_dtype``, ``max_seq_len``.

  Returns:
    The decoder, its parameters in ``param_dtype`` (float32 unless overridden).

  Raises:
    jaxfuse.models.UnsupportedConfigError: the config has a field the decoder does not
      compute (named).
    ValueError: a key is missing or unknown, or a shape does not match (named).
    FileNotFoundError: no config or weights in the directory.

  Example:
    >>> import tempfile
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxfuse import interop
    >>> from jaxfuse.models import Decoder, DecoderConfig
    >>> cfg = DecoderConfig(vocab_size=64, d_model=16, num_layers=1, num_heads=2, mlp_dim=32)
    >>> model = Decoder(cfg, rngs=nnx.Rngs(0))
    >>> with tempfile.TemporaryDirectory() as path:
    ...   interop.save_pretrained(model, path)
    ...   again = interop.from_pretrained(path, fused=False)
    >>> tokens = jnp.arange(8)[None]
    >>> bool(jnp.allclose(again.logits(tokens), model.logits(tokens), atol=1e-5))
    True
  """
  from jaxfuse.models.config import DecoderConfig

  if isinstance(source, (str, os.PathLike)):
    directory = Path(source)
    config_file = directory / CONFIG_NAME
    if not config_file.is_file():
      raise FileNotFoundError(f"{directory}: no {CONFIG_NAME}")
    cfg = DecoderConfig.from_hf(json.loads(config_file.read_text()), **overrides)
    state_dict = read_checkpoint(directory)
  elif hasattr(source, "config") and hasattr(source, "state_dict"):
    cfg = DecoderConfig.from_hf(source.config, **overrides)
    state_dict = source.state_dict()
  else:
    raise TypeError(f"from_pretrained: expected a directory or a transformers model, got "
                    f"{type(source).__name__}")
  return _decoder_from(cfg, state_dict, fused=fused, remat=remat, implementation=implementation,
                       scan_layers=scan_layers)


def save_pretrained(model, path: str | os.PathLike, model_type: str | None = None) -> None:
  """Writes a decoder as a Hugging Face checkpoint directory that
  ``transformers.AutoModelForCausalLM.from_pretrained(path)`` loads.

  The directory gets ``config.json`` (from :meth:`DecoderConfig.to_hf`, with ``architectures``
  and ``dtype`` set; needs ``transformers``) and ``model.safetensors`` (the parameters in their
  ``param_dtype``; no ``lm_head.weight`` when tied; a MoE layer's experts one by one, as
  ``transformers`` writes them). A sharded checkpoint already there (an
  index and the shards it lists) is removed, so that loaders find this one.

  Args:
    model: a :class:`jaxfuse.models.Decoder`.
    path: the directory (created if needed).
    model_type: a family of :data:`jaxfuse.models.families.FAMILIES` (default: the config's
      own); the config must be expressible in it (e.g. q/k/v biases without an output bias
      are Qwen2's).

  Raises:
    ValueError: the config cannot be written as ``model_type``.
  """
  import safetensors.numpy

  from jaxfuse.models import families

  _check_decoder(model, "save_pretrained")
  model_type = model_type or model.cfg.model_type
  hf_config = model.cfg.to_hf(model_type)
  hf_config.architectures = [families.family(model_type).architecture]
  hf_config.dtype = jnp.dtype(model.cfg.param_dtype).name
  directory = Path(path)
  directory.mkdir(parents=True, exist_ok=True)
  index = directory / SAFETENSORS_INDEX_NAME
  if index.is_file():
    for shard in set(json.loads(index.read_text()).get("weight_map", {}).values()):
      (directory / shard).unlink(missing_ok=True)
    index.unlink()
  hf_config.save_pretrained(directory)
  state = hf_state_dict(model.with_layers(False) if model.scan_layers else model)
  written = model.cfg.replace(model_type=model_type)
  if model_type != model.cfg.model_type:   # the weights as the written family stores them
    state = fuse_projections(written, split_fused(model.cfg, state))
  state = experts_one_by_one(written, stack_experts(model.cfg, state))
  safetensors.numpy.save_file(state, directory / SAFETENSORS_NAME, metadata={"format": "pt"})
