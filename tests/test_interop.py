"""Torch parameter maps of every module (NNX and Linen): round trips, torch twins loaded from our
state dicts, and the errors; the decoder's Hugging Face map and checkpoint files.

(The decoder against Hugging Face's own models is in test_hf_twin.py.)
"""

import dataclasses
import json
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import jaxfuse.linen
import jaxfuse.nnx
from jaxfuse import interop
from jaxfuse.interop import TorchParam
from jaxfuse.models import Decoder, DecoderConfig, UnsupportedConfigError
from tests import helpers

transformers = pytest.importorskip("transformers")
from transformers.models.llama import modeling_llama  # noqa: E402

B, T, D, H, V = 2, 11, 32, 48, 53  # batch, sequence, features, hidden, vocabulary


# Torch twins --------------------------------------------------------------------------------------


class TorchMLP(torch.nn.Module):
  """``down_proj(gelu(up_proj(x)))``: jaxfuse's MLP with torch ``nn.Linear`` projections."""

  def __init__(self, d, hidden, bias):
    super().__init__()
    self.up_proj = torch.nn.Linear(d, hidden)
    self.down_proj = torch.nn.Linear(hidden, d, bias=bias)

  def forward(self, x):
    return self.down_proj(torch.nn.functional.gelu(self.up_proj(x)))


class TorchHead(torch.nn.Module):
  """LM-head logits: ``weight [V, D]`` and an optional bias."""

  def __init__(self, d, vocab, bias):
    super().__init__()
    self.weight = torch.nn.Parameter(torch.empty(vocab, d))
    self.bias = torch.nn.Parameter(torch.empty(vocab)) if bias else None

  def forward(self, h):
    return torch.nn.functional.linear(h, self.weight, self.bias)


class HFAttention(torch.nn.Module):
  """Hugging Face's ``LlamaAttention`` (GQA, rotary, causal), its parameters at the top level."""

  def __init__(self, heads, kv_heads, bias):
    super().__init__()
    config = transformers.LlamaConfig(hidden_size=D, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, attention_bias=bias,
                                      attn_implementation="eager")
    attention = modeling_llama.LlamaAttention(config, layer_idx=0)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
      setattr(self, name, getattr(attention, name))
    self.forward_attention = attention.forward
    self.rotary = modeling_llama.LlamaRotaryEmbedding(config)

  def forward(self, x):
    t = x.shape[1]
    position_embeddings = self.rotary(x, torch.arange(t)[None])
    causal = torch.full((t, t), float("-inf")).triu(1)[None, None]
    return self.forward_attention(x, position_embeddings=position_embeddings,
                                  attention_mask=causal)[0]


def _llama_mlp(bias):
  config = transformers.LlamaConfig(hidden_size=D, intermediate_size=H, mlp_bias=bias)
  return modeling_llama.LlamaMLP(config)


@dataclasses.dataclass(frozen=True)
class Case:
  """A module in both frameworks, its torch twin (None: round trips only), and how to call it."""

  nnx: Callable
  linen: Callable
  twin: Callable | None
  keys: tuple
  kwargs: dict = dataclasses.field(default_factory=dict)


