"""The recomputation planner (jaxfuse.remat.profile and plan) and the FLOP counter it reads.

The profile of a small decoder is measured once and the plans are made from it. The decoder is
the plain one (fused=False): its FLOPs are read off the traced program, while the fused
attention's loops make the counter compile and run a program per choice (the counter's loops
are tested on their own below).
"""

import itertools
import random
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxfuse.metrics import flops
from jaxfuse.models import Decoder, DecoderConfig, next_token_targets
from jaxfuse.models.decoder import IGNORE_INDEX
from jaxfuse.remat import BudgetError, ChoiceCost, Plan, plan, profile
from jaxfuse.remat.planner import _knapsack, _step_costs
from tests.test_remat_decoder import (FAST_COMPILE, assert_equal_grads, per_layer,
                                      random_decoder)

CFG = DecoderConfig(vocab_size=64, d_model=32, num_layers=4, num_heads=2, num_kv_heads=1,
                    mlp_dim=64)
TOKENS = jnp.asarray(np.random.default_rng(1).integers(0, CFG.vocab_size, (2, 16)),
                     jnp.int32)
_TARGETS = np.array(next_token_targets(TOKENS))
_TARGETS[1, 2] = IGNORE_INDEX   # an ignored target too
BATCH = (TOKENS, jnp.asarray(_TARGETS))
CHOICES = ["none", "nothing", "dots", "minimal", "save_qkv_proj", "save_context"]


def loss_fn(model, batch):
  return model(*batch)


@pytest.fixture(scope="module")
def model():
  return random_decoder(CFG, fused=False)


@pytest.fixture(scope="module")
def prof(model):
  return profile(loss_fn, model, BATCH, choices=CHOICES)


@pytest.fixture(scope="module")
def plans(model, prof):
  return {b: plan(loss_fn, model, BATCH, b, profiled=prof) for b in ("25%", "50%", "75%")}


def grads(model):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(p):
    return nnx.merge(graphdef, p, rest)(*BATCH)

  value, g = jax.jit(jax.value_and_grad(loss), compiler_options=FAST_COMPILE)(params)
  return float(value), nnx.to_pure_dict(g)


def measured_bytes(model, remat):
  saved = (model.remat, model.segments)
  model.set_remat(remat)
  try:
    return _step_costs(loss_fn, model, BATCH, with_flops=False)
  finally:
    model.set_remat(*saved)


CARRY_BYTES = TOKENS.size * CFG.d_model * 4   # a block's input: the residual stream, float32


def additive_gap(choices) -> int:
  """What the profile's additive model over-counts. It counts every block's input (the
  residual stream) outside the layers, as measured with every block keeping nothing, where
  each block keeps its input; a block without recomputation ("none") keeps its ops' own
  residuals instead, and its input is then kept by nothing."""
  return CARRY_BYTES * sum(c == "none" for c in choices)


@pytest.mark.parametrize("budget", ["25%", "50%", "75%"])
def test_plans_fit_their_budget_and_predict_the_measured_bytes(model, prof, plans, budget):
  p = plans[budget]
  assert p.budget_bytes == int(int(budget[:-1]) / 100 * prof.no_remat_bytes)
  assert p.measured_bytes <= p.budget_bytes
  assert p.predicted_bytes <= p.budget_bytes
  assert (p.predicted_bytes, p.predicted_flops) == prof.total(p.choices)
  assert p.predicted_bytes - p.measured_bytes == additive_gap(p.choices)
  assert p.measured_bytes == measured_bytes(model, per_layer(p.choices))
  assert len({p.choices for p in plans.values()}) > 1   # the budgets matter


def test_the_additive_model_over_counts_only_the_carries_of_blocks_without_recomputation(
    model, prof):
  for choices in (["none", "nothing", "nothing", "nothing"], ["dots", "none", "minimal", "none"],
                  ["save_context", "minimal", "dots", "nothing"]):
    predicted = prof.total(choices)[0]
    assert predicted - measured_bytes(model, per_layer(choices)) == additive_gap(choices)
  assert prof.total(["nothing"] * 4)[0] == measured_bytes(model, "nothing")


def test_a_plan_gives_the_gradients_without_recomputation(model, plans):
  loss0, grads0 = grads(model)
  # Decoder(remat=plan), on the same parameters.
  p = plans["75%"]
  other = nnx.eval_shape(lambda: Decoder(CFG, fused=model.fused, remat=p, rngs=nnx.Rngs(0)))
  nnx.update(other, nnx.state(model))
  assert other.layer_policies == p.policies
  loss, g = grads(other)
  assert loss == loss0
  assert_equal_grads(g, grads0, what=f"Decoder(remat={p.choices})")
  # model.set_remat(plan): the other plans.
  for budget in ("25%", "50%"):
    p = plans[budget]
    model.set_remat(p)
    try:
      assert model.layer_policies == p.policies
      loss, g = grads(model)
    finally:
      model.set_remat(None)
    assert loss == loss0
    assert_equal_grads(g, grads0, what=f"set_remat({p.choices})")


@pytest.mark.parametrize("recipe", CHOICES)
def test_the_planner_is_never_worse_than_one_choice_for_every_layer(model, prof, recipe):
  uniform_bytes, uniform_flops = prof.total([recipe] * CFG.num_layers)
  p = plan(loss_fn, model, BATCH, uniform_bytes, profiled=prof, measure=False)
  assert p.predicted_bytes <= uniform_bytes
  assert p.predicted_flops <= uniform_flops


