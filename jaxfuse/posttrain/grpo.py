"""GRPO's data: prompt records, and the training batch a step makes of its rollouts.

A step of reinforcement learning with verifiable rewards takes a batch of prompts, samples
``G`` completions of each with the current policy (:func:`jaxfuse.posttrain.rollout`), scores
them with the reward functions (:func:`jaxfuse.posttrain.score`), turns the rewards into group
advantages (:func:`jaxfuse.posttrain.group_advantages`) and trains on the completions
(:class:`jaxfuse.posttrain.objectives.GRPO`). :func:`rollout_batch` does all but the last: it
returns the rows the training step reads, as the trainer's other objectives read theirs
(``tokens`` and ``targets`` ``[n, seq]``: prompt then completion, the targets on the completion
tokens only), with each row's advantage, and the step's metrics.

Prompt records (:func:`read_prompt_rows`): JSON lines or Parquet rows with a ``prompt`` (a
string, or a list of ``{role, content}`` messages rendered by the tokenizer's chat template
with the assistant's turn opened); every other column (an ``answer``, say) is passed to the
reward functions as a field.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxfuse.data.encoding import Encoder
from jaxfuse.data.packing import IGNORE_INDEX
from jaxfuse.data.records import DataError, read_objects, resolve_files
from jaxfuse.posttrain.rewards import group_advantages, score
from jaxfuse.posttrain.rollouts import rollout

__all__ = ["PromptRows", "read_prompt_rows", "rollout_batch"]


@dataclasses.dataclass
class PromptRows:
  """Prompt records encoded: ``ids [n, width]`` right-padded with 0, ``lengths [n]``, the
  prompts as written (``prompts``: strings or message lists), the other columns of each record
  (``fields``) and where each came from (``sources``, file and line)."""

  ids: np.ndarray
  lengths: np.ndarray
  prompts: list
  fields: list[dict]
  sources: list[str]
  fingerprint: str

  def __len__(self) -> int:
    return len(self.prompts)

  def indices(self, step: int, batch: int, seed: int) -> np.ndarray:
    """The prompts of step ``step``: ``batch`` of them from an order shuffled by ``seed`` anew
    each pass over the records (a function of the step: a resumed run draws the same)."""
    first = step * batch
    out = []
    for k in range(first, first + batch):
      epoch, at = divmod(k, len(self))
      order = np.random.default_rng([seed, epoch]).permutation(len(self))
      out.append(int(order[at]))
    return np.asarray(out, np.int64)


def read_prompt_rows(paths, tokenizer: Any, *, vocab_size: int | None = None,
                     max_length: int | None = None) -> PromptRows:
  """The prompt records of ``paths`` (files, directories, globs of ``.jsonl`` and ``.parquet``).

  Raises:
    DataError: naming the file and line: a record that is not an object, one without a
      ``prompt`` or with an empty one, a prompt of another type than a string or a message
      list, a prompt longer than ``max_length`` tokens, token ids past ``vocab_size``.
  """
  files = resolve_files(paths)
  encoder = Encoder(tokenizer, vocab_size=vocab_size)
  encoded, prompts, fields, sources = [], [], [], []
  for where, obj in read_objects(files):
    if not isinstance(obj, dict):
      raise DataError(f"{where}: expected a JSON object, got a {type(obj).__name__}")
    prompt = obj.get("prompt")
    if prompt is None:
      raise DataError(f"{where}: a prompt record needs 'prompt'; it has "
                      f"{sorted(k for k, v in obj.items() if v is not None)}")
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
      prompt = [dict(m) for m in prompt]
    elif not isinstance(prompt, str):
      raise DataError(f"{where}: 'prompt' is a {type(prompt).__name__}, expected a string or a "
                      "list of {'role', 'content'} messages")
    if not prompt:
      raise DataError(f"{where}: 'prompt' is empty")
    ids = encoder.encode_prompt(prompt, where)
    if max_length is not None and len(ids) > max_length:
      raise DataError(f"{where}: the prompt has {len(ids)} tokens, more than the {max_length} "
                      "that leave room for the completion in --seq")
    encoded.append(ids)
    prompts.append(prompt)
    fields.append({k: v for k, v in obj.items() if k != "prompt"})
    sources.append(where)
  if not encoded:
    raise DataError(f"no prompt records in {', '.join(str(f) for f in files)}")
  lengths = np.asarray([len(x) for x in encoded], np.int32)
  ids = np.zeros((len(encoded), int(lengths.max())), np.int32)
  for i, x in enumerate(encoded):
    ids[i, :len(x)] = x
  digest = hashlib.sha256()
  for x, f in zip(encoded, fields):
    digest.update(x.tobytes())
    digest.update(json.dumps(f, sort_keys=True, default=str).encode())
  return PromptRows(ids, lengths, prompts, fields, sources, digest.hexdigest()[:20])


def _prompt_text(prompt) -> str:
  """A prompt as the reward functions see it: the string, or the last message's content."""
  return prompt if isinstance(prompt, str) else str(prompt[-1].get("content", ""))


