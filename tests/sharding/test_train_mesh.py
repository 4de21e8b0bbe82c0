"""``python -m jaxfuse.train --mesh`` on 8 simulated devices: the same losses as one device,
step by step, for each parallel strategy; a resumed run on a mesh continues exactly; a mesh that
does not fit the devices or the batch is refused by name."""

import numpy as np
import pytest

from jaxfuse import parallel, train
from tests import helpers

TINY = ["--steps", "4", "--batch", "8", "--seq", "16", "--d-model", "16", "--layers", "2",
        "--heads", "4", "--kv-heads", "2", "--mlp", "32", "--warmup", "1", "--eval-every", "2",
        "--eval-batches", "2", "--save-every", "2", "--sample-tokens", "0"]


def _run(out, *extra):
  cfg = train.parse_args([*TINY, "--out", str(out), *extra])
  return train.train(cfg, log=lambda *_: None)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
  return _run(tmp_path_factory.mktemp("single"))["history"]


@pytest.mark.parametrize("mesh", ["data=2,fsdp=2,tensor=2", "data=2,context=2,tensor=2",
                                  "fsdp=8"])
def test_training_on_a_mesh_gives_the_single_device_losses(tmp_path, single, mesh):
  result = _run(tmp_path / "run", "--mesh", mesh)
  assert result["mesh"] == {"data": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1,
                            **parallel.parse_mesh(mesh)}
  history = result["history"]
  assert history["step"] == single["step"]
  helpers.assert_close(np.asarray(history["loss"]), np.asarray(single["loss"]), rtol=1e-5,
                       atol=0)
  helpers.assert_close(np.asarray(history["val_loss"]), np.asarray(single["val_loss"]),
                       rtol=1e-5, atol=0)


def test_grad_accum_on_a_mesh_equals_the_larger_batch(tmp_path):
  """Two micro-batches of 4 rows, each split over data x fsdp = 4 devices, against the 8-row
  batch on one device: the same losses, and the same state after the steps (each parameter
  within 1e-6 of its norm)."""
  from tests.test_train_runs import _final_state, _relative_errors

  options = ["--steps", "3", "--save-every", "3", "--eval-every", "3"]
  cfgs = [train.parse_args([*TINY, *options, "--out", str(tmp_path / name), *extra])
          for name, extra in (("one", []), ("mesh", ["--mesh", "data=2,fsdp=2,tensor=2",
                                                     "--batch", "4", "--grad-accum", "2"]))]
  one, mesh = (train.train(cfg, log=lambda *_: None)["history"] for cfg in cfgs)
  assert mesh["step"] == one["step"] == [1, 2, 3]
  for key in ("loss", "val_loss"):
    helpers.assert_close(np.asarray(mesh[key]), np.asarray(one[key]), rtol=1e-6, atol=0)
  errors = _relative_errors(*(_final_state(cfg) for cfg in cfgs))
  assert max(errors.values()) <= 1e-6, max(errors.items(), key=lambda kv: kv[1])


def test_a_resumed_run_on_a_mesh_continues_exactly(tmp_path):
  mesh = ("--mesh", "data=2,fsdp=2,tensor=2")
  whole = _run(tmp_path / "whole", *mesh)
  _run(tmp_path / "resumed", *mesh, "--stop-at", "2")
  resumed = _run(tmp_path / "resumed", *mesh, "--resume")
  assert resumed["history"] == whole["history"]


@pytest.mark.parametrize("extra,message", [
    (["--mesh", "data=4"], "--mesh data=4 needs 4 devices, jax sees 8"),
    (["--mesh", "data=8", "--batch", "12"],
     "--batch 12 must be a multiple of data x fsdp x expert = 8"),
    (["--mesh", "context=8", "--seq", "24"], "--seq 24 must be a multiple of 2 x context = 16"),
    (["--mesh", "model=8"], "--mesh: expected comma-separated AXIS=SIZE"),
    (["--mesh", "context=8", "--baseline"], "--baseline cannot run context parallel"),
])
def test_a_mesh_that_does_not_fit_is_refused(tmp_path, capsys, extra, message):
  assert train.main([*TINY, "--out", str(tmp_path / "run"), *extra]) == 2
  assert message in capsys.readouterr().err
  assert not (tmp_path / "run").exists()


def test_dpo_on_a_mesh_gives_the_single_device_losses(tmp_path):
  """Preference rows, the reference pass and the DPO loss split over data, fsdp and tensor
  (the vocabulary split in the fused log-probabilities) give one device's losses."""
  import json

  from jaxfuse.testing.checkpoints import write_tiny_checkpoint

  checkpoint = write_tiny_checkpoint(tmp_path / "ckpt", initializer_range=0.1)
  pairs = [{"prompt": f"What is {i} plus 2?", "chosen": f" {i + 2}.",
            "rejected": f" {i + 3}, or so."} for i in range(16)]
  (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))

  def run(out, *extra):
    cfg = train.parse_args(["--objective", "dpo", "--init-from", str(checkpoint), "--data",
                            str(tmp_path / "pairs.jsonl"), "--steps", "4", "--warmup", "1",
                            "--batch", "4", "--seq", "48", "--lr", "3e-3", "--log-every", "1",
                            "--sample-tokens", "0", "--out", str(tmp_path / out), *extra])
    return train.train(cfg, log=lambda *_: None)["history"]

  one = run("one")
  mesh = run("mesh", "--mesh", "data=2,fsdp=2,tensor=2")
  np.testing.assert_allclose(mesh["loss"], one["loss"], rtol=1e-5)
  np.testing.assert_allclose(mesh["metrics"]["rewards/margins"],
                             one["metrics"]["rewards/margins"], rtol=1e-4, atol=1e-6)
  assert one["loss"][-1] < one["loss"][0]


def test_grpo_on_a_mesh_gives_the_single_device_losses(tmp_path):
  """Rollouts of the sharded policy, rewards, the reference's KL and the GRPO loss over data,
  fsdp and tensor give one device's rewards and losses, step by step."""
  import json

  from jaxfuse.testing.checkpoints import write_tiny_checkpoint

  checkpoint = write_tiny_checkpoint(tmp_path / "ckpt", initializer_range=0.1)
  rows = [{"prompt": f"What is {i} plus 2?", "answer": i + 2} for i in range(8)]
  (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  (tmp_path / "vowels.py").write_text(
      "def vowels(prompts, completions, **_):\n"
      "    return [sum(c in 'aeiou' for c in t) / max(len(t), 1) for t in completions]\n")

  def run(out, *extra):
    cfg = train.parse_args(["--objective", "grpo", "--init-from", str(checkpoint), "--data",
                            str(tmp_path / "prompts.jsonl"), "--reward",
                            f"{tmp_path / 'vowels.py'}:vowels", "--num-generations", "4",
                            "--max-new-tokens", "8", "--beta", "0.05", "--steps", "3",
                            "--warmup", "0", "--batch", "8", "--seq", "32", "--lr", "3e-3",
                            "--log-every", "1", "--sample-tokens", "0", "--out",
                            str(tmp_path / out), *extra])
    return train.train(cfg, log=lambda *_: None)["history"]

  one = run("one")
  mesh = run("mesh", "--mesh", "data=2,fsdp=2,tensor=2")
  np.testing.assert_array_equal(mesh["metrics"]["reward"], one["metrics"]["reward"])
  np.testing.assert_allclose(mesh["loss"], one["loss"], rtol=1e-5, atol=1e-7)
  assert max(one["metrics"]["reward_std"]) > 0
