"""The ``posttrain`` benchmark suite's records at a tiny shape: one row per implementation of the
DPO and distillation steps, every loss equal to torch-eager's, figures and their sources, the
residual bytes each row keeps, ratios, the row skipped without jaxfuse's distillation op, the
plot and the registration.

Nothing is timed: the context's ``time`` runs each candidate as the harness would and returns
fixed times, so that ratios are checked exactly. Liger's chunks run eagerly and torch-compile
is left out (``compiled=False``): compiling would take most of the test's time.
"""

import numpy as np
import pytest

from benchmarks import cli, harness
from benchmarks import records as rec
from benchmarks.suites import posttrain as pt
from jaxfuse.ops import base
from tests.train_steps import fixed_times

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
pytest.importorskip("liger_kernel")

SHAPE = pt.Shape(pairs=2, seq=16, d_model=16, vocab=128, teacher_d_model=24)
LOG_PROBS_ROW = harness.jaxfuse_row(base.REGISTRY["linear_log_probs"].resolve(None))
TORCH = ["torch-eager", "trl-chunked", "liger-kernel"]
TIMES = {LOG_PROBS_ROW: 2.0, "jaxfuse-xla": 2.0, "jax-unfused": 4.0, "torch-eager": 5.0,
         "trl-chunked": 3.0, "liger-kernel": 2.5}
# float32 steps at O(1) values: the errors are rounding.
OUT_TOL, GRAD_TOL = 1e-5, 1e-6
FixedTimes = fixed_times(TIMES)


def _distill_row():
  op, _ = pt.distillation_op()
  if op is None:
    return "jaxfuse-xla"
  return harness.jaxfuse_row(base.REGISTRY["linear_distillation_loss"].resolve(None))


@pytest.fixture(scope="module")
def records():
  ctx = FixedTimes(suite="posttrain", runs=1)
  return {problem: pt.case_records(ctx, SHAPE, problem, compiled=False)
          for problem in pt.PROBLEMS}


def _by_impl(records):
  return {r.impl: r for r in records}


def test_one_record_per_row(records):
  assert [r.impl for r in records["dpo"]] == [LOG_PROBS_ROW, "jax-unfused", *TORCH]
  assert [r.impl for r in records["distill"]] == [_distill_row(), "jax-unfused", *TORCH]
  assert {r.case for r in records["dpo"]} == {"dpo pairs=2 T=16 N=64 D=16 V=128"}
  assert {r.case for r in records["distill"]} == {
      "distill seqs=4 T=16 N=64 Ds=16 Dt=24 V=128"}
  assert [r.impl for r in records["grpo"]] == ["jaxfuse-xla", "jax-unfused", *TORCH]
  assert {r.case for r in records["grpo"]} == {"grpo completions=4 T=16 N=64 D=16 V=128"}
  for r in [*records["dpo"], *records["distill"], *records["grpo"]]:
    assert (r.suite, r.dtype) == ("posttrain", "float32")
    assert r.reference == (None if r.impl == pt.REFERENCE else pt.REFERENCE)


@pytest.mark.parametrize("problem", pt.PROBLEMS)
def test_every_loss_and_gradient_matches_torch_eager(records, problem):
  for r in records[problem]:
    if r.impl == pt.REFERENCE or r.time_ms is None:
      continue
    assert r.max_abs_err <= OUT_TOL, (r.impl, r.max_abs_err)
    assert r.max_grad_err <= GRAD_TOL, (r.impl, r.max_grad_err)
    assert "relative" in r.note and "not timed" not in r.note
    assert r.sources["max_abs_err"] == pt.ERROR_SOURCE
  liger = _by_impl(records[problem])["liger-kernel"]
  assert f"'s at {pt.SMALL.case(problem)}" in liger.note


@pytest.mark.parametrize("problem", pt.PROBLEMS)
def test_figures_and_their_sources(records, problem):
  for r in records[problem]:
    if r.time_ms is None:   # jaxfuse's distillation op is not importable
      assert r.note.startswith("not run:") and r.residual_bytes is None
      continue
    for field in ("time_ms", "ratio", "residual_bytes"):
      assert getattr(r, field) is not None and field in r.sources, (r.impl, field)
    is_jax = r.impl.startswith("jax")
    assert (r.xla_bytes_accessed is not None) == is_jax
    assert (r.temp_bytes is not None) == is_jax
  rows = _by_impl(records[problem])
  assert rows["jax-unfused"].sources["residual_bytes"] == rec.JAX_RESIDUAL_SOURCE
  assert rows["torch-eager"].sources["residual_bytes"] == rec.TORCH_RESIDUAL_SOURCE
  assert rows["liger-kernel"].sources["residual_bytes"] == pt.GRAPH_RESIDUAL_SOURCE


