"""Batched rollouts (:mod:`jaxfuse.posttrain.rollouts`) on tiny checkpoints that ``transformers``
wrote: greedy completions of prompts of different lengths token for token equal to Hugging
Face's left-padded ``generate`` (with and without an EOS that stops rows early), sampling
reproducible from the key, ``logps`` equal to the full forward's log-softmax, the logits
processors equal to Hugging Face's, stop strings and the option errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxfuse import interop
from jaxfuse.posttrain.rollouts import process_logits, rollout, truncate_at_stop_strings
from jaxfuse.testing.checkpoints import write_tiny_checkpoint

transformers = pytest.importorskip("transformers")

PROMPT_LENGTHS = (3, 7, 5)
STEPS = 8
PAD = 0


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(1, vocab, n).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def checkpoint(request, tmp_path_factory):
  """``(hf model, jaxfuse model)`` of one tiny checkpoint, float32."""
  directory = write_tiny_checkpoint(tmp_path_factory.mktemp(request.param),
                                    family=request.param, seed=1, initializer_range=0.1)
  hf = transformers.AutoModelForCausalLM.from_pretrained(
      directory, attn_implementation="eager").float().eval()
  return hf, interop.from_pretrained(directory, dtype=jnp.float32), directory


def _hf_greedy(hf, prompts, eos=None) -> list[list[int]]:
  """Each prompt's greedy completion by ``generate`` on a left-padded batch, padding and
  everything after an EOS stripped."""
  width = max(map(len, prompts))
  ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
  mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
  config = transformers.GenerationConfig(do_sample=False, max_new_tokens=STEPS,
                                         pad_token_id=PAD, eos_token_id=eos)
  with torch.no_grad():
    out = hf.generate(ids, attention_mask=mask, generation_config=config)[:, width:].tolist()
  completions = []
  for row in out:
    end = row.index(eos) + 1 if eos is not None and eos in row else len(row)
    completions.append(row[:end])
  return completions


def _assert_rows_equal(out, want: list[list[int]]):
  for row, tokens in enumerate(want):
    n = len(tokens)
    assert out.completion_lengths[row] == n
    assert out.completion_ids[row, :n].tolist() == tokens, row
    assert np.all(out.completion_ids[row, n:] == PAD)
    assert out.completion_mask[row].tolist() == [j < n for j in range(STEPS)]
    assert np.all(out.logps[row, n:] == 0) and np.all(out.logps[row, :n] < 0)


def test_greedy_rollouts_equal_hf_generate_on_left_padded_prompts(checkpoint):
  hf, model, _ = checkpoint
  prompts = _prompts(model.cfg.vocab_size)
  want = _hf_greedy(hf, prompts)
  assert all(len(w) == STEPS for w in want)
  out = rollout(model, prompts, num_generations=1, max_new_tokens=STEPS, key=jax.random.key(0),
                temperature=0, pad_token_id=PAD)
  assert out.prompt_lengths.tolist() == list(PROMPT_LENGTHS)
  for row, prompt in enumerate(prompts):
    assert out.prompt_ids[row].tolist() == prompt + [PAD] * (7 - len(prompt))
  _assert_rows_equal(out, want)
  assert not out.finished.any() and out.tokens_per_second > 0

  # An EOS that some row emits early (a token of row 1's completion not before it).
  tokens = want[1]
  eos = next(t for j, t in enumerate(tokens[1:], 1) if t not in tokens[:j] and j < STEPS - 1)
  want = _hf_greedy(hf, prompts, eos=eos)
  assert min(map(len, want)) < STEPS
  out = rollout(model, prompts, num_generations=1, max_new_tokens=STEPS, key=jax.random.key(0),
                temperature=0, pad_token_id=PAD, eos_token_ids=[eos])
  _assert_rows_equal(out, want)
  assert out.finished.tolist() == [w[-1] == eos for w in want]


def test_sampling_is_reproducible_from_the_key_and_generations_differ(checkpoint):
  _, model, _ = checkpoint
  prompts, g = _prompts(model.cfg.vocab_size, seed=1), 4

  def sample(seed):
    return rollout(model, prompts, num_generations=g, max_new_tokens=STEPS,
                   key=jax.random.key(seed), temperature=1.0, top_p=0.95, top_k=50)

  a, b, c = sample(0), sample(0), sample(1)
  np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
  np.testing.assert_array_equal(a.logps, b.logps)
  assert not np.array_equal(a.completion_ids, c.completion_ids)
  assert a.completion_ids.shape == (len(prompts) * g, STEPS) and a.num_generations == g
  for i, prompt in enumerate(prompts):
    rows = slice(i * g, (i + 1) * g)
    assert np.all(a.prompt_ids[rows, :len(prompt)] == prompt)
    assert np.all(a.prompt_lengths[rows] == len(prompt))
    assert len({tuple(r) for r in a.completion_ids[rows].tolist()}) > 1   # they differ
  assert np.all(a.sampling_logps >= a.logps - 1e-6)   # top-k, top-p only concentrate


def test_logps_equal_the_full_forward_and_top_k_one_is_greedy(checkpoint):
  _, model, _ = checkpoint
  prompts, temperature = _prompts(model.cfg.vocab_size, seed=2), 0.7
  greedy = rollout(model, prompts, num_generations=1, max_new_tokens=STEPS, key=jax.random.key(0),
                   temperature=0)
  eos = int(greedy.completion_ids[0, 2])   # rows stop early where they sample it
  out = rollout(model, prompts, num_generations=2, max_new_tokens=STEPS, key=jax.random.key(3),
                temperature=temperature, top_k=20, top_p=0.9, eos_token_ids=eos)
  logits = jax.jit(model.logits)
  for row in range(out.completion_ids.shape[0]):
    p, n = out.prompt_lengths[row], out.completion_lengths[row]
    tokens = np.concatenate([out.prompt_ids[row, :p], out.completion_ids[row, :n]])
    full = logits(jnp.asarray(tokens)[None])[0, p - 1:p + n - 1]   # predicting the completion
    want = jnp.take_along_axis(jax.nn.log_softmax(full / temperature), tokens[p:, None], -1)
    np.testing.assert_allclose(out.logps[row, :n], want[:, 0], atol=1e-5, rtol=0)
    processed = process_logits(full, temperature=temperature, top_k=20, top_p=0.9)
    want = jnp.take_along_axis(jax.nn.log_softmax(processed), tokens[p:, None], -1)
    np.testing.assert_allclose(out.sampling_logps[row, :n], want[:, 0], atol=1e-5, rtol=0)
    assert np.all(out.logps[row, n:] == 0) and np.all(out.sampling_logps[row, n:] == 0)
    assert out.finished[row] == (out.completion_ids[row, n - 1] == eos)

  top1 = rollout(model, prompts, num_generations=1, max_new_tokens=STEPS, key=jax.random.key(5),
                 temperature=temperature, top_k=1)
  np.testing.assert_array_equal(top1.completion_ids, greedy.completion_ids)
  np.testing.assert_array_equal(top1.sampling_logps, 0.0)


@pytest.mark.parametrize("top_k, top_p", [(0, 0.8), (5, 1.0), (7, 0.5)])
def test_process_logits_equals_hf_logits_processors(top_k, top_p):
  logits = np.random.default_rng(0).normal(size=(4, 50)).astype(np.float32) * 3
  processors = transformers.LogitsProcessorList([transformers.TemperatureLogitsWarper(0.6)])
  if top_k:
    processors.append(transformers.TopKLogitsWarper(top_k))
  if top_p < 1:
    processors.append(transformers.TopPLogitsWarper(top_p))
  want = processors(None, torch.tensor(logits)).numpy()
  got = np.asarray(process_logits(jnp.asarray(logits), temperature=0.6, top_k=top_k, top_p=top_p))
  np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
  np.testing.assert_allclose(got[~np.isinf(got)], want[~np.isinf(want)], rtol=1e-6)


def test_stop_strings_cut_the_completion_after_the_matching_token(checkpoint):
  _, model, directory = checkpoint
  tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
  out = rollout(model, _prompts(model.cfg.vocab_size), num_generations=1, max_new_tokens=STEPS,
                key=jax.random.key(0), temperature=0)
  ids = out.completion_ids[0].tolist()
  stop = tokenizer.decode(ids[2:4])
  assert stop, "the tokens decode to text"
  cut = truncate_at_stop_strings(out, tokenizer, [stop, "never in the text \x00"])
  n = cut.completion_lengths[0]
  assert n <= 4 and cut.finished[0]
  assert stop in tokenizer.decode(ids[:n]) and stop not in tokenizer.decode(ids[:n - 1])
  assert cut.completion_mask[0].sum() == n and np.all(cut.logps[0, n:] == 0)
  np.testing.assert_array_equal(cut.completion_ids, out.completion_ids)   # kept, not counted
  for row in (1, 2):
    if stop not in tokenizer.decode(out.completion_ids[row].tolist()):
      assert cut.completion_lengths[row] == STEPS and not cut.finished[row]


@pytest.mark.parametrize("change, message", [
    (dict(num_generations=0), "num_generations"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(temperature=-0.1), "temperature"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(prompts=[[1, 2], []]), "prompt 1"),
    (dict(prompts=[]), "no prompts"),
    (dict(prompts=[[1] * 500]), "max_seq_len"),
])
def test_bad_options_raise(checkpoint, change, message):
  _, model, _ = checkpoint
  args = dict(prompts=[[1, 2, 3]], num_generations=2, max_new_tokens=13, key=jax.random.key(0))
  args.update(change)
  with pytest.raises(ValueError, match=message):
    rollout(model, args.pop("prompts"), **args)
