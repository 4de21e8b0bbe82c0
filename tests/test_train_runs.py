"""python -m jaxfuse.train as a run of days is used: configuration files, gradient accumulation,
TensorBoard and W&B logs, preemption by SIGTERM, an unreadable latest checkpoint, non-finite
losses, the model FLOPs behind the MFU."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from jaxfuse import train
from jaxfuse.metrics.jaxprs import sub_jaxprs
from jaxfuse.models import Decoder, DecoderConfig
from jaxfuse.train import checkpoint, cli, loop, writers
from jaxfuse.train import model as model_lib

from tests.test_train import TINY, _run

ROOT = Path(__file__).resolve().parent.parent


# Configuration files -------------------------------------------------------------------------


def test_a_config_file_and_overrides_run_as_the_flags(tmp_path):
  (tmp_path / "run.yaml").write_text(
      "model:\n  d_model: 16\n  layers: 1\n  heads: 2\n  kv-heads: 1\n  mlp: 32\n"
      "optimisation:\n  steps: 6\n  batch: 2\n  warmup: 2\n  lr: 0.01\n"
      "data:\n  seq: 16\n"
      "logging:\n  eval_every: 3\n  eval_batches: 2\n  sample_tokens: 0\n  tensorboard: false\n"
      "checkpoints:\n  save_every: 3\n")
  (tmp_path / "run.toml").write_text(
      "d_model = 16\nlayers = 1\nheads = 2\nkv_heads = 1\nmlp = 32\nsteps = 6\nbatch = 2\n"
      "warmup = 2\nlr = 0.01\nseq = 16\neval_every = 3\neval_batches = 2\nsample_tokens = 0\n"
      "save_every = 3\n[logging]\ntensorboard = false\n")
  flags = train.parse_args([*TINY, "--lr", "0.005", "--no-tensorboard",
                            "--out", str(tmp_path / "flags")])
  from_yaml = train.parse_args(["--config", str(tmp_path / "run.yaml"), "--lr", "0.005",
                                "--out", str(tmp_path / "yaml")])
  from_toml = train.parse_args(["--config", str(tmp_path / "run.toml"), "--lr", "0.005",
                                "--out", str(tmp_path / "toml")])
  assert dataclasses.replace(from_yaml, out=flags.out) == flags
  assert dataclasses.replace(from_toml, out=flags.out) == flags
  by_flags = train.train(flags, log=lambda *_: None)
  by_file = train.train(from_yaml, log=lambda *_: None)
  assert by_file["history"] == by_flags["history"]   # the same floats
  # The run wrote its resolved configuration, which reads back as the same run.
  written = tmp_path / "yaml" / "config.yaml"
  assert train.parse_args(["--config", str(written)]) == from_yaml
  assert "optimisation:\n" in written.read_text() and "lr: 0.005" in written.read_text()


@pytest.mark.parametrize("text,message", [
    ("optimisation:\n  grad_acum: 4\n",
     "unknown option optimisation.'grad_acum'; did you mean 'grad_accum'?"),
    ("learning_rate: 0.1\n", "unknown option 'learning_rate'"),
    ("steps: ten\n", "'steps' must be int, got 'ten'"),
    ("dtype: float8\n", "'dtype' must be one of float32, bfloat16, float16, got 'float8'"),
    ("- 1\n- 2\n", "must be a mapping of options to values"),
    ("model: [unclosed\n", "not valid YAML"),
])
def test_a_bad_config_file_is_named_and_nothing_is_written(tmp_path, capsys, text, message):
  (tmp_path / "bad.yaml").write_text(text)
  assert train.main(["--config", str(tmp_path / "bad.yaml"),
                     "--out", str(tmp_path / "run")]) == 2
  err = capsys.readouterr().err
  assert message in err and str(tmp_path / "bad.yaml") in err
  assert not (tmp_path / "run").exists()


def test_help_shows_the_groups_and_the_configuration_file():
  text = cli.build_parser().format_help()
  for group in train.config.GROUPS:
    assert f"\n{group}:\n" in text
  assert "--config FILE" in text and "--grad-accum GRAD_ACCUM" in text
  assert "micro-batches a step sums its gradient over" in text


# Gradient accumulation ------------------------------------------------------------------------


def _final_state(cfg):
  """The state a run saved last, restored into the structure of a fresh one."""
  _, state, _, _ = loop.make_steps(*model_lib.build(cfg), wrt=model_lib.trained(cfg))
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
  manager = checkpoint.checkpoint_manager(Path(cfg.out) / "checkpoints")
  return checkpoint.restore_checkpoint(manager, abstract)[1]


def _relative_errors(a, b) -> dict:
  """Each array's ``|a - b| / |a|`` (Frobenius norms)."""
  errors = {}
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    scale = np.linalg.norm(x)
    errors[jax.tree_util.keystr(path)] = np.linalg.norm(x - y) / scale if scale else \
        np.linalg.norm(y)
  return errors