def test_a_budget_below_the_minimum_states_the_minimum(model, prof):
  # The fewest bytes: outside the layers, plus each layer's cheapest choice (none offloads).
  least = prof.base_bytes + sum(min(c.residual_bytes for c in layer.values())
                                for layer in prof.layers)
  with pytest.raises(BudgetError) as info:
    plan(loss_fn, model, BATCH, least - 1, profiled=prof, measure=False)
  stated = [int(x) for x in re.findall(r"\d+", str(info.value))]
  assert least in stated and least - 1 in stated, str(info.value)
  assert isinstance(info.value, ValueError)
  # The minimum itself fits, with the cheapest choices.
  p = plan(loss_fn, model, BATCH, least, profiled=prof, measure=False)
  assert p.predicted_bytes == p.min_bytes == least


def test_plan_and_profile_print_their_choices(prof, plans, capsys):
  print(prof)
  text = capsys.readouterr().out
  for choice in CHOICES:
    assert re.search(rf"^\s+{choice}\s", text, re.MULTILINE), choice
  p = plans["50%"]
  print(p)
  text = capsys.readouterr().out
  for choice in set(p.choices):
    assert choice in text
  assert "budget" in text and "measured" in text


# The knapsack --------------------------------------------------------------------------------


def _brute_force(layers, capacity, cost):
  best = None
  for pick in itertools.product(*[sorted(layer) for layer in layers]):
    nbytes = sum(layer[c].residual_bytes for layer, c in zip(layers, pick))
    total = sum(cost(layer[c]) for layer, c in zip(layers, pick))
    if nbytes <= capacity and (best is None or (total, nbytes) < best[0]):
      best = ((total, nbytes), pick)
  return best


def _flops(c: ChoiceCost) -> float:
  return c.flops


def test_the_knapsack_is_exact_on_random_instances():
  rng = random.Random(0)
  infeasible = 0
  for _ in range(300):
    layers = [{f"c{j}": ChoiceCost(f"c{j}", rng.randint(0, 40), 0, rng.randint(0, 40))
               for j in range(4)} for _ in range(3)]
    capacity = rng.randint(0, 100)
    want = _brute_force(layers, capacity, _flops)
    got = _knapsack(layers, capacity, _flops)
    if want is None:
      assert got is None
      infeasible += 1
      continue
    assert got is not None
    total = sum(_flops(layer[c]) for layer, c in zip(layers, got))
    nbytes = sum(layer[c].residual_bytes for layer, c in zip(layers, got))
    assert nbytes <= capacity
    assert (total, nbytes) == want[0], (layers, capacity, got, want)
  assert 0 < infeasible < 300


def test_plan_from_a_profile_is_what_the_knapsack_chooses(model, prof):
  for fraction in (0.3, 0.6, 0.9):
    p = plan(loss_fn, model, BATCH, fraction, profiled=prof, measure=False)
    want = _brute_force(list(prof.layers), p.budget_bytes - prof.base_bytes, _flops)
    assert p.predicted_flops == prof.base_flops + want[0][0]
    assert isinstance(p, Plan) and p.measured_bytes is None


# FLOPs ---------------------------------------------------------------------------------------

M, K, N = 6, 10, 14


def _rand(*shape):
  return jnp.asarray(np.random.default_rng(sum(shape)).standard_normal(shape), jnp.float32)


def test_a_matmul_counts_2mnk():
  assert flops(lambda a, b: a @ b, _rand(M, K), _rand(K, N)) == 2 * M * N * K
  # A batched one: every batch.
  assert flops(lambda a, b: a @ b, _rand(3, M, K), _rand(3, K, N)) == 3 * 2 * M * N * K


@pytest.mark.parametrize("trips", [0, 1, 3, 7])
def test_a_loop_with_a_traced_bound_counts_each_iteration(trips):
  def loop(x, w, n):
    return jax.lax.fori_loop(0, n, lambda i, c: c @ w, x)

  # Each iteration: the matmul, the counter's increment and the loop test (one FLOP each).
  per_iteration = 2 * M * K * K + 2
  assert flops(loop, _rand(M, K), _rand(K, K), jnp.int32(trips)) == trips * per_iteration


def test_a_scan_counts_length_times_its_body():
  length = 5

  def run(x, w, xs):
    return jax.lax.scan(lambda c, xt: (c @ w + xt, None), x, xs)[0]

  assert flops(run, _rand(M, K), _rand(K, K), _rand(length, M, K)) == length * (
      2 * M * K * K + M * K)


@pytest.mark.parametrize("taken", [True, False])
def test_a_cond_counts_the_branch_taken(taken):
  def branch(p, x, w):
    return jax.lax.cond(p, lambda x: x @ w, lambda x: jnp.sin(x), x)

  want = 2 * M * K * K if taken else M * K
  assert flops(branch, jnp.bool_(taken), _rand(M, K), _rand(K, K)) == want


def test_recomputation_adds_the_recomputed_forward():
  """Under "nothing" the backward recomputes ``tanh(x @ w1)`` (which the gradients of ``w2`` and
  of the tanh need), not the second matmul (a sum's gradient needs no value of it)."""
  hidden = 12

  def f(x, w1, w2):
    return jnp.sum(jnp.tanh(x @ w1) @ w2)

  def step_flops(fn):
    return flops(lambda *a: jax.value_and_grad(fn, argnums=(0, 1, 2))(*a),
                 _rand(M, K), _rand(K, hidden), _rand(hidden, N))

  checkpointed = jax.checkpoint(f, policy=jax.checkpoint_policies.nothing_saveable)
  assert step_flops(checkpointed) - step_flops(f) == 2 * M * K * hidden + M * hidden
