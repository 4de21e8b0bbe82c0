"""Training records read from plain text, JSON lines and Parquet files; each of three kinds.

Paths may name files, directories (read recursively, in sorted order, hidden entries skipped)
and glob patterns (``data/**/*.jsonl``). The format follows the suffix:

- ``.txt``: the whole file is one text document;
- ``.jsonl`` / ``.json``: one JSON object per line (blank lines skipped);
- ``.parquet``: one record per row, read a record batch at a time (never loaded whole).

A record's kind follows its fields, checked in this order: ``messages`` (a list of
``{"role", "content"}``: ``chat``), ``prompt`` and ``completion`` (``prompt_completion``), the
text field (``text`` unless told: ``text``). Fields that are ``null`` count as absent. Every
problem is a :class:`DataError` whose message starts with where it is: ``file:line`` (JSON
lines, from 1), ``file:row N`` (Parquet, from 0) or ``file``.

Example:
  >>> import pathlib, tempfile
  >>> root = pathlib.Path(tempfile.mkdtemp())
  >>> lines = ['{"prompt": "2+2=", "completion": "4"}', '', '{"text": "hi"}']
  >>> _ = (root / "a.jsonl").write_text("\\n".join(lines))
  >>> [(r.kind, pathlib.Path(r.source).name) for r in read_records(root)]
  [('prompt_completion', 'a.jsonl:1'), ('text', 'a.jsonl:3')]
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

PathLike = str | os.PathLike

# Suffix -> reader name.
FORMATS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
KINDS = ("text", "chat", "prompt_completion")
# Parquet rows read at a time.
PARQUET_BATCH_ROWS = 1024


class DataError(ValueError):
  """Bad training data. The message starts with where: ``file:line``, ``file:row N`` or
  ``file``."""


@dataclasses.dataclass(frozen=True)
class Record:
  """One training example: ``kind`` is ``text`` (``text``), ``chat`` (``messages``, a tuple of
  dicts with string ``role`` and ``content``) or ``prompt_completion`` (``prompt``,
  ``completion``); ``source`` says where it was read.

  Example:
    >>> Record("notes.txt", "text", text="hello").texts
    ['hello']
  """
  source: str
  kind: str
  text: str | None = None
  prompt: str | None = None
  completion: str | None = None
  messages: tuple[dict[str, Any], ...] | None = None

  @property
  def texts(self) -> list[str]:
    """The record's strings, in order (what a tokenizer is trained on)."""
    if self.kind == "chat":
      return [m["content"] for m in self.messages]
    if self.kind == "prompt_completion":
      return [self.prompt, self.completion]
    return [self.text]


def _as_list(paths: PathLike | Sequence[PathLike]) -> list[PathLike]:
  return [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)


def describe_paths(paths: PathLike | Sequence[PathLike]) -> str:
  """``paths`` as they were given, for messages: ``"a.jsonl, data/*.parquet"``."""
  return ", ".join(str(p) for p in _as_list(paths))


def _supported(path: Path) -> bool:
  return path.suffix.lower() in FORMATS


def _directory_files(root: Path) -> list[Path]:
  files = []
  for path in root.rglob("*"):
    parts = path.relative_to(root).parts
    if path.is_file() and _supported(path) and not any(p.startswith(".") for p in parts):
      files.append(path)
  return sorted(files, key=lambda p: p.relative_to(root).parts)


def resolve_files(paths: PathLike | Sequence[PathLike]) -> list[Path]:
  """The data files that ``paths`` name, in order: each entry's files (a directory's sorted
  recursively, a glob's sorted). An entry that exists is taken literally, else as a glob.

  Example:
    >>> resolve_files("no/such/file.jsonl")
    Traceback (most recent call last):
    ...
    jaxfuse.data.records.DataError: no/such/file.jsonl: no such file or directory
  """
  files: list[Path] = []
  entries = _as_list(paths)
  if not entries:
    raise DataError("resolve_files: no data paths given")
  for entry in entries:
    path = Path(entry)
    if path.is_dir():
      found = _directory_files(path)
      if not found:
        raise DataError(f"{entry}: no {', '.join(FORMATS)} files in the directory")
      files.extend(found)
    elif path.exists():
      if not _supported(path):
        raise DataError(f"{entry}: unsupported format {path.suffix!r}; the formats are "
                        f"{', '.join(FORMATS)}")
      files.append(path)
    elif glob.has_magic(str(entry)):
      found = []
      for match in sorted(glob.glob(str(entry), recursive=True)):
        match = Path(match)
        found.extend(_directory_files(match) if match.is_dir() else
                     [match] if _supported(match) else [])
      if not found:
        raise DataError(f"{entry}: no {', '.join(FORMATS)} files matched the pattern")
      files.extend(found)
    else:
      raise DataError(f"{entry}: no such file or directory")
  return files


def _string(obj: dict, name: str, where: str) -> str:
  value = obj[name]
  if not isinstance(value, str):
    raise DataError(f"{where}: field {name!r} is a {type(value).__name__}, expected a string")
  return value


def _messages(value: Any, where: str) -> tuple[dict[str, Any], ...]:
  if not isinstance(value, (list, tuple)):
    raise DataError(f"{where}: field 'messages' is a {type(value).__name__}, expected a list "
                    "of {'role', 'content'} objects")
  if not value:
    raise DataError(f"{where}: field 'messages' is empty")
  messages = []
  for i, message in enumerate(value):
    if not isinstance(message, dict):
      raise DataError(f"{where}: message {i} is a {type(message).__name__}, expected an "
                      "object with 'role' and 'content'")
    for name in ("role", "content"):
      if message.get(name) is None:
        raise DataError(f"{where}: message {i} has no {name!r} (it has {sorted(message)})")
      if not isinstance(message[name], str):
        raise DataError(f"{where}: message {i}'s {name!r} is a "
                        f"{type(message[name]).__name__}, expected a string")
    messages.append({k: v for k, v in message.items() if v is not None})
  return tuple(messages)


