"""Preference data as rows: each pair's chosen and rejected sequences packed into one row.

A preference record is an object with ``prompt``, ``chosen`` and ``rejected`` (TRL's
preference format), read from JSON lines or Parquet (:func:`jaxfuse.data.read_objects`):

- strings: the prompt after the tokenizer's leading special tokens, then the completion and
  the tokenizer's trailing ones and EOS, as :class:`jaxfuse.data.Encoder` encodes
  ``prompt``/``completion`` records;
- chat messages: ``prompt`` a list of messages, ``chosen`` and ``rejected`` lists of the
  assistant message(s) that follow it, rendered by the tokenizer's chat template
  (:meth:`jaxfuse.data.Encoder.encode_chat`); only the completion's assistant turns are
  targets.

A row of ``seq`` tokens holds one pair: prompt + chosen as segment 1, then prompt + rejected as
segment 2 (positions restart; attention stays inside each), then padding (segment 0). The
targets are the next tokens of each completion, :data:`~jaxfuse.data.IGNORE_INDEX` elsewhere. A
pair longer than the row has each sequence cut to its first ``seq // 2`` tokens (TRL's
``keep_start`` truncation); a pair whose prompt leaves no completion token is an error naming
its file and line, as is every other bad record.

Example:
  >>> import pathlib, tempfile
  >>> from jaxfuse.data import ByteTokenizer
  >>> path = pathlib.Path(tempfile.mkdtemp()) / "pairs.jsonl"
  >>> _ = path.write_text('{"prompt": "2+2=", "chosen": "4", "rejected": "5"}\\n')
  >>> rows = read_preference_rows(path, ByteTokenizer(), seq=12)
  >>> rows.segment_ids.tolist(), rows.targets.tolist()
  ([[1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 0, 0]], [[-100, -100, -100, 52, -100, -100, -100, -100, \
53, -100, -100, -100]])
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from jaxfuse.data import DataError, Encoder, Record, read_objects, resolve_files
from jaxfuse.data.cache import data_fingerprint
from jaxfuse.data.packing import IGNORE_INDEX

__all__ = ["PreferenceRows", "read_kto_rows", "read_preference_rows"]

# Bump when the rows' layout changes.
LAYOUT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class PreferenceRows:
  """``[pairs, seq]`` int32 ``tokens``, ``targets``, ``positions`` and ``segment_ids`` (1: the
  chosen sequence, 2: the rejected one; for KTO the completion and its mismatched pair, with
  the ``labels``), the record each row came from, how many pairs were cut to fit, and a
  fingerprint of the files, tokenizer and ``seq``."""
  tokens: np.ndarray
  targets: np.ndarray
  positions: np.ndarray
  segment_ids: np.ndarray
  sources: tuple[str, ...]
  truncated: int
  fingerprint: str
  labels: np.ndarray | None = None

  def __len__(self) -> int:
    return self.tokens.shape[0]

  def rows(self, indices) -> dict[str, np.ndarray]:
    """The rows ``indices`` as a batch of the model's arguments."""
    indices = np.asarray(indices)
    rows = {"tokens": self.tokens[indices], "targets": self.targets[indices],
            "positions": self.positions[indices], "segment_ids": self.segment_ids[indices]}
    if self.labels is not None:
      rows["labels"] = self.labels[indices]
    return rows


def _text(obj: dict, name: str, where: str) -> str | list[dict]:
  if name not in obj or obj[name] is None:
    present = sorted(k for k, v in obj.items() if v is not None)
    raise DataError(f"{where}: a preference record needs 'prompt', 'chosen' and 'rejected'; "
                    f"it has no {name!r} (it has {present})")
  value = obj[name]
  if isinstance(value, str):
    return value
  if isinstance(value, (list, tuple)) and all(isinstance(m, dict) for m in value):
    return [dict(m) for m in value]
  raise DataError(f"{where}: field {name!r} is a {type(value).__name__}, expected a string or a "
                  "list of {'role', 'content'} messages")


def _sequence(encoder: Encoder, where: str, prompt, completion, name: str):
  """``(ids, loss_mask)`` of prompt + completion, the loss on the completion only."""
  if isinstance(prompt, str) != isinstance(completion, str):
    raise DataError(f"{where}: 'prompt' and {name!r} must both be strings or both message "
                    "lists")
  if isinstance(prompt, str):
    if not completion:
      raise DataError(f"{where}: {name!r} is empty")
    return encoder(Record(where, "prompt_completion", prompt=prompt, completion=completion))
  if not completion or any(m.get("role") != "assistant" for m in completion):
    raise DataError(f"{where}: {name!r} must be a non-empty list of assistant messages")
  if any(not m.get("content") for m in completion):
    raise DataError(f"{where}: {name!r} has an empty assistant message")
  return encoder.encode_chat(list(prompt) + list(completion), where, loss_from=len(prompt))


def _place(row: dict, ids: np.ndarray, mask: np.ndarray, start: int, segment: int) -> None:
  n = len(ids)
  row["tokens"][start:start + n] = ids
  row["targets"][start:start + n - 1] = np.where(mask[1:] > 0, ids[1:], IGNORE_INDEX)
  row["positions"][start:start + n] = np.arange(n)
  row["segment_ids"][start:start + n] = segment


