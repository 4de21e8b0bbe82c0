"""Recomputation policies (jaxfuse.remat.policies) and ``remat`` for functions, NNX and Linen
modules.

What a policy does is read off a probe: a function that tags one value per name of
``names.ALL`` (plus one name no recipe uses), each of a different size, so that the residuals a
policy leaves tell which names it kept, and where (device or host memory).
"""

import itertools
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxfuse.metrics import offloaded_bytes, residual_bytes, residuals
from jaxfuse.ops import names
from jaxfuse.remat import (PRESETS, RECIPES, Plan, Remat, checkpoint_name, freeze_policy,
                           policy_table, remat, resolve_policy)
from tests import helpers

CP = jax.checkpoint_policies
OTHER = "not.a.jaxfuse.name"
PROBE_NAMES = names.ALL + (OTHER,)
# Value i has i + 1 float32 elements: its size names it.
SIZE_TO_NAME = {4 * (i + 1): n for i, n in enumerate(PROBE_NAMES)}
PROBE_X = jnp.asarray(np.linspace(0.1, 1.0, len(PROBE_NAMES) + 1), jnp.float32)


def probe(x):
  total = 0.0
  for i, name in enumerate(PROBE_NAMES):
    value = checkpoint_name(jnp.sin(x[:i + 1] * (i + 1)), name)
    total = total + jnp.sum(jnp.sin(value))   # the backward needs every tagged value
  return total


def kept_by(policy) -> dict[str, str]:
  """``{name: "device" | "host"}`` of the probe's values a ``jax.checkpoint`` policy keeps."""
  rs = residuals(jax.checkpoint(probe, policy=policy), PROBE_X)
  kept = {SIZE_TO_NAME[r.nbytes]: r.memory for r in rs}
  assert len(kept) == len(rs), rs
  return kept


def as_memory(table: dict[str, str]) -> dict[str, str]:
  return {k: {"device": "device", "offload": "host"}[v] for k, v in table.items()
          if v != "remat"}


# resolve_policy ------------------------------------------------------------------------------


def test_presets_are_jax_policies():
  assert resolve_policy("nothing") is CP.nothing_saveable
  assert resolve_policy("everything") is CP.everything_saveable
  assert resolve_policy("dots") is CP.dots_saveable
  assert resolve_policy("dots_no_batch") is CP.dots_with_no_batch_dims_saveable
  assert resolve_policy(None) is CP.nothing_saveable
  assert set(PRESETS) == {"nothing", "everything", "dots", "dots_no_batch"}
  assert kept_by(resolve_policy("nothing")) == {}
  assert kept_by(resolve_policy(None)) == {}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_each_recipe_keeps_exactly_its_table(recipe):
  table = policy_table(recipe)
  assert set(table) <= set(names.ALL), set(table) - set(names.ALL)
  assert set(table.values()) <= {"device", "offload"}
  assert kept_by(resolve_policy(recipe)) == as_memory(table)


def test_recipes_are_maxtexts():
  """The relations between MaxText's remat_policy values, over our names."""
  keys = {r: set(policy_table(r)) for r in RECIPES}
  assert keys["full"] == set()
  assert keys["save_qkv_proj"] == {names.ATTN_Q, names.ATTN_K, names.ATTN_V}
  assert keys["save_out_proj"] == {names.ATTN_PROJ}
  chain = ["save_qkv_proj", "save_dot_except_mlp", "save_dot_except_mlpwi", "minimal",
           "minimal_with_context"]
  for smaller, larger in itertools.pairwise(chain):
    assert keys[smaller] < keys[larger], (smaller, larger)
  assert keys["minimal_with_context"] - keys["minimal"] == {names.ATTN_OUT, names.ATTN_LSE}
  assert keys["save_dot_except_mlpwi"] - keys["save_dot_except_mlp"] == {names.MLP_DOWN}
  assert keys["save_dot_with_context_except_mlp"] == (
      keys["save_dot_except_mlp"] | {names.ATTN_OUT, names.ATTN_LSE})
  # The offloaded recipes move to host memory what their device twins keep.
  for offloaded, twin in [("qkv_proj_offloaded", "save_qkv_proj"),
                          ("minimal_offloaded", "minimal")]:
    assert policy_table(offloaded) == dict.fromkeys(keys[twin], "offload")
  for recipe in RECIPES:
    if "offloaded" not in recipe:
      assert set(policy_table(recipe).values()) <= {"device"}, recipe


def test_a_list_of_names_keeps_them_on_the_device():
  chosen = [names.ATTN_LSE, names.MLP_HIDDEN, OTHER]
  assert kept_by(resolve_policy(chosen)) == dict.fromkeys(chosen, "device")
  assert kept_by(resolve_policy(tuple(chosen))) == dict.fromkeys(chosen, "device")
  assert kept_by(resolve_policy([])) == {}


