"""LoRA: what only lora_dense has (its frozen-base step, its named residual), and the decoder's
adapters (jaxfuse.nnx.apply_lora) against peft on a tiny Llama that transformers builds.

The op's twins, second order, properties, bad arguments and mesh run from its table
(``tests/cases/lora.py``). Relative errors are per tensor, ``max |ours - theirs| / max |theirs|``
in float64, as in ``test_hf_twin.py``.
"""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx

from jaxfuse import interop
from jaxfuse.metrics import residual_bytes, residuals
from jaxfuse.models import Decoder, DecoderConfig, next_token_targets
from jaxfuse.models.stacking import stack_layers
from jaxfuse.nnx import GatedMLP, adapter_of, apply_lora, merge_lora, save_peft_adapter
from jaxfuse.ops import lora_dense, lora_dense_reference, names
from tests import helpers

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

RANK, ALPHA = 4, 8
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)
BATCH, SEQ = 2, 11
FAST_COMPILE = helpers.FAST_COMPILE
SAVE_ONLY = jax.checkpoint_policies.save_only_these_names


def _jit(fn):
  return jax.jit(fn, compiler_options=FAST_COMPILE)


def rel_err(ours, theirs) -> float:
  ours = np.asarray(jnp.asarray(ours).astype(jnp.float32), np.float64)
  theirs = (theirs.detach().double().numpy() if isinstance(theirs, torch.Tensor)
            else np.asarray(theirs, np.float64))
  assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
  return float(np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)))


# The op ------------------------------------------------------------------------------------------

N_IN, N_OUT, R = 24, 40, 4        # distinct sizes: a product's shape names it


def _op_inputs(dtype=jnp.float32, lead=(3, 12)):
  return helpers.normals(0, (*lead, N_IN), (N_IN, N_OUT), (N_IN, R), (R, N_OUT), (N_OUT,),
                         dtype=dtype)


def _dot_shapes(hlo: str) -> list[tuple[int, ...]]:
  """The result shapes of the dots of a compiled HLO module."""
  return [tuple(int(d) for d in dims.split(",") if d)
          for dims in re.findall(r"\w+\[([\d,]*)\](?:\{[^}]*\})? dot\(", hlo)]


def test_training_only_the_adapters_computes_no_kernel_gradient():
  """With the kernel and bias frozen, the jitted step has no [in, out] product: the custom
  backward's kernel gradient is dead code XLA removes. Differentiating the kernel brings it
  back (the check sees it)."""
  x, kernel, lora_a, lora_b, bias = _op_inputs()

  def loss(x, kernel, lora_a, lora_b, bias):
    return jnp.sum(jnp.sin(lora_dense(x, kernel, lora_a, lora_b, bias, scale=2.0)))

  adapters_only = jax.jit(jax.grad(loss, argnums=(2, 3)))
  hlo = adapters_only.lower(x, kernel, lora_a, lora_b, bias).compile().as_text()
  shapes = _dot_shapes(hlo)
  assert shapes, hlo
  assert not {(N_IN, N_OUT), (N_OUT, N_IN)} & set(shapes), shapes
  # x @ kernel, x @ lora_a, xa @ lora_b; g @ lora_b^T, x^T @ dxa, xa^T @ g: no dx (x is frozen)
  assert len(shapes) == 6, shapes
  with_kernel = jax.jit(jax.grad(loss, argnums=(1, 2, 3)))
  shapes = _dot_shapes(with_kernel.lower(x, kernel, lora_a, lora_b, bias).compile().as_text())
  assert {(N_IN, N_OUT), (N_OUT, N_IN)} & set(shapes), shapes


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_keeps_x_and_the_named_xa_and_a_policy_chooses_xa(dtype):
  """The op's residuals beyond its arguments are x @ lora_a alone ([..., rank], named
  lora.xa), never the [..., out] output; under jax.checkpoint a policy that names lora.xa keeps
  exactly it, one that does not recomputes it (keeps nothing)."""
  args = _op_inputs(dtype)
  rows = 3 * 12
  xa_bytes = rows * R * jnp.dtype(dtype).itemsize

  def loss(*a):
    return jnp.sum(jnp.sin(lora_dense(*a, scale=2.0).astype(jnp.float32)))

  kept = [(r.shape, jnp.dtype(r.dtype)) for r in residuals(loss, *args)]
  assert ((3, 12, R), jnp.dtype(dtype)) in kept
  assert residual_bytes(jax.checkpoint(loss, policy=SAVE_ONLY(names.LORA_XA)), *args) == xa_bytes
  assert [(r.shape, jnp.dtype(r.dtype)) for r in residuals(
      jax.checkpoint(loss, policy=SAVE_ONLY(names.LORA_XA)), *args)] == [((3, 12, R),
                                                                          jnp.dtype(dtype))]
  recomputed = jax.checkpoint(loss, policy=jax.checkpoint_policies.nothing_saveable)
  assert residual_bytes(recomputed, *args) == 0
  # The same gradients either way.
  for policy in (SAVE_ONLY(names.LORA_XA), jax.checkpoint_policies.nothing_saveable):
    got = jax.grad(jax.checkpoint(loss, policy=policy), argnums=(0, 2, 3))(*args)
    want = jax.grad(loss, argnums=(0, 2, 3))(*args)
    for a, b in zip(got, want):
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_vmap_jit_and_gradients_match_the_reference():
  args = _op_inputs(lead=(5, 7))
  g = helpers.normal(3, (5, 7, N_OUT))

  def vjp(f):
    def run(*a):
      out, back = jax.vjp(lambda *a: jax.vmap(f)(*a), *a)
      return out, back(g)
    return run

  ours = _jit(vjp(lambda x, k, a, b, bias: lora_dense(x, k, a, b, bias, scale=0.5)))
  ref = vjp(lambda x, k, a, b, bias: lora_dense_reference(x, k, a, b, bias, scale=0.5))
  batched = [jnp.broadcast_to(a, (5, *a.shape)) if i else a for i, a in enumerate(args)]
  got, want = ours(*batched), ref(*batched)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    helpers.assert_close(a, b)