def rollout_batch(model, rows: PromptRows, indices: Sequence[int], *, tokenizer: Any,
                  reward_fns: Sequence[Callable], reward_weights: Sequence[float] | None,
                  num_generations: int, max_new_tokens: int, key: jax.Array, seq: int,
                  temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                  scale_rewards: str = "group", eos_token_ids: Sequence[int] = ()
                  ) -> tuple[dict[str, np.ndarray], dict[str, float], list[dict]]:
  """``(batch, metrics, samples)`` of one step: ``G = num_generations`` completions of each
  prompt ``indices`` sampled by ``model``, scored and made into training rows.

  ``batch`` (numpy, ``n = len(indices) * G`` rows of ``seq`` tokens): ``tokens`` (prompt, then
  completion, then 0), ``targets`` (each completion token at the position before it, else
  ``IGNORE_INDEX``), ``advantages`` (the row's group advantage, repeated along ``seq``).
  ``metrics``: ``reward`` and ``reward_std`` (TRL's: the mean reward and the mean of the
  groups' standard deviations), ``rewards/<function>`` (each function's mean),
  ``completion_length``, ``completions/clipped_ratio`` (the share that hit ``max_new_tokens``
  without an EOS), ``frac_reward_zero_std`` and ``rollout_tokens_per_second``. ``samples``:
  prompt, completion and reward of each row (the trainer logs a few).

  Raises:
    RewardError: a reward function raised, or returned a wrong count or a non-number.
  """
  indices = np.asarray(indices, np.int64)
  out = rollout(model, rows.ids[indices], prompt_lengths=rows.lengths[indices],
                num_generations=num_generations, max_new_tokens=max_new_tokens, key=key,
                temperature=temperature, top_p=top_p, top_k=top_k,
                eos_token_ids=tuple(eos_token_ids))
  n = len(indices) * num_generations
  owner = np.repeat(indices, num_generations)
  completions = [tokenizer.decode(out.completion_ids[i, :out.completion_lengths[i]],
                                  skip_special_tokens=True) for i in range(n)]
  prompts = [_prompt_text(rows.prompts[j]) for j in owner]
  rewards, per_function = score(reward_fns, reward_weights, prompts, completions,
                                [rows.fields[j] for j in owner])
  advantages, std = group_advantages(rewards, num_generations, scale_rewards)

  width = out.prompt_ids.shape[1] + max_new_tokens
  if width > seq:
    raise ValueError(f"rollout_batch: the prompts ({out.prompt_ids.shape[1]} tokens) and "
                     f"--max-new-tokens ({max_new_tokens}) exceed --seq ({seq})")
  tokens = np.zeros((n, seq), np.int32)
  targets = np.full((n, seq), IGNORE_INDEX, np.int32)
  for i in range(n):
    p, c = int(out.prompt_lengths[i]), int(out.completion_lengths[i])
    tokens[i, :p] = out.prompt_ids[i, :p]
    tokens[i, p:p + c] = out.completion_ids[i, :c]
    targets[i, p - 1:p - 1 + c] = out.completion_ids[i, :c]
  batch = {"tokens": tokens, "targets": targets,
           "advantages": np.repeat(advantages[:, None], seq, axis=1).astype(np.float32)}
  names = [getattr(f, "__name__", str(f)) for f in reward_fns]
  metrics = {"reward": float(np.nanmean(rewards)) if np.isfinite(rewards).any() else np.nan,
             "reward_std": float(np.nanmean(std)) if np.isfinite(std).any() else 0.0,
             "completion_length": float(np.mean(out.completion_lengths)),
             "completions/clipped_ratio": float(np.mean(~out.finished)),
             "frac_reward_zero_std": float(np.mean(np.isclose(np.nan_to_num(std), 0.0))),
             "rollout_tokens_per_second": float(out.tokens_per_second)}
  for k, name in enumerate(names):
    column = per_function[:, k]
    metrics[f"rewards/{name}"] = (float(np.nanmean(column)) if np.isfinite(column).any()
                                  else np.nan)
  samples = [{"prompt": prompts[i], "completion": completions[i], "reward": float(rewards[i])}
             for i in range(n)]
  return batch, metrics, samples
