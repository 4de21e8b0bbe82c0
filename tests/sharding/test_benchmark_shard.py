"""The shard suite on a tiny decoder: every strategy's row has its figures and sources, equals
the single-device loss, splits what it promises per device, and the plot is drawn."""

import pytest

from benchmarks import harness
from benchmarks.suites import shard as suite


@pytest.fixture(scope="module")
def records():
  ctx = harness.Context(suite="shard", quick=True, runs=1)
  original = suite.QUICK
  # Enough tokens and width that what the fused head keeps whole on every device (dW under data
  # and context parallelism, dh under tensor parallelism) is a small part of the residuals, as
  # at real sizes (see the suite's docstring).
  suite.QUICK = suite.Shape(vocab=128, d_model=64, layers=2, heads=8, kv_heads=8, mlp=192,
                            batch=8, seq=64)
  try:
    return suite.run(ctx)
  finally:
    suite.QUICK = original


def _row(records, strategy):
  return next(r for r in records if f" strategy={strategy} " in r.case)


def test_every_strategy_has_its_figures_and_sources(records):
  assert [r.case.split("strategy=")[1].split()[0] for r in records] == [
      "single", "dp", "fsdp", "tp", "single", "cp"]
  for r in records:
    assert r.impl == "jaxfuse-xla"
    assert r.residual_bytes > 0 and r.param_bytes > 0 and r.time_ms["median"] > 0
    assert {"residual_bytes", "param_bytes", "collective_bytes", "time_ms"} <= set(r.sources)
    if "strategy=single" in r.case:
      assert r.collective_bytes == 0 and r.max_abs_err is None
    else:
      assert r.collective_bytes > 0 and r.reference == "strategy=single"


def test_strategies_equal_one_device_and_split_what_they_promise(records):
  singles = {r.case.split(" strategy=")[0]: r for r in records if "strategy=single" in r.case}
  for r in records:
    single = singles[r.case.split(" strategy=")[0]]
    if r is single:
      continue
    loss = float(single.note.split("loss ")[1])
    assert r.max_abs_err <= 1e-5 * abs(loss), (r.case, r.max_abs_err)
    strategy = r.case.split("strategy=")[1].split()[0]
    if strategy in ("dp", "tp", "cp"):
      assert r.residual_bytes <= 1.25 / 8 * single.residual_bytes, r.case
    if strategy in ("fsdp", "tp"):
      assert r.param_bytes <= 1.25 / 8 * single.param_bytes, r.case
    else:
      assert r.param_bytes == single.param_bytes, r.case


def test_the_plot_is_drawn(records, tmp_path):
  path = tmp_path / "shard.png"
  suite.plot(records, str(path))
  assert path.stat().st_size > 0
