"""The train-cli suite turns the CLI's own run logs into records (the runs themselves are
stubbed: `tests/test_train.py` and `tests/test_train_runs.py` run the CLI)."""

import dataclasses
import json
from pathlib import Path

import pytest

import jaxfuse.train
from benchmarks import records as rec
from benchmarks.harness import Context
from benchmarks.suites import train_cli


def test_records_carry_the_run_logs(monkeypatch):
  seen = []

  def fake_train(cfg, *, log=print):
    seen.append(cfg)
    tokens = cfg.global_batch * cfg.seq
    # Three spans between read-backs: 10, 20 and 40 ms a step (4 for per-step logging).
    ms = [10.0, 20.0, 40.0] if cfg.log_every == 10 else [40.0] * 3
    with open(Path(cfg.out) / "metrics.jsonl", "w") as f:
      for i, t in enumerate(ms):
        f.write(json.dumps({"step": i, "train/loss": 1.0}) + "\n")
        f.write(json.dumps({"step": i, "perf/tokens_per_second": tokens / t * 1e3}) + "\n")
    return {"final_val_loss_bits_per_byte": 2.5 if not cfg.baseline else 2.6,
            "unigram_entropy_bits_per_byte": 4.5, "seconds": 280.0,
            "tokens_per_second": 12000.0, "final_loss_bits_per_byte": 2.4}

  monkeypatch.setattr(jaxfuse.train, "train", fake_train)
  monkeypatch.setattr(train_cli, "step_temp_bytes", lambda cfg: 1000 * cfg.batch)
  monkeypatch.setattr(train_cli, "accumulation_records", lambda ctx: [])   # real steps: timed
  records = train_cli.run(Context(suite="train-cli"))
  defaults = jaxfuse.train.TrainConfig()
  assert [(c.log_every, c.batch, c.grad_accum, c.baseline) for c in seen] == [
      (10, 16, 1, False), (1, 16, 1, False), (10, 4, 4, False), (10, 16, 1, True)]
  assert all(c.steps == defaults.steps and c.out != defaults.out for c in seen)
  assert dataclasses.replace(seen[0], out=defaults.out, sample_tokens=defaults.sample_tokens,
                             save_every=defaults.save_every,
                             tensorboard=defaults.tensorboard) == defaults
  assert [r.impl for r in records] == ["jaxfuse"] * 3 + ["jax-unfused"]
  assert records[0].time_ms == {"median": pytest.approx(20.0), "min": pytest.approx(10.0),
                                "max": pytest.approx(40.0), "runs": 3}
  assert records[1].time_ms["median"] == pytest.approx(40.0)
  assert "step 2.00x the defaults'" in records[1].note
  assert [r.temp_bytes for r in records] == [16000, 16000, 4000, 16000]
  assert [r.final_loss for r in records] == [2.5, 2.5, 2.5, 2.6]
  assert "unigram entropy 4.500 bits/byte" in records[0].note and "280 s" in records[0].note
  assert {"final_loss", "time_ms", "temp_bytes"} <= set(records[0].sources)
  table = rec.markdown_table(records, rec.table_columns(records, rec.HEADLINE_COLUMNS))
  assert "| final loss |" in table and "| 2.500 |" in table and "| 15.6 KiB |" in table

  seen.clear()
  quick = train_cli.run(Context(suite="train-cli", quick=True))
  assert [c.steps for c in seen] == [train_cli.QUICK_STEPS] * 3 and len(quick) == 3
