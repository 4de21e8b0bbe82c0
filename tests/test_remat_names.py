"""Named residuals (jaxfuse.ops.names): what each op tags, and what a policy that names it keeps.

Each op runs inside ``jax.checkpoint`` followed by a nonlinear read-out, so that the region's
backward needs every value the op computes. Under ``save_only_these_names(name)`` the backward
must then keep exactly the tagged value (shape and dtype derived here from the op's inputs), and
under ``nothing_saveable`` nothing at all.
"""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core as jex_core

from jaxfuse import ops
from jaxfuse.metrics import flops, residual_bytes, residuals
from jaxfuse.ops import names
from jaxfuse.remat import mlp as mlp_blocks

B, T, H, KVH, D = 2, 16, 4, 2, 8        # attention: batch, length, heads, kv heads, head_dim
F, HIDDEN, OUT = 32, 64, 24              # norms' features; the MLPs' hidden and output sizes
F32, BF16 = jnp.dtype("float32"), jnp.dtype("bfloat16")
SAVE_ONLY = jax.checkpoint_policies.save_only_these_names
NOTHING = jax.checkpoint_policies.nothing_saveable


def _normal(seed, shape, dtype=jnp.float32):
  """Drawn on the host: module-level data compiles nothing."""
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _readout(out):
  """A nonlinear scalar of the op's outputs: its backward needs the outputs themselves."""
  return sum(jnp.sum(jnp.sin(o.astype(jnp.float32))) for o in jax.tree.leaves(out))


# Each op: (function, arguments, {name: (shape, dtype) of the value it tags}). The shapes follow
# the ops' layouts: the norms keep their inputs' shape, with float32 statistics of shape
# (..., 1); the attention's log-sum-exp is float32 [batch, heads, length].
_X = _normal(1, (B, T, F), jnp.bfloat16)
_RES = _normal(2, (B, T, F), jnp.bfloat16)
_SCALE = 1 + 0.1 * _normal(3, (F,))
_BIAS = 0.1 * _normal(4, (F,))
_Q, _K, _V = (_normal(5, (B, T, H, D), jnp.bfloat16), _normal(6, (B, T, KVH, D), jnp.bfloat16),
              _normal(7, (B, T, KVH, D), jnp.bfloat16))
_XM = _normal(8, (B, T, F))
_WG, _WU, _WD = _normal(9, (F, HIDDEN)), _normal(10, (F, HIDDEN)), _normal(11, (HIDDEN, OUT))
_BU = 0.1 * _normal(12, (HIDDEN,))
_HEAD, _TOKENS = 0.1 * _normal(13, (OUT, F)), jnp.arange(B * T).reshape(B, T) % OUT
_XT, _TEACHER = _normal(14, (B, T, HIDDEN)), 0.1 * _normal(15, (OUT, HIDDEN))

_NORM_TAGS = {names.NORM_INPUT: ((B, T, F), BF16), names.NORM_RSTD: ((B, T, 1), F32),
              names.NORM_OUT: ((B, T, F), BF16)}