ATTENTION = dict(num_heads=4, num_kv_heads=2, rotary=True)
ATTENTION_KEYS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")
ATTENTION_BIASES = ("q_proj.bias", "k_proj.bias", "v_proj.bias", "o_proj.bias")
CASES = {
    "rms_norm": Case(lambda r: jaxfuse.nnx.RMSNorm(D, rngs=r), lambda: jaxfuse.linen.RMSNorm(),
                     lambda: torch.nn.RMSNorm(D, eps=1e-6), ("weight",)),
    "layer_norm": Case(lambda r: jaxfuse.nnx.LayerNorm(D, rngs=r),
                       lambda: jaxfuse.linen.LayerNorm(),
                       lambda: torch.nn.LayerNorm(D, eps=1e-6), ("weight", "bias")),
    "layer_norm_no_bias": Case(lambda r: jaxfuse.nnx.LayerNorm(D, use_bias=False, rngs=r),
                               lambda: jaxfuse.linen.LayerNorm(use_bias=False),
                               lambda: torch.nn.LayerNorm(D, eps=1e-6, bias=False), ("weight",)),
    "layer_norm_no_params": Case(
        lambda r: jaxfuse.nnx.LayerNorm(D, use_bias=False, use_scale=False, rngs=r),
        lambda: jaxfuse.linen.LayerNorm(use_bias=False, use_scale=False),
        lambda: torch.nn.LayerNorm(D, eps=1e-6, elementwise_affine=False), ()),
    "gated_mlp": Case(lambda r: jaxfuse.nnx.GatedMLP(D, H, rngs=r),
                      lambda: jaxfuse.linen.GatedMLP(H), lambda: _llama_mlp(False),
                      ("gate_proj.weight", "up_proj.weight", "down_proj.weight")),
    "gated_mlp_bias": Case(lambda r: jaxfuse.nnx.GatedMLP(D, H, use_bias=True, rngs=r),
                           lambda: jaxfuse.linen.GatedMLP(H, use_bias=True),
                           lambda: _llama_mlp(True),
                           ("gate_proj.weight", "gate_proj.bias", "up_proj.weight",
                            "up_proj.bias", "down_proj.weight", "down_proj.bias")),
    "mlp": Case(lambda r: jaxfuse.nnx.MLP(D, H, rngs=r), lambda: jaxfuse.linen.MLP(H),
                lambda: TorchMLP(D, H, True),
                ("up_proj.weight", "up_proj.bias", "down_proj.weight", "down_proj.bias")),
    "mlp_no_down_bias": Case(lambda r: jaxfuse.nnx.MLP(D, H, use_bias=False, rngs=r),
                             lambda: jaxfuse.linen.MLP(H, use_bias=False),
                             lambda: TorchMLP(D, H, False),
                             ("up_proj.weight", "up_proj.bias", "down_proj.weight")),
    "lm_head": Case(lambda r: jaxfuse.nnx.LMHead(D, V, rngs=r),
                    lambda: jaxfuse.linen.LMHead(V), lambda: TorchHead(D, V, False), ("weight",)),
    "lm_head_bias": Case(lambda r: jaxfuse.nnx.LMHead(D, V, use_bias=True, rngs=r),
                         lambda: jaxfuse.linen.LMHead(V, use_bias=True),
                         lambda: TorchHead(D, V, True), ("weight", "bias")),
    "self_attention": Case(
        lambda r: jaxfuse.nnx.SelfAttention(in_features=D, use_bias=False, **ATTENTION, rngs=r),
        lambda: jaxfuse.linen.SelfAttention(use_bias=False, **ATTENTION),
        lambda: HFAttention(4, 2, False), ATTENTION_KEYS, dict(is_causal=True)),
    "multi_head_attention_bias": Case(
        lambda r: jaxfuse.nnx.MultiHeadAttention(in_features=D, **ATTENTION, rngs=r),
        lambda: jaxfuse.linen.MultiHeadAttention(**ATTENTION),
        lambda: HFAttention(4, 2, True), ATTENTION_KEYS + ATTENTION_BIASES,
        dict(is_causal=True)),
    "attention_normalize_qk": Case(
        lambda r: jaxfuse.nnx.MultiHeadAttention(num_heads=4, in_features=D, normalize_qk=True,
                                                 rngs=r),
        lambda: jaxfuse.linen.MultiHeadAttention(num_heads=4, normalize_qk=True),
        None, ATTENTION_KEYS + ATTENTION_BIASES + ("q_norm.weight", "k_norm.weight")),
    "recompute_linear": Case(lambda r: jaxfuse.nnx.RecomputeLinear(D, H, rngs=r),
                             lambda: jaxfuse.linen.RecomputeLinear(H),
                             lambda: torch.nn.Linear(D, H), ("weight", "bias")),
    "recompute_linear_no_bias": Case(
        lambda r: jaxfuse.nnx.RecomputeLinear(D, H, use_bias=False, rngs=r),
        lambda: jaxfuse.linen.RecomputeLinear(H, use_bias=False),
        lambda: torch.nn.Linear(D, H, bias=False), ("weight",)),
}
FRAMEWORKS = ("nnx", "linen")