def _pair_row(pair, seq: int, where: str, names: tuple[str, str]) -> tuple[dict, bool]:
  """Two ``(ids, loss_mask)`` sequences as one row (segments 1 and 2), each cut to ``seq // 2``
  tokens when both do not fit; whether they were cut."""
  cut = sum(len(ids) for ids, _ in pair) > seq
  if cut:
    pair = [(ids[:seq // 2], mask[:seq // 2]) for ids, mask in pair]
  for (ids, mask), name in zip(pair, names):
    if not mask[1:].any():
      raise DataError(f"{where}: the prompt leaves no token of {name!r} within --seq // 2 = "
                      f"{seq // 2} tokens; raise --seq or shorten the prompt")
  row = {"tokens": np.zeros(seq, np.int32), "targets": np.full(seq, IGNORE_INDEX, np.int32),
         "positions": np.zeros(seq, np.int32), "segment_ids": np.zeros(seq, np.int32)}
  _place(row, *pair[0], 0, 1)
  _place(row, *pair[1], len(pair[0][0]), 2)
  return row, cut


def read_preference_rows(paths, tokenizer: Any, *, seq: int, vocab_size: int | None = None
                         ) -> PreferenceRows:
  """The preference records of ``paths`` (files, directories, globs of ``.jsonl`` and
  ``.parquet``) as rows of ``seq`` tokens (see the module docstring).

  Raises:
    DataError: naming the file and line: a record without ``prompt``, ``chosen`` or
      ``rejected``, an empty completion, fields of the wrong type, a prompt that leaves no
      room for its completion in ``seq // 2`` tokens, token ids past ``vocab_size``.
  """
  if seq < 4:
    raise ValueError(f"read_preference_rows: seq must be >= 4, got {seq}")
  files = resolve_files(paths)
  encoder = Encoder(tokenizer, loss_on="completion", vocab_size=vocab_size)
  rows, sources, truncated = [], [], 0
  for where, obj in read_objects(files):
    if not isinstance(obj, dict):
      raise DataError(f"{where}: expected a JSON object, got a {type(obj).__name__}")
    prompt, chosen, rejected = (_text(obj, k, where) for k in ("prompt", "chosen", "rejected"))
    pair = [_sequence(encoder, where, prompt, chosen, "chosen"),
            _sequence(encoder, where, prompt, rejected, "rejected")]
    row, cut = _pair_row(pair, seq, where, ("chosen", "rejected"))
    truncated += cut
    rows.append(row)
    sources.append(where)
  return _stacked(rows, sources, truncated, files, tokenizer, seq, "prompt/chosen/rejected")


def _stacked(rows, sources, truncated, files, tokenizer, seq, kind, **extra):
  key = {"layout": LAYOUT_VERSION, "seq": seq, **extra, "data": data_fingerprint(
      files, tokenizer, text_field=kind, loss_on="completion")}
  fingerprint = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
  stacked = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
  return PreferenceRows(**stacked, sources=tuple(sources), truncated=truncated,
                        fingerprint=fingerprint)


def read_kto_rows(paths, tokenizer: Any, *, seq: int, group: int,
                  vocab_size: int | None = None) -> PreferenceRows:
  """KTO's unpaired records (``prompt``, ``completion``, ``label``: a boolean, True for a
  desirable completion) as rows: prompt + completion as segment 1, and the mismatched pair
  TRL 1.16's ``KTOTrainer`` estimates its KL term from as segment 2: the prompt with the
  completion of the row before it in its group of ``group`` consecutive records (the first
  with the group's last; TRL's groups are its per-device batches). ``labels`` holds the label
  at every position of the row.

  Raises:
    DataError: naming the file and line: a record without ``prompt``, ``completion`` or
      ``label``, a label that is not a boolean, an empty completion, a prompt that leaves no
      room for its completion.
  """
  if seq < 4:
    raise ValueError(f"read_kto_rows: seq must be >= 4, got {seq}")
  files = resolve_files(paths)
  encoder = Encoder(tokenizer, loss_on="completion", vocab_size=vocab_size)
  records = []
  for where, obj in read_objects(files):
    if not isinstance(obj, dict):
      raise DataError(f"{where}: expected a JSON object, got a {type(obj).__name__}")
    missing = [k for k in ("prompt", "completion", "label") if obj.get(k) is None]
    if missing:
      present = sorted(k for k, v in obj.items() if v is not None)
      raise DataError(f"{where}: a KTO record needs 'prompt', 'completion' and 'label'; it has "
                      f"no {missing[0]!r} (it has {present})")
    if not isinstance(obj["label"], bool):
      raise DataError(f"{where}: 'label' must be a boolean (true: a desirable completion), got "
                      f"{obj['label']!r}")
    completion = _text(obj, "completion", where)
    if not completion:
      raise DataError(f"{where}: 'completion' is empty")
    records.append((where, _text(obj, "prompt", where), completion, obj["label"]))
  rows, sources, truncated = [], [], 0
  for first in range(0, len(records), group):
    chunk = records[first:first + group]
    for i, (where, prompt, completion, label) in enumerate(chunk):
      other = chunk[i - 1][2]   # the row before's completion (the first: the group's last)
      pair = [_sequence(encoder, where, prompt, completion, "completion"),
              _sequence(encoder, where, prompt, other, "completion")]
      row, cut = _pair_row(pair, seq, where, ("completion", "mismatched completion"))
      row["labels"] = np.full(seq, int(label), np.int32)
      truncated += cut
      rows.append(row)
      sources.append(where)
  return _stacked(rows, sources, truncated, files, tokenizer, seq, "prompt/completion/label",
                  group=group)


def pair_masks(targets, segment_ids):
  """The chosen and rejected completions' target masks ``[rows, seq]`` of preference rows:
  where the target is a token of segment 1, and of segment 2."""
  valid = targets != IGNORE_INDEX
  return valid & (segment_ids == 1), valid & (segment_ids == 2)


def cache_path(out: str | Path, fingerprint: str) -> Path:
  """Where a run keeps the reference model's per-token log-probabilities of its rows."""
  return Path(out) / "reference" / f"{fingerprint}.npy"
