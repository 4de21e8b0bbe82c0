"""python -m jaxfuse.train at a tiny size: a run writes its log, plot and checkpoints; a resumed
run reproduces the uninterrupted losses exactly; a failed save never replaces the last good
checkpoint; bad input gets a clear error and loses nothing written before."""

import json

import numpy as np
import pytest

from jaxfuse import train

TINY = ["--steps", "6", "--batch", "2", "--seq", "16", "--d-model", "16", "--layers", "1",
        "--heads", "2", "--kv-heads", "1", "--mlp", "32", "--warmup", "2", "--eval-every", "3",
        "--eval-batches", "2", "--save-every", "3", "--sample-tokens", "0"]


def _run(tmp_path, name, *extra):
  cfg = train.parse_args([*TINY, "--out", str(tmp_path / name), *extra])
  return train.train(cfg, log=lambda *_: None)


def test_a_run_writes_its_log_plot_and_checkpoints(tmp_path):
  result = _run(tmp_path, "run", "--sample-tokens", "8")
  out = tmp_path / "run"
  log = json.loads((out / "train_log.json").read_text())
  assert log["history"]["step"] == [1, 2, 3, 4, 5, 6]
  assert log["history"]["val_step"] == [3, 6]
  assert all(np.isfinite(log["history"]["loss"]))
  assert (out / "loss_curve.png").stat().st_size > 0
  assert isinstance(result["sample"], str) and result["sample"].startswith("def ")
  assert 0 < result["unigram_entropy_bits_per_byte"] < 8


def test_resume_reproduces_the_uninterrupted_losses(tmp_path):
  whole = _run(tmp_path, "whole")
  _run(tmp_path, "resumed", "--stop-at", "3")
  resumed = _run(tmp_path, "resumed", "--resume")
  assert resumed["history"] == whole["history"]   # the same floats, step by step


def test_a_failed_save_leaves_the_last_good_checkpoint(tmp_path, monkeypatch):
  _run(tmp_path, "run", "--stop-at", "3")
  real_save = train.save_checkpoint

  def failing_save(manager, step, state, meta):
    # The state item is written, then the metadata cannot be: the save fails half-way.
    real_save(manager, step, state, {**meta, "unserializable": {1, 2}})

  monkeypatch.setattr(train.checkpoint, "save_checkpoint", failing_save)
  with pytest.raises(TypeError):
    _run(tmp_path, "run", "--resume")
  monkeypatch.undo()
  manager = train._manager(tmp_path / "run" / "checkpoints")
  assert manager.latest_step() == 3
  resumed = _run(tmp_path, "run", "--resume")      # continues from the good checkpoint
  assert resumed["history"]["step"] == [1, 2, 3, 4, 5, 6]


def test_a_corrupt_checkpoint_is_reported_and_kept(tmp_path, capsys):
  _run(tmp_path, "run", "--stop-at", "3")
  checkpoint = tmp_path / "run" / "checkpoints" / "3"
  files = [p for p in checkpoint.rglob("*") if p.is_file() and p.stat().st_size > 0]
  for path in files:
    path.write_bytes(b"\x00garbage")
  args = [*TINY, "--out", str(tmp_path / "run"), "--resume"]
  assert train.main(args) == 2
  assert "cannot be read" in capsys.readouterr().err
  assert all(p.exists() for p in files)             # nothing deleted


def test_bad_input_gets_a_clear_error_and_writes_nothing(tmp_path, capsys):
  assert train.main([*TINY, "--heads", "3", "--out", str(tmp_path / "bad")]) == 2
  assert "d_model (16) must be divisible by num_heads (3)" in capsys.readouterr().err
  assert train.main([*TINY, "--warmup", "6", "--out", str(tmp_path / "bad")]) == 2
  assert "--warmup must be in [0, --steps)" in capsys.readouterr().err
  _run(tmp_path, "run", "--stop-at", "3")
  before = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
  assert train.main([*TINY, "--out", str(tmp_path / "run")]) == 2   # not --resume
  assert "pass --resume" in capsys.readouterr().err
  assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == before


def test_a_remat_budget_plans_per_block_and_trains_the_same(tmp_path):
  """--remat-budget plans on the first batch within the budget; recomputation changes what is
  kept, not what is computed: the losses match the run without it."""
  three = ["--layers", "3", "--steps", "3", "--save-every", "3", "--scan-layers"]
  plain = _run(tmp_path, "plain", *three)
  planned = _run(tmp_path, "planned", *three, "--remat-budget", "50%", "--remat-choices",
                 "none,nothing,minimal", "--segments", "sqrt")
  plan = planned["remat_plan"]
  assert len(plan["choices"]) == 3 and set(plan["choices"]) <= {"none", "nothing", "minimal"}
  assert plan["measured_bytes"] <= plan["budget_bytes"] == int(0.5 * plan["no_remat_bytes"])
  np.testing.assert_allclose(planned["history"]["loss"], plain["history"]["loss"], rtol=1e-5)
  assert plain["remat_plan"] is None


def test_remat_options_are_checked(tmp_path, capsys):
  out = ["--out", str(tmp_path / "bad")]
  assert train.main([*TINY, "--remat", "--remat-budget", "50%", *out]) == 2
  assert "at most one of --remat, --remat-policy and --remat-budget" in capsys.readouterr().err
  assert train.main([*TINY, "--remat-policy", "no_such_recipe", *out]) == 2
  assert "no_such_recipe" in capsys.readouterr().err
  assert train.main([*TINY, "--segments", "half", *out]) == 2
  assert "--segments must be 'sqrt' or a positive number" in capsys.readouterr().err
  assert not (tmp_path / "bad").exists()
