"""jaxfuse.blocks.rope against transformers' own rotary embedding modules.

Two comparisons per rope type. transformers' ``base ** exponent`` (torch's CPU pow) is within one
ulp of the correctly rounded power that :mod:`jaxfuse.blocks.rope` computes, and differs from it
in about 2% of the table entries; a one-ulp difference in ``inv_freq[i]`` moves the angle of
position ``p`` by ``p * ulp(inv_freq[i])``. So:

- on transformers' module as it is: the tables are within two ulps, and cos/sin within 1e-6
  plus the largest difference of the float32 angles ``p * inv_freq`` those ulps make; given
  torch's pow, the static tables are bit-identical;
- on transformers' module computing from our tables (its init functions patched to return them):
  cos/sin within 1e-6 at every position, which checks everything else (which table, which
  sequence length, the dynamic state, the angles, cos/sin, attention_scaling, the halves).
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers import modeling_rope_utils
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from jaxfuse.blocks import rope as rope_lib
from jaxfuse.blocks.rope import TYPES, Rope, UnsupportedRopeError

transformers.logging.set_verbosity_error()

TOL = 1e-6   # max |cos - cos_hf| and |sin - sin_hf|, relative to attention_scaling

_I = np.arange(48)
# Shaped like Phi-3-mini-128k's factors (48 = head_dim 96 / 2), not copies of them.
PHI3_SHORT = [float(v) for v in np.round(1.0 + 0.02 * _I + 0.5 * (_I / 47) ** 4, 4)]
PHI3_LONG = [float(v) for v in np.round(1.03 + 63.8 / (1 + np.exp(-(_I - 26) / 3.5)), 4)]


class Case(NamedTuple):
  head_dim: int
  max_position_embeddings: int
  rope_parameters: dict
  boundary: int                         # where the type switches, or its original context
  phi3_original: int | None = None      # Phi-3's top-level original_max_position_embeddings


_LLAMA3 = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
CASES = {
    "default-qwen3": Case(128, 40960, {"rope_type": "default", "rope_theta": 1e6}, 40960),
    "default-olmo2": Case(128, 4096, {"rope_type": "default", "rope_theta": 500000.0}, 4096),
    "default-gemma-local": Case(256, 131072, {"rope_type": "default", "rope_theta": 1e4}, 4096),
    "linear-gemma3-global": Case(256, 131072, {"rope_type": "linear", "factor": 8.0,
                                               "rope_theta": 1e6}, 8192),
    "dynamic": Case(128, 2048, {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}, 2048),
    "llama3-3.2": Case(64, 131072, {**_LLAMA3, "factor": 32.0}, 8192),
    "llama3-3.1": Case(128, 131072, {**_LLAMA3, "factor": 8.0}, 8192),
    "yarn-qwen2.5": Case(128, 131072, {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                       "original_max_position_embeddings": 32768}, 32768),
    "yarn-deepseek-v3": Case(64, 163840, {
        "rope_type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
        "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "rope_theta": 1e4},
        4096),
    "yarn-gpt-oss": Case(64, 131072, {
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
        4096),
    "longrope-phi3-mini-128k": Case(96, 131072, {
        "rope_type": "longrope", "short_factor": PHI3_SHORT, "long_factor": PHI3_LONG,
        "rope_theta": 1e4}, 4096, phi3_original=4096),
}


def _rope(case: Case) -> Rope:
  return Rope.from_hf(case.rope_parameters, head_dim=case.head_dim,
                      max_position_embeddings=case.max_position_embeddings,
                      original_max_position_embeddings=case.phi3_original)


def _hf_config(case: Case):
  common = {"hidden_size": 2 * case.head_dim, "num_attention_heads": 2, "num_hidden_layers": 1,
            "vocab_size": 8, "intermediate_size": 8,
            "max_position_embeddings": case.max_position_embeddings,
            "rope_parameters": copy.deepcopy(case.rope_parameters)}
  if case.phi3_original is not None:
    return transformers.Phi3Config(original_max_position_embeddings=case.phi3_original, **common)
  return transformers.LlamaConfig(head_dim=case.head_dim, **common)


def _hf_module(case: Case):
  module = Phi3RotaryEmbedding if case.phi3_original is not None else LlamaRotaryEmbedding
  return module(_hf_config(case))


def _positions(b: int) -> list[np.ndarray]:
  """Position ids [batch, seq] below and above a boundary b: the longrope switch is between
  the third (max + 1 == b) and the fourth (b + 1)."""
  return [np.arange(48)[None], np.arange(b // 2, b // 2 + 48)[None], np.arange(b - 48, b)[None],
          np.arange(b - 47, b + 1)[None], np.stack([np.arange(48), np.arange(2 * b, 2 * b + 48)])]


def _hf_call(module, positions: np.ndarray, **kwargs):
  """transformers' cos and sin halves, and the table it used."""
  cos, sin = module(torch.zeros(()), torch.from_numpy(positions), **kwargs)
  half = cos.shape[-1] // 2
  assert torch.equal(cos[..., :half], cos[..., half:]) and torch.equal(sin[..., :half],
                                                                       sin[..., half:])
  layer = kwargs.get("layer_type")
  table = getattr(module, "inv_freq" if layer is None else f"{layer}_inv_freq")
  return cos[..., :half].numpy(), sin[..., :half].numpy(), table.numpy().copy()


