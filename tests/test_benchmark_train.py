"""The ``train`` benchmark suite's records at a tiny decoder: rows, figures and their sources,
step-0 losses against the float64 Hugging Face twin, the loss curves and the plot.

Nothing is timed: the context's ``time`` runs each candidate as the harness would and returns
fixed times, so that ratios and notes are checked exactly.
"""

import dataclasses

import pytest

from benchmarks import cli
from benchmarks import records as rec
from benchmarks.suites import train
from tests.train_steps import FAST_COMPILE, FIGURES, fixed_times

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

SHAPE = train.Shape(vocab=300, d_model=32, layers=2, heads=4, kv_heads=2, mlp=64, batch=2,
                    seq=16)
CURVE_STEPS = 4
TIMES = {"jaxfuse": 1.5, "jaxfuse-xla": 2.0, "jax-unfused": 4.0, "torch-eager": 5.0}
STEP0_RTOL = 1e-5
FixedTimes = fixed_times(TIMES)


def _failing_compile(fn, *args, **kwargs):
  def compiled(*a, **k):
    raise RuntimeError("no C++ compiler here\nsecond line")

  return compiled


@pytest.fixture(scope="module")
def records():
  ctx = FixedTimes(suite="train", runs=1)
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(torch, "compile", _failing_compile)
    return train.case_records(ctx, SHAPE, curve_steps=CURVE_STEPS,
                              compiler_options=FAST_COMPILE)


def _by_impl(records):
  return {r.impl: r for r in records}


def test_one_record_per_impl_in_the_case(records):
  assert [r.impl for r in records] == list(train.IMPLS)
  assert {r.case for r in records} == {"decoder d32 L2 V300 b2 seq=16"}
  assert {(r.suite, r.dtype) for r in records} == {("train", "float32")}


def test_figures_and_their_sources(records):
  rows = _by_impl(records)
  for r in records:
    for field in FIGURES:
      if getattr(r, field) is not None:
        assert field in r.sources, (r.impl, field)
    assert set(r.sources) <= set(FIGURES), r.sources
  for name in ("jaxfuse", "jaxfuse-xla", "jax-unfused"):
    r = rows[name]
    assert r.temp_bytes > 0 and "temp bytes" in r.sources["temp_bytes"]
    assert "jax.vjp residuals" in r.sources["residual_bytes"]
  eager = rows["torch-eager"]
  assert eager.temp_bytes is None and eager.residual_bytes > 0
  assert "autograd saved tensors" in eager.sources["residual_bytes"]
  # The fused decoder keeps neither attention scores nor logits for its backward.
  assert rows["jaxfuse-xla"].residual_bytes < rows["jax-unfused"].residual_bytes
  # The default implementations keep what the XLA ones keep.
  assert rows["jaxfuse"].residual_bytes == rows["jaxfuse-xla"].residual_bytes


def test_ratios_to_the_baseline_and_torch_in_the_note(records):
  rows = _by_impl(records)
  assert {r.ratio_to for r in records if r.time_ms} == {"jax-unfused"}
  assert rows["jaxfuse-xla"].ratio == pytest.approx(0.5)
  assert rows["jaxfuse"].ratio == pytest.approx(0.375)
  assert rows["torch-eager"].ratio == pytest.approx(1.25)
  assert "time / torch-eager = 0.40" in rows["jaxfuse-xla"].note
  assert "16000 tokens/s (32 tokens/step)" in rows["jaxfuse-xla"].note
  assert "time / torch-eager" not in rows["torch-eager"].note


def test_a_compiler_that_fails_leaves_a_note_and_no_figures(records):
  r = _by_impl(records)["torch-compile"]
  assert r.note == "did not run: RuntimeError: no C++ compiler here"
  assert (r.time_ms, r.ratio, r.residual_bytes, r.max_abs_err) == (None, None, None, None)
  assert set(r.sources) == {"note"}


def test_step0_losses_match_the_float64_hf_twin(records):
  for r in records:
    if r.impl == "torch-compile":
      continue
    assert r.reference == train.REFERENCE
    step0 = train.losses_of(r)[0]
    assert f"step-0 loss {step0:.6f}" in r.note
    assert r.max_abs_err <= STEP0_RTOL * step0, (r.impl, r.max_abs_err)


def test_loss_curves_cover_the_same_steps_and_agree(records):
  rows = _by_impl(records)
  curves = {name: train.losses_of(rows[name]) for name in train.CURVE_IMPLS}
  # Step 0, one warm-up call and one timed round come from timing; the rest from the curve.
  assert {len(c) for c in curves.values()} == {CURVE_STEPS}
  reference = curves["torch-eager"]
  for name, curve in curves.items():
    assert curve == pytest.approx(reference, rel=1e-5), name


def test_losses_round_trip_through_the_note():
  r = rec.Record("train", "c", "jaxfuse-xla", "cpu", "float32")
  r.add_note("1 tokens/s")
  r.add_note(train.format_losses([10.5, 10.25, 9.875]))
  assert train.losses_of(r) == [10.5, 10.25, 9.875]
  assert train.losses_of(rec.Record("train", "c", "x", "cpu", "float32")) is None


def test_plot_is_written_from_saved_records(records, tmp_path):
  path = tmp_path / "records.json"
  rec.write_json(records, path)
  png = tmp_path / "train.png"
  train.plot(rec.read_json(path), str(png))
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_headline_is_the_quick_case():
  rows = [rec.Record("train", shape.name, impl, "cpu", "float32")
          for shape in (train.QUICK, train.LONG) for impl in train.IMPLS]
  assert [r.impl for r in train.headline(rows)] == list(train.IMPLS)
  assert {r.case for r in train.headline(rows)} == {"decoder d512 L4 V32000 b4 seq=1024"}
  assert train.LONG.tokens == train.QUICK.tokens
  assert dataclasses.replace(train.QUICK, batch=2, seq=2048) == train.LONG


def test_the_suite_is_registered():
  assert cli.SUITES["train"] == "benchmarks.suites.train"
  assert "train" in cli._available()


@pytest.mark.parametrize("family", ["gemma2", "qwen3", "mixtral"])
def test_family_rows_match_their_float64_hf_twin(family):
  """The families' cases: the same step-0 loss as the family's transformers model (Gemma 2's
  with eager attention for its soft-cap; Mixtral's experts in a Mixture of Experts) in
  float64, and the same loss curve."""
  shape = dataclasses.replace(SHAPE, family=family)
  assert shape.name.startswith(f"{family}-like ")
  assert shape.config().moe == (family == "mixtral")
  rows = _by_impl(train.case_records(FixedTimes(suite="train", runs=1), shape,
                                     impls=("jaxfuse-xla", "torch-eager"), curve_steps=3,
                                     compiler_options=FAST_COMPILE))
  for r in rows.values():
    step0 = train.losses_of(r)[0]
    assert r.max_abs_err <= STEP0_RTOL * step0, (r.impl, r.max_abs_err)
  assert train.losses_of(rows["jaxfuse-xla"]) == pytest.approx(
      train.losses_of(rows["torch-eager"]), rel=1e-5)