def record_from_object(obj: Any, where: str, text_field: str = "text") -> Record:
  """The :class:`Record` of one JSON object (or Parquet row) read at ``where``.

  Example:
    >>> record_from_object({"body": "hi"}, "a.jsonl:1", text_field="body").kind
    'text'
  """
  if not isinstance(obj, dict):
    hint = " (one JSON object per line, not one array)" if isinstance(obj, list) else ""
    raise DataError(f"{where}: expected a JSON object, got a {type(obj).__name__}{hint}")
  present = {k for k, v in obj.items() if v is not None}
  if "messages" in present:
    return Record(where, "chat", messages=_messages(obj["messages"], where))
  if {"prompt", "completion"} <= present:
    return Record(where, "prompt_completion", prompt=_string(obj, "prompt", where),
                  completion=_string(obj, "completion", where))
  if text_field in present:
    return Record(where, "text", text=_string(obj, text_field, where))
  raise DataError(f"{where}: a record needs {text_field!r} (text), 'messages' (chat) or "
                  f"'prompt' and 'completion'; it has {sorted(present)}")


def _read_text(path: Path) -> Iterator[Record]:
  try:
    text = path.read_bytes().decode("utf-8")
  except UnicodeDecodeError as e:
    raise DataError(f"{path}: not UTF-8 text ({e})") from None
  yield Record(str(path), "text", text=text)


def _json_objects(path: Path) -> Iterator[tuple[str, Any]]:
  with open(path, "rb") as f:
    for number, raw in enumerate(f, 1):
      where = f"{path}:{number}"
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise DataError(f"{where}: not UTF-8 ({e})") from None
      if not line.strip():
        continue
      try:
        obj = json.loads(line)
      except json.JSONDecodeError as e:
        hint = (" (a .json file holds one JSON object per line, not one array)"
                if number == 1 and line.lstrip().startswith("[") else "")
        raise DataError(f"{where}: malformed JSON: {e.msg} at column {e.colno}{hint}") from None
      yield where, obj


def _parquet_objects(path: Path, wanted: Sequence[str] | None = None,
                     needs: str = "") -> Iterator[tuple[str, Any]]:
  import pyarrow.parquet as pq

  try:
    table = pq.ParquetFile(path)
  except (OSError, ValueError) as e:  # pyarrow's errors are one or the other
    raise DataError(f"{path}: not a readable Parquet file ({e})") from None
  names = table.schema_arrow.names
  columns = None if wanted is None else [c for c in dict.fromkeys(wanted) if c in names]
  if columns is not None and not columns:
    raise DataError(f"{path}: {needs}; the file's columns are {sorted(names)}")
  row = 0
  for batch in table.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns):
    for obj in batch.to_pylist():
      yield f"{path}:row {row}", obj
      row += 1


def read_objects(paths: PathLike | Sequence[PathLike]) -> Iterator[tuple[str, Any]]:
  """``(where, object)`` of every JSON line (blank lines skipped) and Parquet row (all columns)
  of the files ``paths`` name, in order: for records of other shapes than :class:`Record`'s
  (preference pairs). ``.txt`` files are refused.

  Example:
    >>> import pathlib, tempfile
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "pairs.jsonl"
    >>> _ = path.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\\n')
    >>> [(pathlib.Path(w).name, o["chosen"]) for w, o in read_objects(path)]
    [('pairs.jsonl:1', 'b')]
  """
  count = 0
  for path in resolve_files(paths):
    kind = FORMATS[path.suffix.lower()]
    if kind == "text":
      raise DataError(f"{path}: a plain text file holds no fields; give JSON lines or Parquet")
    for item in _json_objects(path) if kind == "json" else _parquet_objects(path):
      count += 1
      yield item
  if not count:
    raise DataError(f"{describe_paths(paths)}: no records")


def _read_json_lines(path: Path, text_field: str) -> Iterator[Record]:
  for where, obj in _json_objects(path):
    yield record_from_object(obj, where, text_field)


def _read_parquet(path: Path, text_field: str) -> Iterator[Record]:
  needs = (f"a record needs {text_field!r} (text), 'messages' (chat) or 'prompt' and "
           "'completion'")
  for where, obj in _parquet_objects(path, ("messages", "prompt", "completion", text_field),
                                     needs):
    yield record_from_object(obj, where, text_field)


def read_files(files: Sequence[Path], text_field: str = "text") -> Iterator[Record]:
  """The records of already resolved ``files`` (see :func:`resolve_files`), streamed."""
  for path in files:
    kind = FORMATS[path.suffix.lower()]
    if kind == "text":
      yield from _read_text(path)
    elif kind == "json":
      yield from _read_json_lines(path, text_field)
    else:
      yield from _read_parquet(path, text_field)


def read_records(paths: PathLike | Sequence[PathLike], text_field: str = "text"
                 ) -> Iterator[Record]:
  """The records of the files ``paths`` name (files, directories, globs), streamed in order; a
  :class:`DataError` where the files hold no record at all.

  Example:
    >>> import pathlib, tempfile
    >>> empty = pathlib.Path(tempfile.mkdtemp()) / "empty.jsonl"
    >>> _ = empty.write_text("\\n")
    >>> list(read_records(empty))
    Traceback (most recent call last):
    ...
    jaxfuse.data.records.DataError: .../empty.jsonl: no records
  """
  files = resolve_files(paths)
  count = 0
  for record in read_files(files, text_field):
    count += 1
    yield record
  if not count:
    raise DataError(f"{describe_paths(paths)}: no records")
