"""``python -m jaxfuse.train --objective grpo`` end to end on a tiny Llama that
``transformers`` wrote: rollouts, rewards (a reward module of the test's and the built-ins),
several updates a batch with the reference's KL, LoRA and gradient accumulation, exact resume
(the sampling keys are a function of the step), and the errors a run stops with."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxfuse import interop
from jaxfuse import train as jtrain
from jaxfuse.posttrain import RewardError, grpo_loss
from jaxfuse.posttrain.grpo import read_prompt_rows, rollout_batch
from jaxfuse.posttrain.objectives import GRPO
from jaxfuse.testing.checkpoints import write_tiny_checkpoint
from jaxfuse.data import DataError, load_tokenizer

pytest.importorskip("transformers")

REWARDS = '''
def vowels(prompts, completions, **fields):
    """The share of vowels among the completion's characters."""
    return [sum(c in "aeiou" for c in text) / max(len(text), 1) for text in completions]


def broken(prompts, completions, **fields):
    raise ZeroDivisionError("a reward that fails")


def short(prompts, completions, **fields):
    return [0.0]


CALLS = []


def fails_third(prompts, completions, **fields):
    CALLS.append(1)
    if len(CALLS) == 3:
        raise RuntimeError("the third call fails")
    return [float(len(text)) for text in completions]
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  root = tmp_path_factory.mktemp("grpo")
  checkpoint = write_tiny_checkpoint(root / "ckpt", initializer_range=0.1)
  prompts = root / "prompts.jsonl"
  prompts.write_text("".join(json.dumps({"prompt": f"What is {a} plus {b}?", "answer": a + b})
                             + "\n" for a in range(1, 5) for b in range(1, 4)))
  (root / "my_rewards.py").write_text(REWARDS)
  return checkpoint, prompts, root / "my_rewards.py"


def _args(files, out, *extra):
  checkpoint, prompts, rewards = files
  return jtrain.parse_args([
      "--init-from", str(checkpoint), "--data", str(prompts), "--objective", "grpo",
      "--reward", f"{rewards}:vowels", "exact_match", "--reward-weights", "1,0.5",
      "--num-generations", "4", "--batch", "8", "--seq", "40", "--max-new-tokens", "10",
      "--steps", "4", "--warmup", "0", "--lr", "3e-3", "--sample-tokens", "0",
      "--log-every", "1", "--out", str(out), *extra])


def test_a_grpo_run_reports_its_rewards_and_trains(files, tmp_path):
  result = jtrain.train(_args(files, tmp_path / "run", "--beta", "0.04", "--num-iterations",
                              "2", "--loss-type", "grpo"), log=lambda *_: None)
  history, metrics = result["history"], result["history"]["metrics"]
  assert history["step"] == [1, 2, 3, 4]
  assert all(np.isfinite(history["loss"]))
  for name in ("reward", "reward_std", "rewards/vowels", "rewards/exact_match",
               "completion_length", "kl", "entropy", "clip_ratio/region_mean",
               "frac_reward_zero_std", "rollout_tokens_per_second"):
    assert len(metrics[name]) == 4, name
  # The vowel reward varies between completions: the groups have advantages, the policy moves
  # away from the reference (KL > 0 after the first updates) and the second update of a batch
  # sees ratios other than 1.
  assert max(metrics["reward_std"]) > 0
  assert metrics["kl"][-1] > 0
  assert all(1 <= n <= 10 for n in metrics["completion_length"])
  log = json.loads((tmp_path / "run" / "train_log.json").read_text())
  assert log["history"]["metrics"]["reward"] == metrics["reward"]


def test_resume_samples_and_trains_as_the_uninterrupted_run(files, tmp_path):
  whole = jtrain.train(_args(files, tmp_path / "whole", "--lora-rank", "4", "--grad-accum",
                             "2", "--batch", "4"), log=lambda *_: None)
  jtrain.train(_args(files, tmp_path / "split", "--lora-rank", "4", "--grad-accum", "2",
                     "--batch", "4", "--stop-at", "2", "--save-every", "2"), log=lambda *_: None)
  resumed = jtrain.train(_args(files, tmp_path / "split", "--lora-rank", "4", "--grad-accum",
                               "2", "--batch", "4", "--resume", "--save-every", "2"),
                         log=lambda *_: None)
  assert resumed["history"]["step"] == whole["history"]["step"]
  np.testing.assert_array_equal(resumed["history"]["metrics"]["reward"],
                                whole["history"]["metrics"]["reward"])
  np.testing.assert_allclose(resumed["history"]["loss"], whole["history"]["loss"], rtol=1e-6)


@pytest.mark.parametrize("name,error", [("broken", "broken.*raised ZeroDivisionError"),
                                        ("short", "short.*1")])
def test_a_bad_reward_stops_the_run_by_name(files, tmp_path, name, error):
  _, _, rewards = files
  args = _args(files, tmp_path / "run", "--save-every", "1")
  args.reward, args.reward_weights = [f"{rewards}:{name}"], None
  with pytest.raises(RewardError, match=error):
    jtrain.train(args, log=lambda *_: None)
  assert not (tmp_path / "run" / "checkpoints" / "1").exists()


