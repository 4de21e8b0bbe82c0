"""The decoder under recomputation: every preset and recipe, √L segments and scanned layers give
the gradients of no recomputation, keep fewer residual bytes the less they keep, and the
scanned program does not grow with the number of layers.

Each compiled program costs seconds on a CPU, so the presets and recipes are spread over the
layers of one model: a per-layer plan gives each layer a different policy, and one compile
checks seven of them (each layer's backward recomputes under its own policy, and a wrong
recomputation in any of them changes the gradients).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxfuse.metrics import residuals
from jaxfuse.models import Decoder, DecoderConfig, next_token_targets
from jaxfuse.models.decoder import stack_layers, unstack_layers
from jaxfuse.remat import PRESETS, RECIPES, Plan, freeze_policy
from jaxfuse.remat.planner import choice_policy

L = 7
CFG = DecoderConfig(vocab_size=64, d_model=32, num_layers=L, num_heads=2, num_kv_heads=1,
                    mlp_dim=64)
TOKENS = jnp.asarray(np.random.default_rng(1).integers(0, CFG.vocab_size, (2, 16)),
                     jnp.int32)
_TARGETS = np.array(next_token_targets(TOKENS))
_TARGETS[0, 5] = -100   # an ignored target too
BATCH = (TOKENS, jnp.asarray(_TARGETS))
# XLA:CPU spends these tests compiling. Both sides of every comparison are compiled with the
# same options, which change how fast the code runs (and so how fast it compiles), not which
# operations it performs.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
                "xla_cpu_use_fusion_emitters": False, "xla_cpu_parallel_codegen_split_count": 1}
# A relative error per tensor (max |a - b| / max |b|) for the scanned layers, whose blocks are
# compiled as a loop body rather than inline. (Here, on XLA:CPU with the options above, they
# agree exactly; the tolerance leaves XLA free to compile a loop body differently.)
SCAN_RTOL = 1e-6

POLICIES = list(PRESETS) + list(RECIPES)
# Two plans of seven layers: the four presets and ten recipes, each once.
PLAN_A, PLAN_B = POLICIES[:L], POLICIES[L:]
assert len(POLICIES) == 2 * L


def per_layer(choices) -> Plan:
  """A plan choosing ``choices[i]`` for layer ``i`` (its costs play no part here)."""
  return Plan(tuple(choices), tuple(freeze_policy(choice_policy(c)) for c in choices),
              budget_bytes=1, predicted_bytes=1, predicted_flops=1, no_remat_bytes=1,
              no_remat_flops=1, min_bytes=1)


def loss_and_grads(model, remat, segments=None):
  """The loss and the parameter gradients (a pure dict) with ``model`` set to ``remat``."""
  model.set_remat(remat, segments)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(params):
    return nnx.merge(graphdef, params, rest)(*BATCH)

  value, grads = jax.jit(jax.value_and_grad(loss), compiler_options=FAST_COMPILE)(params)
  return value, grads


def flat(grads_dict) -> dict:
  return {jax.tree_util.keystr(path): np.asarray(leaf)
          for path, leaf in jax.tree_util.tree_leaves_with_path(grads_dict)}


def assert_equal_grads(got, want, rtol=0.0, what=""):
  got, want = flat(got), flat(want)
  assert got.keys() == want.keys()
  bad = {}
  for key, w in want.items():
    g = got[key]
    assert g.shape == w.shape, (key, g.shape, w.shape)
    if rtol == 0.0:
      if not np.array_equal(g, w):
        bad[key] = float(np.max(np.abs(g - w)))
    else:
      err = float(np.max(np.abs(g - w)) / np.max(np.abs(w)))
      if not err <= rtol:
        bad[key] = err
  assert not bad, f"{what}: gradients differ: {bad}"


def random_decoder(cfg: DecoderConfig, fused: bool, scan_layers: bool = False) -> Decoder:
  """A decoder with random parameters drawn on the host (its initializers compile nothing):
  norm scales near 1, weights of about unit gain."""
  model = nnx.eval_shape(lambda: Decoder(cfg, fused=fused, scan_layers=scan_layers,
                                         rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(0)

  def draw(path, leaf):
    key = jax.tree_util.keystr(path)
    if "norm" in key:
      return jnp.asarray(1 + 0.2 * rng.standard_normal(leaf.shape), leaf.dtype)
    return jnp.asarray(rng.standard_normal(leaf.shape) * leaf.shape[-1] ** -0.5, leaf.dtype)

  state = nnx.state(model)
  nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(draw, nnx.to_pure_dict(state)))
  nnx.update(model, state)
  return model


@pytest.fixture(scope="module", params=[True, False], ids=["fused", "plain"])
def unrolled(request):
  """``(fused, model, (loss, grads) without recomputation)``."""
  model = random_decoder(CFG, request.param)
  loss, grads = loss_and_grads(model, None)
  return request.param, model, (loss, nnx.to_pure_dict(grads))


@pytest.mark.parametrize("choices,segments", [(PLAN_A, None), (PLAN_B, "sqrt")],
                         ids=["presets-and-recipes", "recipes-and-sqrt-segments"])
def test_every_policy_gives_bitwise_the_gradients_without_recomputation(unrolled, choices,
                                                                       segments):
  fused, model, (loss0, grads0) = unrolled
  loss, grads = loss_and_grads(model, per_layer(choices), segments)
  assert float(loss) == float(loss0)
  assert_equal_grads(nnx.to_pure_dict(grads), grads0, what=f"fused={fused} {choices}")


def _scanned_from(model: Decoder) -> Decoder:
  """A ``scan_layers=True`` decoder with ``model``'s parameters."""
  scanned = nnx.eval_shape(lambda: Decoder(CFG, fused=model.fused, scan_layers=True,
                                           rngs=nnx.Rngs(0)))
  state = nnx.state(scanned)
  nnx.replace_by_pure_dict(state, stack_layers(nnx.state(model), CFG.num_layers))
  nnx.update(scanned, state)
  return scanned


