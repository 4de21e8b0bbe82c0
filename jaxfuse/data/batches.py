"""Batches of packed rows: shuffled for training, by step; in order for evaluation.

Training rows are read in the order of ``grain.MapDataset.source(range(num_rows))
.shuffle(seed=seed).repeat(None)`` (a new permutation every epoch, random access); the global
batch of step ``s`` is rows ``s * b .. s * b + b - 1`` of that order. The pipeline's position is
the step: a resumed run asks for the same step and gets the same batch, and
:attr:`Batches.fingerprint` (data, packing, batch size, seed) lets a checkpoint refuse to resume
on different data. A process that holds only some of a batch's rows builds only those
(:meth:`Batches.rows`).

Example:
  >>> import numpy as np
  >>> from jaxfuse.data.packing import PackedRows, plan_packing
  >>> offsets = np.array([0, 3, 5, 9])
  >>> packed = PackedRows(np.arange(9, dtype=np.int32), np.ones(9, np.uint8), offsets,
  ...                     plan_packing(np.diff(offsets), seq=4))
  >>> batches = Batches(packed, batch_size=2, seed=0)
  >>> batches.batch_at(0)["tokens"].shape
  (2, 4)
  >>> sorted([*batches.indices(0).tolist(), *batches.indices(1)[:1].tolist()])  # an epoch
  [0, 1, 2]
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

from jaxfuse.data.packing import PackedRows
from jaxfuse.data.records import DataError


def held_out_documents(num_documents: int, share: float, seed: int = 0
                       ) -> tuple[np.ndarray, np.ndarray]:
  """``(train, held_out)`` document indices, each sorted: ``round(share * num_documents)``
  documents (at least one) chosen by a permutation seeded with ``seed``.

  Example:
    >>> held_out_documents(10, 0.2, seed=0)[1].tolist()
    [4, 6]
  """
  if not 0 < share < 1:
    raise ValueError(f"held_out_documents: share must be in (0, 1), got {share}")
  count = max(1, round(share * num_documents))
  if count >= num_documents:
    raise DataError(f"eval_share={share} of {num_documents} documents leaves none to train on")
  chosen = np.zeros(num_documents, bool)
  chosen[np.random.default_rng(seed).permutation(num_documents)[:count]] = True
  return np.flatnonzero(~chosen), np.flatnonzero(chosen)


def _check_rows(name: str, lo: int, hi: int, batch_size: int) -> None:
  if not 0 <= lo <= hi <= batch_size:
    raise ValueError(f"{name}: rows [lo, hi) must satisfy 0 <= lo <= hi <= batch_size "
                     f"({batch_size}), got lo={lo}, hi={hi}")


class Batches:
  """Training batches: :meth:`batch_at` (step) gives ``[batch_size, seq]`` int32 ``tokens``,
  ``targets``, ``segment_ids`` and ``positions`` (see :mod:`jaxfuse.data.packing`)."""

  def __init__(self, packed: PackedRows, batch_size: int, seed: int = 0):
    import grain  # imported here: only training batches need it

    if batch_size < 1:
      raise ValueError(f"Batches: batch_size must be at least 1, got {batch_size}")
    if not packed.num_rows:
      raise DataError("Batches: the packed data has no rows")
    self.packed, self.batch_size, self.seed = packed, batch_size, seed
    self._order = grain.MapDataset.source(range(packed.num_rows)).shuffle(seed=seed).repeat(None)
    key = f"{packed.fingerprint}/batch{batch_size}/seed{seed}"
    self.fingerprint = hashlib.sha256(key.encode()).hexdigest()[:20]

  seq = property(lambda self: self.packed.seq)
  num_rows = property(lambda self: self.packed.num_rows)
  num_tokens = property(lambda self: self.packed.num_tokens)
  efficiency = property(lambda self: self.packed.efficiency)
  truncated = property(lambda self: self.packed.truncated)

  @property
  def steps_per_epoch(self) -> float:
    return self.num_rows / self.batch_size

  def indices(self, step: int, lo: int = 0, hi: int | None = None) -> np.ndarray:
    """The packed rows of step ``step``'s global batch, positions ``lo .. hi - 1``."""
    hi = self.batch_size if hi is None else hi
    _check_rows("Batches.indices", lo, hi, self.batch_size)
    if step < 0:
      raise ValueError(f"Batches.indices: step must be at least 0, got {step}")
    first = step * self.batch_size
    return np.asarray([int(self._order[first + k]) for k in range(lo, hi)], np.int64)

  def batch_at(self, step: int) -> dict[str, np.ndarray]:
    """Step ``step``'s global batch: ``[batch_size, seq]`` int32 arrays."""
    return self.packed.rows(self.indices(step))

  def rows(self, step: int, lo: int, hi: int) -> dict[str, np.ndarray]:
    """Rows ``lo .. hi - 1`` of step ``step``'s global batch (``batch_at(step)[k][lo:hi]``),
    built alone: for a process that holds only those rows."""
    return self.packed.rows(self.indices(step, lo, hi))

  def check_resume(self, recorded: str) -> None:
    """Raises :class:`DataError` unless ``recorded`` (a checkpoint's :attr:`fingerprint`) is
    this data's: a run resumes only on the data, packing, batch size and seed it started
    with."""
    if recorded != self.fingerprint:
      raise DataError(f"the checkpoint was trained on data {recorded}, these batches are "
                      f"{self.fingerprint} (other files, tokenizer, packing, batch size or "
                      "seed); resume with the same data options or start a new run")


class EvalBatches:
  """Evaluation batches in row order, no shuffling: batch ``i`` is rows ``i * b .. i * b + b -
  1``; the last one is filled with rows of padding (all targets ignored)."""

  def __init__(self, packed: PackedRows, batch_size: int):
    if batch_size < 1:
      raise ValueError(f"EvalBatches: batch_size must be at least 1, got {batch_size}")
    self.packed, self.batch_size = packed, batch_size
    key = f"{packed.fingerprint}/eval-batch{batch_size}"
    self.fingerprint = hashlib.sha256(key.encode()).hexdigest()[:20]

  seq = property(lambda self: self.packed.seq)
  num_rows = property(lambda self: self.packed.num_rows)
  num_tokens = property(lambda self: self.packed.num_tokens)
  efficiency = property(lambda self: self.packed.efficiency)
  truncated = property(lambda self: self.packed.truncated)

  def __len__(self) -> int:
    return math.ceil(self.num_rows / self.batch_size)

  def indices(self, index: int, lo: int = 0, hi: int | None = None) -> np.ndarray:
    """The rows of batch ``index``, positions ``lo .. hi - 1`` (``-1``: padding)."""
    hi = self.batch_size if hi is None else hi
    _check_rows("EvalBatches.indices", lo, hi, self.batch_size)
    if not 0 <= index < len(self):
      raise IndexError(f"EvalBatches: batch {index} of {len(self)}")
    rows = index * self.batch_size + np.arange(lo, hi)
    return np.where(rows < self.num_rows, rows, -1)

  def batch_at(self, index: int) -> dict[str, np.ndarray]:
    """Batch ``index``: ``[batch_size, seq]`` int32 arrays."""
    return self.packed.rows(self.indices(index))

  def rows(self, index: int, lo: int, hi: int) -> dict[str, np.ndarray]:
    """Rows ``lo .. hi - 1`` of batch ``index``, built alone."""
    return self.packed.rows(self.indices(index, lo, hi))

  def __iter__(self):
    return (self.batch_at(i) for i in range(len(self)))
