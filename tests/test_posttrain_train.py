"""``python -m jaxfuse.train --objective dpo|orpo|...`` end to end on a tiny Llama that
``transformers`` wrote, and a convergence twin: 30 steps of DPO and of ORPO by jaxfuse's trainer
against the same steps in PyTorch (the Hugging Face model on TRL's padded batches of the same
pairs, TRL 1.16's own loss code, torch AdamW on optax's schedule): per-step losses within 1e-4
relative."""

import json

import numpy as np
import optax
import pytest
import torch

from jaxfuse import data
from jaxfuse import train as jtrain
from jaxfuse.train.inputs import Inputs
from jaxfuse.testing.checkpoints import write_tiny_checkpoint
from tests.test_posttrain_twin import _hf_log_probs, _trl_batch, _trl_dpo, _trl_pair_batch
from tests.test_posttrain_twin import _trl_pair_loss

transformers = pytest.importorskip("transformers")
pytest.importorskip("trl")

STEPS, BATCH, SEQ, LR = 30, 4, 48, 2e-3
RTOL = 1e-4


def _pairs(count=24):
  rows = []
  for i in range(count):
    a, b = i % 7, (3 * i + 2) % 9
    rows.append({"prompt": f"What is {a} plus {b}?", "chosen": f" It is {a + b}.",
                 "rejected": f" It is {a + b + 1 + i % 3}" + " maybe" * (i % 2) + "."})
  return rows


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  root = tmp_path_factory.mktemp("posttrain")
  checkpoint = write_tiny_checkpoint(root / "ckpt", initializer_range=0.1)
  pairs = root / "pairs.jsonl"
  pairs.write_text("".join(json.dumps(r) + "\n" for r in _pairs()))
  return checkpoint, pairs


def _args(checkpoint, pairs, out, *extra):
  return jtrain.parse_args([
      "--init-from", str(checkpoint), "--data", str(pairs), "--steps", str(STEPS),
      "--warmup", "3", "--batch", str(BATCH), "--seq", str(SEQ), "--lr", str(LR),
      "--sample-tokens", "0", "--log-every", "1", "--out", str(out), *extra])


def _torch_losses(cfg, checkpoint, loss_of):
  """The losses of ``cfg.steps`` steps in torch on the run's batches: ``loss_of(hf, rows)`` is
  TRL's loss of the step's pairs; clipping, AdamW and the schedule as jaxfuse's optimizer."""
  tokenizer = data.load_tokenizer(checkpoint)
  inputs = Inputs.load(cfg, tokenizer, len(tokenizer), log=lambda *_: None)
  hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32,
                                                         attn_implementation="eager")
  params = [p for p in hf.parameters() if p.requires_grad]
  optimizer = torch.optim.AdamW(params, lr=0.0, betas=(0.9, 0.999), eps=1e-8,
                                weight_decay=cfg.weight_decay)
  schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup, cfg.steps,
                                                end_value=cfg.lr * 0.1)
  losses = []
  for step in range(cfg.steps):
    picked = inputs.pair_indices(step)
    rows = _Rows(inputs.pairs.tokens[picked], inputs.pairs.targets[picked],
                 inputs.pairs.segment_ids[picked])
    loss = loss_of(hf, rows)
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, cfg.clip)
    for group in optimizer.param_groups:
      group["lr"] = float(schedule(step))
    optimizer.step()
    losses.append(loss.item())
  return losses


class _Rows:
  """Some preference rows, as :func:`tests.test_posttrain_twin._trl_batch` reads them."""

  def __init__(self, tokens, targets, segment_ids):
    self.tokens, self.targets, self.segment_ids = tokens, targets, segment_ids

  def __len__(self):
    return len(self.tokens)


def _compare(name, ours, theirs):
  ours, theirs = np.asarray(ours), np.asarray(theirs)
  assert ours.shape == theirs.shape == (STEPS,)
  worst = float(np.max(np.abs(ours - theirs) / np.abs(theirs)))
  print(f"\n{name}: loss {ours[0]:.4f} -> {ours[-1]:.4f}, worst relative difference "
        f"{worst:.2e} over {STEPS} steps")
  np.testing.assert_allclose(ours, theirs, rtol=RTOL, err_msg=name)
  assert np.mean(ours[-5:]) < 0.8 * np.mean(ours[:5]), ours   # it learned