def _err(rope: Rope, positions, hf_cos, hf_sin, seq_len=None) -> float:
  cos, sin = rope.cos_sin(jnp.asarray(positions), seq_len=seq_len)
  assert cos.dtype == sin.dtype == jnp.float32 and cos.shape == hf_cos.shape
  diff = max(np.abs(np.asarray(cos) - hf_cos).max(), np.abs(np.asarray(sin) - hf_sin).max())
  return float(diff / rope.attention_scaling)


def _ulps(ours, theirs) -> np.ndarray:
  ours, theirs = np.asarray(ours), np.asarray(theirs)
  return np.abs(ours.astype(np.float64) - theirs) / np.spacing(np.abs(theirs))


def _angle_gap(positions, ours, theirs) -> float:
  """The largest difference between the float32 angles the two tables give."""
  p = np.asarray(positions, np.float32)[..., None]
  return float(np.abs(p * np.asarray(ours, np.float32) - p * np.asarray(theirs, np.float32)).max())


def _check_table(ours, theirs, max_ulps=2):
  """At most ``max_ulps`` apart (one from torch's pow, one more from the roundings after it);
  returns how many entries differ."""
  ulps = _ulps(ours, theirs)
  assert ulps.max() <= max_ulps, f"{ulps.max()} ulps"
  return int((ulps > 0).sum())