@pytest.mark.parametrize("problem", pt.PROBLEMS)
def test_residual_bytes(records, problem):
  rows = _by_impl(records[problem])
  n, d, v = SHAPE.tokens, SHAPE.d_model, SHAPE.vocab
  # The full-logits rows keep [N, V] floats (at least), the fused ones a few floats a token.
  assert rows["jax-unfused"].residual_bytes >= n * v * 4
  assert rows["torch-eager"].residual_bytes >= n * v * 4
  fused = {"dpo": LOG_PROBS_ROW, "grpo": "jaxfuse-xla"}.get(problem) or _distill_row()
  for name in (fused, "trl-chunked"):
    if rows[name].residual_bytes is not None:
      # jaxfuse's distillation and GRPO compute the gradients in the forward: they keep dh
      # and dW.
      extra = (n * d + v * d) * 4 if problem != "dpo" and name == fused else 0
      # GRPO's torch formula keeps a few floats a token (the ratios, the KL's exponential).
      per_token = 32 if problem == "grpo" and name == "trl-chunked" else 16
      assert extra <= rows[name].residual_bytes <= extra + per_token * n, name
  # Liger computes the gradients in the forward and keeps them: dh and dW.
  assert rows["liger-kernel"].residual_bytes == (n * d + v * d) * 4
  assert "residual / torch-eager = " in rows["liger-kernel"].note


def test_the_graph_walk_sees_what_the_hooks_see():
  for problem in pt.PROBLEMS:
    x = pt.inputs(SHAPE, problem)
    rows, _ = pt.torch_rows(SHAPE, problem, compiled=False)
    for name in ("torch-eager", "trl-chunked"):
      t_args = pt.torch_args(x, problem, name)
      walked = pt.graph_residual_bytes(rows[name], t_args)
      hooked = harness.torch_residual_bytes(rows[name], t_args, n_diff=2)
      # The walk also counts the Python scalars autograd wraps as 0-dim tensors (8 bytes each).
      assert 0 <= walked - hooked <= 16, (problem, name, walked, hooked)


@pytest.mark.parametrize("problem", pt.PROBLEMS)
def test_ratios_to_the_fastest_other_row(records, problem):
  rows = _by_impl(records[problem])
  assert {r.ratio_to for r in records[problem] if r.ratio is not None} == {"liger-kernel"}
  for name, r in rows.items():
    if r.time_ms is not None:
      assert r.ratio == pytest.approx(TIMES[name] / TIMES["liger-kernel"]), name


def test_the_plain_losses_are_the_references():
  x = pt.inputs(SHAPE, "dpo")
  # DPO in float64 numpy: log-softmax, gather, masked sums, -log sigmoid(beta * delta).
  logits = x["h"].astype(np.float64) @ x["w"].T.astype(np.float64)
  logp = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) \
      - logits.max(1, keepdims=True)
  tokens = np.maximum(x["tokens"], 0)
  per_token = np.take_along_axis(logp, tokens[:, None], 1)[:, 0].reshape(x["mask"].shape)
  seq = (per_token * x["mask"]).sum(1) - x["ref"]
  delta = seq[:SHAPE.pairs] - seq[SHAPE.pairs:]
  want = np.mean(np.log1p(np.exp(-pt.DPO_BETA * delta)))
  rows, _ = pt.jax_rows(SHAPE, "dpo")
  for loss in rows.values():
    np.testing.assert_allclose(float(loss(*pt.jax_args(x, "dpo"))), want, rtol=1e-5)

  x = pt.inputs(SHAPE, "distill")
  args = pt.jax_args(x, "distill")
  got = float(pt.plain_jsd(*args))
  try:
    from jaxfuse.ops import linear_distillation_loss_reference
  except ImportError:
    pytest.skip("jaxfuse.ops.linear_distillation_loss_reference is not importable")
  want = linear_distillation_loss_reference(*args[:4], labels=args[4], beta=pt.JSD_BETA,
                                            temperature=pt.TEMPERATURE, reduction="batchmean")
  np.testing.assert_allclose(got, float(want), rtol=1e-5)


def test_the_distillation_row_is_skipped_without_the_op(monkeypatch):
  monkeypatch.setattr(pt, "distillation_op", lambda: (None, "not run: no op here"))
  records = pt.case_records(FixedTimes(suite="posttrain", runs=1), SHAPE, "distill",
                            compiled=False)
  first = records[0]
  assert (first.impl, first.note, first.time_ms, first.ratio) == (
      "jaxfuse-xla", "not run: no op here", None, None)
  assert [r.impl for r in records[1:]] == ["jax-unfused", *TORCH]
  assert all(r.time_ms is not None for r in records[1:])


def test_torch_compile_is_a_row_when_compiling():
  rows, notes = pt.torch_rows(SHAPE, "dpo")
  assert list(rows) == list(pt.TORCH_ROWS)
  assert "eagerly" not in notes["liger-kernel"]


def test_plot_is_written_from_saved_records(records, tmp_path):
  path = tmp_path / "records.json"
  rec.write_json([*records["dpo"], *records["distill"]], path)
  png = tmp_path / "posttrain.png"
  pt.plot(rec.read_json(path), str(png))
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_suite_is_registered_with_its_columns(records):
  both = [*records["dpo"], *records["distill"]]
  assert cli.SUITES["posttrain"] == "benchmarks.suites.posttrain"
  assert "posttrain" in cli._available()
  assert "note" in rec.table_columns(both, rec.COLUMNS)
  assert "temp" in rec.table_columns(both, rec.COLUMNS)
  assert pt.headline(both) == both
  block = rec.table_block(both, "Generated by `python -m benchmarks posttrain`")
  assert block.count("\n| dpo ") == len(records["dpo"])
  assert ", float32." in block