def _input(seed=0):
  return jax.random.normal(jax.random.key(seed), (B, T, D))


def _twin(case: Case, seed=0) -> torch.nn.Module:
  """The torch twin with random parameters (not the identity a fresh norm has)."""
  torch.manual_seed(seed)
  module = case.twin()
  with torch.no_grad():
    for name, p in module.named_parameters():
      if p.ndim == 2:  # a linear weight [out, in]
        p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
      elif name.endswith("weight"):  # a norm's scale
        p.copy_(1 + 0.2 * torch.randn_like(p))
      else:  # a bias
        p.copy_(0.2 * torch.randn_like(p))
  return module


class Wrapped:
  """One interface over an NNX module and a Linen module with its variables."""

  def __init__(self, framework: str, case: Case, seed: int):
    self.framework, self.case = framework, case
    if framework == "nnx":
      self.module = case.nnx(nnx.Rngs(seed))
      self.graphdef, self.params, self.rest = nnx.split(self.module, nnx.Param, ...)
    else:
      self.module = case.linen()
      self.variables = self.module.init(jax.random.key(seed), _input(), **case.kwargs)

  def to_torch(self, **kw) -> dict:
    if self.framework == "nnx":
      return interop.torch_state_dict(self.module, **kw)
    return interop.linen_params_to_torch(self.module, self.variables, **kw)

  def load(self, state_dict, **kw) -> None:
    if self.framework == "nnx":
      interop.load_torch_state_dict(self.module, state_dict, **kw)
      self.graphdef, self.params, self.rest = nnx.split(self.module, nnx.Param, ...)
    else:
      self.variables = interop.linen_params_from_torch(self.module, self.variables, state_dict,
                                                       **kw)

  def value_and_grads(self, x, g):
    """The output, and the gradients of ``sum(out * g)`` w.r.t. x and the parameters (the
    latter under torch names)."""
    kwargs = self.case.kwargs
    if self.framework == "nnx":
      def run(params, x):
        return nnx.merge(self.graphdef, params, self.rest)(x, **kwargs)
      params = self.params
    else:
      def run(params, x):
        return self.module.apply({**self.variables, "params": params}, x, **kwargs)
      params = self.variables.get("params", {})

    @jax.jit
    def both(params, x):
      out, vjp = jax.vjp(run, params, x)
      return out, *vjp(g.astype(out.dtype))

    out, grad_params, grad_x = both(params, x)
    if self.framework == "nnx":
      grads = interop.torch_state_dict(nnx.merge(self.graphdef, grad_params, self.rest))
    else:
      grads = interop.linen_params_to_torch(self.module, {"params": grad_params})
    return out, grad_x, grads


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_round_trips_are_exact(name, framework):
  """ours -> torch -> ours and torch -> ours -> torch give back the very same values."""
  case = CASES[name]
  ours, other = Wrapped(framework, case, 0), Wrapped(framework, case, 1)
  state = ours.to_torch()
  assert sorted(state) == sorted(case.keys)
  other.load(state)
  back = other.to_torch()
  for key, value in state.items():
    np.testing.assert_array_equal(back[key], value, err_msg=key)
  ours_leaves = jax.tree.leaves(ours.params if framework == "nnx" else ours.variables)
  other_leaves = jax.tree.leaves(other.params if framework == "nnx" else other.variables)
  for a, b in zip(ours_leaves, other_leaves, strict=True):
    np.testing.assert_array_equal(a, b)
  if case.twin is not None:
    twin_state = _twin(case).state_dict()
    other.load(twin_state)
    back = other.to_torch(as_torch=True)
    assert sorted(back) == sorted(twin_state)
    for key, value in twin_state.items():
      torch.testing.assert_close(back[key], value, rtol=0, atol=0)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c.twin is not None))