def test_a_table_keeps_offloads_and_recomputes():
  table = {names.ATTN_Q: "device", names.MLP_HIDDEN: "offload", names.NORM_OUT: "remat",
           names.ATTN_LSE: "offload"}
  expected = {names.ATTN_Q: "device", names.MLP_HIDDEN: "host", names.ATTN_LSE: "host"}
  assert kept_by(resolve_policy(table)) == expected
  assert policy_table(table) == {names.ATTN_Q: "device", names.MLP_HIDDEN: "offload",
                                 names.ATTN_LSE: "offload"}


def test_frozen_tables_are_hashable_and_keep_the_same():
  table = {names.MLP_HIDDEN: "offload", names.ATTN_Q: "device", names.NORM_OUT: "remat"}
  frozen = freeze_policy(table)
  assert frozen == tuple(sorted(table.items()))
  hash(frozen)
  assert kept_by(resolve_policy(frozen)) == kept_by(resolve_policy(table)) == {
      names.ATTN_Q: "device", names.MLP_HIDDEN: "host"}
  assert policy_table(frozen) == policy_table(table)
  assert freeze_policy([names.ATTN_Q]) == (names.ATTN_Q,)
  assert freeze_policy("minimal") == "minimal"


def test_a_callable_is_used_as_it_is():
  def keep_lse(prim, *_, **params):
    return prim.name == "name" and params.get("name") == names.ATTN_LSE

  assert resolve_policy(keep_lse) is keep_lse
  assert kept_by(resolve_policy(keep_lse)) == {names.ATTN_LSE: "device"}


@pytest.mark.parametrize("bad,error,match", [
    ("bogus", ValueError, "'bogus'"),
    ({names.ATTN_Q: "disk"}, ValueError, "disk"),
    ({names.ATTN_Q: "device", 3: "device"}, ValueError, "3"),
    (3, TypeError, "int"),
    ([names.ATTN_Q, 3], TypeError, "list"),
])
def test_bad_policies_are_refused_naming_the_problem(bad, error, match):
  with pytest.raises(error, match=match):
    resolve_policy(bad)


def test_policy_table_refuses_presets_and_callables():
  with pytest.raises(ValueError, match="'dots' is not a recipe"):
    policy_table("dots")
  with pytest.raises(TypeError, match="function"):
    policy_table(CP.nothing_saveable)
  with pytest.raises(ValueError, match="disk"):
    freeze_policy({names.ATTN_Q: "disk"})


# Offloading ----------------------------------------------------------------------------------


def _mlp_like(x, w1, w2):
  hidden = checkpoint_name(jnp.tanh(x @ w1), names.MLP_HIDDEN)
  return jnp.sum(jnp.sin(hidden @ w2))


_X, _W1, _W2 = (jnp.asarray(np.random.default_rng(i).standard_normal(s), jnp.float32)
                for i, s in enumerate([(8, 16), (16, 32), (32, 16)]))
HIDDEN_BYTES = 8 * 32 * 4


def test_an_offloaded_value_is_kept_in_host_memory_and_the_gradients_are_unchanged():
  on_device = remat(_mlp_like, policy={names.MLP_HIDDEN: "device"})
  offloaded = remat(_mlp_like, policy={names.MLP_HIDDEN: "offload"})
  args = (_X, _W1, _W2)
  assert offloaded_bytes(offloaded, *args) == HIDDEN_BYTES
  assert offloaded_bytes(on_device, *args) == 0
  assert residual_bytes(offloaded, *args) == residual_bytes(on_device, *args) - HIDDEN_BYTES
  [host] = [r for r in residuals(offloaded, *args) if r.memory == "host"]
  assert (host.shape, host.dtype) == ((8, 32), "float32")

  def grad(f):
    return jax.jit(jax.grad(f, argnums=(0, 1, 2)))(*args)

  for got, want in zip(grad(offloaded), grad(_mlp_like)):
    np.testing.assert_array_equal(got, want)


def test_offloading_lowers_to_a_pinned_host_placement():
  """XLA:CPU has one memory: its lowering drops the placement. The CUDA lowering (built here
  without a GPU) carries it."""
  def lowered(policy):
    f = jax.grad(remat(_mlp_like, policy=policy), argnums=1)
    return jax.jit(f).trace(_X, _W1, _W2).lower(lowering_platforms=("cuda",)).as_text()

  assert 'pinned_host' in lowered({names.MLP_HIDDEN: "offload"})
  assert 'pinned_host' not in lowered({names.MLP_HIDDEN: "device"})


# remat() -------------------------------------------------------------------------------------


def _repeat(x, times):
  for _ in range(times):   # a Python loop: ``times`` must be static
    x = jnp.tanh(x) * 1.5
  return jnp.sum(x)


def test_remat_of_a_function_with_static_arguments():
  x = jnp.linspace(-1.0, 1.0, 64)
  checkpointed = remat(_repeat, policy="nothing", static_argnums=1)
  got = jax.jit(jax.grad(checkpointed), static_argnums=1)(x, 3)
  want = jax.jit(jax.grad(_repeat), static_argnums=1)(x, 3)
  np.testing.assert_array_equal(got, want)
  assert residual_bytes(lambda x: _repeat(x, 3), x) > 0
  assert residual_bytes(lambda x: checkpointed(x, 3), x) == 0
  with pytest.raises(jax.errors.TracerIntegerConversionError):
    jax.grad(remat(_repeat, policy="nothing"))(x, 3)