# Adapters on modules -----------------------------------------------------------------------------


def _cfg(**changes):
  return DecoderConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                       mlp_dim=64, **changes)


def _tokens(seed=1):
  return jnp.asarray(np.random.default_rng(seed).integers(0, 64, (BATCH, SEQ)), jnp.int32)


def _randomize_adapters(model, seed=7, scale=0.2):
  """Nonzero lora_b (and fresh lora_a), so that an adapter's term is not zero."""
  rng = np.random.default_rng(seed)
  for _, variable in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
    value = rng.standard_normal(variable.shape).astype(np.float32) * scale
    variable[...] = jnp.asarray(value, variable.dtype)


def test_apply_lora_initializes_as_peft_and_changes_nothing_until_trained():
  model = Decoder(_cfg(), rngs=nnx.Rngs(0))
  tokens = _tokens()
  before = model.logits(tokens)
  assert apply_lora(model, rank=RANK, alpha=ALPHA, rngs=nnx.Rngs(1)) is model
  np.testing.assert_array_equal(model.logits(tokens), before)   # lora_b is zero
  q = model.layers[0].self_attn.q_proj
  assert isinstance(q.lora_a, nnx.LoRAParam) and isinstance(q.lora_b, nnx.LoRAParam)
  assert q.lora_scale == ALPHA / RANK
  down = model.layers[1].mlp.down_proj
  assert down.lora_a.shape == (64, RANK) and down.lora_b.shape == (RANK, 32)
  # kaiming_uniform_(a=sqrt(5)) of torch's [rank, in]: uniform in +-1/sqrt(in).
  a = np.asarray(down.lora_a[...])
  assert np.abs(a).max() <= 64 ** -0.5 and np.abs(a).max() > 0.8 * 64 ** -0.5
  assert abs(a.std() - 64 ** -0.5 / np.sqrt(3)) < 0.2 * 64 ** -0.5 / np.sqrt(3)
  assert not np.asarray(down.lora_b[...]).any()
  adapted = {path[-2] for path, _ in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))}
  assert adapted == set(PROJECTIONS)
  assert len(jax.tree.leaves(nnx.state(model, nnx.LoRAParam))) == 2 * 2 * len(PROJECTIONS)
  # Distinct draws per projection and layer.
  assert not np.array_equal(model.layers[0].mlp.up_proj.lora_a[...],
                            model.layers[1].mlp.up_proj.lora_a[...])


