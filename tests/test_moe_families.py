"""Mixture-of-Experts: the routing and the experts' MLP (:mod:`jaxfuse.blocks.moe`), and the MoE
families (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE) against Hugging Face's own models on checkpoints ``transformers``
wrote: tiny random configs built here (4 experts, top 2, no download).

Per family, as ``tests/test_families.py`` checks the dense ones: the logits (within 2e-5), the
loss with the load-balancing loss where ``output_router_logits`` (1e-5) and the gradient of every
parameter (1e-4) of ``Decoder(fused=True)`` and ``Decoder(fused=False)``, each relative to the
tensor's largest entry; greedy decoding with the KV cache, token for token equal to
``generate``; our ``save_pretrained``, which ``AutoModelForCausalLM.from_pretrained`` loads with
equal logits.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxfuse import interop
from jaxfuse.blocks import moe
from jaxfuse.models import (Decoder, DecoderConfig, UnsupportedConfigError, families, generate,
                            next_token_targets)
from tests.test_hf_twin import _loss_logits_grads, _tokens, rel_err

transformers = pytest.importorskip("transformers")

SIZES = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2)
WINDOW = 5
# Per case: (model_type, config changes). The auxiliary loss's coefficient is large enough that
# its gradient is far above the tolerance.
FAMILIES = {
    "mixtral-aux-window": ("mixtral", dict(num_local_experts=4, sliding_window=WINDOW,
                                           output_router_logits=True, router_aux_loss_coef=0.5)),
    "qwen3_moe-aux": ("qwen3_moe", dict(num_experts=4, moe_intermediate_size=24, head_dim=16,
                                        output_router_logits=True, router_aux_loss_coef=0.3)),
    "qwen2_moe-shared-aux": ("qwen2_moe", dict(num_experts=4, moe_intermediate_size=24,
                                               shared_expert_intermediate_size=40,
                                               output_router_logits=True,
                                               router_aux_loss_coef=0.3)),
}
# Mixtral renormalizes the top-k weights; Qwen3-MoE here does not (its default
# norm_topk_prob=False): test_routing_matches_transformers_routers covers both settings.
LOGITS_RTOL, LOSS_RTOL, GRAD_RTOL = 2e-5, 1e-5, 1e-4


def _hf_model(model_type, changes, seed=0):
  """A random ``*ForCausalLM`` in float32, eager attention and experts, with weights large
  enough that attention and routing are far from uniform (every matrix, each expert's too,
  ``randn / sqrt(fan_in)``) and norm scales that are not their initial values."""
  fam = families.family(model_type)
  config = getattr(transformers, fam.config_class)(**{**SIZES, **changes},
                                                   attn_implementation="eager",
                                                   experts_implementation="eager")
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if p.ndim >= 2:
        p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
      elif "norm" in name:
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      else:
        p.copy_(0.2 * torch.randn_like(p))
  return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory):
  """``(name, hf model, directory transformers wrote it to)``."""
  model_type, changes = FAMILIES[request.param]
  hf = _hf_model(model_type, changes)
  directory = tmp_path_factory.mktemp(request.param)
  hf.save_pretrained(directory)
  return request.param, hf, directory


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "plain"])
def test_logits_loss_and_every_gradient_match_hf(checkpoint, fused):
  name, hf, directory = checkpoint
  tokens_t = _tokens(1)
  hf.zero_grad()
  out = hf(tokens_t, labels=tokens_t)
  out.loss.backward()
  hf_grads = {key: p.grad for key, p in hf.named_parameters()}
  model = interop.from_pretrained(directory, fused=fused)
  assert model.cfg.model_type == FAMILIES[name][0] and model.cfg.num_experts == 4
  tokens = jnp.asarray(tokens_t.numpy())
  loss, logits, grads = _loss_logits_grads(model, tokens)
  assert sorted(grads) == sorted(hf_grads)
  errors = {key: rel_err(grads[key], g) for key, g in hf_grads.items()}
  worst = max((e, key) for key, e in errors.items())
  aux = ""
  if out.aux_loss is not None:   # the load-balancing loss itself
    ours = moe.load_balancing_loss(model.router_stats(tokens))
    aux = f", aux loss {rel_err(ours, out.aux_loss):.2e}"
    assert rel_err(ours, out.aux_loss) <= LOSS_RTOL
    assert model.cfg.router_aux_loss_coef == hf.config.router_aux_loss_coef
  print(f"\n{name} fused={fused}: loss {rel_err(loss, out.loss):.2e}, logits "
        f"{rel_err(logits, out.logits):.2e}{aux}, worst gradient {worst[0]:.2e} ({worst[1]})")
  assert rel_err(logits, out.logits) <= LOGITS_RTOL
  assert rel_err(loss, out.loss) <= LOSS_RTOL
  assert worst[0] <= GRAD_RTOL, {k: e for k, e in errors.items() if e > GRAD_RTOL}


def test_greedy_decoding_with_the_cache_matches_hf_generate(checkpoint):
  name, hf, directory = checkpoint
  model = interop.from_pretrained(directory)
  prompt = _tokens(2)[:1, :4]
  steps = 3 * WINDOW
  with torch.no_grad():
    want = hf.generate(prompt, max_new_tokens=steps, do_sample=False, min_new_tokens=steps)
  got = generate(model, jnp.asarray(prompt.numpy()), steps, jax.random.key(0), temperature=0)
  np.testing.assert_array_equal(np.asarray(got), want.numpy(), err_msg=name)


def test_our_save_pretrained_loads_in_transformers_with_equal_logits(checkpoint, tmp_path):
  name, hf, directory = checkpoint
  model = interop.from_pretrained(directory, fused=False, scan_layers=True)
  interop.save_pretrained(model, tmp_path)
  files = interop.read_checkpoint(tmp_path)
  assert set(files) == set(interop.read_checkpoint(directory))   # transformers' own layout
  again = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, attn_implementation="eager", experts_implementation="eager")
  assert type(again).__name__ == families.family(FAMILIES[name][0]).architecture
  tokens_t = _tokens(3)
  with torch.no_grad():
    assert rel_err(again(tokens_t).logits, hf(tokens_t).logits) == 0.0
  # The live model's layout (experts stacked, gate and up fused) loads too, and is ours.
  live = interop.from_pretrained(hf)
  state = interop.hf_state_dict(live)
  assert sorted(state) == sorted(hf.state_dict())
  for key, value in hf.state_dict().items():
    np.testing.assert_array_equal(state[key], value.numpy(), err_msg=key)


# Routing against transformers' functions --------------------------------------------------------


@pytest.mark.parametrize("model_type,renormalize", [("mixtral", True), ("qwen3_moe", False),
                                                    ("qwen3_moe", True)])
def test_routing_matches_transformers_routers(model_type, renormalize):
  """Top-k weights and experts of the routers of ``transformers`` on random (tie-free)
  logits."""
  fam = families.family(model_type)
  extra = {} if model_type == "mixtral" else {"norm_topk_prob": renormalize}
  config = getattr(transformers, fam.config_class)(hidden_size=16, num_experts_per_tok=3,
                                                   num_local_experts=6, **extra)
  module = transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter if model_type == \
      "mixtral" else transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter
  router = module(config)
  torch.manual_seed(0)
  with torch.no_grad():
    router.weight.copy_(torch.randn(6, 16))
    x = torch.randn(50, 16)
    logits, weights, experts = router(x)
  ours = moe.route(jnp.asarray(logits.numpy()), 3, renormalize=renormalize)
  np.testing.assert_array_equal(np.asarray(ours.experts), experts.numpy())
  np.testing.assert_allclose(np.asarray(ours.weights), weights.numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("masked", [False, True], ids=["all-rows", "attention-mask"])
def test_load_balancing_loss_matches_transformers(masked):
  from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

  gen = torch.Generator().manual_seed(1)
  layers = tuple(torch.randn(2 * 7, 5, generator=gen) for _ in range(3))
  mask = (torch.rand(2, 7, generator=gen) > 0.3).long() if masked else None
  want = load_balancing_loss_func(layers, 5, 2, mask)
  got = moe.load_balancing_loss_of([jnp.asarray(x.numpy()) for x in layers], 2,
                                   None if mask is None else jnp.asarray(mask.numpy()))
  assert rel_err(got, want) <= 1e-6


# The experts' MLP ------------------------------------------------------------------------------

T, D, F, E, K = 13, 8, 12, 4, 2


def _layer(seed=0):
  keys = jax.random.split(jax.random.key(seed), 5)
  x = jax.random.normal(keys[0], (T, D))
  router = jax.random.normal(keys[1], (D, E))
  gate, up = (jax.random.normal(k, (E, D, F)) * D ** -0.5 for k in keys[2:4])
  down = jax.random.normal(keys[4], (E, F, D)) * F ** -0.5
  return x, router, gate, up, down


@pytest.mark.parametrize("fused,renormalize", [(True, True), (False, False)],
                         ids=["fused-renormalized", "plain"])
def test_moe_mlp_and_its_gradient_equal_the_dense_masked_computation(fused, renormalize):
  """Sorted by expert and grouped, or every expert on every token weighted by routing weights
  that are zero outside the top k: the same outputs, and the same gradients of the tokens,
  the router and every expert."""
  args = _layer()
  settings = dict(top_k=K, renormalize=renormalize)

  def sparse(*a):
    return moe.moe_mlp(*a, fused=fused, **settings)[0]

  def dense(*a):
    return moe.moe_mlp_dense(*a, **settings)

  np.testing.assert_allclose(jax.jit(sparse)(*args), dense(*args), rtol=1e-5, atol=1e-5)
  probe = jax.random.normal(jax.random.key(9), (T, D))
  grads = [jax.jit(jax.grad(lambda *a, f=f: jnp.sum(f(*a) * probe), argnums=range(5)))(*args)
           for f in (sparse, dense)]
  for name, a, b in zip(("x", "router", "gate", "up", "down"), *grads):
    assert rel_err(a, np.asarray(b)) <= 1e-5, name
    assert float(jnp.max(jnp.abs(b))) > 0, name


def test_capacity_drops_the_overflow_and_counts_it():
  """With a capacity factor each expert keeps its first ``C`` pairs in token order; the
  dropped pairs contribute nothing (the dense computation with their weights zeroed) and are
  counted."""
  x, router, gate, up, down = _layer(1)
  factor = 0.5
  limit = moe.capacity(T, K, E, factor)
  out, stats = moe.moe_mlp(x, router, gate, up, down, top_k=K, capacity_factor=factor)
  routing = moe.route(x @ router, K)
  experts = np.asarray(routing.experts)
  kept = np.zeros_like(experts, dtype=bool)
  seen = np.zeros(E, int)
  for t in range(T):                      # pairs in token order, slot order within a token
    for j in range(K):
      e = experts[t, j]
      kept[t, j] = seen[e] < limit
      seen[e] += 1
  assert int(stats["dropped"]) == int((~kept).sum()) == int(np.maximum(seen - limit, 0).sum())
  assert int(stats["dropped"]) > 0
  weights = np.zeros((T, E), np.float32)
  np.put_along_axis(weights, experts, np.asarray(routing.weights) * kept, axis=1)
  hidden = jax.nn.silu(jnp.einsum("td,edf->etf", x, gate)) * jnp.einsum("td,edf->etf", x, up)
  want = jnp.einsum("etd,te->td", jnp.einsum("etf,efd->etd", hidden, down), weights)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
  none_dropped = moe.moe_mlp(x, router, gate, up, down, top_k=K, capacity_factor=E / K)[1]
  assert int(none_dropped["dropped"]) == 0


def test_the_z_loss_and_recomputation_keep_what_they_say():
  """The router z-loss is the mean squared log-sum-exp of the logits; the fused layer's
  backward, by default, keeps the routing and the routed rows and recomputes the experts'
  products: less than without recomputation, and less than one of the experts' ``[T * k, F]``
  intermediates beyond the routed rows and the routing."""
  from jaxfuse.metrics import residual_bytes

  x, router, *_ = _layer(2)
  stats = moe.router_stats(x @ router, moe.route(x @ router, K))
  want = jnp.mean(jax.nn.logsumexp(x @ router, axis=-1) ** 2)
  np.testing.assert_allclose(moe.router_z_loss(stats), want, rtol=1e-6)

  cfg = DecoderConfig(vocab_size=32, d_model=D, num_layers=1, num_heads=2, mlp_dim=F,
                      num_experts=E, experts_per_token=K)
  layer = Decoder(cfg, rngs=nnx.Rngs(0)).layers[0].mlp
  graphdef, params = nnx.split(layer)
  kept = {}
  for recompute in ("activation", None):
    layer.recompute = recompute
    graphdef, params = nnx.split(layer)
    kept[recompute] = residual_bytes(
        lambda p, x, g=graphdef: jnp.sum(jnp.sin(nnx.merge(g, p)(x))), params, x)
  routed, routing = T * K * D * 4, T * (E + 3 * K) * 4   # rows; logits, weights, order, ids
  assert kept["activation"] < kept[None]
  assert kept["activation"] - routed - routing < T * K * F * 4, kept


def test_a_layer_that_keeps_expert_products_keeps_them_and_nothing_else_changes():
  """``expert_keep``: the same loss and gradients as recomputing them; the layer's residuals
  grow by one ``[T * k, F]`` array per kept product; the config reads back from a dict and
  through ``to_hf``; an unknown product is refused by name."""
  from jaxfuse.metrics import residual_bytes

  x = _layer(2)[0]
  cfg = DecoderConfig(vocab_size=32, d_model=D, num_layers=1, num_heads=2, mlp_dim=F,
                      num_experts=E, experts_per_token=K, model_type="mixtral")
  kept, grads = {}, {}
  for keep in ((), ("gate",), ("gate", "up")):
    layer = Decoder(cfg.replace(expert_keep=keep), rngs=nnx.Rngs(0)).layers[0].mlp
    graphdef, params = nnx.split(layer)
    loss = lambda p, x, g=graphdef: jnp.sum(jnp.sin(nnx.merge(g, p)(x)))
    kept[keep] = residual_bytes(loss, params, x)
    grads[keep] = jax.grad(loss, argnums=(0, 1))(params, x)
  for keep in (("gate",), ("gate", "up")):
    assert kept[keep] - kept[()] == len(keep) * T * K * F * 4, kept
    for a, b in zip(jax.tree.leaves(grads[keep]), jax.tree.leaves(grads[()])):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  keeping = cfg.replace(expert_keep="up")
  assert keeping.expert_keep == ("up",)
  assert DecoderConfig.from_dict(keeping.as_dict()) == keeping
  assert "expert_keep" not in keeping.to_hf().to_dict()
  with pytest.raises(ValueError, match=r"expert_keep takes distinct names among \('gate', "
                                       r"'up'\), got \('hidden',\)"):
    cfg.replace(expert_keep=("hidden",))


def test_the_train_cli_keeps_the_expert_products_it_is_asked_to(checkpoint):
  from jaxfuse.train import config, model

  _, _, directory = checkpoint
  built, _ = model.build(config.TrainConfig(init_from=str(directory), expert_keep="up,gate"))
  assert built.cfg.expert_keep == ("gate", "up")
  for bad, message in ((dict(expert_keep="gate"), "--expert-keep needs --init-from"),
                       (dict(init_from=str(directory), expert_keep="gate,hidden"),
                        (r"--expert-keep takes distinct names among \('gate', 'up'\), "
                         r"got \('gate', 'hidden'\)")),
                       (dict(init_from=str(directory), expert_keep=" , "),
                        "--expert-keep takes gate, up or gate,up, got ' , '")):
    with pytest.raises(ValueError, match=message):
      config.check_config(config.TrainConfig(**bad))


# The decoder -----------------------------------------------------------------------------------


def test_scanned_recomputed_moe_decoder_matches_unrolled():
  """Stacked experts in a scan, under a policy, with the z-loss and the auxiliary loss: the
  same loss and gradients as the unrolled blocks."""
  cfg = DecoderConfig(vocab_size=64, d_model=16, num_layers=2, num_heads=2, mlp_dim=24,
                      num_experts=4, experts_per_token=2, router_aux_loss_coef=0.1,
                      router_z_loss_coef=0.01)
  tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, 64)
  unrolled = Decoder(cfg, rngs=nnx.Rngs(0))
  scanned = Decoder(cfg, remat="nothing", rngs=nnx.Rngs(0)).with_layers(True)
  nnx.update(scanned, nnx.state(unrolled.with_layers(True)))
  assert scanned.layers.mlp.experts.gate_proj.shape == (2, 4, 16, 24)
  assert scanned.layers.mlp.experts.gate_proj.get_metadata()["out_sharding"] == (
      "layers", "expert", "embed", "mlp")

  @nnx.jit
  def loss_and_grads(model):
    return nnx.value_and_grad(lambda m: m(tokens, next_token_targets(tokens)))(model)

  (a, ga), (b, gb) = loss_and_grads(unrolled), loss_and_grads(scanned)
  np.testing.assert_allclose(a, b, rtol=1e-6)
  ga = jax.tree.map(lambda *xs: jnp.stack(xs), *[ga.layers[i] for i in range(2)])
  for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb.layers)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=2e-6)


def test_moe_configs_are_refused_by_name_where_unsupported():
  base = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)
  with pytest.raises(UnsupportedConfigError, match="mlp_only_layers"):
    DecoderConfig.from_hf(transformers.Qwen3MoeConfig(**base, mlp_only_layers=[1]))
  with pytest.raises(UnsupportedConfigError, match="decoder_sparse_step"):
    DecoderConfig.from_hf(transformers.Qwen3MoeConfig(**base, decoder_sparse_step=2))
  with pytest.raises(UnsupportedConfigError, match="router_jitter_noise"):
    DecoderConfig.from_hf(transformers.MixtralConfig(**base, router_jitter_noise=0.1))
  cfg = DecoderConfig.from_hf(transformers.MixtralConfig(**base, num_local_experts=4))
  with pytest.raises(ValueError, match="capacity_factor"):
    cfg.replace(capacity_factor=1.25).to_hf()
  with pytest.raises(ValueError, match="router_renormalize"):
    cfg.replace(router_renormalize=False).to_hf()
  with pytest.raises(ValueError, match="num_experts"):
    cfg.to_hf("llama")