def _documents(path: Path) -> Path:
  words = "the quick brown fox jumps over a lazy dog while seven wizards hex jolly boxes".split()
  rng = np.random.default_rng(0)
  with open(path, "w") as f:
    for _ in range(60):
      f.write(json.dumps({"text": " ".join(rng.choice(words, rng.integers(2, 13)))}) + "\n")
  return path


@pytest.mark.parametrize("case,tolerance", [
    ("bytes", 1e-6),
    ("packed", 1e-6),
    # LoRA's B starts at zero: after 3 steps it is made of Adam's normalized updates alone, in
    # which an element's float32 summation noise counts at full size (measured 2.1e-6; its
    # gradients agree within 3e-7 and its loss within 1e-7).
    ("packed+lora", 5e-6),
])
def test_grad_accum_4_of_batch_2_equals_batch_8(tmp_path, case, tolerance):
  options = ["--steps", "3", "--warmup", "1", "--eval-every", "3", "--eval-batches", "1",
             "--save-every", "3", "--no-tensorboard"]
  if case != "bytes":
    options += ["--data", str(_documents(tmp_path / "docs.jsonl")), "--eval-share", "0.1"]
  if case.endswith("lora"):
    options += ["--lora-rank", "2"]
  cfgs = [train.parse_args([*TINY, *options, *batch, "--out", str(tmp_path / name)])
          for name, batch in (("whole", ["--batch", "8"]),
                              ("accumulated", ["--batch", "2", "--grad-accum", "4"]))]
  whole, accumulated = (train.train(cfg, log=lambda *_: None) for cfg in cfgs)
  for key in ("loss", "val_loss"):
    np.testing.assert_allclose(accumulated["history"][key], whole["history"][key], rtol=1e-6)
  errors = _relative_errors(_final_state(cfgs[0]), _final_state(cfgs[1]))
  assert len(errors) > 10 and max(errors.values()) <= tolerance, max(errors.items(),
                                                                     key=lambda kv: kv[1])
  assert any(e > 0 for e in errors.values())   # two computations, not one run twice


def test_grad_accum_is_checked_against_the_mesh(tmp_path):
  cfg = train.parse_args([*TINY, "--batch", "3", "--grad-accum", "2", "--mesh", "data=2"])
  with pytest.raises(ValueError, match=r"--batch 3 must be a multiple of data x fsdp x expert "
                                       r"= 2 \(each of the --grad-accum micro-batches"):
    train.check_config(cfg)
  with pytest.raises(ValueError, match="--grad-accum must be >= 1"):
    train.check_config(train.parse_args([*TINY, "--grad-accum", "0"]))


# Logging ------------------------------------------------------------------------------------


def test_tensorboard_files_read_back_with_the_logged_values(tmp_path):
  result = _run(tmp_path, "run", "--log-every", "2", "--peak-tflops", "0.5")
  history = result["history"]
  scalars = train.read_scalars(tmp_path / "run" / "tensorboard")
  assert scalars["train/loss"] == list(zip(history["step"], np.float32(history["loss"])))
  assert scalars["eval/loss"] == list(zip(history["val_step"],
                                          np.float32(history["val_loss"])))
  cfg = train.parse_args(TINY)
  assert [v for _, v in scalars["train/learning_rate"]] == [
      np.float32(model_lib.learning_rate(cfg, s - 1)) for s in history["step"]]
  assert [s for s, _ in scalars["train/grad_norm"]] == history["step"]
  assert all(np.isfinite(v) and v > 0 for _, v in scalars["train/grad_norm"])
  assert [s for s, _ in scalars["train/loss_tokens"]] == history["step"]
  assert {v for _, v in scalars["train/loss_tokens"]} == {2 * 16}
  # Throughput and MFU once per read-back: every 2 steps, and before evaluating and saving.
  rates = scalars["perf/tokens_per_second"]
  assert [s for s, _ in rates] == [2, 3, 4, 6] and all(v > 0 for _, v in rates)
  mfu = [v for _, v in scalars["perf/mfu"]]
  flops = DecoderConfig(vocab_size=256, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1,
                        mlp_dim=32).flops_per_token(16)
  np.testing.assert_allclose(mfu, [r * flops / 0.5e12 for _, r in rates], rtol=1e-6)
  assert result["mfu"] == pytest.approx(mfu[-1], rel=1e-6)
  lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
           .splitlines()]
  assert [line["train/loss"] for line in lines if "train/loss" in line] == history["loss"]


