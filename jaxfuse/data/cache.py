"""The tokenized data set, written once and memory-mapped: ``<cache_root>/<fingerprint>/``.

A cache directory holds every document's ids concatenated (``ids.npy``, int32), their loss masks
(``mask.npy``, uint8), the document offsets (``offsets.npy``, int64, one more than there are
documents) and ``meta.json``. Records are streamed and the arrays written in chunks, so no list
of all tokens is ever held. A build writes into a temporary directory beside the cache and
renames it when complete: a failed or interrupted build never leaves a cache that looks
complete. A cache whose fingerprint matches is reused, not rebuilt.

The fingerprint covers the input files (absolute paths, sizes, modification times), the
tokenizer (:func:`~jaxfuse.data.tokenization.tokenizer_fingerprint`), the text field, the loss
setting and :data:`FORMAT_VERSION`.

Example:
  >>> import pathlib, tempfile
  >>> from jaxfuse.data.tokenization import ByteTokenizer
  >>> root = pathlib.Path(tempfile.mkdtemp())
  >>> _ = (root / "a.txt").write_text("hello")
  >>> cache = build_cache(root / "a.txt", ByteTokenizer(), root / "cache")
  >>> cache.num_documents, cache.num_tokens, bytes(cache.ids[:5].astype("uint8"))
  (1, 5, b'hello')
  >>> build_cache(root / "a.txt", ByteTokenizer(), root / "cache").reused
  True
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxfuse.data.encoding import Encoder
from jaxfuse.data.records import DataError, PathLike, describe_paths, read_files, resolve_files
from jaxfuse.data.tokenization import VocabularyError, tokenizer_fingerprint

# Bump when what a cache holds or how records are encoded changes: old caches are then unused.
FORMAT_VERSION = 1
# Tokens buffered before a chunk is written.
CHUNK_TOKENS = 1 << 20
# Every .npy header this module writes is this long, so the shape can be filled in at the end.
_HEADER_BYTES = 128


@contextlib.contextmanager
def atomic_directory(target: Path) -> Iterator[Path]:
  """Yields a fresh temporary directory beside ``target`` that becomes ``target`` when the block
  completes, and is removed when it raises (or is interrupted). Where another process
  completed ``target`` first, its copy is kept and this one removed."""
  target = Path(target)
  target.parent.mkdir(parents=True, exist_ok=True)
  temporary = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
  temporary.mkdir()
  try:
    yield temporary
  except BaseException:
    shutil.rmtree(temporary, ignore_errors=True)
    raise
  try:
    os.rename(temporary, target)
  except OSError:
    shutil.rmtree(temporary, ignore_errors=True)
    if not target.is_dir():
      raise


class NpyWriter:
  """Writes a 1-D ``.npy`` file chunk by chunk: a fixed-size header, rewritten with the final
  length by :meth:`close`.

  Example:
    >>> import pathlib, tempfile
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "x.npy"
    >>> with NpyWriter(path, np.int32, chunk=2) as writer:
    ...   writer.append(np.arange(3))
    ...   writer.append(np.arange(2))
    >>> np.load(path, mmap_mode="r").tolist()
    [0, 1, 2, 0, 1]
  """

  def __init__(self, path: Path, dtype: Any, chunk: int | None = None):
    self.path = Path(path)
    self.dtype = np.dtype(dtype).newbyteorder("<")
    self.chunk = CHUNK_TOKENS if chunk is None else chunk
    self.count = 0
    self._pending: list[np.ndarray] = []
    self._pending_count = 0
    self._file = open(self.path, "wb")  # noqa: SIM115 - closed by close()
    self._file.write(b"\0" * _HEADER_BYTES)

  def __enter__(self) -> NpyWriter:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def append(self, values: np.ndarray) -> None:
    values = np.asarray(values).astype(self.dtype, copy=False).ravel()
    self._pending.append(values)
    self._pending_count += values.size
    self.count += values.size
    if self._pending_count >= self.chunk:
      self.flush()

  def flush(self) -> None:
    if self._pending:
      self._file.write(np.concatenate(self._pending).tobytes())
      self._pending, self._pending_count = [], 0

  def close(self) -> None:
    if self._file.closed:
      return
    self.flush()
    header = repr({"descr": self.dtype.str, "fortran_order": False, "shape": (self.count,)})
    preamble = b"\x93NUMPY\x01\x00" + (_HEADER_BYTES - 10).to_bytes(2, "little")
    padded = header.encode("latin1").ljust(_HEADER_BYTES - len(preamble) - 1) + b"\n"
    self._file.seek(0)
    self._file.write(preamble + padded)
    self._file.close()


@dataclasses.dataclass(frozen=True)
class TokenCache:
  """A complete cache directory, memory-mapped: ``ids`` (int32), ``mask`` (uint8), ``offsets``
  (int64; document ``d`` is ``ids[offsets[d]:offsets[d + 1]]``) and ``meta``; ``reused`` says
  whether it was there already."""
  directory: Path
  ids: np.ndarray
  mask: np.ndarray
  offsets: np.ndarray
  meta: dict
  reused: bool = False

  @property
  def fingerprint(self) -> str:
    return self.meta["fingerprint"]

  @property
  def num_documents(self) -> int:
    return len(self.offsets) - 1

  @property
  def num_tokens(self) -> int:
    return int(self.offsets[-1])

  @property
  def lengths(self) -> np.ndarray:
    """Every document's length in tokens (int64)."""
    return np.diff(self.offsets)