@pytest.mark.parametrize("name", list(CASES))
def test_cos_sin_matches_transformers(name):
  case = CASES[name]
  rope = _rope(case)
  worst, tables = 0.0, {}
  for positions in _positions(case.boundary):
    module = _hf_module(case)      # fresh: the dynamic state is test_dynamic_state's subject
    hf_cos, hf_sin, hf_table = _hf_call(module, positions)
    assert rope.attention_scaling == module.attention_scaling
    ours = rope.inv_freq(int(positions.max()) + 1)
    differing = _check_table(ours, hf_table)
    # torch's pow is off the correctly rounded power now and then, not systematically.
    assert differing <= max(2, ours.size // 10)
    tables[hf_table.tobytes()] = f"{differing}/{ours.size}"
    err = _err(rope, positions, hf_cos, hf_sin)
    assert err <= TOL + _angle_gap(positions, ours, hf_table), (positions.max(), err)
    worst = max(worst, err)
  print(f"{name}: max error {worst:.2e} up to position {positions.max()}; table entries "
        f"an ulp off: {', '.join(tables.values())}")


@pytest.mark.parametrize("name", list(CASES))
def test_static_tables_are_bit_identical_given_torchs_pow(name, monkeypatch):
  """Everything but the power mirrors torch operation by operation."""
  monkeypatch.setattr(rope_lib, "_pow32", lambda base, e: (base ** torch.from_numpy(e)).numpy())
  case = CASES[name]
  rope = _rope(case)
  for positions in _positions(case.boundary):
    seq_len = int(positions.max()) + 1
    if rope.rope_type == "dynamic" and seq_len > case.max_position_embeddings:
      continue   # grown on the device, in float32: test_cos_sin_matches_transformers
    _, _, hf_table = _hf_call(_hf_module(case), positions)
    np.testing.assert_array_equal(rope.inv_freq(seq_len), hf_table)


@pytest.fixture
def our_tables(monkeypatch):
  """Makes transformers' rotary modules compute from our inv_freq tables."""

  def use(rope: Rope, owner=LlamaRotaryEmbedding):
    def init(config, device=None, seq_len=None, layer_type=None, **_):
      table = np.asarray(rope.inv_freq(None if seq_len is None else int(seq_len)))
      return torch.from_numpy(table.copy()), rope.attention_scaling

    monkeypatch.setitem(modeling_rope_utils.ROPE_INIT_FUNCTIONS, rope.rope_type, init)
    monkeypatch.setattr(owner, "compute_default_rope_parameters", staticmethod(init))

  return use


@pytest.mark.parametrize("name", list(CASES))
def test_cos_sin_matches_transformers_on_the_same_tables(name, our_tables):
  case = CASES[name]
  rope = _rope(case)
  our_tables(rope, Phi3RotaryEmbedding if case.phi3_original else LlamaRotaryEmbedding)
  module, seq_len = _hf_module(case), None   # one module: it switches back and forth
  far = case.max_position_embeddings - 48
  for positions in _positions(case.boundary) + [np.arange(far, far + 48)[None],
                                                np.arange(48)[None]]:
    hf_cos, hf_sin, _ = _hf_call(module, positions)
    seq_len = rope.track_seq_len(positions, seq_len)   # the dynamic module's state
    assert _err(rope, positions, hf_cos, hf_sin, seq_len=seq_len) <= TOL, positions.max()


def test_longrope_switches_after_the_original_length():
  rope = _rope(CASES["longrope-phi3-mini-128k"])
  short, long = rope.inv_freq(4096), rope.inv_freq(4097)
  np.testing.assert_array_equal(rope.inv_freq(), short)
  assert not np.array_equal(short, long)
  # Position 4095 alone is a sequence of 4096: short factors; 4096 makes it 4097: long ones.
  np.testing.assert_array_equal(rope.cos_sin(jnp.array([4095]))[0][0],
                                jnp.cos(4095 * short) * rope.attention_scaling)
  np.testing.assert_array_equal(rope.cos_sin(jnp.array([4096]))[0][0],
                                jnp.cos(4096 * long) * rope.attention_scaling)


# transformers' dynamic module keeps max_seq_len_cached between calls: it grows on a longer
# sequence, resets on one shorter than max_position_embeddings (2048 here), and otherwise keeps
# the frequencies of the cached length (2300 and 2048 below use 2500's, the last uses 3010's).
DYNAMIC_CALLS = [
    (np.arange(16)[None], 2048), (np.arange(1900, 2100)[None], 2100),
    (np.arange(2490, 2500)[None], 2500), (np.arange(2200, 2300)[None], 2500),
    (np.arange(2048)[None], 2500), (np.arange(10)[None], 2048),
    (np.stack([np.arange(3000, 3010), np.arange(10)]), 3010), (np.arange(2048)[None], 3010),
]


@pytest.mark.parametrize("same_tables", [False, True])
def test_dynamic_state_follows_transformers(same_tables, our_tables):
  case = CASES["dynamic"]
  rope = _rope(case)
  if same_tables:
    our_tables(rope)
  module, cached = _hf_module(case), None
  for positions, expected in DYNAMIC_CALLS:
    hf_cos, hf_sin, hf_table = _hf_call(module, positions)
    cached = rope.track_seq_len(jnp.asarray(positions), cached)
    assert int(cached) == expected == module.max_seq_len_cached
    ours = rope.inv_freq(cached)
    _check_table(ours, hf_table, max_ulps=0 if same_tables else 2)
    angle = _angle_gap(positions, ours, hf_table)
    assert _err(rope, positions, hf_cos, hf_sin, seq_len=cached) <= TOL + angle
  # Without the state, the 2300 call takes its own length, as a fresh module does.
  stale = DYNAMIC_CALLS[3][0]
  assert not np.array_equal(rope.cos_sin(stale)[0], rope.cos_sin(stale, seq_len=2500)[0])
  if same_tables:
    hf_cos, hf_sin, _ = _hf_call(_hf_module(case), stale)
    assert _err(rope, stale, hf_cos, hf_sin) <= TOL


@pytest.mark.parametrize("name", ["dynamic", "longrope-phi3-mini-128k"])
def test_sequence_length_may_be_traced(name):
  """Under jit the dynamic table is computed by XLA's fused float32 pow and log: within the
  same ulps of transformers' as eagerly, though not always the same ones."""
  case = CASES[name]
  rope = _rope(case)
  cos_sin, inv_freq = jax.jit(rope.cos_sin), jax.jit(rope.inv_freq)
  track = jax.jit(rope.track_seq_len)
  for positions in _positions(case.boundary):
    hf_cos, hf_sin, hf_table = _hf_call(_hf_module(case), positions)
    ours = inv_freq(jnp.int32(positions.max() + 1))
    _check_table(ours, hf_table)
    cos, sin = cos_sin(jnp.asarray(positions))
    err = max(np.abs(np.asarray(cos) - hf_cos).max(), np.abs(np.asarray(sin) - hf_sin).max())
    assert err / rope.attention_scaling <= TOL + _angle_gap(positions, ours, hf_table)
    if rope.rope_type == "longrope":
      np.testing.assert_array_equal(cos, rope.cos_sin(positions)[0])
    assert int(track(positions, 2100)) == int(rope.track_seq_len(positions, 2100))


@pytest.mark.parametrize("layer_type", ["full_attention", "sliding_attention"])
def test_gemma3_layer_types(layer_type):
  params = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
  config = transformers.Gemma3TextConfig(
      hidden_size=64, head_dim=256, num_attention_heads=2, num_key_value_heads=1,
      num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], vocab_size=8,
      intermediate_size=8, max_position_embeddings=131072,
      rope_parameters=copy.deepcopy(params))
  rope = Rope.from_hf(config.rope_parameters[layer_type], head_dim=256,
                      max_position_embeddings=131072)
  assert rope == Rope.from_hf(params[layer_type], head_dim=256, max_position_embeddings=131072)
  module = Gemma3RotaryEmbedding(config)
  for positions in _positions(8192):
    hf_cos, hf_sin, hf_table = _hf_call(module, positions, layer_type=layer_type)
    _check_table(rope.inv_freq(), hf_table)
    angle = _angle_gap(positions, rope.inv_freq(), hf_table)
    assert _err(rope, positions, hf_cos, hf_sin) <= TOL + angle