# One program each (a scanned program compiles as slowly as a few unrolled layers):
SCANNED = {
    # One policy for all, offloading inside the scan's body: the two full segments of three
    # layers in an outer scan (each a scan over its layers), the remaining layer after it.
    True: ("minimal_offloaded", "sqrt"),
    # A plan with runs of layers under one policy each, not aligned with the segments of three
    # layers: the segments one by one, one scan per run inside each.
    False: (per_layer(["save_dot_with_context_except_mlp"] * 2 + ["nothing"] * 3
                      + ["none"] * 2), "sqrt"),
}


def test_scanned_layers_give_the_gradients_of_the_unrolled_ones(unrolled):
  fused, model, (loss0, grads0) = unrolled
  remat, segments = SCANNED[fused]
  scanned = _scanned_from(model)
  loss, grads = loss_and_grads(scanned, remat, segments)
  np.testing.assert_allclose(float(loss), float(loss0), rtol=SCAN_RTOL)
  assert_equal_grads(unstack_layers(grads, CFG.num_layers), grads0, rtol=SCAN_RTOL,
                     what=f"fused={fused} scanned {remat} {segments}")


# Residual bytes ------------------------------------------------------------------------------

SMALL = CFG.replace(num_layers=4)


def _shapes_only(cfg):
  """Residual bytes are read off the traced program: the parameters need only shapes."""
  return nnx.eval_shape(lambda: Decoder(cfg, fused=True, rngs=nnx.Rngs(0)))


@pytest.fixture(scope="module")
def small_fused():
  return _shapes_only(SMALL)


def step_residuals(model, remat, segments=None) -> tuple[int, int]:
  """The whole step's residual bytes: ``(on the device, in host memory)``."""
  model.set_remat(remat, segments)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  rs = residuals(lambda p: nnx.merge(graphdef, p, rest)(*BATCH), params)
  return (sum(r.nbytes for r in rs if r.memory == "device"),
          sum(r.nbytes for r in rs if r.memory == "host"))