class _NnxBlock(nnx.Module):
  def __init__(self, rngs):
    self.up = nnx.Linear(8, 32, rngs=rngs)
    self.down = nnx.Linear(32, 8, rngs=rngs)

  def __call__(self, x, double: bool = False):
    h = self.down(jnp.tanh(self.up(x)))
    return 2 * h if double else h   # a Python branch: ``double`` must be static


def _nnx_loss(model, x, double=False):
  return jnp.sum(jnp.sin(model(x, double)))


def _nnx_grads(model, x, double):
  """The gradients of every variable of ``model``, compiled (eager recomputation would compile
  each op on its own)."""
  graphdef, state = nnx.split(model)

  def loss(state, x):
    return _nnx_loss(nnx.merge(graphdef, state), x, double)

  return jax.tree.leaves(jax.jit(jax.grad(loss))(state, x))


def test_remat_of_an_nnx_module_shares_its_variables_and_keeps_less():
  block = _NnxBlock(nnx.Rngs(0))
  wrapped = remat(block, policy="nothing", static_argnums=1)
  assert isinstance(wrapped, Remat) and wrapped.module is block
  x = jnp.asarray(np.random.default_rng(1).standard_normal((4, 8)), jnp.float32)
  for double in (False, True):
    got, want = _nnx_grads(wrapped, x, double), _nnx_grads(block, x, double)
    assert len(got) == len(want) == 4
    for a, b in zip(got, want):
      helpers.assert_close(a, b, rtol=1e-6, what=f"double={double}")
  # Under "nothing" only the read-out outside the region keeps anything: one block output.
  assert residual_bytes(_nnx_loss, wrapped, x) == x.nbytes < residual_bytes(_nnx_loss, block, x)
  # The wrapper calls the same variables: an update to the block shows in it.
  block.down.bias[...] = block.down.bias[...] + 1.0
  np.testing.assert_array_equal(wrapped(x, False), block(x, False))


class _LinenBlock(nn.Module):
  features: int = 32
  scale: float = 1.5

  @nn.compact
  def __call__(self, x, double: bool):
    h = nn.Dense(x.shape[-1])(jnp.tanh(nn.Dense(self.features)(x)) * self.scale)
    return 2 * h if double else h


def _linen_grads(module, params, x, double):
  def loss(p):
    return jnp.sum(jnp.sin(module.apply(p, x, double)))

  return jax.jit(jax.grad(loss))(params), residual_bytes(loss, params)


@pytest.mark.parametrize("form", ["class", "instance"])
def test_remat_of_a_linen_module(form):
  plain = _LinenBlock(features=24, scale=0.5)
  if form == "class":
    wrapped = remat(_LinenBlock, policy="nothing", static_argnums=1)(features=24, scale=0.5)
  else:
    wrapped = remat(plain, policy="nothing", static_argnums=1)
    assert (wrapped.features, wrapped.scale) == (24, 0.5)
  assert type(wrapped) is not _LinenBlock and isinstance(wrapped, nn.Module)
  x = jnp.asarray(np.random.default_rng(2).standard_normal((4, 8)), jnp.float32)
  params = wrapped.init(jax.random.key(3), x, True)
  assert jax.tree.structure(params) == jax.tree.structure(plain.init(jax.random.key(3), x, True))
  for double in (False, True):
    np.testing.assert_array_equal(wrapped.apply(params, x, double), plain.apply(params, x, double))
    got, got_bytes = _linen_grads(wrapped, params, x, double)
    want, want_bytes = _linen_grads(plain, params, x, double)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      helpers.assert_close(a, b, rtol=1e-6, what=f"double={double}")
    assert got_bytes < want_bytes


def _plan(choices, policies):
  """A hand-made plan (the costs are irrelevant to remat)."""
  return Plan(tuple(choices), tuple(policies), budget_bytes=1, predicted_bytes=1,
              predicted_flops=1, no_remat_bytes=1, no_remat_flops=1, min_bytes=1)


def test_remat_takes_a_plan_with_one_policy_and_refuses_a_per_layer_plan():
  kept = (names.MLP_HIDDEN, names.ATTN_LSE)
  single = _plan(["save_two", "save_two"], [kept, kept])
  assert single.single_policy() == kept
  rs = residuals(remat(probe, policy=single), PROBE_X)
  assert {SIZE_TO_NAME[r.nbytes] for r in rs} == set(kept)
  per_layer = _plan(["minimal", "nothing"], ["minimal", "nothing"])
  with pytest.raises(ValueError, match="per layer"):
    remat(probe, policy=per_layer)
  with pytest.raises(ValueError, match="per layer"):
    remat(_NnxBlock(nnx.Rngs(0)), policy=per_layer)


def test_remat_refuses_what_it_cannot_wrap():
  with pytest.raises(TypeError, match="int"):
    remat(3)
  np.testing.assert_array_equal(
      jax.grad(remat(partial(_repeat, times=2)))(jnp.ones(3)),
      jax.grad(partial(_repeat, times=2))(jnp.ones(3)))