def data_fingerprint(files: Sequence[Path], tokenizer: Any, *, text_field: str,
                     loss_on: str) -> str:
  """The hash that names a cache directory (see the module's docstring)."""
  described = []
  for path in files:
    stat = path.stat()
    described.append([str(path.resolve()), stat.st_size, stat.st_mtime_ns])
  key = {"format_version": FORMAT_VERSION, "files": described, "text_field": text_field,
         "loss_on": loss_on, "tokenizer": tokenizer_fingerprint(tokenizer)}
  return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def open_cache(directory: str | os.PathLike, reused: bool = True) -> TokenCache:
  """The complete cache in ``directory``, memory-mapped read-only."""
  directory = Path(directory)
  meta_path = directory / "meta.json"
  if not meta_path.is_file():
    raise DataError(f"{directory}: not a complete data cache (no meta.json)")
  meta = json.loads(meta_path.read_text())
  if meta.get("format_version") != FORMAT_VERSION:
    raise DataError(f"{directory}: data cache format {meta.get('format_version')}, this version "
                    f"reads {FORMAT_VERSION}")
  ids, mask, offsets = (np.load(directory / name, mmap_mode="r")
                        for name in ("ids.npy", "mask.npy", "offsets.npy"))
  return TokenCache(directory, ids, mask, offsets, meta, reused)


def build_cache(paths: PathLike | Sequence[PathLike], tokenizer: Any,
                cache_root: str | os.PathLike, *, text_field: str = "text",
                loss_on: str = "completion", vocab_size: int | None = None,
                log: Callable[[str], None] | None = None) -> TokenCache:
  """The cache of the records ``paths`` name, encoded with ``tokenizer``
  (:class:`~jaxfuse.data.encoding.Encoder`): reused where ``<cache_root>/<fingerprint>`` is
  complete, else built there. ``log`` gets a line saying which."""
  files = resolve_files(paths)
  fingerprint = data_fingerprint(files, tokenizer, text_field=text_field, loss_on=loss_on)
  target = Path(cache_root) / fingerprint
  where = describe_paths(paths)
  if (target / "meta.json").is_file():
    cache = open_cache(target, reused=True)
    max_id = cache.meta["max_id"]
    if vocab_size is not None and max_id >= vocab_size:
      raise VocabularyError(f"{where}: token id {max_id} is past the model's vocabulary of "
                            f"{vocab_size} (cached in {target})")
    if log:
      log(f"data: reusing {cache.num_documents} documents, {cache.num_tokens} tokens in {target}")
    return cache
  encoder = Encoder(tokenizer, loss_on=loss_on, vocab_size=vocab_size)
  kinds = {}
  max_id = -1
  loss_tokens = 0
  with atomic_directory(target) as temporary:
    with (NpyWriter(temporary / "ids.npy", np.int32) as ids,
          NpyWriter(temporary / "mask.npy", np.uint8) as mask,
          NpyWriter(temporary / "offsets.npy", np.int64) as offsets):
      offsets.append(np.zeros(1, np.int64))
      for record in read_files(files, text_field):
        tokens, loss_mask = encoder(record)
        ids.append(tokens)
        mask.append(loss_mask)
        offsets.append(np.asarray([ids.count], np.int64))
        kinds[record.kind] = kinds.get(record.kind, 0) + 1
        max_id = max(max_id, int(tokens.max(initial=-1)))
        loss_tokens += int(loss_mask.sum())
    if not kinds:
      raise DataError(f"{where}: no records")
    if not ids.count:
      raise DataError(f"{where}: the records hold no tokens")
    meta = {"format_version": FORMAT_VERSION, "fingerprint": fingerprint,
            "files": [str(p) for p in files],
            "tokenizer": str(getattr(tokenizer, "name_or_path", "")), "text_field": text_field,
            "loss_on": loss_on, "documents": offsets.count - 1, "tokens": ids.count,
            "loss_tokens": loss_tokens, "max_id": max_id, "kinds": kinds}
    (temporary / "meta.json").write_text(json.dumps(meta, indent=1))
  if log:
    log(f"data: tokenized {meta['documents']} documents, {meta['tokens']} tokens into {target}")
  return open_cache(target, reused=False)