def test_dpo_run_matches_trl_step_by_step(files, tmp_path):
  checkpoint, pairs = files
  cfg = _args(checkpoint, pairs, tmp_path / "run", "--objective", "dpo", "--beta", "0.2")
  result = jtrain.train(cfg, log=lambda *_: None)
  history = result["history"]
  # The reference is the initial model: the first step's log-ratios are 0, its loss log 2.
  assert history["loss"][0] == pytest.approx(np.log(2), rel=1e-6)
  assert len(history["metrics"]["rewards/margins"]) == STEPS
  assert np.mean(history["metrics"]["rewards/accuracies"][-5:]) > 0.5
  logged = json.loads((tmp_path / "run" / "train_log.json").read_text())
  assert logged["history"]["metrics"]["rewards/margins"] == history["metrics"]["rewards/margins"]
  (cache,) = (tmp_path / "run" / "reference").glob("*.npy")
  reference = np.load(cache)

  ref_model = transformers.AutoModelForCausalLM.from_pretrained(
      checkpoint, dtype=torch.float32, attn_implementation="eager")

  def loss_of(hf, rows):
    batch = _trl_batch(rows)
    with torch.no_grad():
      ref = _hf_log_probs(ref_model, batch).sum(1).numpy()
    return _trl_dpo(_hf_log_probs(hf, batch), batch, ref,
                    {"loss_type": ("sigmoid",), "beta": 0.2})

  _compare("dpo", history["loss"], _torch_losses(cfg, checkpoint, loss_of))
  # The cached reference is the reference model's log-probabilities (all rows).
  tokenizer = data.load_tokenizer(checkpoint)
  inputs = Inputs.load(cfg, tokenizer, len(tokenizer), log=lambda *_: None)
  batch = _trl_batch(inputs.pairs)
  with torch.no_grad():
    want = _hf_log_probs(ref_model, batch).sum(1).numpy()
  chosen, rejected = (inputs.pairs.targets != -100) & (inputs.pairs.segment_ids == 1), \
      (inputs.pairs.targets != -100) & (inputs.pairs.segment_ids == 2)
  got = np.concatenate([(reference * chosen).sum(1), (reference * rejected).sum(1)])
  np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
def test_orpo_run_matches_trl_step_by_step(files, tmp_path):
  checkpoint, pairs = files
  cfg = _args(checkpoint, pairs, tmp_path / "run", "--objective", "orpo", "--beta", "0.5",
              "--remat")
  history = jtrain.train(cfg, log=lambda *_: None)["history"]
  assert not (tmp_path / "run" / "reference").exists()   # ORPO has no reference

  def loss_of(hf, rows):
    return _trl_pair_loss("orpo", hf, _trl_pair_batch(rows), {"beta": 0.5}, tmp_path)

  _compare("orpo", history["loss"], _torch_losses(cfg, checkpoint, loss_of))


def test_lora_dpo_with_grad_accum_resumes_from_its_cached_reference(files, tmp_path):
  checkpoint, pairs = files
  extra = ["--objective", "dpo", "--lora-rank", "4", "--grad-accum", "2", "--batch", "2",
           "--steps", "6", "--save-every", "3"]
  out = tmp_path / "run"
  logs = []
  whole = jtrain.train(_args(checkpoint, pairs, tmp_path / "whole", *extra), log=lambda *_: None)
  jtrain.train(_args(checkpoint, pairs, out, *extra, "--stop-at", "3"), log=logs.append)
  assert any("reference log-probabilities of 24 pairs" in line for line in logs)
  logs.clear()
  resumed = jtrain.train(_args(checkpoint, pairs, out, *extra, "--resume"), log=logs.append)
  assert any("reading the reference log-probabilities" in line for line in logs)
  assert whole["history"]["loss"][0] == pytest.approx(np.log(2), rel=1e-6)
  np.testing.assert_allclose(resumed["history"]["loss"], whole["history"]["loss"], rtol=1e-6)


