"""The train-cli suite turns the CLI's own run log into records (the run itself is stubbed:
`tests/test_train.py` runs the CLI)."""

import dataclasses

import jaxfuse.train
from benchmarks import records as rec
from benchmarks.harness import Context
from benchmarks.suites import train_cli


def test_records_carry_the_run_log(monkeypatch):
  seen = []

  def fake_train(cfg, *, log=print):
    seen.append(cfg)
    return {"final_val_loss_bits_per_byte": 2.5 if not cfg.baseline else 2.6,
            "unigram_entropy_bits_per_byte": 4.5, "seconds": 280.0,
            "tokens_per_second": 12000.0, "final_loss_bits_per_byte": 2.4}

  monkeypatch.setattr(jaxfuse.train, "train", fake_train)
  records = train_cli.run(Context(suite="train-cli"))
  defaults = jaxfuse.train.TrainConfig()
  assert [c.baseline for c in seen] == [False, True]
  assert all(c.steps == defaults.steps and c.out != defaults.out for c in seen)
  assert dataclasses.replace(seen[0], out=defaults.out, sample_tokens=defaults.sample_tokens,
                             save_every=defaults.save_every) == defaults
  assert [r.impl for r in records] == ["jaxfuse-xla", "jax-unfused"]
  assert [r.final_loss for r in records] == [2.5, 2.6]
  assert "unigram entropy 4.500 bits/byte" in records[0].note and "280 s" in records[0].note
  assert "final_loss" in records[0].sources
  table = rec.markdown_table(records, rec.table_columns(records, rec.HEADLINE_COLUMNS))
  assert "| final loss |" in table and "| 2.500 |" in table

  seen.clear()
  quick = train_cli.run(Context(suite="train-cli", quick=True))
  assert [c.steps for c in seen] == [train_cli.QUICK_STEPS] and len(quick) == 1
