"""Documents packed into rows of ``seq`` tokens by best-fit decreasing; rows built on demand.

The plan (:func:`plan_packing`) is deterministic:

1. Each document becomes pieces. One of at most ``seq`` tokens is one piece; a longer one is cut
   into pieces of ``seq`` tokens and a remainder (``long_documents="split"``, for pretraining)
   or keeps its first ``seq`` tokens (``"truncate"``, for fine-tuning; the cut documents and
   tokens are counted). Empty documents are dropped.
2. Pieces are placed longest first (ties in document order), each into the open row with the
   least free room that still fits it (ties: the row that reached that room last), else into a
   new row. The distinct free rooms are kept sorted and searched by bisection: ``O(n log seq)``
   searches for ``n`` pieces.
3. A row's pieces keep their placement order; rows are numbered as they were opened.

A row (:meth:`PackedRows.rows`) is four int32 arrays of length ``seq``: ``tokens``;
``targets``, the next token of the same piece, or :data:`IGNORE_INDEX` at each piece's last
token, at padding and where the next token's loss mask is 0; ``segment_ids``, 1, 2, 3, ... for
the row's pieces and 0 for padding; ``positions``, from 0 in each piece (0 on padding).

Example:
  >>> plan = plan_packing(np.array([3, 5, 2, 6]), seq=8)
  >>> plan.pieces.tolist(), plan.row_offsets.tolist(), plan.efficiency
  ([[3, 0, 6], [2, 0, 2], [1, 0, 5], [0, 0, 3]], [0, 2, 4], 1.0)
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np

from jaxfuse.data.cache import TokenCache, atomic_directory
from jaxfuse.data.records import DataError

LONG_DOCUMENTS = ("split", "truncate")
# The target of a token that has no loss (the cross-entropy's ignore index).
IGNORE_INDEX = -100
# Bump when plans change: stored plans are then unused.
PACKING_VERSION = 1
ROW_FIELDS = ("tokens", "targets", "segment_ids", "positions")


@dataclasses.dataclass(frozen=True)
class PackingPlan:
  """Where every piece goes: ``pieces`` ``[n, 3]`` int64 rows of ``(document, start, length)``,
  grouped by row; row ``r``'s pieces are ``pieces[row_offsets[r]:row_offsets[r + 1]]``."""
  pieces: np.ndarray
  row_offsets: np.ndarray
  seq: int
  truncated_documents: int = 0
  truncated_tokens: int = 0

  @property
  def num_rows(self) -> int:
    return len(self.row_offsets) - 1

  @property
  def num_tokens(self) -> int:
    """Tokens in the rows (padding not counted)."""
    return int(self.pieces[:, 2].sum())

  @property
  def efficiency(self) -> float:
    """The share of the rows' positions that hold tokens: tokens / (rows * seq)."""
    return self.num_tokens / (self.num_rows * self.seq) if self.num_rows else 0.0