def test_wandb_gets_the_logged_values(tmp_path, monkeypatch):
  """``--wandb PROJECT``: one W&B run with the configuration, the same scalars as TensorBoard,
  and the same run id when the run resumes (W&B itself is stood in: no network here)."""
  calls = []

  class Run:
    def log(self, values, step):
      calls.append(("log", step, dict(values)))

    def finish(self):
      calls.append(("finish",))

  fake = types.SimpleNamespace(
      init=lambda **kwargs: calls.append(("init", kwargs)) or Run(),
      util=types.SimpleNamespace(generate_id=lambda: "run-id-1"))
  monkeypatch.setitem(sys.modules, "wandb", fake)
  monkeypatch.setattr(writers, "wandb_available", lambda: True)
  result = _run(tmp_path, "run", "--wandb", "my-project", "--stop-at", "3")
  init = calls[0][1]
  assert init["project"] == "my-project" and init["id"] == "run-id-1"
  assert init["config"]["wandb"] == "my-project" and calls[-1] == ("finish",)
  logged = [(c[1], c[2]["train/loss"]) for c in calls if c[0] == "log" and "train/loss" in c[2]]
  assert logged == list(zip(result["history"]["step"], result["history"]["loss"]))
  calls.clear()
  fake.util.generate_id = lambda: "another-id"
  _run(tmp_path, "run", "--wandb", "my-project", "--resume")
  assert calls[0][1]["id"] == "run-id-1"


