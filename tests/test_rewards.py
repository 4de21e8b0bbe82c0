"""jaxfuse.posttrain.rewards: the built-in rewards on edge cases, load_reward of each kind of spec
and its errors, score's weighting, None handling and errors, and group_advantages against a
torch transcription of TRL 1.16's GRPOTrainer advantages."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
import torch

from jaxfuse.posttrain import rewards as rewards_module
from jaxfuse.posttrain.rewards import (RewardError, exact_match, format_reward, group_advantages,
                                       length_penalty, load_reward, score)


def _exact(completions, answers):
  return exact_match(["q"] * len(completions), completions, answers)


@pytest.mark.parametrize("completion, answer, expected", [
    (r"So \boxed{4}.", "4", 1.0),
    (r"So \boxed{4}.", "5", 0.0),
    (r"first \boxed{3}, then \boxed{4}", 4, 1.0),
    (r"first \boxed{3}, then \boxed{4}", 3, 0.0),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\frac{\sqrt{2}}{2}} is it", r"\frac{\sqrt{2}}{2}", 1.0),
    (r"the box wins over a later number: \boxed{7} in 2 steps", 7, 1.0),
    (r"\boxed{ 4.0 }", 4, 1.0),
    (r"\boxed{1,234}", "1234", 1.0),
    (r"an unclosed \boxed{5 so the last number: 6", 6, 1.0),
    ("The answer is 42.", "42", 1.0),
    ("3 apples and 5 pears", 3, 0.0),
    ("It is -7 degrees", -7, 1.0),
    ("It is -7 degrees", 7, 0.0),
    ("10-4 leaves 6", 6, 1.0),
    ("10-4", 4, 1.0),
    ("pi is about 3.14.", "3.14", 1.0),
    ("pi is about 3.14", 3.14, 1.0),
    ("total: 4.50", "4.5", 1.0),
    ("4.0", "4", 1.0),
    ("It costs $1,234,567 in all", 1234567, 1.0),
    ("It costs 1,234.5", "1,234.50", 1.0),
    ("the list 1,2,3", 3, 1.0),
    ("no number at all", "4", 0.0),
    ("", 0, 0.0),
    (r"\boxed{x + 1}", "x + 1", 1.0),
    (r"\boxed{x + 1}", "x+1", 0.0),
])
def test_exact_match(completion, answer, expected):
  assert _exact([completion], [answer]) == [expected]


def test_exact_match_batch_and_none_answer():
  out = _exact([r"\boxed{2}", "2", "3"], ["2", None, 2.0])
  assert out == [1.0, None, 0.0]


def test_exact_match_needs_aligned_answers():
  with pytest.raises(ValueError):
    _exact(["1", "2"], ["1"])


def test_format_reward():
  reward = format_reward(r"<think>.*?</think>\s*<answer>\d+</answer>")
  completions = ["<think>a\nmulti-line\nthought</think>\n<answer>12</answer>",
                 "<think>a</think><answer>12</answer> trailing",
                 "preamble <think>a</think><answer>12</answer>",
                 "<think>a</think><answer>x</answer>"]
  assert reward(["q"] * 4, completions) == [1.0, 0.0, 0.0, 0.0]
  assert reward.__name__ == "format:<think>.*?</think>\\s*<answer>\\d+</answer>"
  assert pickle.loads(pickle.dumps(reward))(["q"], completions[:1]) == [1.0]


def test_format_reward_bad_pattern():
  with pytest.raises(ValueError, match=r"bad regular expression '\(unclosed'"):
    format_reward("(unclosed")


def test_length_penalty():
  reward = length_penalty(max_chars=10, target_chars=6)
  completions = ["", "abcdef", "abcdefg", "abcdefgh", "x" * 10, "x" * 11, "x" * 1000]
  assert reward([""] * 7, completions) == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0]
  default = length_penalty(max_chars=100)
  assert default([""] * 3, ["x" * 80, "x" * 90, "x" * 100]) == [0.0, -0.5, -1.0]
  assert default([""], ["é" * 90]) == [-0.5]  # characters, not bytes
  with pytest.raises(ValueError, match="target_chars < max_chars"):
    length_penalty(max_chars=10, target_chars=10)


def test_load_reward_builtins():
  assert load_reward("exact_match") is exact_match
  fmt = load_reward("format:a:b+")  # the regex may hold colons
  assert fmt(["q"] * 2, ["a:bbb", "ab"]) == [1.0, 0.0]
  length = load_reward("length:10")
  assert length([""] * 3, ["x" * 8, "x" * 9, "x" * 10]) == [0.0, -0.5, -1.0]
  with pytest.raises(ValueError, match="'length:ten'.*integer"):
    load_reward("length:ten")
  with pytest.raises(ValueError, match=r"'format:\['.*bad regular expression"):
    load_reward("format:[")


REWARD_SOURCE = """
def starts_with_yes(prompts, completions, **_):
  return [1.0 if c.startswith("yes") else 0.0 for c in completions]