def test_apply_lora_errors_name_the_argument():
  model = Decoder(_cfg(), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"^apply_lora: targets has 'qkv'"):
    apply_lora(model, rank=2, alpha=4, targets=("q", "qkv"), rngs=nnx.Rngs(1))
  with pytest.raises(TypeError, match=r"^apply_lora: targets must be a sequence"):
    apply_lora(model, rank=2, alpha=4, targets="q", rngs=nnx.Rngs(1))
  with pytest.raises(ValueError, match=r"^apply_lora: rank must be a positive int"):
    apply_lora(model, rank=0, alpha=4, rngs=nnx.Rngs(1))
  with pytest.raises(ValueError, match=r"^apply_lora: alpha must be a finite number"):
    apply_lora(model, rank=2, alpha=float("nan"), rngs=nnx.Rngs(1))
  with pytest.raises(ValueError, match=r"^apply_lora: the model has no nnx.Linear named"):
    apply_lora(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), rank=2, alpha=4, rngs=nnx.Rngs(1))
  apply_lora(model, rank=2, alpha=4, targets=("q_proj",), rngs=nnx.Rngs(1))
  assert adapter_of(model.layers[0].self_attn.k_proj) is None
  with pytest.raises(ValueError, match=r"^apply_lora: layers.0.self_attn.q_proj has an "
                                       r"adapter already"):
    apply_lora(model, rank=2, alpha=4, targets=("q", "k"), rngs=nnx.Rngs(1))
  with pytest.raises(ValueError, match=r"^save_peft_adapter: the model has no LoRA adapters"):
    save_peft_adapter(Decoder(_cfg(), rngs=nnx.Rngs(0)), "unused")


def _adapter_loss_and_grads(model, tokens):
  """The loss and the gradients of the adapters alone (``nnx.LoRAParam``), one jitted step."""
  graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)

  @_jit
  def run(lora, tokens):
    return jax.value_and_grad(
        lambda lora: nnx.merge(graphdef, lora, rest)(tokens, next_token_targets(tokens)))(lora)

  loss, grads = run(lora, tokens)
  return loss, nnx.to_pure_dict(grads)


@pytest.mark.parametrize("recompute", ["activation", "block", None])
def test_gated_mlp_adapters_keep_what_recompute_says(recompute):
  """The fused GatedMLP's adapters: its gradients match the plain formula's whatever
  ``recompute`` is; "activation" keeps the three [rows, rank] x @ lora_a beside gate and up,
  "block" recomputes them."""
  mlp = GatedMLP(16, 48, recompute=recompute, rngs=nnx.Rngs(0))
  apply_lora(mlp, rank=3, alpha=6, rngs=nnx.Rngs(1))
  _randomize_adapters(mlp)
  x = helpers.normal(2, (4, 5, 16))

  def plain(mlp, x):
    def proj(p, h):
      a = adapter_of(p)
      return h @ p.kernel[...] + a.scale * (h @ a.lora_a) @ a.lora_b
    return proj(mlp.down_proj, jax.nn.silu(proj(mlp.gate_proj, x)) * proj(mlp.up_proj, x))

  graphdef, lora, rest = nnx.split(mlp, nnx.LoRAParam, ...)

  def loss(fn):
    return lambda lora, x: jnp.sum(jnp.sin(fn(nnx.merge(graphdef, lora, rest), x)))

  got = jax.grad(loss(lambda m, x: m(x)), argnums=(0, 1))(lora, x)
  want = jax.grad(loss(plain), argnums=(0, 1))(lora, x)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    helpers.assert_close(a, b)
  kept = sorted(r.shape for r in residuals(loss(lambda m, x: m(x)), lora, x))
  hidden, xa, readout = (4, 5, 48), (4, 5, 3), (4, 5, 16)   # readout: the sine's cosine
  expected = {"activation": [xa, xa, xa, hidden, hidden], "block": [],
              None: [xa, xa, xa, hidden, hidden, hidden]}[recompute]
  assert kept == sorted(expected + [readout]), kept


# Against peft ------------------------------------------------------------------------------------


def _hf_model(seed=0):
  """A random LlamaForCausalLM in float32 (eager attention), weights large enough that attention
  is far from uniform."""
  config = transformers.LlamaConfig(**SIZES, attn_implementation="eager")
  torch.manual_seed(seed)
  model = transformers.LlamaForCausalLM(config).float()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if p.ndim == 2:
        p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
      elif "norm" in name:
        p.copy_(1 + 0.2 * torch.randn_like(p))
  return model.eval()


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp("llama")
  _hf_model().save_pretrained(path)
  return path


def _adapted(base_dir, *, fused=True, scan_layers=False, seed=7):
  model = interop.from_pretrained(base_dir, dtype=jnp.float32, fused=fused)
  apply_lora(model, rank=RANK, alpha=ALPHA, rngs=nnx.Rngs(3))
  _randomize_adapters(model, seed)
  if scan_layers:
    stacked = interop.from_pretrained(base_dir, dtype=jnp.float32, fused=fused,
                                      scan_layers=True)
    apply_lora(stacked, rank=RANK, alpha=ALPHA, rngs=nnx.Rngs(3))
    state = nnx.state(stacked)
    nnx.replace_by_pure_dict(state, stack_layers(nnx.state(model), SIZES["num_hidden_layers"]))
    nnx.update(stacked, state)
    return stacked
  return model