def test_wandb_without_the_package_is_named(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(writers, "wandb_available", lambda: False)
  assert train.main([*TINY, "--wandb", "p", "--out", str(tmp_path / "run")]) == 2
  assert "--wandb needs the wandb package: pip install wandb" in capsys.readouterr().err


def _matmul_flops(jaxpr) -> int:
  """2 M N K of every ``dot_general`` in ``jaxpr`` and the jaxprs inside it."""
  total = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (contract, _), _ = eqn.params["dimension_numbers"]
      k = np.prod([eqn.invars[0].aval.shape[d] for d in contract])
      total += 2 * int(np.prod(eqn.outvars[0].aval.shape)) * int(k)
    total += sum(_matmul_flops(sub) for sub in sub_jaxprs(eqn))
  return total


def test_model_flops_per_token_count_the_forward_pass():
  """The matmuls of a one-token forward pass, as its jaxpr has them; the attention term by the
  keys each query sees."""
  for cfg in (DecoderConfig(vocab_size=97, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                            mlp_dim=48),
              DecoderConfig(vocab_size=64, d_model=16, num_layers=1, num_heads=2, mlp_dim=24,
                            head_dim=12, tie_embeddings=True)):
    model = Decoder(cfg, fused=False, rngs=nnx.Rngs(0))
    tokens = np.zeros((1, 1), np.int32)
    counted = _matmul_flops(jax.make_jaxpr(lambda t: model.logits(t))(tokens).jaxpr)
    assert cfg.flops_per_token(1, training=False) == counted
    assert cfg.flops_per_token(1) == 3 * counted
  windowed = DecoderConfig(vocab_size=64, d_model=16, num_layers=2, num_heads=2, mlp_dim=24,
                           sliding_window=4, layer_types=("sliding_attention", "full_attention"))
  keys = (1 + 2 + 3 + 4 + 4 * 4) / 8 + (1 + 2 + 3 + 4 + 5 + 6 + 7 + 8) / 8
  attention = 4 * windowed.num_heads * windowed.head_dim * keys
  assert windowed.flops_per_token(8, training=False) - windowed.flops_per_token(
      1, training=False) == pytest.approx(attention - 4 * 2 * 8 * 2)


# Faults ---------------------------------------------------------------------------------------


def test_an_unreadable_latest_checkpoint_resumes_from_the_one_before(tmp_path):
  whole = _run(tmp_path, "whole", "--save-every", "2")
  _run(tmp_path, "run", "--save-every", "2", "--stop-at", "4")   # keeps 2 and 4
  for path in (tmp_path / "run" / "checkpoints" / "4").rglob("*"):
    if path.is_file() and path.stat().st_size:
      path.write_bytes(b"\x00garbage")
  said = []
  cfg = train.parse_args([*TINY, "--save-every", "2", "--resume", "--out",
                          str(tmp_path / "run")])
  resumed = train.train(cfg, log=said.append)
  assert any("checkpoint of step 4" in s and "cannot be read" in s for s in said)
  assert any("resuming from step 2" in s for s in said)
  assert resumed["history"] == whole["history"]
  assert (tmp_path / "run" / "checkpoints-unreadable" / "4").is_dir()   # kept, set aside


def _poison(monkeypatch, step: int):
  """Step ``step``'s batch gets a target outside the vocabulary: its loss is NaN."""
  real = train.inputs.Inputs.train

  def poisoned(self, at, mesh=None):
    batch = real(self, at, mesh)
    if at == step - 1:
      targets = np.array(batch["targets"])
      targets[0, 0] = 300
      batch = {**batch, "targets": targets}
    return batch

  monkeypatch.setattr(train.inputs.Inputs, "train", poisoned)


def test_a_nonfinite_loss_stops_the_run_naming_the_step(tmp_path, monkeypatch, capsys):
  _poison(monkeypatch, 5)
  assert train.main([*TINY, "--save-every", "2", "--out", str(tmp_path / "run")]) == 2
  err = capsys.readouterr().err
  assert "step 5: the loss is nan" in err and "--skip-nonfinite" in err
  assert checkpoint.checkpoint_manager(tmp_path / "run" / "checkpoints").all_steps() == [2, 4]


def test_skip_nonfinite_leaves_the_state_of_a_bad_step_unchanged(tmp_path, monkeypatch):
  whole = _run(tmp_path, "whole", "--stop-at", "4")
  _poison(monkeypatch, 5)
  skipped = _run(tmp_path, "skipped", "--skip-nonfinite", "1", "--log-every", "3")
  history = skipped["history"]
  assert history["skipped"] == [5] and history["step"] == [1, 2, 3, 4, 6]
  assert history["loss"][:4] == whole["history"]["loss"]
  assert np.isfinite(history["loss"][-1])


# Preemption -----------------------------------------------------------------------------------

LONG = ["--steps", "400", "--batch", "4", "--seq", "32", "--d-model", "32", "--layers", "2",
        "--heads", "2", "--kv-heads", "1", "--mlp", "64", "--warmup", "2", "--eval-every",
        "1000", "--eval-batches", "1", "--save-every", "1000", "--sample-tokens", "0",
        "--log-every", "1"]


def _cli(out: Path, *extra) -> subprocess.Popen:
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAXFUSE_")}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
  return subprocess.Popen([sys.executable, "-m", "jaxfuse.train", *LONG, "--out", str(out),
                           *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def _logged_step(out: Path) -> int:
  path = out / "metrics.jsonl"
  if not path.is_file():
    return 0
  steps = [json.loads(line)["step"] for line in path.read_text().splitlines()
           if line.endswith("}")]
  return max(steps, default=0)


def test_sigterm_saves_the_step_and_resume_continues_bit_for_bit(tmp_path):
  whole = _cli(tmp_path / "whole")
  stopped = _cli(tmp_path / "stopped")
  deadline = time.monotonic() + 300
  while _logged_step(tmp_path / "stopped") < 5:
    assert stopped.poll() is None, stopped.communicate()[1][-3000:]
    assert time.monotonic() < deadline
    time.sleep(0.02)
  stopped.send_signal(signal.SIGTERM)
  _, err = stopped.communicate(timeout=300)
  assert stopped.returncode == 128 + signal.SIGTERM, err[-3000:]
  log = json.loads((tmp_path / "stopped" / "train_log.json").read_text())
  at = log["preempted_at"]
  assert 5 <= at < 400 and f"stopped by SIGTERM after step {at}" in err
  assert checkpoint.checkpoint_manager(tmp_path / "stopped" / "checkpoints").all_steps() == [at]
  resumed = _cli(tmp_path / "stopped", "--resume")
  for process in (whole, resumed):
    _, err = process.communicate(timeout=600)
    assert process.returncode == 0, err[-3000:]
  want = json.loads((tmp_path / "whole" / "train_log.json").read_text())["history"]
  got = json.loads((tmp_path / "stopped" / "train_log.json").read_text())["history"]
  assert got["step"] == want["step"] == list(range(1, 401))
  assert got["loss"] == want["loss"]   # the same floats
