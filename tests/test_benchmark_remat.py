"""The remat suite on a tiny MLP stack: every row measures its own figures, the planner's rows
fit their budgets, recomputation leaves the gradients as they were, and the plot is drawn."""

import functools

import pytest

from benchmarks import harness
from benchmarks.suites import remat as suite


@pytest.fixture(scope="module")
def records():
  ctx = harness.Context(suite="remat", quick=True, runs=1)
  layers = 4
  make = functools.partial(suite._mlp, features=16)
  original = suite._mlp
  suite._mlp = make
  try:
    batch = make(ctx, layers)[1]
    return suite._jax_rows(ctx, "mlp", layers) + suite._torch_rows(ctx, "mlp", layers, batch)
  finally:
    suite._mlp = original


def _row(records, schedule, impl=suite.IMPL):
  return next(r for r in records if r.case == f"mlp L=4 schedule={schedule}" and r.impl == impl)


def test_every_schedule_has_its_figures_and_sources(records):
  jax_rows = [r for r in records if r.impl == suite.IMPL]
  assert {r.case.split("schedule=")[1] for r in jax_rows} == {
      "none", "full", "sqrt", "plan25", "plan50", "plan75"}
  for r in jax_rows:
    assert r.residual_bytes > 0 and r.flops > 0 and r.time_ms["median"] > 0
    assert {"residual_bytes", "flops", "time_ms", "max_grad_err"} <= set(r.sources)


def test_recomputation_keeps_less_costs_flops_and_leaves_the_gradients(records):
  none, full, sqrt = (_row(records, s) for s in ("none", "full", "sqrt"))
  assert sqrt.residual_bytes < full.residual_bytes < none.residual_bytes
  assert none.flops < full.flops < sqrt.flops
  for r in records:
    if r.impl == suite.IMPL:
      assert r.max_grad_err <= 1e-6, (r.case, r.max_grad_err)
  assert _row(records, "none").max_grad_err == 0


def test_plans_fit_their_budgets(records):
  budgets = []
  for pct in suite.PLAN_BUDGETS:
    r = _row(records, f"plan{pct}")
    assert r.residual_bytes <= r.budget_bytes
    budgets.append(r.budget_bytes)
  assert budgets == sorted(budgets) and len(set(budgets)) == 3


def test_torch_checkpointing_keeps_less(records):
  none, full, sqrt = (_row(records, s, suite.TORCH) for s in ("none", "full", "sqrt"))
  assert full.residual_bytes < none.residual_bytes and sqrt.residual_bytes < none.residual_bytes


def test_the_plot_and_the_headline(records, tmp_path):
  frontier = _row(records, "none").series
  assert len(frontier["frontier_bytes"]) == len(frontier["frontier_flops"]) > 1
  path = tmp_path / "remat.png"
  suite.plot(records, str(path))
  assert path.stat().st_size > 10_000
  assert suite.headline(records) == []   # no decoder rows here
