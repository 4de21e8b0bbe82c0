"""Reinforcement learning with verifiable rewards end to end on this CPU: ``python -m
jaxfuse.train --objective grpo`` learning single-digit addition, and the rollouts' speed against
Hugging Face ``generate``.

The task the suite writes: the 100 prompts ``"a+b="`` (``a, b`` in 0..9), rewarded 1 when the
completion's last number is ``a + b`` (the built-in ``exact_match`` reward). The model: a decoder
from scratch (d_model 64, 2 layers, a byte-level BPE of 300 tokens trained on the records),
given ``SFT_STEPS`` steps of SFT on the 100 sums first, so that it answers some of them and
rewards differ within a group, then exported as a Hugging Face checkpoint, which both GRPO runs
start from.

- ``grpo ...`` case: ``GRPO_STEPS`` steps of ``--objective grpo`` (16 prompts x 8 completions a
  step, ``--max-new-tokens 4``, dapo loss, AdamW at 1.5e-3 after 10 warm-up steps), by the fused
  decoder (``jaxfuse``) and by plain flax/jax parts (``--baseline``: the full logits,
  ``jax-unfused``). The budget: those steps. Figures: ``time_ms``, one step (rollouts, rewards
  and the update) from the run's tokens per second between read-backs; the note gives the
  reward at the start (step 1's rollouts, the SFT model's), the mean of the last 10 steps and
  their ratio, and the first step at which the two runs' rewards differ; ``series`` holds the
  reward of every step (the plot draws them).
- ``rollout ...`` case: 16 prompts x 8 completions of exactly ``ROLLOUT_TOKENS`` new tokens
  (temperature 1, no EOS), :func:`jaxfuse.posttrain.rollout` (``jaxfuse``) against
  ``transformers``' ``generate`` (``hf-generate``: ``do_sample=True``,
  ``num_return_sequences=8``, the prompts left-padded, its KV cache) on the same checkpoint,
  timed interleaved; the note gives the tokens per second.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from benchmarks.records import Record
from benchmarks.suites.train_cli import step_times_ms

SUITE = "rl"
SFT_STEPS = 100
GRPO_STEPS = 300
QUICK_GRPO_STEPS = 150
PROMPTS, GENERATIONS, MAX_NEW = 16, 8, 4
ROLLOUT_TOKENS = 32
MODEL = ["--d-model", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--mlp", "128"]


def write_task(root: Path) -> tuple[Path, Path]:
  """The SFT records (``a+b=`` and the sum) and the prompt records (with their ``answer``)."""
  sums = [(a, b) for a in range(10) for b in range(10)]
  sft, prompts = root / "sft.jsonl", root / "prompts.jsonl"
  sft.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "completion": str(a + b)}) + "\n"
                         for a, b in sums))
  prompts.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": a + b}) + "\n"
                             for a, b in sums))
  return sft, prompts


def _train(argv: Sequence[str]) -> dict:
  from jaxfuse import train

  return train.train(train.parse_args(list(argv)), log=lambda *_: None)


def sft_checkpoint(root: Path, sft: Path) -> Path:
  """The SFT'd model of the task, exported as a Hugging Face checkpoint."""
  _train(["--data", str(sft), "--train-tokenizer", "300", *MODEL, "--seq", "48", "--batch",
          "8", "--steps", str(SFT_STEPS), "--warmup", "5", "--lr", "3e-3", "--loss-on",
          "completion", "--export-hf", str(root / "sft"), "--out", str(root / "sft-run"),
          "--sample-tokens", "0", "--no-tensorboard"])
  return root / "sft"


def grpo_argv(checkpoint: Path, prompts: Path, out: Path, steps: int, *extra: str) -> list[str]:
  return ["--objective", "grpo", "--init-from", str(checkpoint), "--data", str(prompts),
          "--reward", "exact_match", "--num-generations", str(GENERATIONS), "--batch",
          str(PROMPTS * GENERATIONS), "--max-new-tokens", str(MAX_NEW), "--seq", "16",
          "--steps", str(steps), "--warmup", str(min(10, steps - 1)), "--lr", "1.5e-3",
          "--log-every", "10", "--save-every", str(steps), "--sample-tokens", "0",
          "--no-tensorboard", "--out", str(out), *extra]


def _grpo_records(ctx, root: Path, checkpoint: Path, prompts: Path) -> list[Record]:
  steps = QUICK_GRPO_STEPS if ctx.quick else GRPO_STEPS
  case = (f"grpo addition d64 L2, {PROMPTS} prompts x {GENERATIONS} completions, "
          f"steps={steps}")
  runs = {}
  for impl, extra in (("jaxfuse", ()), ("jax-unfused", ("--baseline",))):
    ctx.step(f"{case}: {impl}")
    out = root / impl
    result = _train(grpo_argv(checkpoint, prompts, out, steps, *extra))
    rewards = result["history"]["metrics"]["reward"]
    tokens = PROMPTS * GENERATIONS * 16
    runs[impl] = (rewards, step_times_ms(out / "metrics.jsonl", tokens))
  fused = np.asarray(runs["jaxfuse"][0])
  differ = np.flatnonzero(fused != np.asarray(runs["jax-unfused"][0]))
  records = []
  for impl, (rewards, times) in runs.items():
    start, end = rewards[0], float(np.mean(rewards[-10:]))
    record = Record(suite=SUITE, case=case, impl=impl, platform=ctx.platform, dtype="float32",
                    series={"reward": [float(r) for r in rewards]})
    record.set("time_ms", {"median": statistics.median(times), "min": min(times),
                           "max": max(times), "runs": len(times)},
               "one step (rollouts, rewards, update) over the tokens/s of each span between "
               "the host's read-backs (metrics.jsonl), first step excluded")
    record.ratio_to = "jaxfuse"
    record.ratio = statistics.median(times) / statistics.median(runs["jaxfuse"][1])
    same = ("rewards equal the other run's at every step" if not len(differ) else
            f"rewards equal the other run's up to step {int(differ[0])}, then differ")
    record.note = (f"mean reward {start:.3f} at step 1 -> {end:.3f} over the last 10 steps "
                   f"({end / start:.2f}x) in {len(rewards)} steps; {same}")
    records.append(record)
  return records