def test_torch_twin_loaded_from_our_state_dict_agrees(name, framework):
  """The twin loads our state dict (strictly) and gives our output and gradients."""
  case = CASES[name]
  ours = Wrapped(framework, case, 0)
  ours.load(_twin(case, seed=3).state_dict())  # parameters that are not a default init
  twin = case.twin()
  twin.load_state_dict(ours.to_torch(as_torch=True), strict=True)
  x = _input(1)
  g = jax.random.normal(jax.random.key(2), (B, T, V if name.startswith("lm_head") else
                                            H if name.startswith("recompute") else D))
  out, grad_x, grads = ours.value_and_grads(x, g)
  tx = helpers.to_torch(x, requires_grad=True)
  t_out = twin(tx)
  t_out.backward(helpers.to_torch(g))
  helpers.assert_close(out, t_out, what="output")
  helpers.assert_close(grad_x, tx.grad, what="grad x")
  t_grads = {n: p.grad for n, p in twin.named_parameters()}
  assert sorted(grads) == sorted(t_grads)
  for key, value in t_grads.items():
    helpers.assert_close(grads[key], value, what=f"grad {key}")


def test_tied_head_maps_only_its_bias():
  embed = nnx.Embed(V, D, rngs=nnx.Rngs(0))
  head = jaxfuse.nnx.LMHead(D, tie_to=embed, use_bias=True, rngs=nnx.Rngs(1))
  state = interop.torch_state_dict(head)
  assert list(state) == ["bias"]
  interop.load_torch_state_dict(head, {"bias": np.arange(V, dtype=np.float32)})
  np.testing.assert_array_equal(head.bias[...], np.arange(V))
  # Linen: a head given weight= creates no kernel; its map without the kernel entry serves.
  linen_head = jaxfuse.linen.LMHead(V, use_bias=True)
  h = _input()
  variables = linen_head.init(jax.random.key(0), h, weight=embed.embedding[...])
  mapping = {p: e for p, e in linen_head.TORCH_PARAMS.items() if p != ("kernel",)}
  assert list(interop.linen_params_to_torch(linen_head, variables, mapping=mapping)) == ["bias"]
  with pytest.raises(ValueError, match="no parameter kernel"):
    interop.linen_params_to_torch(linen_head, variables)