# A plain norm's norm.input is its own input: an argument, which exists anyway and is never a
# residual (keeping it costs nothing). The add variants' norm.input is the computed sum.
_INPUT_TAG = {names.NORM_INPUT: None}
OPS = {
    "attention": (
        lambda q, k, v: ops.attention(q, k, v, causal=True), (_Q, _K, _V),
        {names.ATTN_Q: ((B, T, H, D), BF16), names.ATTN_K: ((B, T, KVH, D), BF16),
         names.ATTN_V: ((B, T, KVH, D), BF16), names.ATTN_OUT: ((B, T, H, D), BF16),
         names.ATTN_LSE: ((B, H, T), F32)}),
    "rms_norm": (lambda x, s: ops.rms_norm(x, s), (_X, _SCALE), {**_NORM_TAGS, **_INPUT_TAG}),
    "layer_norm": (lambda x, s, b: ops.layer_norm(x, s, b), (_X, _SCALE, _BIAS),
                   {**_NORM_TAGS, **_INPUT_TAG, names.NORM_MEAN: ((B, T, 1), F32)}),
    # norm.input is x + residual here, which is also an output.
    "add_rms_norm": (lambda x, r, s: ops.add_rms_norm(x, r, s), (_X, _RES, _SCALE), _NORM_TAGS),
    "gated_mlp": (
        lambda x, wg, wu, wd: mlp_blocks.gated_mlp(x, wg, wu, wd, recompute=None),
        (_XM, _WG, _WU, _WD),
        {names.MLP_GATE: ((B, T, HIDDEN), F32), names.MLP_UP: ((B, T, HIDDEN), F32),
         names.MLP_HIDDEN: ((B, T, HIDDEN), F32), names.MLP_DOWN: ((B, T, OUT), F32)}),
    "mlp": (
        lambda x, wu, bu, wd: mlp_blocks.mlp(x, wu, bu, wd, recompute=None),
        (_XM, _WU, _BU, _WD),
        {names.MLP_PRE: ((B, T, HIDDEN), F32), names.MLP_HIDDEN: ((B, T, HIDDEN), F32),
         names.MLP_DOWN: ((B, T, OUT), F32)}),
    "linear_log_probs": (
        lambda h, w: ops.linear_log_probs(h, w, _TOKENS, return_entropy=True), (_XM, _HEAD),
        {names.LOGP_LSE: ((B * T,), F32), names.LOGP_MEAN_LOGIT: ((B * T,), F32)}),
    "linear_distillation_loss": (
        lambda h, w: ops.linear_distillation_loss(h, w, _XT, _TEACHER, labels=_TOKENS,
                                                  reduction="none"), (_XM, _HEAD),
        {names.DISTILL_STUDENT_LSE: ((B * T,), F32), names.DISTILL_TEACHER_LSE: ((B * T,), F32)}),
}


def _kept(op, policy):
  fn, args, _ = OPS[op]
  region = jax.checkpoint(lambda *a: _readout(fn(*a)), policy=policy)
  return residuals(region, *args)


@pytest.mark.parametrize("op", sorted(OPS))
def test_keeping_one_name_keeps_exactly_the_tagged_value(op):
  for name, tagged in OPS[op][2].items():
    kept = [(r.shape, jnp.dtype(r.dtype), r.memory) for r in _kept(op, SAVE_ONLY(name))]
    assert kept == ([] if tagged is None else [(*tagged, "device")]), (op, name, kept)


@pytest.mark.parametrize("op", sorted(OPS))
def test_keeping_nothing_keeps_nothing(op):
  assert _kept(op, NOTHING) == []
  fn, args, _ = OPS[op]
  # Without the checkpoint the same function keeps something: the policy is what empties it.
  assert residual_bytes(lambda *a: _readout(fn(*a)), *args) > 0


@pytest.mark.parametrize("op", sorted(OPS))
def test_keeping_more_names_never_keeps_fewer_bytes(op):
  tags = sorted(OPS[op][2])
  nbytes = {}
  for r in range(len(tags) + 1):
    for subset in itertools.combinations(tags, r):
      nbytes[subset] = sum(x.nbytes for x in _kept(op, SAVE_ONLY(*subset)))
  for subset, kept in nbytes.items():
    for extra in set(tags) - set(subset):
      bigger = tuple(sorted(subset + (extra,)))
      assert nbytes[bigger] >= kept, (subset, extra, kept, nbytes[bigger])
  # Distinct values: keeping all of them costs the sum of keeping each.
  sizes = {n: math.prod(t[0]) * jnp.dtype(t[1]).itemsize for n, t in OPS[op][2].items()
           if t is not None}
  assert nbytes[tuple(tags)] == sum(sizes.values())


# Which names exist ---------------------------------------------------------------------------


def _names_in(jaxpr, found):
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "name":
      found.add(eqn.params["name"])
    for param in eqn.params.values():
      for sub in (param if isinstance(param, (tuple, list)) else (param,)):
        if isinstance(sub, jex_core.ClosedJaxpr):
          _names_in(sub.jaxpr, found)
        elif isinstance(sub, jex_core.Jaxpr):
          _names_in(sub, found)
  return found


