"""``python -m jaxfuse.train`` fine-tuning a checkpoint transformers wrote on JSON-lines files:
chat SFT with LoRA resumes exactly and refuses other data; bad input stops the run with a named
error that says where (file and line), and loses nothing a previous run wrote."""

import hashlib
import json

import numpy as np
import pytest

from jaxfuse import data, train
from jaxfuse.testing.checkpoints import (arithmetic_chats, arithmetic_completions, write_jsonl,
                                         write_tiny_checkpoint)

TINY = ["--steps", "6", "--warmup", "1", "--batch", "4", "--seq", "64", "--save-every", "3",
        "--eval-every", "3", "--eval-batches", "1", "--sample-tokens", "0"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
  return write_jsonl(tmp_path_factory.mktemp("data") / "chats.jsonl", arithmetic_chats(40))


def _run(*argv):
  return train.train(train.parse_args([*TINY, *argv]), log=lambda *_: None)


def _files(directory):
  """Every file under ``directory`` with a hash of its bytes."""
  return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(directory.rglob("*")) if p.is_file()}


def test_chat_sft_with_lora_resumes_exactly_and_refuses_other_data(checkpoint, chats, tmp_path,
                                                                  capsys):
  sft = ["--init-from", str(checkpoint), "--data", str(chats), "--loss-on", "completion",
         "--lora-rank", "4", "--eval-share", "0.1"]
  whole = _run(*sft, "--out", str(tmp_path / "whole"))
  assert whole["history"]["step"] == [1, 2, 3, 4, 5, 6]
  assert whole["history"]["val_step"] == [3, 6]
  assert "36 documents" in whole["data"] and "packing efficiency" in whole["data"]
  assert whole["history"]["loss"][-1] < whole["history"]["loss"][0]
  _run(*sft, "--out", str(tmp_path / "resumed"), "--stop-at", "3")
  resumed = _run(*sft, "--out", str(tmp_path / "resumed"), "--resume")
  assert resumed["history"] == whole["history"]   # the same floats, step by step
  # The run keeps the tokenizer it trained with, for the export and generation.
  run_tokenizer = data.load_tokenizer(tmp_path / "whole" / "tokenizer")
  assert data.tokenizer_fingerprint(run_tokenizer) == data.tokenizer_fingerprint(
      data.load_tokenizer(checkpoint))
  # Resuming on other data is refused before a step is taken.
  other = write_jsonl(tmp_path / "other.jsonl", arithmetic_chats(30, system=False))
  before = _files(tmp_path / "resumed")
  argv = [*TINY, *sft, "--data", str(other), "--out", str(tmp_path / "resumed"), "--resume"]
  assert train.main(argv) == 2
  assert "the checkpoint was trained on data" in capsys.readouterr().err
  assert {k: v for k, v in _files(tmp_path / "resumed").items() if k in before} == before


def test_a_tokenizer_trained_on_the_data_trains_a_model_from_scratch(chats, tmp_path):
  text = write_jsonl(tmp_path / "text.jsonl",
                     [{"text": r["prompt"] + r["completion"]} for r in arithmetic_completions(60)])
  result = _run("--data", str(text), "--train-tokenizer", "300", "--d-model", "32", "--layers",
                "1", "--heads", "2", "--kv-heads", "1", "--mlp", "64", "--eval-share", "0.1",
                "--out", str(tmp_path / "run"))
  tokenizer = data.load_tokenizer(tmp_path / "run" / "tokenizer")
  assert len(tokenizer) == result["model"]["vocab_size"] <= 300
  assert np.isfinite(result["final_val_loss"])
  assert result["history"]["loss"][-1] < result["history"]["loss"][0]


def _bad_inputs(tmp_path, checkpoint):
  """(name, extra argv, fragments of the error) for each kind of bad input."""
  rows = [json.dumps(r) for r in arithmetic_chats(4)]
  (tmp_path / "malformed.jsonl").write_text("\n".join([*rows[:2], rows[2][:-5], rows[3]]) + "\n")
  (tmp_path / "missing.jsonl").write_text(rows[0] + '\n{"title": "no text here"}\n')
  (tmp_path / "empty.jsonl").write_text("\n")
  small = write_tiny_checkpoint(tmp_path / "small", vocab_size=200)
  no_template = write_tiny_checkpoint(tmp_path / "no_template", chat_template=None)
  bigger = data.train_tokenizer([f"word{i} mot{i} wort{i}" for i in range(500)], 400,
                                tmp_path / "bigger")
  assert len(bigger) > 320
  chats = str(tmp_path / "chats.jsonl")
  write_jsonl(chats, arithmetic_chats(8))
  return [
      ("malformed JSON", ["--data", str(tmp_path / "malformed.jsonl")],
       [f"{tmp_path / 'malformed.jsonl'}:3: malformed JSON"]),
      ("missing field", ["--data", str(tmp_path / "missing.jsonl")],
       [f"{tmp_path / 'missing.jsonl'}:2: a record needs 'text' (text), 'messages' (chat)"]),
      ("empty data set", ["--data", str(tmp_path / "empty.jsonl")],
       [f"{tmp_path / 'empty.jsonl'}: no records"]),
      ("checkpoint's tokenizer past its vocabulary",
       ["--init-from", str(small), "--data", chats],
       [f"the tokenizer has {len(data.load_tokenizer(small))} tokens, more than the model's "
        "vocabulary of 200"]),
      ("--tokenizer past the vocabulary",
       ["--init-from", str(checkpoint), "--tokenizer", str(tmp_path / "bigger"), "--data", chats],
       [f"the tokenizer has {len(bigger)} tokens, more than the model's vocabulary of "]),
      ("chat without a template", ["--init-from", str(no_template), "--data", chats],
       [f"{chats}:1:", "chat template"]),
  ]


def test_bad_input_is_named_with_its_file_and_line_and_loses_nothing(checkpoint, chats,
                                                                     tmp_path, capsys):
  run = tmp_path / "run"
  first = ["--init-from", str(checkpoint), "--data", str(chats), "--out", str(run)]
  _run(*first, "--stop-at", "3")
  before = _files(run)
  assert "tokenizer/tokenizer.json" in before and "checkpoints/3/_CHECKPOINT_METADATA" in before
  cases = _bad_inputs(tmp_path, checkpoint)
  for name, extra, fragments in cases:
    # Into the previous run's directory (resuming it) and into a fresh one.
    for out in (["--out", str(run), "--resume"], ["--out", str(tmp_path / "fresh")]):
      argv = [*TINY, "--init-from", str(checkpoint), *extra, *out]
      assert train.main(argv) == 2, name
      err = capsys.readouterr().err
      for fragment in fragments:
        assert fragment in err, f"{name}: {fragment!r} not in {err!r}"
      after = _files(run)
      assert {k: v for k, v in after.items() if k in before} == before, name
  # The previous run still resumes and finishes.
  assert _run(*first, "--resume")["history"]["step"] == [1, 2, 3, 4, 5, 6]