def test_shapes():
  rope = Rope(head_dim=8)
  assert rope.cos_sin(jnp.arange(5))[0].shape == (5, 4)
  assert rope.cos_sin(jnp.zeros((2, 3, 5), jnp.int32))[1].shape == (2, 3, 5, 4)
  assert rope.inv_freq().shape == (4,) and rope.inv_freq().dtype == jnp.float32


@pytest.mark.parametrize("name", list(CASES))
def test_to_hf_round_trips_and_is_what_transformers_holds(name):
  case = CASES[name]
  rope = _rope(case)
  assert Rope.from_hf(rope.to_hf(), head_dim=case.head_dim,
                      max_position_embeddings=case.max_position_embeddings) == rope
  held = dict(_hf_config(case).rope_parameters)
  assert Rope.from_hf(held, head_dim=case.head_dim,
                      max_position_embeddings=case.max_position_embeddings,
                      original_max_position_embeddings=case.phi3_original) == rope
  assert held.pop("partial_rotary_factor", 1.0) == 1.0
  assert rope.to_hf() == held
  hash(rope)


def test_legacy_forms():
  new = Rope.from_hf({"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}, head_dim=64,
                     max_position_embeddings=8192)
  # A legacy rope_scaling dict: `type`, and rope_theta at the config's top level.
  assert Rope.from_hf({"type": "linear", "factor": 8.0}, theta=1e6, head_dim=64,
                      max_position_embeddings=8192) == new
  assert Rope.from_hf({"type": "default", "rope_type": "linear", "factor": 8.0,
                       "rope_theta": 1e6, "partial_rotary_factor": 1.0}, head_dim=64,
                      max_position_embeddings=8192) == new
  config = transformers.LlamaConfig(head_dim=64, rope_scaling={"type": "linear", "factor": 8.0},
                                    rope_theta=1e6, max_position_embeddings=8192)
  held = {k: v for k, v in config.rope_parameters.items() if k != "type"}
  assert held == new.to_hf()
  assert Rope.from_hf(None, theta=500000.0, head_dim=64, max_position_embeddings=8192) == Rope(
      head_dim=64, theta=500000.0, max_position_embeddings=8192)
  # The config's own original_max_position_embeddings wins (Phi-3's does), as in transformers.
  params = {"rope_type": "longrope", "short_factor": PHI3_SHORT, "long_factor": PHI3_LONG,
            "original_max_position_embeddings": 8192, "rope_theta": 1e4}
  rope = Rope.from_hf(params, head_dim=96, max_position_embeddings=131072,
                      original_max_position_embeddings=4096)
  phi3 = transformers.Phi3Config(hidden_size=192, num_attention_heads=2,
                                 max_position_embeddings=131072,
                                 original_max_position_embeddings=4096,
                                 rope_parameters=copy.deepcopy(params))
  assert rope.param("original_max_position_embeddings") == 4096
  assert phi3.rope_parameters["original_max_position_embeddings"] == 4096


_SUPPORTED = "supported: " + ", ".join(TYPES)
REFUSED = [
    ({"rope_type": "proportional", "rope_theta": 1e4},
     "rope_type 'proportional' is not supported; " + _SUPPORTED),
    ({"rope_type": "mrope", "rope_theta": 1e4}, _SUPPORTED),
    ({"type": "su", "rope_theta": 1e4}, "rope_type 'su' is not supported"),
    ({"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0, "rope_theta": 1e4},
     "'low_freq_factor' is not a parameter of rope_type 'linear'; it takes factor"),
    ({"rope_type": "default", "rope_theta": 1e4, "mrope_section": [8, 12, 12]},
     "'mrope_section' is not a parameter of rope_type 'default'; it takes only rope_theta"),
    ({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
     "partial_rotary_factor 0.5 is not supported: only 1.0 is supported"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "rope_theta": 1e4},
     ("'high_freq_factor' is missing: rope_type 'llama3' requires factor, low_freq_factor, "
      "high_freq_factor, original_max_position_embeddings")),
    ({"rope_type": "linear", "factor": None, "rope_theta": 1e4}, "'factor' must be set"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 32,
      "rope_theta": 1e4}, "short_factor must have head_dim // 2 = 32 values, got 3"),
    ({"rope_type": "default"}, "rope_theta is missing"),
]


@pytest.mark.parametrize("params, message", REFUSED)
def test_refuses(params, message):
  with pytest.raises(UnsupportedRopeError) as info:
    Rope.from_hf(params, head_dim=64, max_position_embeddings=4096)
  assert message in str(info.value)
  assert isinstance(info.value, ValueError)


def test_refuses_constructed():
  with pytest.raises(UnsupportedRopeError, match="head_dim must be a positive even int"):
    Rope(head_dim=63)
  with pytest.raises(UnsupportedRopeError, match="'factor' is missing"):
    Rope(head_dim=64, rope_type="linear")