@pytest.mark.parametrize("row,message", [
    ({"prompt": "Q", "chosen": "A"}, r"pairs.jsonl:2: a preference record needs 'prompt', "
                                     r"'chosen' and 'rejected'; it has no 'rejected'"),
    ({"prompt": "Q", "chosen": "", "rejected": "B"}, r"pairs.jsonl:2: 'chosen' is empty"),
    ({"prompt": "Q", "chosen": 3, "rejected": "B"}, r"pairs.jsonl:2: field 'chosen' is a int"),
    ({"prompt": [{"role": "user", "content": "Q"}], "chosen": "A", "rejected": "B"},
     r"pairs.jsonl:2: 'prompt' and 'chosen' must both be strings or both message lists"),
])
def test_bad_preference_rows_are_named_and_touch_nothing(files, tmp_path, row, message):
  checkpoint, _ = files
  out = tmp_path / "run"
  out.mkdir()
  (out / "train_log.json").write_text("a previous run's log")
  path = tmp_path / "pairs.jsonl"
  path.write_text(json.dumps(_pairs(1)[0]) + "\n" + json.dumps(row) + "\n")
  with pytest.raises(data.DataError, match=message):
    jtrain.train(_args(checkpoint, path, out, "--objective", "dpo"), log=lambda *_: None)
  assert (out / "train_log.json").read_text() == "a previous run's log"


@pytest.mark.parametrize("argv,message", [
    (["--objective", "dpo"], "--objective dpo needs --data"),
    (["--beta", "0.1"], "--beta is not an option of --objective sft"),
    (["--objective", "orpo", "--data", "x.jsonl", "--loss-type", "ipo"],
     "--loss-type is not an option of --objective orpo"),
    (["--objective", "dpo", "--data", "x.jsonl", "--loss-type", "dpo"],
     "loss_type must be one or more of"),
    (["--objective", "dpo", "--data", "x.jsonl", "--eval-share", "0.1"],
     "--eval-share is not available with --objective dpo"),
])
def test_objective_options_are_checked_by_name(argv, message):
  with pytest.raises(ValueError, match=message):
    jtrain.check_config(jtrain.parse_args(argv))


def test_chat_pairs_learn_only_the_answer_after_the_prompt(files, tmp_path):
  """Chat pairs (TRL's conversational preference format) render through the tokenizer's chat
  template; the targets are the final assistant turn's tokens only, not an earlier one's in
  the prompt."""
  checkpoint, _ = files
  tokenizer = data.load_tokenizer(checkpoint)
  prompt = [{"role": "user", "content": "What is 1 plus 1?"},
            {"role": "assistant", "content": "It is 2."},
            {"role": "user", "content": "And 2 plus 2?"}]
  row = {"prompt": prompt, "chosen": [{"role": "assistant", "content": "It is 4."}],
         "rejected": [{"role": "assistant", "content": "It is 5."}]}
  path = tmp_path / "chat.jsonl"
  path.write_text(json.dumps(row) + "\n")
  from jaxfuse.posttrain.data import read_preference_rows

  rows = read_preference_rows(path, tokenizer, seq=256)
  for side, answer in ((1, "It is 4."), (2, "It is 5.")):
    where = rows.segment_ids[0] == side
    ids = rows.tokens[0][where]
    whole = tokenizer.apply_chat_template(prompt + [row["chosen" if side == 1 else "rejected"][0]],
                                          tokenize=True)
    whole = whole["input_ids"] if hasattr(whole, "keys") else whole
    assert ids.tolist() == list(whole)
    targets = rows.targets[0][where]
    learned = tokenizer.decode([t for t in targets if t != -100])
    assert learned == answer + tokenizer.eos_token   # the template closes the turn with EOS


@pytest.mark.parametrize("row,message", [
    ({"prompt": "Q", "completion": "A", "label": "yes"},
     r"kto.jsonl:2: 'label' must be a boolean \(true: a desirable completion\), got 'yes'"),
    ({"prompt": "Q", "completion": "A", "label": 1}, r"kto.jsonl:2: 'label' must be a boolean"),
    ({"prompt": "Q", "label": True}, r"kto.jsonl:2: a KTO record needs 'prompt', 'completion' "
                                     r"and 'label'; it has no 'completion'"),
    ({"prompt": "Q", "completion": "", "label": False}, r"kto.jsonl:2: 'completion' is empty"),
])
def test_bad_kto_rows_are_named_and_touch_nothing(files, tmp_path, row, message):
  checkpoint, _ = files
  out = tmp_path / "run"
  out.mkdir()
  (out / "train_log.json").write_text("a previous run's log")
  path = tmp_path / "kto.jsonl"
  path.write_text(json.dumps({"prompt": "Q", "completion": "A", "label": True}) + "\n"
                  + json.dumps(row) + "\n")
  with pytest.raises(data.DataError, match=message):
    jtrain.train(_args(checkpoint, path, out, "--objective", "kto"), log=lambda *_: None)
  assert (out / "train_log.json").read_text() == "a previous run's log"