def _rollout_records(ctx, checkpoint: Path, prompts: Path) -> list[Record]:
  import jax
  import torch
  import transformers

  from jaxfuse import data, interop
  from jaxfuse.posttrain import rollout
  from jaxfuse.posttrain.grpo import read_prompt_rows

  case = f"rollout {PROMPTS} prompts x {GENERATIONS} x {ROLLOUT_TOKENS} new tokens"
  ctx.step(case)
  tokenizer = data.load_tokenizer(checkpoint)
  rows = read_prompt_rows(prompts, tokenizer)
  ids, lengths = rows.ids[:PROMPTS], rows.lengths[:PROMPTS]
  model = interop.from_pretrained(checkpoint)
  hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
  width = int(lengths.max())
  left = np.zeros((PROMPTS, width), np.int64)
  mask = np.zeros((PROMPTS, width), np.int64)
  for i, n in enumerate(lengths):
    left[i, width - n:], mask[i, width - n:] = ids[i, :n], 1
  left, mask = torch.tensor(left), torch.tensor(mask)
  keys = iter(range(10**6))

  def ours():
    return rollout(model, ids, prompt_lengths=lengths, num_generations=GENERATIONS,
                   max_new_tokens=ROLLOUT_TOKENS, key=jax.random.key(next(keys)))

  def theirs():
    with torch.no_grad():
      return hf.generate(input_ids=left, attention_mask=mask, do_sample=True,
                         num_return_sequences=GENERATIONS, max_new_tokens=ROLLOUT_TOKENS,
                         min_new_tokens=ROLLOUT_TOKENS, top_k=0, pad_token_id=0)

  assert ours().completion_lengths.min() == ROLLOUT_TOKENS   # no EOS: every row full length
  assert theirs().shape == (PROMPTS * GENERATIONS, width + ROLLOUT_TOKENS)
  times = ctx.time({"jaxfuse": ours, "hf-generate": theirs}, sync=lambda out: out)
  tokens = PROMPTS * GENERATIONS * ROLLOUT_TOKENS
  records = []
  for impl in ("jaxfuse", "hf-generate"):
    record = Record(suite=SUITE, case=case, impl=impl, platform=ctx.platform, dtype="float32",
                    ratio_to="hf-generate",
                    ratio=times[impl]["median"] / times["hf-generate"]["median"])
    record.set("time_ms", times[impl], "interleaved rounds in one process; compilation out")
    record.note = f"{tokens / (times[impl]['median'] / 1e3):,.0f} new tokens/s"
    records.append(record)
  return records


def run(ctx) -> list[Record]:
  with tempfile.TemporaryDirectory() as tmp:
    root = Path(tmp)
    sft, prompts = write_task(root)
    ctx.step(f"SFT of the task, {SFT_STEPS} steps")
    checkpoint = sft_checkpoint(root, sft)
    return (_grpo_records(ctx, root, checkpoint, prompts)
            + _rollout_records(ctx, checkpoint, prompts))


def headline(records) -> list[Record]:
  return list(records)


def plot(records: Sequence[Record], path: str) -> None:
  """Left: the mean reward of every step of both GRPO runs (and its moving mean over 10 steps),
  with twice the starting reward drawn across; right: the rollouts' time over HF generate's."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.4),
                                    gridspec_kw={"width_ratios": [2, 1]})
  learning = [r for r in records if r.series and "reward" in r.series]
  for i, r in enumerate(learning):
    rewards = np.asarray(r.series["reward"])
    steps = np.arange(1, len(rewards) + 1)
    left.plot(steps, rewards, color=f"C{i}", alpha=0.25, lw=0.8)
    window = min(10, len(rewards))
    smooth = np.convolve(rewards, np.ones(window) / window, mode="valid")
    left.plot(steps[window - 1:], smooth, color=f"C{i}", lw=2,
              label=f"{r.impl} ({window}-step mean)")
  if learning:
    start = learning[0].series["reward"][0]
    left.axhline(2 * start, color="k", ls="--", lw=1,
                 label=f"twice step 1's reward (2 x {start:.2f})")
    left.set_title(learning[0].case, fontsize=9)
  left.set_xlabel("step")
  left.set_ylabel("mean reward of the step's rollouts")
  left.set_ylim(0, 1)
  left.legend(fontsize=8, loc="lower right")
  speed = [r for r in records if r.case.startswith("rollout")]
  xs = np.arange(len(speed))
  bars = right.bar(xs, [r.time_ms["median"] for r in speed],
                   color=[f"C{i + 2}" for i in range(len(speed))])
  for bar, r in zip(bars, speed):
    right.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), r.note, ha="center",
               va="bottom", fontsize=8)
  right.set_xticks(xs, [r.impl for r in speed])
  right.set_ylabel("ms (median)")
  right.set_title(speed[0].case if speed else "rollouts", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