def _peft_twin(base_dir, model):
  """peft's LoRA on the same Llama, with the decoder's adapters copied in."""
  hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32,
                                                         attn_implementation="eager")
  config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(PROJECTIONS),
                           lora_dropout=0.0)
  twin = peft.get_peft_model(hf, config)
  lora = nnx.to_pure_dict(nnx.state(model, nnx.LoRAParam))
  params = dict(twin.named_parameters())
  copied = 0
  with torch.no_grad():
    for i, layer in lora["layers"].items():
      for part, projections in layer.items():
        for proj, ab in projections.items():
          prefix = f"base_model.model.model.layers.{i}.{part}.{proj}"
          params[f"{prefix}.lora_A.default.weight"].copy_(torch.from_numpy(
              np.asarray(ab["lora_a"]).T.copy()))
          params[f"{prefix}.lora_B.default.weight"].copy_(torch.from_numpy(
              np.asarray(ab["lora_b"]).T.copy()))
          copied += 2
  assert copied == sum("lora_" in name for name in params)
  return twin.eval()


def _logits(model, tokens):
  graphdef, state = nnx.split(model)
  return _jit(lambda state, tokens: nnx.merge(graphdef, state).logits(tokens))(state, tokens)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_logits_loss_and_every_adapter_gradient_match_peft(base_dir, fused):
  model = _adapted(base_dir, fused=fused)
  twin = _peft_twin(base_dir, model)
  tokens = _tokens()
  tokens_t = torch.from_numpy(np.asarray(tokens)).long()
  out = twin(input_ids=tokens_t, labels=tokens_t)
  out.loss.backward()
  trained = {name: p for name, p in twin.named_parameters() if p.requires_grad}
  assert sorted(trained) == sorted(name for name, _ in twin.named_parameters()
                                   if ".lora_" in name)   # peft freezes the base too
  assert rel_err(_logits(model, tokens), out.logits) < 1e-5
  loss, grads = _adapter_loss_and_grads(model, tokens)
  assert rel_err(loss, out.loss) < 1e-5
  compared = 0
  for i, layer in grads["layers"].items():
    for part, projections in layer.items():
      for proj, ab in projections.items():
        prefix = f"base_model.model.model.layers.{i}.{part}.{proj}"
        for ours, theirs in (("lora_a", "lora_A"), ("lora_b", "lora_B")):
          want = trained[f"{prefix}.{theirs}.default.weight"].grad.T
          err = rel_err(ab[ours], want)
          assert err < 1e-5, (prefix, ours, err)
          compared += 1
  assert compared == len(trained) == 2 * SIZES["num_hidden_layers"] * len(PROJECTIONS)


def test_an_optimizer_over_lora_params_trains_only_the_adapters(base_dir):
  model = _adapted(base_dir)
  base = nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.LoRAParam)))
  lora_shapes = sorted(a.shape for a in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
  optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.LoRAParam)
  moments = sorted(a.shape for a in jax.tree.leaves(nnx.state(optimizer.opt_state))
                   if a.ndim > 0)
  assert moments == sorted(lora_shapes * 2)   # mu and nu of each adapter, nothing of the base

  @nnx.jit
  def step(model, optimizer, tokens):
    loss_fn = lambda m: m(tokens, next_token_targets(tokens))   # noqa: E731
    loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
    optimizer.update(model, grads)
    return loss

  tokens = _tokens()
  lora_before = nnx.to_pure_dict(nnx.state(model, nnx.LoRAParam))
  losses = [float(step(model, optimizer, tokens)) for _ in range(3)]
  assert losses[-1] < losses[0]
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(
      nnx.state(model, nnx.Not(nnx.LoRAParam))), base)
  changed = jax.tree.leaves(jax.tree.map(lambda a, b: bool((a != b).any()), lora_before,
                                         nnx.to_pure_dict(nnx.state(model, nnx.LoRAParam))))
  assert all(changed)