def best_fit_decreasing(sizes: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
  """``(order, rows)``: the items in placement order (largest first, ties by index) and the row
  of each item, each placed into the open row with the least free room that fits it (ties: the
  row that reached that room last), else into a new row. Every size must be in
  ``1..capacity``.

  Example:
    >>> order, rows = best_fit_decreasing(np.array([2, 7, 3, 1]), 8)
    >>> order.tolist(), rows.tolist()
    ([1, 2, 0, 3], [1, 0, 1, 0])
  """
  sizes = np.asarray(sizes, dtype=np.int64)
  if sizes.size and (sizes.min() < 1 or sizes.max() > capacity):
    raise ValueError(f"best_fit_decreasing: sizes must be in 1..{capacity}, got "
                     f"{sizes.min()}..{sizes.max()}")
  order = np.argsort(-sizes, kind="stable")
  rows = np.empty(len(sizes), np.int64)
  rooms: list[int] = []  # the distinct free rooms of open rows, sorted
  rows_with_room: dict[int, list[int]] = {}  # room -> open rows with it, latest last
  num_rows = 0
  for item, size in zip(order.tolist(), sizes[order].tolist()):
    j = bisect.bisect_left(rooms, size)
    if j == len(rooms):
      row, left = num_rows, capacity - size
      num_rows += 1
    else:
      room = rooms[j]
      waiting = rows_with_room[room]
      row = waiting.pop()
      if not waiting:
        del rows_with_room[room], rooms[j]
      left = room - size
    rows[item] = row
    if left:
      waiting = rows_with_room.get(left)
      if waiting is None:
        rows_with_room[left] = [row]
        bisect.insort(rooms, left)
      else:
        waiting.append(row)
  return order, rows


def plan_packing(lengths: np.ndarray, seq: int, *, long_documents: str = "split",
                 documents: np.ndarray | None = None) -> PackingPlan:
  """The :class:`PackingPlan` of documents of ``lengths`` (all, or the indices ``documents``)
  in rows of ``seq`` tokens (see the module's docstring)."""
  if seq < 1:
    raise ValueError(f"plan_packing: seq must be at least 1, got {seq}")
  if long_documents not in LONG_DOCUMENTS:
    raise ValueError(f"plan_packing: long_documents must be one of {LONG_DOCUMENTS}, got "
                     f"{long_documents!r}")
  lengths = np.asarray(lengths, dtype=np.int64)
  docs = np.arange(len(lengths)) if documents is None else np.asarray(documents, np.int64)
  docs = docs[lengths[docs] > 0]
  sizes = lengths[docs]
  long = sizes > seq
  truncated_documents = truncated_tokens = 0
  if long_documents == "truncate":
    truncated_documents = int(long.sum())
    truncated_tokens = int((sizes[long] - seq).sum())
    piece_docs, starts, piece_sizes = docs, np.zeros_like(docs), np.minimum(sizes, seq)
  else:
    count = -(-sizes // seq)
    piece_docs = np.repeat(docs, count)
    first = np.repeat(np.cumsum(count) - count, count)
    starts = (np.arange(len(piece_docs)) - first) * seq
    piece_sizes = np.minimum(seq, np.repeat(sizes, count) - starts)
  order, rows = best_fit_decreasing(piece_sizes, seq)
  order = order[np.argsort(rows[order], kind="stable")]   # grouped by row, in placement order
  pieces = np.stack([piece_docs[order], starts[order], piece_sizes[order]], axis=1)
  num_rows = int(rows.max()) + 1 if rows.size else 0
  row_offsets = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=num_rows))])
  return PackingPlan(pieces.astype(np.int64).reshape(-1, 3), row_offsets.astype(np.int64), seq,
                     truncated_documents, truncated_tokens)