def test_a_reward_failing_later_keeps_the_steps_done(files, tmp_path):
  """A reward that fails at step 3 stops the run naming it, after saving step 2: resuming
  continues from there."""
  _, _, rewards = files
  args = _args(files, tmp_path / "run", "--save-every", "10")
  args.reward, args.reward_weights = [f"{rewards}:fails_third"], None
  with pytest.raises(RewardError, match="fails_third.*the third call fails"):
    jtrain.train(args, log=lambda *_: None)
  assert (tmp_path / "run" / "checkpoints" / "2").is_dir()


@pytest.mark.parametrize("argv,message", [
    (["--reward-weights", "1"], "gives 1 weights for 2 --reward"),
    (["--num-generations", "3"], "must be a multiple of --num-generations"),
    (["--num-generations", "1", "--batch", "4"], "--num-generations must be >= 2"),
    (["--top-p", "0"], "--top-p must be in"),
    (["--scale-rewards", "std"], "--scale-rewards must be group, batch or none"),
    (["--loss-type", "ppo"], "unknown loss_type 'ppo'"),
    (["--max-new-tokens", "40"], "must leave room for the prompts"),
    (["--label-smoothing", "0.1"], "--label-smoothing is not an option of --objective grpo"),
])
def test_grpo_options_are_checked_by_name(files, tmp_path, argv, message):
  with pytest.raises(ValueError, match=message):
    jtrain.config.check_config(_args(files, tmp_path / "run", *argv))


def test_prompt_records_errors_name_the_line(files, tmp_path):
  checkpoint, _, _ = files
  tokenizer = load_tokenizer(checkpoint)
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"prompt": "fine"}\n{"question": "no prompt"}\n')
  with pytest.raises(DataError, match=r"bad.jsonl:2: a prompt record needs 'prompt'"):
    read_prompt_rows(bad, tokenizer)
  bad.write_text('{"prompt": ""}\n')
  with pytest.raises(DataError, match=r"bad.jsonl:1: 'prompt' is empty"):
    read_prompt_rows(bad, tokenizer)
  bad.write_text('{"prompt": "a much longer prompt than four tokens"}\n')
  with pytest.raises(DataError, match=r"more than the 4"):
    read_prompt_rows(bad, tokenizer, max_length=4)


def test_the_objective_is_grpo_loss_of_the_rollout_rows_and_makes_no_logits(files):
  """The batch :func:`rollout_batch` makes, through :class:`GRPO`: the loss equals
  :func:`grpo_loss` on the model's per-token log-probabilities (the targets on the completions
  only, the prompts' tokens before them), and the compiled gradient step holds no
  ``[tokens, V]`` array."""
  checkpoint, prompts, rewards = files
  model = interop.from_pretrained(checkpoint, dtype=jnp.float32)
  tokenizer = load_tokenizer(checkpoint)
  rows = read_prompt_rows(prompts, tokenizer)
  lengths = lambda prompts, completions, **_: [len(c) for c in completions]  # noqa: E731
  batch, metrics, samples = rollout_batch(
      model, rows, [0, 5], tokenizer=tokenizer, reward_fns=[lengths], reward_weights=None,
      num_generations=3, max_new_tokens=6, key=jax.random.key(0), seq=32)
  assert batch["tokens"].shape == (6, 32) and len(samples) == 6
  for i in range(6):   # each row: its prompt, then its completion as the targets
    p = int(rows.lengths[[0, 5][i // 3]])
    np.testing.assert_array_equal(batch["tokens"][i, :p], rows.ids[[0, 5][i // 3], :p])
    where = np.flatnonzero(batch["targets"][i] != -100)
    np.testing.assert_array_equal(batch["targets"][i, where], batch["tokens"][i, where + 1])
    assert where[0] == p - 1
  assert metrics["reward"] == np.mean([len(s["completion"]) for s in samples])
  batch = {k: jnp.asarray(v) for k, v in batch.items()}
  objective = GRPO(loss_type="dr_grpo", max_completion_length=6)
  loss, _ = objective.loss(model, batch)
  logps = model.token_log_probs(batch["tokens"], batch["targets"])
  want, _ = grpo_loss(logps, None, batch["advantages"][:, 0],
                      (batch["targets"] != -100).astype(jnp.float32), loss_type="dr_grpo",
                      max_completion_length=6)
  # The advantages of a group sum to 0: the loss is near 0, its gradient is not.
  np.testing.assert_allclose(float(loss), float(want), rtol=1e-5, atol=1e-6)
  model.lm_head.loss_options["chunk_size"] = 32   # 192 tokens: chunks of 32 of them
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def plain(p):
    m = nnx.merge(graphdef, p, rest)
    return grpo_loss(m.token_log_probs(batch["tokens"], batch["targets"]), None,
                     batch["advantages"][:, 0], (batch["targets"] != -100).astype(jnp.float32),
                     loss_type="dr_grpo", max_completion_length=6)[0]

  got = jax.grad(lambda p: objective.loss(nnx.merge(graphdef, p, rest), batch)[0])(params)
  want_grads = jax.grad(plain)(params)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4,
                               atol=1e-5 * float(np.max(np.abs(w))))
  text = jax.jit(jax.grad(lambda p: objective.loss(nnx.merge(graphdef, p, rest), batch)[0])
                 ).lower(params).compile().as_text()
  v = model.cfg.vocab_size
  assert f"[32,{v}]" in text   # a chunk's logits: the check sees the shapes
  assert f"[192,{v}]" not in text and f"[6,32,{v}]" not in text