def test_merged_checkpoint_loads_in_transformers_with_the_adapted_logits(base_dir, tmp_path):
  model = _adapted(base_dir)
  tokens = _tokens()
  adapted = _logits(model, tokens)
  assert merge_lora(model) is model
  assert not jax.tree.leaves(nnx.state(model, nnx.LoRAParam))
  assert adapter_of(model.layers[0].self_attn.q_proj) is None
  assert rel_err(_logits(model, tokens), adapted) < 1e-5
  interop.save_pretrained(model, tmp_path)
  hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                         attn_implementation="eager").eval()
  assert not [k for k in hf.state_dict() if "lora" in k]
  with torch.no_grad():
    logits = hf(torch.from_numpy(np.asarray(tokens)).long()).logits
  assert rel_err(adapted, logits) < 1e-5


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scanned"])
def test_peft_adapter_checkpoint_loads_in_peft(base_dir, tmp_path, scan_layers):
  model = _adapted(base_dir, scan_layers=scan_layers)
  save_peft_adapter(model, tmp_path, base_model_name_or_path=str(base_dir))
  config = json.loads((tmp_path / "adapter_config.json").read_text())
  assert (config["r"], config["lora_alpha"], config["peft_type"]) == (RANK, ALPHA, "LORA")
  assert sorted(config["target_modules"]) == sorted(PROJECTIONS)
  tensors = interop.read_safetensors(tmp_path / "adapter_model.safetensors")
  assert tensors["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"].shape == (RANK, 64)
  assert tensors["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].shape == (32, RANK)
  assert len(tensors) == 2 * SIZES["num_hidden_layers"] * len(PROJECTIONS)
  hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32,
                                                         attn_implementation="eager")
  loaded = peft.PeftModel.from_pretrained(hf, tmp_path).eval()
  tokens = _tokens()
  with torch.no_grad():
    logits = loaded(torch.from_numpy(np.asarray(tokens)).long()).logits
  assert rel_err(_logits(model, tokens), logits) < 1e-5


# The decoder's paths agree -------------------------------------------------------------------


def test_fused_unfused_unrolled_and_scanned_agree(base_dir):
  tokens = _tokens()
  results = {}
  for fused in (True, False):
    for scan_layers in (False, True):
      model = _adapted(base_dir, fused=fused, scan_layers=scan_layers)
      loss, grads = _adapter_loss_and_grads(model, tokens)
      if scan_layers:   # the unrolled layout, layer by layer
        grads["layers"] = {i: jax.tree.map(lambda a, i=i: a[i], grads["layers"])
                           for i in range(SIZES["num_hidden_layers"])}
      results[fused, scan_layers] = (_logits(model, tokens), loss, grads)
  want = results[True, False]
  for key, got in results.items():
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert rel_err(a, b) < 1e-5, key


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scanned"])
def test_decoder_policy_naming_lora_xa_keeps_one_xa_per_adapter(scan_layers):
  """Under a block policy, naming lora.xa keeps the [tokens, rank] x @ lora_a of each of the
  7 projections of each layer, and nothing else more; the same gradients. (Every parameter is
  differentiated: jax.grad of the adapters alone, the base closed over, trips nnx.remat's
  trace-level check on unrolled layers; nnx.value_and_grad with ``nnx.DiffState`` does not, see
  the optimizer test.)"""
  tokens = _tokens()
  grads, kept = {}, {}
  for policy in ("nothing", [names.LORA_XA]):
    model = Decoder(_cfg(), remat=policy, scan_layers=scan_layers, rngs=nnx.Rngs(0))
    apply_lora(model, rank=RANK, alpha=ALPHA, rngs=nnx.Rngs(1))
    _randomize_adapters(model)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)   # LoRAParam is a Param

    def loss(params, graphdef=graphdef, rest=rest):
      return nnx.merge(graphdef, params, rest)(tokens, next_token_targets(tokens))

    key = "xa" if policy != "nothing" else policy
    kept[key] = residual_bytes(loss, params)
    grads[key] = _jit(jax.grad(loss))(params)
  xa_bytes = BATCH * SEQ * RANK * 4
  assert kept["xa"] - kept["nothing"] == 2 * len(PROJECTIONS) * xa_bytes, kept
  for a, b in zip(jax.tree.leaves(grads["xa"]), jax.tree.leaves(grads["nothing"])):
    helpers.assert_close(a, b)


def test_bfloat16_base_with_float32_adapters_trains_the_adapters_in_float32():
  model = Decoder(_cfg(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16), rngs=nnx.Rngs(0))
  apply_lora(model, rank=RANK, alpha=ALPHA, rngs=nnx.Rngs(1))
  _randomize_adapters(model)
  loss, grads = _adapter_loss_and_grads(model, _tokens())
  leaves = jax.tree.leaves(grads)
  assert np.isfinite(float(loss))
  assert {jnp.dtype(g.dtype) for g in leaves} == {jnp.dtype(jnp.float32)}
  assert all(np.isfinite(np.asarray(g)).all() and np.abs(np.asarray(g)).max() > 0
             for g in leaves)
  assert model.layers[0].self_attn.q_proj.kernel.dtype == jnp.bfloat16