class PackedRows:
  """Rows of a :class:`PackingPlan` built on demand from a cache's (memory-mapped) ``ids``,
  ``mask`` and ``offsets``.

  Example:
    >>> ids, mask = np.arange(10, 15, dtype=np.int32), np.array([1, 1, 0, 1, 1], np.uint8)
    >>> offsets = np.array([0, 3, 5])                    # documents [10, 11, 12] and [13, 14]
    >>> rows = PackedRows(ids, mask, offsets, plan_packing(np.diff(offsets), seq=6))
    >>> for name, values in rows.row(0).items():
    ...   print(name, values.tolist())
    tokens [10, 11, 12, 13, 14, 0]
    targets [11, -100, -100, 14, -100, -100]
    segment_ids [1, 1, 1, 2, 2, 0]
    positions [0, 1, 2, 0, 1, 0]
  """

  def __init__(self, ids: np.ndarray, mask: np.ndarray, offsets: np.ndarray, plan: PackingPlan,
               fingerprint: str = ""):
    self.ids, self.mask, self.offsets = ids, mask, offsets
    self.plan = plan
    self.fingerprint = fingerprint

  @property
  def seq(self) -> int:
    return self.plan.seq

  @property
  def num_rows(self) -> int:
    return self.plan.num_rows

  @property
  def num_tokens(self) -> int:
    """Tokens in the rows (padding not counted)."""
    return self.plan.num_tokens

  @property
  def efficiency(self) -> float:
    return self.plan.efficiency

  @property
  def truncated(self) -> int:
    """Documents cut to ``seq`` tokens (``long_documents="truncate"``)."""
    return self.plan.truncated_documents

  def __len__(self) -> int:
    return self.num_rows

  def rows(self, indices) -> dict[str, np.ndarray]:
    """Rows ``indices`` as ``[len(indices), seq]`` int32 arrays (an index of ``-1`` gives a row
    of padding)."""
    indices = [int(i) for i in indices]
    seq, plan = self.seq, self.plan
    out = {name: np.zeros((len(indices), seq), np.int32) for name in ROW_FIELDS}
    out["targets"][:] = IGNORE_INDEX
    for r, index in enumerate(indices):
      if index == -1:
        continue
      if not 0 <= index < self.num_rows:
        raise IndexError(f"PackedRows.rows: row {index} of {self.num_rows}")
      column = 0
      pieces = plan.pieces[plan.row_offsets[index]:plan.row_offsets[index + 1]].tolist()
      for segment, (document, start, length) in enumerate(pieces, 1):
        begin = int(self.offsets[document]) + start
        ids = np.asarray(self.ids[begin:begin + length])
        learn = np.asarray(self.mask[begin + 1:begin + length]) != 0
        span = slice(column, column + length)
        out["tokens"][r, span] = ids
        out["targets"][r, column:column + length - 1] = np.where(learn, ids[1:], IGNORE_INDEX)
        out["segment_ids"][r, span] = segment
        out["positions"][r, span] = np.arange(length)
        column += length
    return out

  def row(self, index: int) -> dict[str, np.ndarray]:
    """Row ``index`` as ``[seq]`` int32 arrays."""
    return {name: value[0] for name, value in self.rows([index]).items()}


def _plan_key(seq: int, long_documents: str, documents: np.ndarray | None) -> str:
  if documents is None:
    chosen = "all"
  else:
    chosen = hashlib.sha256(np.asarray(documents, np.int64).tobytes()).hexdigest()[:12]
  return f"v{PACKING_VERSION}-seq{seq}-{long_documents}-{chosen}"


def pack(cache: TokenCache, seq: int, *, long_documents: str = "split",
         documents: np.ndarray | None = None) -> PackedRows:
  """The rows of ``cache``'s documents (all, or the indices ``documents``), the plan read from
  the cache's ``packing/`` directory where it was made before, else made and stored there."""
  key = _plan_key(seq, long_documents, documents)
  directory = Path(cache.directory) / "packing" / key
  if not (directory / "meta.json").is_file():
    plan = plan_packing(cache.lengths, seq, long_documents=long_documents, documents=documents)
    if not plan.num_rows:
      raise DataError(f"{cache.directory}: the chosen documents hold no tokens to pack")
    with atomic_directory(directory) as temporary:
      np.save(temporary / "pieces.npy", plan.pieces)
      np.save(temporary / "row_offsets.npy", plan.row_offsets)
      meta = {"seq": seq, "long_documents": long_documents,
              "truncated_documents": plan.truncated_documents,
              "truncated_tokens": plan.truncated_tokens}
      (temporary / "meta.json").write_text(json.dumps(meta, indent=1))
  meta = json.loads((directory / "meta.json").read_text())
  plan = PackingPlan(np.load(directory / "pieces.npy", mmap_mode="r"),
                     np.load(directory / "row_offsets.npy", mmap_mode="r"), seq,
                     meta["truncated_documents"], meta["truncated_tokens"])
  fingerprint = hashlib.sha256(f"{cache.fingerprint}/{key}".encode()).hexdigest()[:20]
  return PackedRows(cache.ids, cache.mask, cache.offsets, plan, fingerprint)
