"""The ``finetune`` benchmark suite's records at a tiny decoder: packed batches, rows, figures
and their sources, the step-0 losses against the float64 Hugging Face model, the same losses in
every row of a family (full fine-tuning; LoRA against peft), the plot and the registration.

Nothing is timed: the context's ``time`` runs each candidate as the harness would and returns
fixed times, so that ratios and notes are checked exactly.
"""

import numpy as np
import pytest

from benchmarks import cli
from benchmarks import records as rec
from benchmarks.suites import finetune
from benchmarks.suites.train import Shape
from tests.train_steps import FAST_COMPILE, FIGURES, fixed_times

pytest.importorskip("transformers")
pytest.importorskip("peft")
torch = pytest.importorskip("torch")

SHAPE = Shape(vocab=300, d_model=32, layers=2, heads=4, kv_heads=2, mlp=64, batch=2, seq=32)
TIMES = {"jaxfuse-xla": 2.0, "jax-unfused": 4.0, "torch-eager": 5.0}
STEP0_RTOL = 1e-5
FixedTimes = fixed_times(TIMES)


@pytest.fixture(scope="module")
def records():
  return finetune.case_records(FixedTimes(suite="finetune", runs=2), SHAPE,
                               compiler_options=FAST_COMPILE)


def _rows(records, family):
  return {r.impl: r for r in records if r.case.startswith(family)}


def test_packed_batches_restart_positions_and_mask_prompts():
  batches = finetune.packed_batches(SHAPE, n=2)
  assert len(batches) == 2
  for batch in batches:
    assert {k: v.shape for k, v in batch.items()} == {
        k: (SHAPE.batch, SHAPE.seq) for k in ("tokens", "targets", "positions", "segment_ids")}
    segments, positions, targets = batch["segment_ids"], batch["positions"], batch["targets"]
    assert segments.max() >= 2                               # several documents a row
    starts = np.diff(segments, axis=1, prepend=0) != 0
    assert np.all(positions[starts & (segments > 0)] == 0)   # positions restart per document
    assert np.any(targets == -100) and np.any(targets >= 0)  # prompts have no loss


def test_block_causal_mask_keeps_documents_apart():
  mask = finetune.block_causal_mask(np.array([[1, 1, 2, 2, 0]]))
  allowed = (mask[0, 0] == 0).int().tolist()
  assert allowed == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0],
                     [0, 0, 0, 0, 1]]


def test_rows_figures_and_sources(records):
  assert [(r.case.split(" ")[0], r.impl) for r in records] == [
      (family, impl) for family in ("full-ft", "lora-r16") for impl in finetune.IMPLS]
  assert {r.case for r in records} == {"full-ft d32 L2 V300 b2 seq=32 packed",
                                       "lora-r16 d32 L2 V300 b2 seq=32 packed"}
  for r in records:
    for field in FIGURES:
      if getattr(r, field) is not None:
        assert field in r.sources, (r.impl, field)
    assert set(r.sources) <= set(FIGURES), r.sources
    assert r.residual_bytes > 0 and r.time_ms is not None
    assert (r.temp_bytes is None) == (r.impl == "torch-eager")
  for family in ("full-ft", "lora-r16"):
    rows = _rows(records, family)
    # The fused decoder keeps neither attention scores nor logits for its backward.
    assert rows["jaxfuse-xla"].residual_bytes < rows["jax-unfused"].residual_bytes
    assert rows["jaxfuse-xla"].residual_bytes < rows["torch-eager"].residual_bytes


def test_ratios_to_torch_eager_and_the_note(records):
  assert {r.ratio_to for r in records} == {"torch-eager"}
  for family in ("full-ft", "lora-r16"):
    rows = _rows(records, family)
    assert rows["jaxfuse-xla"].ratio == pytest.approx(0.4)
    assert rows["torch-eager"].ratio == pytest.approx(1.0)
    assert "32,000 tokens/s" in rows["jaxfuse-xla"].note
    note = rows["jaxfuse-xla"].note
    residual = rows["jaxfuse-xla"].residual_bytes / rows["torch-eager"].residual_bytes
    assert f"residual / torch-eager = {residual:.2f}" in note
    assert ("goal met" if residual <= 0.5 else "goal not met") in note   # time: 0.4x
    assert "goal" not in rows["jax-unfused"].note
  full, lora = _rows(records, "full-ft"), _rows(records, "lora-r16")
  trained = [int(r.note.split(" trained")[0].split("; ")[-1].replace(",", ""))
             for r in (full["jaxfuse-xla"], full["torch-eager"], lora["jaxfuse-xla"],
                       lora["torch-eager"])]
  assert trained[0] == trained[1] > trained[2] == trained[3] > 0


def test_losses_match_the_float64_hf_model_and_each_other(records):
  for family in ("full-ft", "lora-r16"):
    rows = _rows(records, family)
    curves = {name: r.series["losses"] for name, r in rows.items()}
    # Step 0, one warm-up call and two timed rounds.
    assert {len(c) for c in curves.values()} == {4}
    for name, r in rows.items():
      assert r.reference == finetune.REFERENCE
      assert r.max_abs_err <= STEP0_RTOL * curves[name][0], (family, name, r.max_abs_err)
      assert curves[name] == pytest.approx(curves["torch-eager"], rel=1e-4), (family, name)
      assert r.final_loss == curves[name][-1]
  # Before any update both families compute the base model (LoRA's B starts at zero).
  assert (_rows(records, "full-ft")["jaxfuse-xla"].series["losses"][0]
          == pytest.approx(_rows(records, "lora-r16")["jaxfuse-xla"].series["losses"][0]))


def test_plot_headline_and_tables_from_saved_records(records, tmp_path):
  path = tmp_path / "records.json"
  rec.write_json(records, path)
  saved = rec.read_json(path)
  png = tmp_path / "finetune.png"
  finetune.plot(saved, str(png))
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert finetune.headline(saved) == saved
  readme = tmp_path / "README.md"
  readme.write_text("<!-- bench:finetune:start -->\n<!-- bench:finetune:end -->\n")
  assert rec.update_readme(readme, "finetune", saved, "Generated by `x`")
  assert "| lora-r16 d32 L2 V300 b2 seq=32 packed | jaxfuse-xla |" in readme.read_text()


def test_the_suite_is_registered():
  assert cli.SUITES["finetune"] == "benchmarks.suites.finetune"
  assert "finetune" in cli._available()
