"""The integer values of a Pallas kernel body, in every program of its grid at once.

Part of :mod:`jaxfuse.metrics.traffic`, which explains the scheme: each int or bool value is a
numpy array with a leading program axis (of size 1 when it is the same in every program) that
keeps size-1 axes where the value is constant along them; a value loaded from memory is an
interval ``[lo, hi]`` instead (``lo is hi`` when exact), and a bool interval is three-state
(``lo``: surely true, ``hi``: maybe true). Float values are None: they are never computed.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

I64 = np.dtype(np.int64)
I64_MIN, I64_MAX = int(np.iinfo(I64).min), int(np.iinfo(I64).max)


class Ints:
  """An int or bool value in every program: exact (``lo is hi``) or an interval ``[lo, hi]``.

  Arrays have a leading program axis of size 1 or P, then the value's axes, each of size 1
  (constant along it) or full. Exact values keep their own dtype (arithmetic wraps as on the
  device); intervals are int64 (bool for bools).
  """

  __slots__ = ("lo", "hi")

  def __init__(self, lo, hi=None):
    self.lo = lo
    self.hi = lo if hi is None else hi

  @property
  def exact(self) -> bool:
    return self.lo is self.hi


class Conjunction(Ints):
  """``factor_0 & factor_1 & ...`` of bools that broadcast against each other, kept apart.

  A tile mask such as ``rows_ok[:, None] & cols_ok[None, :]`` is counted from its factors
  without building the tile for every program; other uses build it on first access.
  """

  __slots__ = ("factors", "_bounds")

  def __init__(self, factors: Sequence[Ints]):  # the bounds are built lazily, not stored
    self.factors = tuple(factors)
    self._bounds = None

  def _build(self):
    if self._bounds is None:
      lo = functools.reduce(np.logical_and, [f.lo for f in self.factors])
      hi = lo if self.exact else functools.reduce(np.logical_and, [f.hi for f in self.factors])
      self._bounds = (lo, hi)
    return self._bounds

  lo = property(lambda self: self._build()[0])
  hi = property(lambda self: self._build()[1])

  @property
  def exact(self) -> bool:
    return all(f.exact for f in self.factors)


@functools.lru_cache(maxsize=None)
def is_int(dtype) -> bool:
  dtype = np.dtype(dtype)
  return dtype == np.bool_ or np.issubdtype(dtype, np.integer)


def int_aval(aval) -> bool:
  dtype = getattr(aval, "dtype", None)
  if dtype is None or hasattr(aval, "inner_aval"):
    return False
  try:
    return is_int(dtype)
  except TypeError:
    return False


def full_range(aval) -> Ints | None:
  """The unknown value of ``aval``: its dtype's whole range (None for floats)."""
  if not int_aval(aval):
    return None
  return _unknown(len(aval.shape), np.dtype(aval.dtype))


@functools.lru_cache(maxsize=None)
def _unknown(rank: int, dtype: np.dtype) -> Ints:
  """Shared between values, so read-only (nothing writes into a value's arrays anyway)."""
  shape = (1,) * (1 + rank)
  if dtype == np.bool_:
    lo, hi = np.zeros(shape, bool), np.ones(shape, bool)
  else:
    lo_min, hi_max = _range_of(dtype)
    lo, hi = np.full(shape, lo_min, I64), np.full(shape, hi_max, I64)
  lo.flags.writeable = hi.flags.writeable = False
  return Ints(lo, hi)


def constant(value, aval) -> Ints | None:
  if not int_aval(aval):
    return None
  array = np.asarray(value, dtype=np.dtype(aval.dtype))
  return Ints(array.reshape((1,) + array.shape))


def wide(value: Ints) -> tuple[np.ndarray, np.ndarray]:
  """``(lo, hi)`` as int64 (bools as 0/1)."""
  lo = value.lo.astype(I64, copy=False)
  return lo, (lo if value.exact else value.hi.astype(I64, copy=False))


def bounds(value: Ints) -> tuple[np.ndarray, np.ndarray]:
  """``(lo, hi)`` in the interval dtype: bool for bools, int64 otherwise."""
  if value.lo.dtype == np.bool_:
    return value.lo, value.hi
  return wide(value)


def map_bounds(value: Ints, fn) -> Ints:
  """``fn`` applied to both bounds (once when exact)."""
  lo = fn(value.lo)
  return Ints(lo) if value.exact else Ints(lo, fn(value.hi))


def fit(lo, hi, dtype) -> Ints:
  """An interval of int64 bounds in ``dtype``: the whole range where it would overflow."""
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return Ints(lo.astype(bool), hi.astype(bool))
  lo_min, hi_max = _range_of(dtype)
  return Ints(*saturate((lo < lo_min) | (hi > hi_max), lo, hi, lo_min, hi_max))


def _range_of(dtype: np.dtype) -> tuple[int, int]:
  """An integer dtype's range, clipped to int64's (the intervals' dtype)."""
  info = np.iinfo(dtype)
  return max(int(info.min), I64_MIN), min(int(info.max), I64_MAX)


def saturate(where, lo, hi, lo_min: int = I64_MIN, hi_max: int = I64_MAX):
  """``(lo, hi)`` widened to the whole range ``[lo_min, hi_max]`` where ``where`` holds (an
  overflow, a division by what may be zero)."""
  if np.any(where):
    lo = np.where(where, lo_min, lo)
    hi = np.where(where, hi_max, hi)
  return lo, hi


def align(array: np.ndarray, rank: int) -> np.ndarray:
  """Inserts axes after the program axis so that a lower-rank (scalar) operand broadcasts."""
  missing = rank + 1 - array.ndim
  if missing <= 0:
    return array
  return array.reshape(array.shape[:1] + (1,) * missing + array.shape[1:])


def at_full_shape(array: np.ndarray, shape: Sequence[int]) -> np.ndarray:
  """A read-only view of ``array`` at the value's full shape (program axis kept as is)."""
  return np.broadcast_to(array, (array.shape[0],) + tuple(shape))