def test_all_names_are_distinct_and_cover_the_module_constants():
  assert len(set(names.ALL)) == len(names.ALL)
  constants = {v for k, v in vars(names).items() if k.isupper() and isinstance(v, str)}
  assert constants == set(names.ALL)


def test_the_names_the_ops_and_the_decoder_tag_are_exactly_names_all():
  """The names found in the traced forward and backward of every op above, and of the decoder's
  fused and plain forms, are names.ALL: none is missing from it, and it lists none unused."""
  from flax import nnx

  from jaxfuse.models import Decoder, DecoderConfig, next_token_targets
  from jaxfuse.nnx import apply_lora

  found = set()
  for fn, args, _ in OPS.values():
    grad = jax.grad(lambda *a, fn=fn: _readout(fn(*a)), argnums=tuple(range(len(args))))
    _names_in(jax.make_jaxpr(grad)(*args).jaxpr, found)
  assert found <= set(names.ALL), found - set(names.ALL)
  cfg = DecoderConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1,
                      mlp_dim=64)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 16)), jnp.int32)
  targets = next_token_targets(tokens)
  moe = cfg.replace(num_experts=4, experts_per_token=2)   # a Mixture of Experts: moe.*
  for model_cfg, fused, lora in [(c, f, False) for c, f in itertools.product((cfg, moe),
                                                                            (True, False))
                                 ] + [(cfg, True, True)]:
    model = Decoder(model_cfg, fused=fused, remat="nothing", rngs=nnx.Rngs(0))
    if lora:   # LoRA adapters: lora.xa
      apply_lora(model, rank=2, alpha=4.0, rngs=nnx.Rngs(1))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    grad = jax.grad(lambda p, g=graphdef, r=rest: nnx.merge(g, p, r)(tokens, targets))
    decoder = _names_in(jax.make_jaxpr(grad)(params).jaxpr, set())
    assert decoder <= set(names.ALL), (fused, decoder - set(names.ALL))
    found |= decoder
  assert found == set(names.ALL), set(names.ALL) - found


# What keeping a name saves -------------------------------------------------------------------

M = B * T   # tokens


def _projected_attention(fused: bool):
  """q, k, v projections of x, then attention: jaxfuse's, which tags its own inputs, or
  jax.nn's with the inputs tagged by hand (as the plain decoder does)."""
  def fn(x, wq, wk, wv):
    q = (x @ wq).reshape(B, T, H, D)
    k = (x @ wk).reshape(B, T, KVH, D)
    v = (x @ wv).reshape(B, T, KVH, D)
    if fused:
      o = ops.attention(q, k, v, causal=True)
    else:
      q, k, v = (checkpoint_name(a, n) for a, n in ((q, names.ATTN_Q), (k, names.ATTN_K),
                                                   (v, names.ATTN_V)))
      o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    return _readout(o)
  return fn


@pytest.mark.parametrize("fused", [False, True], ids=["jax.nn", "jaxfuse"])
def test_keeping_the_attention_inputs_saves_recomputing_their_projections(fused):
  """With q, k, v kept, the backward recomputes the attention from them, not the three
  projections: the FLOPs fall by exactly the projections' 2·M·K·N each."""
  x = _normal(20, (B, T, F))
  wq, wk, wv = _normal(21, (F, H * D)), _normal(22, (F, KVH * D)), _normal(23, (F, KVH * D))
  fn = _projected_attention(fused)

  def step_flops(policy):
    region = jax.checkpoint(fn, policy=policy)
    return flops(lambda *a: jax.value_and_grad(region, argnums=(0, 1, 2, 3))(*a), x, wq, wk, wv)

  saved = 2 * M * F * (H * D + 2 * KVH * D)
  kept = step_flops(SAVE_ONLY(names.ATTN_Q, names.ATTN_K, names.ATTN_V))
  assert step_flops(NOTHING) - kept == saved