def test_errors_name_the_key():
  layer = jaxfuse.nnx.MultiHeadAttention(num_heads=4, in_features=D, num_kv_heads=2,
                                         rngs=nnx.Rngs(0))
  state = interop.torch_state_dict(layer)
  assert state["k_proj.weight"].shape == (16, D)
  bad = dict(state, **{"k_proj.weight": state["k_proj.weight"][:8]})
  with pytest.raises(ValueError, match=r"'k_proj.weight'.*expected shape \(16, 32\), got "
                                       r"\(8, 32\)"):
    interop.load_torch_state_dict(layer, bad)
  with pytest.raises(ValueError, match=r"missing keys \['o_proj.bias'\]"):
    interop.load_torch_state_dict(layer, {k: v for k, v in state.items() if k != "o_proj.bias"})
  with pytest.raises(ValueError, match=r"unexpected keys \['extra'\]"):
    interop.load_torch_state_dict(layer, {**state, "extra": np.zeros(1)})
  interop.load_torch_state_dict(layer, {**state, "extra": np.zeros(1)}, strict=False)
  with pytest.raises(TypeError, match="Embed declares no TORCH_PARAMS"):
    interop.torch_state_dict(nnx.Embed(3, 4, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match="cannot flatten axes"):
    TorchParam("w", True, (1, 3)).torch_shape((2, 3, 4))
  with pytest.raises(ValueError, match="'w': a transposed entry needs a 2-D tensor"):
    TorchParam("w", True).torch_shape((2, 3, 4, 5))
  assert TorchParam("w", True).torch_shape((2, 3, 4)) == (2, 4, 3)   # stacked experts


def test_entry_format_stays_backwards_compatible():
  """Two-element entries and paths of names still read; flatten entries round-trip shapes."""
  entries = interop.torch_params(jaxfuse.nnx.SimpleNN(3, 5, 2, rngs=nnx.Rngs(0)))
  assert entries[("fc2", "kernel")] == TorchParam("fc2.weight", True, None)
  out = TorchParam("o_proj.weight", True, (0, 1))
  value = np.arange(4 * 8 * 32).reshape(4, 8, 32)
  np.testing.assert_array_equal(out.to_torch(value), value.reshape(32, 32).T)
  np.testing.assert_array_equal(out.from_torch(out.to_torch(value), value.shape), value)
  bias = TorchParam("q_proj.bias", False, (-2, -1))
  assert bias.torch_shape((4, 8)) == (32,)


# The decoder's Hugging Face map -----------------------------------------------------------------

CFG = DecoderConfig(vocab_size=V, d_model=D, num_layers=2, num_heads=4, num_kv_heads=2,
                    mlp_dim=H, qkv_bias=True)


def _decoder(seed=0, **changes):
  return Decoder(CFG.replace(**changes), rngs=nnx.Rngs(seed))


def _assert_same_params(a, b):
  for (path, x), (_, y) in zip(nnx.to_flat_state(nnx.state(a, nnx.Param)),
                               nnx.to_flat_state(nnx.state(b, nnx.Param)), strict=True):
    np.testing.assert_array_equal(x[...], y[...], err_msg=str(path))


def test_decoder_state_dict_round_trip_and_key_forms():
  a, b = _decoder(0), _decoder(1)
  state = interop.hf_state_dict(a)
  assert len(state) == 2 + 2 * (2 + 4 + 3 + 3) + 1  # embed, norm, per layer, lm_head
  assert state["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 8, D)
  assert state["model.layers.1.self_attn.k_proj.bias"].shape == (2 * 8,)
  assert state["lm_head.weight"].shape == (V, D)
  interop.load_hf_state_dict(b, state)
  _assert_same_params(a, b)
  assert interop.torch_state_dict(a).keys() == state.keys()  # the decoder's map is HF's
  # A base model's keys (no "model." prefix) with the head's, and a derived rotary buffer.
  c = _decoder(2)
  base = {k.removeprefix("model."): v for k, v in interop.hf_state_dict(a, as_torch=True).items()}
  base["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
  interop.load_hf_state_dict(c, base)
  _assert_same_params(a, c)
  with pytest.raises(ValueError, match=r"missing keys \['lm_head.weight'\]"):
    interop.load_hf_state_dict(c, {k: v for k, v in state.items() if k != "lm_head.weight"})
  with pytest.raises(ValueError, match=r"unexpected keys \['model.layers.2.mlp.up_proj.weight'\]"):
    interop.load_hf_state_dict(c, {**state, "model.layers.2.mlp.up_proj.weight": np.zeros(1)})
  bad = dict(state, **{"model.layers.0.mlp.down_proj.weight": np.zeros((D, H + 1))})
  with pytest.raises(ValueError, match=r"'model.layers.0.mlp.down_proj.weight'.*expected shape "
                                       r"\(32, 48\), got \(32, 49\)"):
    interop.load_hf_state_dict(c, bad)
  with pytest.raises(TypeError, match="expected a jaxfuse.models.Decoder"):
    interop.hf_state_dict(jaxfuse.nnx.RMSNorm(D, rngs=nnx.Rngs(0)))


def test_tied_decoder_takes_a_duplicate_head_or_none():
  a, b = _decoder(0, tie_embeddings=True), _decoder(1, tie_embeddings=True)
  state = interop.hf_state_dict(a)
  assert "lm_head.weight" not in state
  interop.load_hf_state_dict(b, {**state, "lm_head.weight": state["model.embed_tokens.weight"]})
  _assert_same_params(a, b)
  with pytest.raises(ValueError, match="lm_head.weight.*differs.*tie_word_embeddings"):
    interop.load_hf_state_dict(b, {**state, "lm_head.weight": np.zeros((V, D), np.float32)})


def test_checkpoint_files(tmp_path):
  model = _decoder(0)
  interop.save_pretrained(model, tmp_path / "one", model_type="qwen2")
  config = json.loads((tmp_path / "one" / "config.json").read_text())
  assert config["model_type"] == "qwen2" and config["architectures"] == ["Qwen2ForCausalLM"]
  again = interop.from_pretrained(tmp_path / "one", fused=False)
  _assert_same_params(model, again)
  assert again.fused is False and again.cfg == CFG.replace(head_dim=D // 4, model_type="qwen2")
  # Sharded by hand: an index over two files; a shard missing a tensor is named.
  state = interop.read_checkpoint(tmp_path / "one")
  import safetensors.numpy

  keys = sorted(state)
  shards = {"model-1.safetensors": keys[: len(keys) // 2],
            "model-2.safetensors": keys[len(keys) // 2:]}
  sharded = tmp_path / "sharded"
  sharded.mkdir()
  (sharded / "config.json").write_text(json.dumps(config))
  for file, names in shards.items():
    safetensors.numpy.save_file({k: state[k] for k in names}, sharded / file)
  weight_map = {k: file for file, names in shards.items() for k in names}
  index = {"metadata": {}, "weight_map": weight_map}
  (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
  _assert_same_params(model, interop.from_pretrained(sharded))
  index["weight_map"]["not.in.the.shard"] = "model-2.safetensors"
  (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
  with pytest.raises(ValueError, match="model-2.safetensors: has no tensor 'not.in.the.shard'"):
    interop.from_pretrained(sharded)
  # Saving over a sharded checkpoint removes it.
  interop.save_pretrained(model, sharded, model_type="qwen2")
  assert sorted(p.name for p in sharded.iterdir()) == ["config.json", "model.safetensors"]
  with pytest.raises(FileNotFoundError, match="no model.safetensors"):
    interop.read_checkpoint(tmp_path)
  with pytest.raises(FileNotFoundError, match="no config.json"):
    interop.from_pretrained(tmp_path)


def test_bfloat16_checkpoints_and_overrides(tmp_path):
  model = _decoder(0, param_dtype=jnp.bfloat16)
  interop.save_pretrained(model, tmp_path, model_type="qwen2")
  assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
  raw = interop.read_checkpoint(tmp_path)
  assert raw["model.norm.weight"].dtype == jnp.bfloat16
  again = interop.from_pretrained(tmp_path, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
  _assert_same_params(model, again)
  assert again.cfg.dtype == jnp.bfloat16
  widened = interop.from_pretrained(tmp_path)  # float32 parameters by default
  assert widened.norm.scale[...].dtype == jnp.float32
  np.testing.assert_array_equal(widened.norm.scale[...], model.norm.scale[...].astype(np.float32))


def test_unsupported_config_fields_are_named(tmp_path):
  interop.save_pretrained(_decoder(0), tmp_path, model_type="qwen2")
  config = json.loads((tmp_path / "config.json").read_text())
  for field, value in [("hidden_act", "gelu_fast"), ("attention_dropout", 0.1),
                       ("rope_parameters", {"rope_type": "proportional", "rope_theta": 1e4}),
                       ("some_new_field", 1)]:
    (tmp_path / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(UnsupportedConfigError, match=field):
      interop.from_pretrained(tmp_path)
  with pytest.raises(ValueError, match="a llama config cannot express o_bias"):
    interop.save_pretrained(_decoder(0), tmp_path / "llama", model_type="llama")