def test_stricter_policies_keep_fewer_bytes():
  two = CFG.replace(num_layers=2)
  model = _shapes_only(two)
  chain = ["everything", "minimal_with_context", "minimal", "save_dot_except_mlp",
           "save_qkv_proj", "nothing"]
  kept = {p: step_residuals(model, p)[0] for p in chain}
  for looser, stricter in itertools.pairwise(chain):
    assert kept[looser] > kept[stricter], (looser, stricter, kept)
  # Where a policy adds values that only live inside a block, the difference is their size.
  n, (b, t) = two.num_layers, TOKENS.shape
  h, kvh, hd, f32 = two.num_heads, two.kv_heads, two.head_dim, 4
  context = b * t * h * hd * f32 + b * h * t * f32            # attn.out and attn.lse
  qkv = b * t * (h + 2 * kvh) * hd * f32
  proj = b * t * two.d_model * f32
  assert kept["minimal_with_context"] - kept["minimal"] == n * context
  assert kept["save_dot_except_mlp"] - kept["save_qkv_proj"] == n * proj
  assert kept["save_qkv_proj"] - kept["nothing"] == n * qkv
  # minimal_offloaded keeps minimal's values in host memory, and on the device what nothing
  # keeps.
  on_device, on_host = step_residuals(model, "minimal_offloaded")
  assert on_host > 0 and on_device == kept["nothing"] and on_device + on_host == kept["minimal"]


def test_sqrt_segments_keep_fewer_bytes_than_keeping_nothing_per_layer(small_fused):
  """With L = 4, two segments of two layers: each segment keeps its input only."""
  assert step_residuals(small_fused, "nothing", "sqrt")[0] < step_residuals(small_fused,
                                                                             "nothing")[0]


# Program size --------------------------------------------------------------------------------


def _equations(jaxpr) -> int:
  count = 0
  for eqn in jaxpr.eqns:
    count += 1
    for param in eqn.params.values():
      for sub in (param if isinstance(param, (tuple, list)) else (param,)):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          count += _equations(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          count += _equations(sub)
  return count


def _grad_size(num_layers, scan_layers):
  cfg = CFG.replace(num_layers=num_layers)
  model = nnx.eval_shape(lambda: Decoder(cfg, fused=False, scan_layers=scan_layers,
                                         rngs=nnx.Rngs(0)))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  grad = jax.grad(lambda p: nnx.merge(graphdef, p, rest)(*BATCH))
  return _equations(jax.make_jaxpr(grad)(params).jaxpr)


def test_the_scanned_program_does_not_grow_with_the_layers():
  scanned = _grad_size(2, True), _grad_size(8, True)
  unrolled = _grad_size(2, False), _grad_size(8, False)
  assert scanned[0] == scanned[1], scanned
  assert unrolled[1] > unrolled[0], unrolled
  assert scanned[1] < unrolled[1]


# Refused settings ----------------------------------------------------------------------------


@pytest.mark.parametrize("remat,segments,match", [
    ("bogus", None, "bogus"),
    (3, None, "int"),
    ({"attn.q": "disk"}, None, "disk"),
    (per_layer(["nothing"] * 3), None, "3 layers"),
    (None, 0, "segments"),
    (None, "cube", "segments"),
    (None, True, "segments"),
])
def test_bad_remat_or_segments_are_refused(small_fused, remat, segments, match):
  with pytest.raises(ValueError, match=match):
    small_fused.set_remat(remat, segments)


def test_the_constructor_checks_remat_and_segments():
  for remat, segments in [("bogus", None), (None, "cube")]:
    with pytest.raises(ValueError, match="bogus|segments"):
      nnx.eval_shape(lambda r=remat, s=segments: Decoder(SMALL, remat=r, segments=s,
                                                         rngs=nnx.Rngs(0)))


def test_a_refused_setting_leaves_the_model_as_it_was():
  model = nnx.eval_shape(lambda: Decoder(SMALL, rngs=nnx.Rngs(0)))
  before = (model.remat, model.segments, model.layer_policies, model.layers[0].mlp.recompute)
  with pytest.raises(ValueError, match="segments"):
    model.set_remat("nothing", "cube")
  after = (model.remat, model.segments, model.layer_policies, model.layers[0].mlp.recompute)
  assert after == before