NOT_CALLABLE = 3

class Scorers:
  @staticmethod
  def length(prompts, completions, **_):
    return [float(len(c)) for c in completions]
"""


def test_load_reward_module(tmp_path, monkeypatch):
  (tmp_path / "my_rewards_mod.py").write_text(REWARD_SOURCE)
  monkeypatch.syspath_prepend(str(tmp_path))
  fn = load_reward("my_rewards_mod:starts_with_yes")
  assert fn(["q"] * 2, ["yes!", "no"]) == [1.0, 0.0]
  assert load_reward("my_rewards_mod:Scorers.length")(["q"], ["abc"]) == [3.0]
  with pytest.raises(ValueError, match="'my_rewards_mod:missing'.*no attribute 'missing'"):
    load_reward("my_rewards_mod:missing")
  with pytest.raises(ValueError, match="'my_rewards_mod:NOT_CALLABLE'.*not callable"):
    load_reward("my_rewards_mod:NOT_CALLABLE")


def test_load_reward_file(tmp_path):
  path = tmp_path / "sub" / "file_rewards.py"
  path.parent.mkdir()
  path.write_text(REWARD_SOURCE)
  fn = load_reward(f"{path}:starts_with_yes")
  assert fn(["q"] * 2, ["no", "yes"]) == [0.0, 1.0]
  assert load_reward(f"{path}:starts_with_yes") is fn  # imported once
  with pytest.raises(ValueError, match="no attribute 'nope'"):
    load_reward(f"{path}:nope")
  with pytest.raises(ValueError, match="'.*missing.py:f'.*no file"):
    load_reward(f"{tmp_path / 'missing.py'}:f")
  broken = tmp_path / "broken.py"
  broken.write_text("def f(:\n")
  with pytest.raises(ValueError, match="broken.py:f'.*SyntaxError"):
    load_reward(f"{broken}:f")


def test_load_reward_errors():
  with pytest.raises(ValueError, match="'no_such_module_xyz:f'.*no module named 'no_such_mo"):
    load_reward("no_such_module_xyz:f")
  with pytest.raises(ValueError, match="'just_a_name'.*module:function"):
    load_reward("just_a_name")
  with pytest.raises(ValueError, match="'math:'"):
    load_reward("math:")
  with pytest.raises(ValueError, match="'math:pi'.*not callable"):
    load_reward("math:pi")
  assert load_reward("math:sqrt") is math.sqrt


def _constant(values):
  def constant(prompts, completions, **_):
    return list(values)
  return constant


def test_score_weighting_and_none():
  first = _constant([1.0, None, 0.5, None])
  second = _constant([2.0, 3.0, None, None])
  rewards, per_function = score([first, second], [0.5, 2.0], ["p"] * 4, list("abcd"), [{}] * 4)
  assert rewards.dtype == np.float32 and per_function.dtype == np.float32
  assert per_function.shape == (4, 2)
  np.testing.assert_array_equal(per_function,
                                [[1.0, 2.0], [np.nan, 3.0], [0.5, np.nan], [np.nan, np.nan]])
  np.testing.assert_array_equal(rewards, [4.5, 6.0, 0.25, np.nan])
  rewards, _ = score([first, second], None, ["p"] * 4, list("abcd"), [{}] * 4)
  np.testing.assert_array_equal(rewards, [3.0, 3.0, 0.5, np.nan])


def test_score_passes_fields_and_specs():
  seen = {}

  def record(prompts, completions, **fields):
    seen.update(prompts=prompts, completions=completions, **fields)
    return [0.0] * len(completions)

  rows = [{"prompt": "p1", "completion": "ref", "answer": "4", "level": 1},
          {"prompt": "p1", "completion": "ref", "answer": "4", "level": 1},
          {"prompt": "p2", "completion": "ref", "answer": "-2", "level": 3}]
  completions = [r"\boxed{4}", "5", "is -2"]
  rewards, per_function = score([record, "exact_match", "format:.*\\d"], [1.0, 1.0, 0.5],
                                ["p1", "p1", "p2"], completions, rows)
  assert seen == {"prompts": ["p1", "p1", "p2"], "completions": completions,
                  "answer": ["4", "4", "-2"], "level": [1, 1, 3]}
  np.testing.assert_array_equal(per_function[:, 1], [1.0, 0.0, 1.0])
  np.testing.assert_array_equal(rewards, [1.0, 0.5, 1.5])


def test_score_accepts_numpy_and_ints():
  rewards, _ = score([lambda prompts, completions, **_: np.array([1, 2], np.int64),
                      lambda prompts, completions, **_: (np.float32(0.5), 1)],
                     None, ["p"] * 2, ["a", "b"], [{}] * 2)
  np.testing.assert_array_equal(rewards, [1.5, 3.0])


def test_score_function_that_raises():
  def broken(prompts, completions, **_):
    raise KeyError("answer")

  with pytest.raises(RewardError, match="reward function 'broken' raised KeyError") as info:
    score([broken], None, ["p"], ["c"], [{}])
  assert isinstance(info.value.__cause__, KeyError)
  # A built-in missing its column is named by its spec.
  with pytest.raises(RewardError, match="'exact_match' raised TypeError.*answer") as info:
    score(["exact_match"], None, ["p"], ["c"], [{}])
  assert isinstance(info.value.__cause__, TypeError)


def test_score_wrong_count():
  short = _constant([1.0, 2.0])
  with pytest.raises(RewardError, match="'constant' returned 2 rewards, expected 3"):
    score([short], None, ["p"] * 3, list("abc"), [{}] * 3)
  with pytest.raises(RewardError, match="'constant' returned 4 rewards, expected 3"):
    score([_constant([1.0] * 4)], None, ["p"] * 3, list("abc"), [{}] * 3)


def test_score_not_a_sequence_names_the_function():
  def scalar(prompts, completions, **_):
    return 1.0

  with pytest.raises(RewardError, match="'scalar' returned a float, expected a sequence of 3"):
    score([scalar], None, ["p"] * 3, list("abc"), [{}] * 3)


@pytest.mark.parametrize("bad", ["1.0", [1.0], 1 + 2j])
def test_score_non_number(bad):
  values = _constant([1.0, bad, None])
  with pytest.raises(RewardError, match=r"'constant' returned .* for completion 1, expected 3 "
                                        r"numbers or None"):
    score([values], None, ["p"] * 3, list("abc"), [{}] * 3)


def test_score_argument_errors():
  one = _constant([1.0])
  with pytest.raises(ValueError, match="one weight per reward function"):
    score([one], [1.0, 2.0], ["p"], ["c"], [{}])
  with pytest.raises(ValueError, match="one prompt and one row per completion"):
    score([one], None, ["p"], ["c"], [{}, {}])
  with pytest.raises(ValueError, match="row 1 has no"):
    score([_constant([1.0, 1.0])], None, ["p"] * 2, ["c"] * 2, [{"answer": 1}, {}])


def _trl_nanstd(tensor, dim=None):
  """trl.trainer.utils.nanstd (TRL 1.16.0), transcribed."""
  mean = torch.nanmean(tensor, dim=dim, keepdim=True)
  variance = torch.nanmean((tensor - mean) ** 2, dim=dim, keepdim=True)
  count = torch.sum(~torch.isnan(tensor), dim=dim, keepdim=True)
  correction = count / (count - 1)
  correction = torch.where(count > 1, correction, torch.full_like(correction, float("nan")))
  variance *= correction
  std = torch.sqrt(variance)
  return std.squeeze(dim) if dim is not None else std.squeeze()


def _trl_advantages(rewards, num_generations, scale_rewards):
  """GRPOTrainer._generate_and_score_completions (TRL 1.16.0), "sum_then_normalize", from the
  summed rewards on, transcribed."""
  rewards = torch.tensor(rewards, dtype=torch.float32)
  mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
  mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
  if scale_rewards in ["group", "none"]:
    if num_generations > 1:
      std_rewards = _trl_nanstd(rewards.view(-1, num_generations), dim=1)
      std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
    else:
      std_rewards = torch.zeros_like(rewards)
  elif scale_rewards == "batch":
    if rewards.numel() > 1:
      std_rewards = _trl_nanstd(rewards).expand_as(rewards)
    else:
      std_rewards = torch.zeros_like(rewards)
  advantages = rewards - mean_grouped_rewards
  if scale_rewards != "none":
    advantages = advantages / (std_rewards + 1e-4)
  advantages = torch.nan_to_num(advantages, nan=0.0)
  return advantages.numpy(), std_rewards.numpy()


# Groups of 4: a spread one, a NaN reward, a zero-std one, one with a single scored reward.
REWARDS = [0.3, 1.7, -0.4, 2.25,
           1.0, float("nan"), 0.0, 0.5,
           0.5, 0.5, 0.5, 0.5,
           float("nan"), 3.0, float("nan"), float("nan")]


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
@pytest.mark.parametrize("num_generations", [4, 2, 1])
def test_group_advantages_match_trl(scale_rewards, num_generations):
  advantages, std = group_advantages(REWARDS, num_generations, scale_rewards)
  expected_advantages, expected_std = _trl_advantages(REWARDS, num_generations, scale_rewards)
  assert advantages.dtype == np.float32 and std.dtype == np.float32
  assert advantages.shape == std.shape == (len(REWARDS),)
  np.testing.assert_allclose(advantages, expected_advantages, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(std, expected_std, rtol=1e-6, atol=1e-6, equal_nan=True)
  assert not np.isnan(advantages).any()


def test_group_advantages_values():
  advantages, std = group_advantages(REWARDS, 4, "group")
  scored = np.array([0.3, 1.7, -0.4, 2.25])
  np.testing.assert_allclose(std[:4], np.std(scored, ddof=1), rtol=1e-6)
  expected = (scored - scored.mean()) / (scored.std(ddof=1) + 1e-4)
  np.testing.assert_allclose(advantages[:4], expected, rtol=1e-5)
  # The NaN reward is left out of its group's mean and std, and has advantage 0.
  group = np.array([1.0, 0.0, 0.5])
  assert advantages[5] == 0.0
  np.testing.assert_allclose(advantages[[4, 6, 7]],
                             (group - group.mean()) / (group.std(ddof=1) + 1e-4), rtol=1e-5)
  # The zero-std group: std 0, advantages 0; the group of one scored reward: std NaN, adv. 0.
  np.testing.assert_array_equal(std[8:12], 0.0)
  np.testing.assert_array_equal(advantages[8:], 0.0)
  assert np.isnan(std[12:]).all()
  unscaled, _ = group_advantages([1.0, 3.0], 2, "none")
  np.testing.assert_array_equal(unscaled, [-1.0, 1.0])


def test_group_advantages_booleans_and_errors():
  for flag, name in [(True, "group"), (False, "none")]:
    np.testing.assert_array_equal(group_advantages(REWARDS, 4, flag)[0],
                                  group_advantages(REWARDS, 4, name)[0])
  with pytest.raises(ValueError, match="scale_rewards must be one of"):
    group_advantages(REWARDS, 4, "mean")
  with pytest.raises(ValueError, match="do not split into groups of num_generations=3"):
    group_advantages(REWARDS, 3)


def test_score_then_advantages():
  rows = [{"answer": "4"}] * 4
  completions = [r"\boxed{4}", "4", "5", "I think 4."]
  rewards, _ = score([rewards_module.exact_match], None, ["2+2"] * 4, completions, rows)
  advantages, _ = group_advantages(rewards, 4)
  np.testing.assert_array_equal(rewards, [1.0, 1.0, 0.0, 1.0])
  assert advantages[2] < 0 < advantages[0] == advantages[1] == advantages[3]