def test_kto_run_learns(files, tmp_path):
  """KTO on the pairs' completions, each labelled: the reference is the initial model, so the
  first step's KL estimate is 0 and the reward margin between desirable and undesirable
  completions grows."""
  checkpoint, _ = files
  records = [{"prompt": r["prompt"], "completion": r[k], "label": k == "chosen"}
             for r in _pairs() for k in ("chosen", "rejected")]
  path = tmp_path / "kto.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  history = jtrain.train(_args(checkpoint, path, tmp_path / "run", "--objective", "kto",
                               "--beta", "0.2"), log=lambda *_: None)["history"]
  assert history["metrics"]["kl"][0] == 0.0
  assert history["loss"][0] == pytest.approx(0.5, rel=1e-6)   # 1 - sigmoid(0) for every row
  # NaN where a step's batch has no completion of one label (TRL logs nothing then).
  margins = history["metrics"]["rewards/margins"]
  assert np.nanmean(margins[-8:]) > np.nanmean(margins[:5]) + 0.5, margins


def test_distillation_run_learns_and_refuses_another_vocabulary(files, tmp_path):
  """--objective distill --teacher on completion-only SFT records: the divergence from the
  teacher falls; a teacher over another vocabulary is refused by name before the run writes
  anything of its own."""
  from jaxfuse.testing.checkpoints import arithmetic_completions, write_jsonl

  checkpoint, _ = files
  teacher = write_tiny_checkpoint(tmp_path / "teacher", seed=3, initializer_range=0.1)
  records = write_jsonl(tmp_path / "sft.jsonl", arithmetic_completions(48))
  extra = ["--objective", "distill", "--teacher", str(teacher), "--loss-on", "completion"]
  history = jtrain.train(_args(checkpoint, records, tmp_path / "run", *extra),
                         log=lambda *_: None)["history"]
  assert np.mean(history["loss"][-5:]) < 0.5 * np.mean(history["loss"][:5]), history["loss"]
  other = write_tiny_checkpoint(tmp_path / "other", tokenizer_size=300)
  out = tmp_path / "refused"
  with pytest.raises(ValueError, match=r"--teacher .*other: a teacher whose vocabulary "
                                       r"differs from the student's: 300 words against 320"):
    jtrain.train(_args(checkpoint, records, out, "--objective", "distill", "--teacher",
                       str(other)), log=lambda *_: None)
  assert not (out / "data").exists() and not (out / "train_log.json").exists()


def test_teacher_topk_of_the_whole_vocabulary_is_the_forward_kl(files, tmp_path):
  """--teacher-topk stores the teacher's top k once (no teacher while training); with k the
  whole vocabulary the run is --beta 0's (the forward KL) step by step, and a smaller k trains
  and reads its store back on --resume."""
  from jaxfuse.testing.checkpoints import arithmetic_completions, write_jsonl

  checkpoint, _ = files
  teacher = write_tiny_checkpoint(tmp_path / "teacher", seed=3, initializer_range=0.1)
  records = write_jsonl(tmp_path / "sft.jsonl", arithmetic_completions(48))
  extra = ["--objective", "distill", "--teacher", str(teacher), "--loss-on", "completion",
           "--steps", "8", "--beta", "0"]
  full = jtrain.train(_args(checkpoint, records, tmp_path / "full", *extra),
                      log=lambda *_: None)["history"]["loss"]
  stored = jtrain.train(_args(checkpoint, records, tmp_path / "stored", *extra,
                              "--teacher-topk", "320"), log=lambda *_: None)["history"]["loss"]
  np.testing.assert_allclose(stored, full, rtol=1e-4)
  logs = []
  out = tmp_path / "k8"
  few = ["--objective", "distill", "--teacher", str(teacher), "--loss-on", "completion",
         "--steps", "8", "--save-every", "4", "--teacher-topk", "8"]
  jtrain.train(_args(checkpoint, records, out, *few, "--stop-at", "4"), log=logs.append)
  assert any("top-8 log-probabilities of" in line for line in logs)
  logs.clear()
  history = jtrain.train(_args(checkpoint, records, out, *few, "--resume"), log=logs.append)
  assert any("reading its top-8" in line for line in logs)
  assert history["history"]["loss"][-1] < history["history"]["loss"][0]
