"""The ``moe`` benchmark suite's records at a tiny block: one row per implementation, every
figure set with its source, errors against the float64 Hugging Face experts, the goal's note,
the layouts between JAX and torch, and the plot.

Nothing is timed: the context's ``time`` runs each candidate as the harness would and returns
fixed times, so that ratios are checked exactly.
"""

import numpy as np
import pytest

from benchmarks import cli
from benchmarks import records as rec
from benchmarks.suites import moe
from jaxfuse.ops import base, dispatch
from tests.train_steps import fixed_times

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

SHAPE = moe.Shape(experts=4, top_k=2, d_model=32, width=48, tokens=64)
# jaxfuse's rows: each implementation of grouped_matmul that compiles here (XLA on CPU).
PLAIN = [f"jaxfuse-{impl}" for impl in base.REGISTRY["grouped_matmul"].implementations
         if dispatch.runs_natively(impl)]
# ... then each keeping the gate products.
KEEPING = [f"{name}[keep gate]" for name in PLAIN]
JAXFUSE = PLAIN + KEEPING
TIMES = {**dict.fromkeys(PLAIN, 2.0), **dict.fromkeys(KEEPING, 1.8), "jax-ragged_dot": 3.0,
         "jax-dense": 4.0, "torch-eager": 5.0, "torch-eager[grouped_mm]": 2.5}
FIGURES = ("time_ms", "ratio", "residual_bytes", "flops", "max_abs_err", "max_grad_err", "note")
# float32 against float64 at O(1) values: the errors are rounding.
OUT_TOL, GRAD_TOL = 1e-5, 1e-4
FixedTimes = fixed_times(TIMES)


@pytest.fixture(scope="module")
def records():
  return moe.case_records(FixedTimes(suite="moe", runs=1), SHAPE)


def _by_impl(records):
  return {r.impl: r for r in records}


def test_one_record_per_row(records):
  assert [r.impl for r in records] == list(TIMES)
  assert {r.case for r in records} == {"moe E4 top2 d32 f48 T64"}
  assert {(r.suite, r.dtype, r.reference) for r in records} == {("moe", "float32",
                                                                 moe.REFERENCE)}


def test_every_figure_is_set_with_its_source(records):
  for r in records:
    for field in FIGURES:
      assert getattr(r, field) is not None, (r.impl, field)
      assert field in r.sources, (r.impl, field)
    assert r.residual_bytes > 0 and r.flops > 0
  rows = _by_impl(records)
  for name in moe.TORCH_ROWS:
    assert rows[name].sources["flops"].startswith("analytic")
    assert rows[name].flops == SHAPE.analytic_flops()
    assert "autograd saved tensors" in rows[name].sources["residual_bytes"]
  for name in (*JAXFUSE, moe.RAGGED, moe.DENSE):
    assert "jaxfuse.metrics.flops" in rows[name].sources["flops"]
    assert "XLA: " in rows[name].note
    assert "jax.vjp residuals" in rows[name].sources["residual_bytes"]


def test_errors_against_the_float64_reference_are_rounding(records):
  for r in records:
    assert r.max_abs_err <= OUT_TOL, (r.impl, r.max_abs_err)
    assert r.max_grad_err <= GRAD_TOL, (r.impl, r.max_grad_err)


def test_ratios_to_the_fastest_row_and_the_goal(records):
  rows = _by_impl(records)
  assert len({r.ratio_to for r in records}) == 1 and records[0].ratio_to in KEEPING
  assert rows["torch-eager"].ratio == pytest.approx(5.0 / 1.8)
  for plain, keeping in zip(PLAIN, KEEPING):
    assert rows[plain].ratio == pytest.approx(2.0 / 1.8)
    assert rows[plain].note.endswith("goal not met")
    assert rows[keeping].ratio == pytest.approx(1.0)
    assert rows[keeping].note.endswith("goal met")
    # jaxfuse keeps the routing and the routed rows (and the gate products where asked),
    # torch the experts' activations.
    assert rows[plain].residual_bytes <= rows["torch-eager"].residual_bytes / 2
    assert rows[keeping].residual_bytes <= rows["torch-eager"].residual_bytes / 2
    gate_products = SHAPE.tokens * SHAPE.top_k * SHAPE.width * 4
    assert rows[keeping].residual_bytes - rows[plain].residual_bytes == gate_products
  assert "goal" not in rows[moe.RAGGED].note


def test_torch_layout_round_trips():
  args, _ = moe.inputs(SHAPE)
  t_args = moe.torch_args(args, device="cpu")
  assert [tuple(t.shape) for t in t_args] == [(1, 64, 32), (4, 32), (4, 96, 32), (4, 32, 48)]
  _, grads = moe.to_jax_layout((t_args[0], t_args))
  for got, want in zip(grads, args):
    np.testing.assert_array_equal(got, np.asarray(want))


def test_plot_is_written_from_saved_records(records, tmp_path):
  path = tmp_path / "records.json"
  rec.write_json(records, path)
  png = tmp_path / "moe.png"
  moe.plot(rec.read_json(path), str(png))
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_suite_is_registered_with_its_columns(records):
  assert cli.SUITES["moe"] == "benchmarks.suites.moe"
  assert "moe" in cli._available()
  assert "GFLOP" in rec.table_columns(records, rec.COLUMNS)
  assert moe.headline(records) == records
