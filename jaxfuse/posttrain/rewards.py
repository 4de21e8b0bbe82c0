"""Rewards of completions and their group advantages, for reinforcement learning with verifiable
rewards (GRPO), in pure Python and numpy, as TRL 1.16's ``GRPOTrainer`` computes them.

A reward function follows TRL's convention: ``fn(prompts, completions, **fields)`` returns one
reward per completion, a number or ``None`` ("cannot score"). ``prompts`` and ``completions``
are lists of strings; ``fields`` are the other columns of the data rows, each a list aligned
with the completions (a prompt's row repeated for each of its generations).

- :func:`exact_match`, :func:`format_reward` and :func:`length_penalty`: built-in rewards;
- :func:`load_reward`: a reward function of its spec (``"module:function"``,
  ``"path/to/file.py:function"``, ``"exact_match"``, ``"format:<regex>"``, ``"length:<n>"``);
- :func:`score`: every reward function on a batch, and their weighted sum (TRL's
  ``_calculate_rewards`` and its ``"sum_then_normalize"`` aggregation);
- :func:`group_advantages`: each completion's reward less its group's mean, scaled as TRL's
  ``scale_rewards`` says.

Example:
  >>> rewards, per_function = score(["exact_match", "length:100"], [1.0, 0.5],
  ...                               ["2+2=", "2+2="], ["4", "5"], [{"answer": "4"}] * 2)
  >>> rewards.tolist(), per_function.tolist()
  ([1.0, 0.0], [[1.0, 0.0], [0.0, 0.0]])
  >>> advantages, std = group_advantages(rewards, num_generations=2)
  >>> print(advantages, std)
  [ 0.70700... -0.70700...] [0.70710... 0.70710...]
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import numbers
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["RewardError", "exact_match", "final_answer", "format_reward", "group_advantages",
           "length_penalty", "load_reward", "score"]

RewardFunction = Callable[..., Sequence[Any]]

# TRL's values of ``scale_rewards``, and its booleans' meanings (GRPOConfig.__post_init__).
SCALE_REWARDS = ("group", "batch", "none")
# The columns of a row that are not passed to reward functions as fields (as TRL's).
NOT_FIELDS = ("prompt", "completion")
# Added to the standard deviation before dividing by it (as TRL's).
STD_EPSILON = 1e-4

_BOXED = re.compile(r"\\boxed\s*\{")
# A number: an optional minus sign (not after a digit: "10-4" holds 10 and 4), digits with
# optional thousands separators ("1,234"), then an optional decimal part.
_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?"
_NUMBER_IN_TEXT = re.compile(r"(?<!\d)" + _NUMBER)
_WHOLE_NUMBER = re.compile(_NUMBER)


class RewardError(Exception):
  """A reward function raised, or returned something other than one number or ``None`` per
  completion."""


def _last_boxed(text: str) -> str | None:
  """The content of the last ``\\boxed{...}`` in ``text`` whose braces close, else ``None``."""
  for start in reversed([m.end() for m in _BOXED.finditer(text)]):
    depth = 1
    for i in range(start, len(text)):
      if text[i] == "{":
        depth += 1
      elif text[i] == "}":
        depth -= 1
        if depth == 0:
          return text[start:i]
  return None


def final_answer(completion: str) -> str | None:
  """The final answer of a completion: the content of its last ``\\boxed{...}`` (nested braces
  included), else its last number (``-1,234.5``), else ``None``.

  Example:
    >>> final_answer(r"so \\boxed{\\frac{1}{2}}"), final_answer("It costs -1,234.50 dollars.")
    ('\\\\frac{1}{2}', '-1,234.50')
    >>> final_answer("no idea") is None
    True
  """
  boxed = _last_boxed(completion)
  if boxed is not None:
    return boxed
  numbers_in_text = _NUMBER_IN_TEXT.findall(completion)
  return numbers_in_text[-1] if numbers_in_text else None


def _as_number(value: Any) -> Decimal | None:
  """``value`` as an exact number when it is one (``"1,234"``, ``"-0.50"``, ``4``, ``4.0``)."""
  if isinstance(value, bool):
    return None
  if isinstance(value, numbers.Integral):
    return Decimal(int(value))
  if isinstance(value, numbers.Real):
    try:
      return Decimal(repr(float(value)))
    except InvalidOperation:
      return None
  if isinstance(value, str) and _WHOLE_NUMBER.fullmatch(value.strip()):
    return Decimal(value.strip().replace(",", ""))
  return None


def _answers_match(predicted: str, answer: Any) -> bool:
  """Numerically when both are numbers, else as stripped strings."""
  predicted_number, answer_number = _as_number(predicted), _as_number(answer)
  if predicted_number is not None and answer_number is not None:
    return predicted_number == answer_number
  return predicted.strip() == str(answer).strip()


def exact_match(prompts: list[str], completions: list[str], answer: Sequence[Any],
                **_) -> list[float | None]:
  """1.0 where a completion's final answer (:func:`final_answer`: its last ``\\boxed{...}``,
  else its last number) equals its row's ``answer`` (str, int or float), else 0.0; ``None``
  where the answer is ``None``. Numbers compare by value (``"4.0"`` equals ``4``,
  ``"1,234"`` equals ``"1234"``), anything else as stripped strings.

  Example:
    >>> exact_match(["2+2=?"] * 4, [r"\\boxed{4.0}", "it is 4", "-4", "nothing"], [4] * 4)
    [1.0, 1.0, 0.0, 0.0]
  """
  rewards = []
  for completion, expected in zip(completions, answer, strict=True):
    if expected is None:
      rewards.append(None)
      continue
    predicted = final_answer(completion)
    rewards.append(1.0 if predicted is not None and _answers_match(predicted, expected) else 0.0)
  return rewards


class _FormatReward:
  """1.0 where a completion matches a pattern from start to end, else 0.0 (a class rather than
  a closure, so that it pickles)."""

  def __init__(self, pattern: str):
    try:
      self.regex = re.compile(pattern, re.DOTALL)
    except re.error as e:
      raise ValueError(f"format_reward: bad regular expression {pattern!r}: {e}") from e
    self.__name__ = f"format:{pattern}"

  def __call__(self, prompts: list[str], completions: list[str], **_) -> list[float]:
    return [1.0 if self.regex.fullmatch(c) else 0.0 for c in completions]

  def __repr__(self) -> str:
    return f"format_reward({self.regex.pattern!r})"


def format_reward(pattern: str) -> RewardFunction:
  """A reward function giving 1.0 where ``re.fullmatch(pattern, completion, re.DOTALL)``
  matches (the whole completion; ``.`` matches newlines too), else 0.0. The pattern is
  compiled once; a bad one raises ``ValueError`` naming it.

  Example:
    >>> reward = format_reward(r"<think>.*</think>\\s*<answer>.*</answer>")
    >>> reward(["q"] * 2, ["<think>a\\nb</think> <answer>4</answer>", "<answer>4</answer>"])
    [1.0, 0.0]
  """
  return _FormatReward(pattern)


class _LengthPenalty:
  """0 up to a target length in characters, then linearly down to -1 at a maximum length."""

  def __init__(self, max_chars: int, target_chars: int | None):
    if target_chars is None:
      target_chars = max_chars * 4 // 5
    if not 0 <= target_chars < max_chars:
      raise ValueError(f"length_penalty: needs 0 <= target_chars < max_chars, got "
                       f"target_chars={target_chars}, max_chars={max_chars}")
    self.max_chars, self.target_chars = max_chars, target_chars
    self.__name__ = f"length:{max_chars}"

  def __call__(self, prompts: list[str], completions: list[str], **_) -> list[float]:
    span = self.max_chars - self.target_chars
    return [0.0 if len(c) <= self.target_chars else -min(1.0, (len(c) - self.target_chars) / span)
            for c in completions]

  def __repr__(self) -> str:
    return f"length_penalty(max_chars={self.max_chars}, target_chars={self.target_chars})"


def length_penalty(max_chars: int, target_chars: int | None = None) -> RewardFunction:
  """A reward function penalizing long completions, by their length ``n`` in characters (code
  points): 0 while ``n <= target_chars``, then ``-(n - target_chars) / (max_chars -
  target_chars)``, down to -1 at ``max_chars`` and -1 beyond. ``target_chars`` defaults to
  four fifths of ``max_chars`` (the proportions of DAPO's soft overlong punishment, TRL's
  ``get_soft_overlong_punishment``, which counts tokens).

  Example:
    >>> reward = length_penalty(max_chars=10, target_chars=6)
    >>> reward([""] * 4, ["abc", "abcdefgh", "abcdefghij", "x" * 50])
    [0.0, -0.5, -1.0, -1.0]
  """
  return _LengthPenalty(max_chars, target_chars)


BUILTIN_SPECS = ("exact_match", "format:<regex>", "length:<n>")


def _import_file(path_text: str, spec: str):
  """The module of a Python file, registered under a name derived from its resolved path."""
  path = Path(path_text).expanduser().resolve()
  if not path.is_file():
    raise ValueError(f"reward {spec!r}: no file {str(path)!r}")
  digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
  name = f"_jaxfuse_reward_{path.stem}_{digest}"
  if name in sys.modules:
    return sys.modules[name]
  module_spec = importlib.util.spec_from_file_location(name, path)
  if module_spec is None or module_spec.loader is None:
    raise ValueError(f"reward {spec!r}: {str(path)!r} cannot be imported as a Python module")
  module = importlib.util.module_from_spec(module_spec)
  sys.modules[name] = module
  try:
    module_spec.loader.exec_module(module)
  except Exception as e:
    del sys.modules[name]
    raise ValueError(f"reward {spec!r}: importing {str(path)!r} raised "
                     f"{type(e).__name__}: {e}") from e
  return module


def _import_module(module_name: str, spec: str):
  try:
    return importlib.import_module(module_name)
  except ModuleNotFoundError as e:
    if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
      raise ValueError(f"reward {spec!r}: no module named {e.name!r}") from e
    raise ValueError(f"reward {spec!r}: importing {module_name!r} raised "
                     f"{type(e).__name__}: {e}") from e
  except Exception as e:
    raise ValueError(f"reward {spec!r}: importing {module_name!r} raised "
                     f"{type(e).__name__}: {e}") from e


def load_reward(spec: str) -> RewardFunction:
  """The reward function of ``spec``: a built-in, ``"exact_match"`` (:func:`exact_match`),
  ``"format:<regex>"`` (:func:`format_reward`) or ``"length:<n>"`` (:func:`length_penalty`
  with ``max_chars=n``), else ``"module:function"`` (imported with importlib) or
  ``"path/to/file.py:function"``; the function may be a dotted attribute path
  (``"module:Class.method"``). The built-in prefixes win over modules of those names. A
  missing module or file, a missing attribute or a non-callable one raises ``ValueError``
  naming ``spec``.

  Example:
    >>> load_reward("exact_match") is exact_match, load_reward("length:100")
    (True, length_penalty(max_chars=100, target_chars=80))
    >>> load_reward("statistics:mean").__name__
    'mean'
  """
  if spec == "exact_match":
    return exact_match
  if spec.startswith("format:"):
    try:
      return format_reward(spec[len("format:"):])
    except ValueError as e:
      raise ValueError(f"reward {spec!r}: {e}") from e
  if spec.startswith("length:"):
    try:
      max_chars = int(spec[len("length:"):])
    except ValueError:
      raise ValueError(f"reward {spec!r}: length:<n> needs an integer number of characters") \
        from None
    return length_penalty(max_chars)
  where, _, attribute = spec.rpartition(":")
  if not where or not attribute:
    raise ValueError(f"reward {spec!r}: expected one of {', '.join(BUILTIN_SPECS)}, "
                     f"'module:function' or 'path/to/file.py:function'")
  if where.endswith(".py") or "/" in where or "\\" in where:
    module = _import_file(where, spec)
  else:
    module = _import_module(where, spec)
  fn: Any = module
  for part in attribute.split("."):
    if not hasattr(fn, part):
      raise ValueError(f"reward {spec!r}: {where!r} has no attribute {attribute!r}")
    fn = getattr(fn, part)
  if not callable(fn):
    raise ValueError(f"reward {spec!r}: {attribute!r} of {where!r} is not callable (a "
                     f"{type(fn).__name__})")
  return fn


def _name(fn: Any) -> str:
  return getattr(fn, "__name__", None) or repr(fn)


def _as_reward(value: Any) -> float | None:
  """``value`` as a float (``None`` as NaN), or ``None`` when it is not a number."""
  if value is None:
    return float("nan")
  if isinstance(value, (str, bytes, complex)):
    return None
  if isinstance(value, numbers.Real):
    return float(value)
  if isinstance(value, np.ndarray) and value.ndim == 0 and np.isrealobj(value):
    return float(value)
  return None


def _call(fn: RewardFunction, name: str, prompts, completions, fields) -> np.ndarray:
  """The rewards ``[n]`` of one function, NaN where it returned ``None``."""
  try:
    output = fn(prompts=prompts, completions=completions, **fields)
  except Exception as e:
    raise RewardError(f"reward function {name!r} raised {type(e).__name__}: {e}") from e
  expected = len(completions)
  is_array = isinstance(output, np.ndarray) and output.ndim == 1
  if not is_array and (isinstance(output, (str, bytes)) or not isinstance(output, Sequence)):
    raise RewardError(f"reward function {name!r} returned a {type(output).__name__}, expected "
                      f"a sequence of {expected} rewards (one per completion)")
  if len(output) != expected:
    raise RewardError(f"reward function {name!r} returned {len(output)} rewards, expected "
                      f"{expected} (one per completion)")
  rewards = []
  for i, value in enumerate(output):
    reward = _as_reward(value)
    if reward is None:
      raise RewardError(f"reward function {name!r} returned {value!r} "
                        f"({type(value).__name__}) for completion {i}, expected {expected} "
                        f"numbers or None")
    rewards.append(reward)
  return np.asarray(rewards, np.float32)


def score(reward_fns: Sequence[RewardFunction | str], weights: Sequence[float] | None,
          prompts: list[str], completions: list[str],
          rows: Sequence[Mapping[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
  """The rewards ``[n]`` and each function's ``[n, k]`` (float32) of ``n`` completions.

  ``reward_fns`` are functions or their specs (:func:`load_reward`); ``weights`` one per
  function (``None``: all 1.0). ``rows`` are the data rows, one per completion: their columns
  but ``"prompt"`` and ``"completion"`` (as TRL's) are passed as fields, each a list aligned
  with the completions. A function's ``None`` is NaN in ``per_function``; a completion's
  reward is the weighted sum of its non-NaN ones (TRL's ``"sum_then_normalize"``), NaN where
  every function returned ``None``. A function that raises, returns a wrong number of rewards
  or something not a number or ``None`` raises :class:`RewardError` naming it (its
  ``__name__``, or its spec).

  Example:
    >>> half = lambda prompts, completions, **_: [0.5, None]
    >>> rewards, per_function = score([half, "format:a+"], [2.0, 1.0], ["p", "p"], ["aa", "b"],
    ...                               [{}, {}])
    >>> rewards.tolist(), per_function.tolist()
    ([2.0, 0.0], [[0.5, 1.0], [nan, 0.0]])
  """
  n = len(completions)
  if len(prompts) != n or len(rows) != n:
    raise ValueError(f"score: needs one prompt and one row per completion ({n}), got "
                     f"{len(prompts)} prompts and {len(rows)} rows")
  if not reward_fns:
    raise ValueError("score: needs at least one reward function")
  weights = [1.0] * len(reward_fns) if weights is None else list(weights)
  if len(weights) != len(reward_fns):
    raise ValueError(f"score: needs one weight per reward function ({len(reward_fns)}), got "
                     f"{len(weights)}")
  keys = [key for key in (rows[0] if rows else {}) if key not in NOT_FIELDS]
  for i, row in enumerate(rows):
    missing = [key for key in keys if key not in row]
    if missing:
      raise ValueError(f"score: row {i} has no {missing} (the first row's columns: {keys})")
  fields = {key: [row[key] for row in rows] for key in keys}
  columns = []
  for fn in reward_fns:
    name = fn if isinstance(fn, str) else _name(fn)
    if isinstance(fn, str):
      fn = load_reward(fn)
    columns.append(_call(fn, name, list(prompts), list(completions), fields))
  per_function = np.stack(columns, axis=1).reshape(n, len(columns))
  rewards = np.nansum(per_function * np.asarray(weights, np.float32)[None, :], axis=1)
  rewards[np.isnan(per_function).all(axis=1)] = np.nan
  return rewards.astype(np.float32), per_function


def _nanmean(x: np.ndarray, axis: int | None = None) -> np.ndarray:
  """torch.nanmean: the sum of the non-NaN values over their count (NaN when none)."""
  count = np.sum(~np.isnan(x), axis=axis, keepdims=True)
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.nansum(x, axis=axis, keepdims=True) / count.astype(x.dtype)


def _nanstd(x: np.ndarray, axis: int | None = None) -> np.ndarray:
  """TRL's ``nanstd``: the unbiased (ddof=1) standard deviation of the non-NaN values, NaN when
  fewer than two (keeps the reduced axis)."""
  variance = _nanmean((x - _nanmean(x, axis)) ** 2, axis)
  count = np.sum(~np.isnan(x), axis=axis, keepdims=True).astype(x.dtype)
  with np.errstate(invalid="ignore", divide="ignore"):
    correction = np.where(count > 1, count / (count - 1), np.nan).astype(x.dtype)
  return np.sqrt(variance * correction)


def group_advantages(rewards: Sequence[float] | np.ndarray, num_generations: int,
                     scale_rewards: str | bool = "group") -> tuple[np.ndarray, np.ndarray]:
  """TRL's advantages ``[n]`` of rewards ``[n]`` in groups of ``num_generations`` consecutive
  completions (a prompt's), and the standard deviation ``[n]`` each was scaled by.

  The advantage is the reward less its group's mean; ``scale_rewards`` ``"group"`` (or
  ``True``) divides it by the group's standard deviation (unbiased, ddof=1) + 1e-4,
  ``"batch"`` by the whole batch's + 1e-4, ``"none"`` (or ``False``) not at all (the group's
  standard deviation is still returned). NaN rewards are left out of the means and standard
  deviations, and their advantages are 0; so is the advantage of a group with one scored
  completion (its standard deviation is NaN). With one generation (or, for ``"batch"``, one
  completion) the standard deviation is 0. Computed in float32, as TRL's.

  Example:
    >>> advantages, std = group_advantages([1.0, 0.0, 2.0, 2.0], num_generations=2)
    >>> print(advantages.round(4), std.round(4))
    [ 0.707 -0.707  0.     0.   ] [0.7071 0.7071 0.     0.    ]
  """
  scale_rewards = {True: "group", False: "none"}.get(scale_rewards, scale_rewards)
  if scale_rewards not in SCALE_REWARDS:
    raise ValueError(f"group_advantages: scale_rewards must be one of {SCALE_REWARDS}, got "
                     f"{scale_rewards!r}")
  rewards = np.asarray(rewards, np.float32)
  if rewards.ndim != 1:
    raise ValueError(f"group_advantages: rewards must be 1-D, got shape {rewards.shape}")
  if num_generations < 1 or rewards.size % num_generations:
    raise ValueError(f"group_advantages: {rewards.size} rewards do not split into groups of "
                     f"num_generations={num_generations}")
  grouped = rewards.reshape(-1, num_generations)
  mean = np.repeat(_nanmean(grouped, axis=1)[:, 0], num_generations)
  if scale_rewards in ("group", "none"):
    if num_generations > 1:
      std = np.repeat(_nanstd(grouped, axis=1)[:, 0], num_generations)
    else:
      std = np.zeros_like(rewards)
  elif rewards.size > 1:
    std = np.broadcast_to(_nanstd(rewards).reshape(()), rewards.shape).copy()
  else:
    std = np.zeros_like(rewards)
  advantages = rewards - mean
  if scale_rewards != "none":
    advantages = advantages / (std + np.float32(STD_EPSILON))
  advantages = np.nan_to_num(advantages, nan=0.0)
  return advantages.astype(np.float32), std.astype(np.float32)
