"""Bytes a Pallas kernel's loads and stores touch, counted from its body over its grid.

Our Pallas kernels lower through Pallas' Triton backend, where a ``BlockSpec`` only offsets
pointers: the memory traffic of a launch is exactly what its loads and stores touch. So
:func:`pallas_call_traffic` reads a ``pallas_call``'s kernel jaxpr and evaluates it for every
program of the grid at once, with numpy:

- each integer or bool value carries a leading program axis (of size 1 when it is the same in
  every program), and keeps size-1 axes where it is constant along the value's own axes, so
  that broadcasts cost nothing;
- float values are never computed: they do not decide what is loaded or stored;
- integers the kernel loads from memory are unknown: they become intervals ``[lo, hi]``
  (``[int32 min, int32 max]`` for a loaded int32), and comparisons of intervals give
  three-state bools (``lo``: surely true, ``hi``: maybe true);
- a load or store moves, in each program that runs it, ``itemsize`` bytes for every element
  its mask keeps (every element of the loaded or stored shape without a mask);
- ``scan`` runs its steps, ``while`` runs until its predicate is false in every program,
  ``cond`` runs each branch some program may take and adds, per program, the costlier one.

Where a mask, a loop bound or a branch depends on loaded data the count is the upper bound
and the result says it is not exact. Primitives without a rule of their own are evaluated by
``jax.vmap`` of the primitive when their inputs are known, and are unknown otherwise.

The figure is what the kernel body asks for, before any cache: a tile that two programs
load is counted twice, as is a tile one program loads twice.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jax.experimental import pallas as pl
  >>> from jax.experimental.pallas import triton as plt
  >>> from jaxfuse.metrics import traffic
  >>> def copy(x_ref, y_ref):  # 4 programs copy blocks of 8; the last block is half outside
  ...   ok = pl.program_id(0) * 8 + jnp.arange(8) < 28
  ...   plt.store(y_ref, plt.load(x_ref, mask=ok), mask=ok)
  >>> f = lambda x: pl.pallas_call(copy, out_shape=x, grid=(4,),
  ...     in_specs=[pl.BlockSpec((8,), lambda i: (i,))],
  ...     out_specs=pl.BlockSpec((8,), lambda i: (i,)), interpret=True)(x)
  >>> [(t.name, t.reads, t.writes, t.exact) for t in traffic.kernel_traffic(f, jnp.ones(28))]
  [('copy', 112, 112, True)]
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.extend import core as jex_core

# A ``while`` loop stops with an error after this many steps (a bound read from memory that
# nothing clips would otherwise run for 2**31 steps).
MAX_LOOP_STEPS = 1 << 17

_I64 = np.dtype(np.int64)
_LOADS = ("masked_load", "get")
_STORES = ("masked_swap", "swap")
_READ_WRITES = ("addupdate", "atomic_rmw", "atomic_cas")
_EFFECTS = frozenset(_LOADS + _STORES + _READ_WRITES)
_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "custom_jvp_call",
                    "custom_vjp_call", "custom_vjp_call_jaxpr", "remat", "checkpoint",
                    "custom_lin"})


@dataclasses.dataclass(frozen=True)
class OperandTraffic:
  """Bytes one operand of a kernel is read from and written to.

  ``role`` is ``"input"`` or ``"output"``, ``index`` its position among those.
  """

  role: str
  index: int
  shape: tuple[int, ...]
  dtype: str
  reads: int
  writes: int


@dataclasses.dataclass(frozen=True)
class KernelTraffic:
  """The bytes one ``pallas_call`` reads and writes, summed over its grid.

  ``exact`` is False when a mask, a loop bound or a branch depended on data the kernel
  loads: the figures are then upper bounds.
  """

  name: str
  reads: int
  writes: int
  operands: tuple[OperandTraffic, ...]
  exact: bool
  programs: int

  @property
  def bytes(self) -> int:
    """Bytes read + written."""
    return self.reads + self.writes


# Values ----------------------------------------------------------------------------------------


class _Ints:
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


class _Conjunction(_Ints):
  """``factor_0 & factor_1 & ...`` of bools that broadcast against each other, kept apart.

  A tile mask such as ``rows_ok[:, None] & cols_ok[None, :]`` is counted from its factors
  without building the tile for every program; other uses build it on first access.
  """

  __slots__ = ("factors", "_bounds")

  def __init__(self, factors: Sequence[_Ints]):  # the bounds are built lazily, not stored
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


@dataclasses.dataclass(frozen=True)
class _Ref:
  operand: int | None  # None: scratch memory, whose traffic is not counted


@functools.lru_cache(maxsize=None)
def _is_int(dtype) -> bool:
  dtype = np.dtype(dtype)
  return dtype == np.bool_ or np.issubdtype(dtype, np.integer)


def _int_aval(aval) -> bool:
  dtype = getattr(aval, "dtype", None)
  if dtype is None or hasattr(aval, "inner_aval"):
    return False
  try:
    return _is_int(dtype)
  except TypeError:
    return False


def _full_range(aval) -> _Ints | None:
  """The unknown value of ``aval``: its dtype's whole range (None for floats)."""
  if not _int_aval(aval):
    return None
  return _unknown(len(aval.shape), np.dtype(aval.dtype))


@functools.lru_cache(maxsize=None)
def _unknown(rank: int, dtype: np.dtype) -> _Ints:
  """Shared between values, so read-only (nothing writes into a value's arrays anyway)."""
  shape = (1,) * (1 + rank)
  if dtype == np.bool_:
    lo, hi = np.zeros(shape, bool), np.ones(shape, bool)
  else:
    info = np.iinfo(dtype)
    lo = np.full(shape, max(info.min, np.iinfo(_I64).min), _I64)
    hi = np.full(shape, min(info.max, np.iinfo(_I64).max), _I64)
  lo.flags.writeable = hi.flags.writeable = False
  return _Ints(lo, hi)


def _constant(value, aval) -> _Ints | None:
  if not _int_aval(aval):
    return None
  array = np.asarray(value, dtype=np.dtype(aval.dtype))
  return _Ints(array.reshape((1,) + array.shape))


def _wide(value: _Ints) -> tuple[np.ndarray, np.ndarray]:
  """``(lo, hi)`` as int64 (bools as 0/1)."""
  lo = value.lo.astype(_I64, copy=False)
  return lo, (lo if value.exact else value.hi.astype(_I64, copy=False))


def _bounds(value: _Ints) -> tuple[np.ndarray, np.ndarray]:
  """``(lo, hi)`` in the interval dtype: bool for bools, int64 otherwise."""
  if value.lo.dtype == np.bool_:
    return value.lo, value.hi
  return _wide(value)


def _map(value: _Ints, fn) -> _Ints:
  """``fn`` applied to both bounds (once when exact)."""
  lo = fn(value.lo)
  return _Ints(lo) if value.exact else _Ints(lo, fn(value.hi))


def _fit(lo, hi, dtype) -> _Ints:
  """An interval of int64 bounds in ``dtype``: the whole range where it would overflow."""
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return _Ints(lo.astype(bool), hi.astype(bool))
  info = np.iinfo(dtype)
  lo_min, hi_max = max(info.min, np.iinfo(_I64).min), min(info.max, np.iinfo(_I64).max)
  wraps = (lo < lo_min) | (hi > hi_max)
  if np.any(wraps):
    lo = np.where(wraps, lo_min, lo)
    hi = np.where(wraps, hi_max, hi)
  return _Ints(lo, hi)


def _align(array: np.ndarray, rank: int) -> np.ndarray:
  """Inserts axes after the program axis so that a lower-rank (scalar) operand broadcasts."""
  missing = rank + 1 - array.ndim
  if missing <= 0:
    return array
  return array.reshape(array.shape[:1] + (1,) * missing + array.shape[1:])


def _full(array: np.ndarray, shape: Sequence[int]) -> np.ndarray:
  """A read-only view of ``array`` at the value's full shape (program axis kept as is)."""
  return np.broadcast_to(array, (array.shape[0],) + tuple(shape))


# Elementwise rules ----------------------------------------------------------------------------


def _trunc_div(a, b):
  with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
    safe = np.where(b == 0, 1, b).astype(np.result_type(a, b), copy=False)
    q = np.floor_divide(a, safe)
    if np.issubdtype(q.dtype, np.signedinteger):
      q = q + ((np.remainder(a, safe) != 0) & ((a < 0) != (safe < 0))).astype(q.dtype)
    return q


def _trunc_rem(a, b):
  with np.errstate(divide="ignore", invalid="ignore"):
    return np.fmod(a, np.where(b == 0, 1, b).astype(np.result_type(a, b), copy=False))


def _select(which, *cases):
  if which.dtype == np.bool_:
    return np.where(which, cases[1], cases[0])
  out = cases[0]
  for i, case in enumerate(cases[1:], 1):
    out = np.where(which == i, case, out)
  return out


_EXACT: dict[str, Callable] = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "neg": np.negative,
    "max": np.maximum, "min": np.minimum, "abs": np.abs, "sign": np.sign,
    "div": _trunc_div, "rem": _trunc_rem, "select_n": _select,
    "clamp": lambda lo, x, hi: np.minimum(np.maximum(x, lo), hi),
    "and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor, "not": np.invert,
    "eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
    "gt": np.greater, "ge": np.greater_equal,
    "shift_left": np.left_shift, "shift_right_arithmetic": np.right_shift,
    "copy": lambda x: x, "copy_p": lambda x: x, "multiple_of": lambda x: x,
}


def _corners(op, a, b):
  (alo, ahi), (blo, bhi) = a, b
  with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
    values = [op(x, y) for x in (alo, ahi) for y in (blo, bhi)]
  return functools.reduce(np.minimum, values), functools.reduce(np.maximum, values)


def _interval_mul(a, b):
  (alo, ahi), (blo, bhi) = a, b
  big = float(2 ** 62)
  with np.errstate(over="ignore", invalid="ignore"):
    loose = [np.abs(x.astype(float) * y.astype(float)) > big
             for x in (alo, ahi) for y in (blo, bhi)]
  lo, hi = _corners(np.multiply, a, b)
  overflow = functools.reduce(np.logical_or, loose)
  if np.any(overflow):
    lo = np.where(overflow, np.iinfo(_I64).min, lo)
    hi = np.where(overflow, np.iinfo(_I64).max, hi)
  return lo, hi


def _interval_div(a, b):
  blo, bhi = b
  one_sign = (blo > 0) | (bhi < 0)
  lo, hi = _corners(_trunc_div, a, b)
  if not np.all(one_sign):
    lo = np.where(one_sign, lo, np.iinfo(_I64).min)
    hi = np.where(one_sign, hi, np.iinfo(_I64).max)
  return lo, hi


def _interval_rem(a, b):
  (alo, ahi), (blo, bhi) = a, b
  m = np.maximum(np.abs(blo), np.abs(bhi)) - 1
  lo = np.where(alo < 0, np.maximum(alo, -m), 0)
  hi = np.where(ahi > 0, np.minimum(ahi, m), 0)
  same = (alo >= 0) & (ahi <= np.minimum(np.abs(blo), np.abs(bhi)) - 1) & ((blo > 0) | (bhi < 0))
  lo, hi = np.where(same, alo, lo), np.where(same, ahi, hi)
  spans_zero = (blo <= 0) & (bhi >= 0)
  if np.any(spans_zero):
    lo = np.where(spans_zero, np.iinfo(_I64).min, lo)
    hi = np.where(spans_zero, np.iinfo(_I64).max, hi)
  return lo, hi


def _interval_abs(a):
  lo, hi = a
  return (np.where(lo >= 0, lo, np.where(hi <= 0, -hi, 0)),
          np.where(lo >= 0, hi, np.where(hi <= 0, -lo, np.maximum(-lo, hi))))


def _interval_eq(a, b):
  (alo, ahi), (blo, bhi) = a, b
  return (alo == ahi) & (blo == bhi) & (alo == blo), (alo <= bhi) & (blo <= ahi)


def _interval_ne(a, b):
  sure, maybe = _interval_eq(a, b)
  return ~maybe, ~sure


def _interval_clamp(lo_b, x, hi_b):
  return (np.minimum(np.maximum(x[0], lo_b[0]), hi_b[0]),
          np.minimum(np.maximum(x[1], lo_b[1]), hi_b[1]))


_INTERVAL: dict[str, Callable] = {
    "add": lambda a, b: (a[0] + b[0], a[1] + b[1]),
    "sub": lambda a, b: (a[0] - b[1], a[1] - b[0]),
    "neg": lambda a: (-a[1], -a[0]),
    "mul": _interval_mul,
    "max": lambda a, b: (np.maximum(a[0], b[0]), np.maximum(a[1], b[1])),
    "min": lambda a, b: (np.minimum(a[0], b[0]), np.minimum(a[1], b[1])),
    "clamp": _interval_clamp,
    "div": _interval_div,
    "rem": _interval_rem,
    "abs": _interval_abs,
    "sign": lambda a: (np.sign(a[0]), np.sign(a[1])),
    "lt": lambda a, b: (a[1] < b[0], a[0] < b[1]),
    "le": lambda a, b: (a[1] <= b[0], a[0] <= b[1]),
    "gt": lambda a, b: (a[0] > b[1], a[1] > b[0]),
    "ge": lambda a, b: (a[0] >= b[1], a[1] >= b[0]),
    "eq": _interval_eq,
    "ne": _interval_ne,
    "copy": lambda a: a, "copy_p": lambda a: a, "multiple_of": lambda a: a,
}

# On bools, three-state logic: (surely true, maybe true).
_LOGIC: dict[str, Callable] = {
    "and": lambda a, b: (a[0] & b[0], a[1] & b[1]),
    "or": lambda a, b: (a[0] | b[0], a[1] | b[1]),
    "not": lambda a: (~a[1], ~a[0]),
    "xor": lambda a, b: ((a[0] & ~b[1]) | (~a[1] & b[0]), (a[1] & ~b[0]) | (~a[0] & b[1])),
}


def _interval_select(which: _Ints, cases: Sequence[_Ints]):
  wlo, whi = _wide(which)
  los, his = [], []
  for i, case in enumerate(cases):
    clo, chi = _wide(case)
    maybe = (wlo <= i) & (i <= whi)
    los.append(np.where(maybe, clo, np.iinfo(_I64).max))
    his.append(np.where(maybe, chi, np.iinfo(_I64).min))
  return functools.reduce(np.minimum, los), functools.reduce(np.maximum, his)


def _spreads(values: Sequence[_Ints]) -> bool:
  """Whether broadcasting the values together makes something much bigger than any of them."""
  shapes = [v.lo.shape for v in values]
  biggest = max(math.prod(shape) for shape in shapes)
  return math.prod(np.broadcast_shapes(*shapes)) >= 4 * biggest >= 4 * 64


def _elementwise(eqn, values):
  name = eqn.primitive.name
  out_aval = eqn.outvars[0].aval
  if any(v is None for v in values):
    return [_full_range(out_aval)]
  rank = len(out_aval.shape)
  dtype = np.dtype(out_aval.dtype)
  if name == "and" and dtype == np.bool_:
    factors = [f for v in values for f in (v.factors if isinstance(v, _Conjunction) else (v,))]
    factors = [_map(f, lambda x: _align(x, rank)) for f in factors]
    if len(factors) > len(values) or _spreads(factors):
      return [_Conjunction(factors)]
    values = factors
  values = [_map(v, lambda x: _align(x, rank)) for v in values]
  if all(v.exact for v in values):
    with np.errstate(over="ignore"):
      out = _EXACT[name](*[v.lo for v in values])
    return [_Ints(np.asarray(out).astype(dtype, copy=False))]
  if name == "select_n":
    lo, hi = _interval_select(values[0], values[1:])
    return [_fit(lo, hi, dtype)]
  if name in _LOGIC and all(v.lo.dtype == np.bool_ for v in values):
    lo, hi = _LOGIC[name](*[(v.lo, v.hi) for v in values])
    return [_Ints(lo, hi)]
  rule = _INTERVAL.get(name)
  if rule is None:
    return [_full_range(out_aval)]
  lo, hi = rule(*[_wide(v) for v in values])
  return [_fit(np.asarray(lo), np.asarray(hi), dtype)]


def _convert(eqn, values):
  (value,), aval = values, eqn.outvars[0].aval
  dtype = np.dtype(eqn.params["new_dtype"])
  if value is None or not _is_int(dtype):
    return [_full_range(aval)]
  if value.exact:
    return [_Ints(value.lo.astype(dtype, copy=False))]
  lo, hi = _wide(value)
  if dtype == np.bool_:
    return [_Ints((lo > 0) | (hi < 0), ~((lo == 0) & (hi == 0)))]
  return [_fit(lo, hi, dtype)]


def _integer_pow(eqn, values):
  (value,), y = values, eqn.params["y"]
  if value is None:
    return [_full_range(eqn.outvars[0].aval)]
  if value.exact:
    with np.errstate(over="ignore"):
      return [_Ints(np.power(value.lo, y).astype(value.lo.dtype, copy=False))]
  lo, hi = _wide(value)
  if y == 2:
    a = _interval_abs((lo, hi))
    return [_fit(a[0] * a[0], a[1] * a[1], eqn.outvars[0].aval.dtype)]
  return [_full_range(eqn.outvars[0].aval)]


# Structural rules: the same numpy op on lo and hi -------------------------------------------------


def _structural(op, per_axis=False):
  """A rule applying ``op`` to the bounds; ``per_axis`` ops also apply factor by factor to a
  :class:`_Conjunction`, which then stays one."""
  def rule(eqn, values):
    if any(v is None for v in values):
      return [_full_range(v.aval) for v in eqn.outvars]
    if per_axis and isinstance(values[0], _Conjunction):
      return [_Conjunction([_map(f, lambda x: op(eqn, x)) for f in values[0].factors])]
    if all(v.exact for v in values):
      return [_Ints(op(eqn, *[v.lo for v in values]))]
    if len(values) == 1:
      return [_map(values[0], lambda x: op(eqn, x))]
    bounds = [_bounds(v) for v in values]
    return [_Ints(op(eqn, *[b[0] for b in bounds]), op(eqn, *[b[1] for b in bounds]))]
  return rule


def _broadcast_in_dim(eqn, x):
  shape = [x.shape[0]] + [1] * len(eqn.params["shape"])
  for i, d in enumerate(eqn.params["broadcast_dimensions"]):
    shape[1 + d] = x.shape[1 + i]
  return x.reshape(shape)


def _reshape(eqn, x):
  new = tuple(eqn.params["new_sizes"])
  if all(s == 1 for s in x.shape[1:]):
    return x.reshape((x.shape[0],) + (1,) * len(new))
  full = _full(x, eqn.invars[0].aval.shape)
  if eqn.params.get("dimensions") is not None:
    full = np.transpose(full, (0, *[d + 1 for d in eqn.params["dimensions"]]))
  return np.reshape(full, (x.shape[0],) + new)


def _squeeze(eqn, x):
  return np.squeeze(x, axis=tuple(d + 1 for d in eqn.params["dimensions"]))


def _transpose(eqn, x):
  return np.transpose(x, (0, *[d + 1 for d in eqn.params["permutation"]]))


def _slice(eqn, x):
  starts, limits = eqn.params["start_indices"], eqn.params["limit_indices"]
  strides = eqn.params.get("strides") or (1,) * len(starts)
  index = [slice(None)]
  for d, (start, limit, stride) in enumerate(zip(starts, limits, strides)):
    index.append(slice(None) if x.shape[1 + d] == 1 else slice(start, limit, stride))
  out = x[tuple(index)]
  # A size-1 axis stays size 1 unless the slice is empty.
  want = eqn.outvars[0].aval.shape
  return out if all(o in (1, w) for o, w in zip(out.shape[1:], want)) else _full(out, want)


def _rev(eqn, x):
  axes = tuple(d + 1 for d in eqn.params["dimensions"] if x.shape[1 + d] > 1)
  return np.flip(x, axis=axes) if axes else x


def _concatenate(eqn, *xs):
  d = eqn.params["dimension"]
  programs = max(x.shape[0] for x in xs)
  rank = len(eqn.outvars[0].aval.shape)
  other = [max(x.shape[1 + a] for x in xs) for a in range(rank)]
  parts = []
  for x, var in zip(xs, eqn.invars):
    shape = [programs] + other
    shape[1 + d] = var.aval.shape[d]
    parts.append(np.broadcast_to(x, shape))
  return np.concatenate(parts, axis=1 + d)


def _iota(eqn):
  p = eqn.params
  shape = [1] * (1 + len(p["shape"]))
  shape[1 + p["dimension"]] = p["shape"][p["dimension"]]
  return [_Ints(np.arange(p["shape"][p["dimension"]], dtype=np.dtype(p["dtype"])).reshape(shape))]


_REDUCE = {"reduce_max": np.max, "reduce_min": np.min, "reduce_sum": np.sum,
           "reduce_and": np.all, "reduce_or": np.any}


def _reduce(eqn, values):
  (value,) = values
  aval = eqn.outvars[0].aval
  if value is None:
    return [_full_range(aval)]
  name = eqn.primitive.name
  axes = tuple(eqn.params["axes"])
  in_shape = eqn.invars[0].aval.shape
  if name == "reduce_sum":
    # Axes along which the value is constant multiply the sum by their length.
    factor = math.prod(in_shape[a] for a in axes if value.lo.shape[1 + a] == 1)
  np_axes = tuple(a + 1 for a in axes)

  def reduce(x, dtype=None):
    if name == "reduce_sum":
      with np.errstate(over="ignore"):
        return (np.sum(x, axis=np_axes, dtype=dtype or x.dtype) * factor).astype(
            dtype or x.dtype, copy=False)
    return _REDUCE[name](x, axis=np_axes)

  if any(in_shape[a] == 0 for a in axes):
    return [_full_range(aval)]
  if value.exact:
    return [_Ints(reduce(value.lo))]
  if name == "reduce_sum":
    lo, hi = _wide(value)
    return [_fit(reduce(lo, _I64), reduce(hi, _I64), aval.dtype)]
  return [_Ints(reduce(value.lo), reduce(value.hi))]


def _argminmax(eqn, values):
  (value,) = values
  aval = eqn.outvars[0].aval
  if value is None or not value.exact:
    (axis,) = eqn.params["axes"]
    n = eqn.invars[0].aval.shape[axis]
    shape = (1,) * (1 + len(aval.shape))
    return [_Ints(np.zeros(shape, _I64), np.full(shape, max(n - 1, 0), _I64))]
  (axis,) = eqn.params["axes"]
  full = _full(value.lo, eqn.invars[0].aval.shape)
  op = np.argmax if eqn.primitive.name == "argmax" else np.argmin
  return [_Ints(op(full, axis=axis + 1).astype(np.dtype(eqn.params["index_dtype"])))]


def _fallback(eqn, values, programs):
  """Evaluates a primitive without a rule of its own with jax, vmapped over the programs."""
  if any(v is None or not v.exact for v in values) or eqn.params.get("jaxpr") is not None:
    return [_full_range(v.aval) for v in eqn.outvars]
  arrays, axes = [], []
  for value, var in zip(values, eqn.invars):
    full = _full(value.lo, var.aval.shape)
    if full.shape[0] == 1:
      arrays.append(np.ascontiguousarray(full[0]))
      axes.append(None)
    else:
      arrays.append(np.ascontiguousarray(full))
      axes.append(0)

  def bind(*xs):
    return eqn.primitive.bind(*xs, **eqn.params)

  batched = any(a is not None for a in axes)
  with jax.ensure_compile_time_eval():
    out = jax.vmap(bind, in_axes=axes)(*arrays) if batched else bind(*arrays)
  outs = out if eqn.primitive.multiple_results else [out]
  results = []
  for o, var in zip(outs, eqn.outvars):
    if not _int_aval(var.aval):
      results.append(None)
      continue
    o = np.asarray(o)
    results.append(_Ints(o if batched else o[None]))
  return results


_RULES: dict[str, Callable] = {name: _elementwise for name in _EXACT}
_RULES.update({
    "convert_element_type": _convert,
    "integer_pow": _integer_pow,
    "broadcast_in_dim": _structural(_broadcast_in_dim, per_axis=True),
    "reshape": _structural(_reshape),
    "squeeze": _structural(_squeeze, per_axis=True),
    "transpose": _structural(_transpose, per_axis=True),
    "slice": _structural(_slice),
    "rev": _structural(_rev),
    "concatenate": _structural(_concatenate),
    "argmax": _argminmax,
    "argmin": _argminmax,
    **{name: _reduce for name in _REDUCE},
})


# The evaluator --------------------------------------------------------------------------------


class _Tally:
  """Bytes read and written, per operand and per program."""

  def __init__(self, operands: int, programs: int):
    self.reads = np.zeros((operands, programs), _I64)
    self.writes = np.zeros((operands, programs), _I64)
    self.exact = True

  def child(self) -> _Tally:
    return _Tally(*self.reads.shape)


def _subjaxprs(eqn):
  for value in eqn.params.values():
    for item in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(item, jex_core.ClosedJaxpr):
        yield item.jaxpr
      elif isinstance(item, jex_core.Jaxpr):
        yield item


def _open(jaxpr):
  """``(jaxpr, consts)`` of a Jaxpr or ClosedJaxpr."""
  if isinstance(jaxpr, jex_core.ClosedJaxpr):
    return jaxpr.jaxpr, jaxpr.consts
  return jaxpr, ()


def _is_var(v) -> bool:
  return not isinstance(v, jex_core.Literal)


class _Evaluator:
  """Evaluates kernel jaxprs for all programs of one grid."""

  def __init__(self, grid: tuple[int, ...]):
    self.grid = grid
    self.programs = math.prod(grid)
    coords = np.unravel_index(np.arange(self.programs), grid) if grid else ()
    self.program_ids = [c.astype(np.int32) for c in coords]
    self._plans: dict[int, tuple] = {}
    self._effects: dict[int, bool] = {}

  # Which equations matter: effects, and what computes the ints they (and the outputs) need.

  def has_effects(self, jaxpr) -> bool:
    key = id(jaxpr)
    if key not in self._effects:
      self._effects[key] = False
      self._effects[key] = any(
          eqn.primitive.name in _EFFECTS or any(self.has_effects(s) for s in _subjaxprs(eqn))
          for eqn in jaxpr.eqns)
    return self._effects[key]

  def plan(self, jaxpr) -> list:
    key = id(jaxpr)
    cached = self._plans.get(key)
    if cached is not None and cached[0] is jaxpr:
      return cached[1]
    needed = {v for v in jaxpr.outvars if _is_var(v) and _int_aval(v.aval)}
    used = {v for eqn in jaxpr.eqns for v in eqn.invars if _is_var(v)}
    used.update(v for v in jaxpr.outvars if _is_var(v))
    steps = []
    for eqn in reversed(jaxpr.eqns):
      effects = eqn.primitive.name in _EFFECTS or any(
          self.has_effects(s) for s in _subjaxprs(eqn))
      if not effects and not any(v in needed for v in eqn.outvars):
        continue
      for v in eqn.invars:
        if _is_var(v) and (_int_aval(v.aval) or hasattr(v.aval, "inner_aval")):
          needed.add(v)
      handler = self.handler(eqn, effects)
      if "args_tree" in eqn.params and eqn.primitive.name in _EFFECTS:
        # (ref, transforms, mask, other) of a load, (ref, transforms, value, mask) of a store.
        where = jax.tree_util.tree_unflatten(eqn.params["args_tree"], range(len(eqn.invars)))
        mask_at = where[2] if eqn.primitive.name == "masked_load" else where[3]
        handler = functools.partial(handler, mask_at=mask_at)
      if eqn.primitive.name in _STORES:
        # Triton drops the load of a swap's old value when nothing uses it.
        handler = functools.partial(handler, reads_old=any(v in used for v in eqn.outvars))
      inputs = tuple((None, _constant(v.val, v.aval)) if isinstance(v, jex_core.Literal)
                     else (v, None) for v in eqn.invars)
      steps.append((eqn, handler, inputs))
    steps.reverse()
    self._plans[key] = (jaxpr, steps)
    return steps

  def handler(self, eqn, effects: bool) -> Callable:
    name = eqn.primitive.name
    special = {"masked_load": self.load, "get": self.load, "masked_swap": self.store,
               "swap": self.store, "addupdate": self.store, "atomic_rmw": self.store,
               "atomic_cas": self.store, "scan": self.scan, "while": self.while_loop,
               "cond": self.cond, "program_id": self.program_id,
               "num_programs": self.num_programs, "run_scoped": self.run_scoped}
    if name in special:
      return special[name]
    if name in _CALLS or (effects and len(list(_subjaxprs(eqn))) == 1):
      return self.call
    if effects:
      raise NotImplementedError(f"traffic: no rule for {name!r}, which contains loads or stores")
    if name == "iota":
      return lambda eqn, values, active, tally: _iota(eqn)
    rule = _RULES.get(name)
    if rule is not None:
      return lambda eqn, values, active, tally: rule(eqn, values)
    return lambda eqn, values, active, tally: _fallback(eqn, values, self.programs)

  def run(self, jaxpr, consts, args, active, tally) -> list:
    env = {}
    for v, c in zip(jaxpr.constvars, consts):
      env[v] = c if isinstance(c, (_Ints, _Ref)) or c is None else _constant(c, v.aval)
    for v, a in zip(jaxpr.invars, args):
      env[v] = a

    get = env.get
    for eqn, handler, inputs in self.plan(jaxpr):
      # Floats are never computed: they read as None.
      outs = handler(eqn, [c if v is None else get(v) for v, c in inputs], active, tally)
      for v, out in zip(eqn.outvars, outs):
        env[v] = out
    return [_constant(v.val, v.aval) if isinstance(v, jex_core.Literal)
            else env[v] if v in env else _full_range(v.aval) for v in jaxpr.outvars]

  def run_closed(self, closed, args, active, tally) -> list:
    jaxpr, consts = _open(closed)
    return self.run(jaxpr, consts, args, active, tally)

  # Programs.

  def program_id(self, eqn, values, active, tally):
    return [_Ints(self.program_ids[eqn.params["axis"]])]

  def num_programs(self, eqn, values, active, tally):
    return [_Ints(np.full((1,), self.grid[eqn.params["axis"]], np.int32))]

  # Loads and stores.

  def count(self, tally, ref, shape, mask, itemsize, active, write):
    if not isinstance(ref, _Ref) or ref.operand is None:
      return
    n = math.prod(shape)
    if mask is None:
      hi = lo = np.full((1,), n * itemsize, _I64)
    elif isinstance(mask, _Conjunction):
      hi = _per_program_of_product([f.hi for f in mask.factors], n) * itemsize
      lo = hi if mask.exact else _per_program_of_product([f.lo for f in mask.factors],
                                                         n) * itemsize
    else:
      hi = _per_program(mask.hi, n) * itemsize
      lo = hi if mask.exact else _per_program(mask.lo, n) * itemsize
    if active is not None:
      hi = np.where(active, hi, 0)
      lo = hi if lo is hi else np.where(active, lo, 0)
    rows = tally.writes if write else tally.reads
    rows[ref.operand] += hi
    if lo is not hi and np.any(lo != hi):
      tally.exact = False

  def load(self, eqn, values, active, tally, mask_at=None):
    (out,) = eqn.outvars
    ref, mask = values[0], (None if mask_at is None else values[mask_at])
    self.count(tally, ref, out.aval.shape, mask, np.dtype(out.aval.dtype).itemsize, active,
               write=False)
    return [_full_range(out.aval)]

  def store(self, eqn, values, active, tally, reads_old=False, mask_at=None):
    name = eqn.primitive.name
    mask = None if mask_at is None else values[mask_at]
    if name in ("masked_swap", "atomic_rmw"):
      ref, shape_var = values[0], eqn.outvars[0]
    elif name == "atomic_cas":
      ref, shape_var = values[0], eqn.outvars[0]
    else:  # swap, addupdate: ref, value, *indices
      ref, shape_var = values[0], eqn.invars[1]
    shape = shape_var.aval.shape
    itemsize = np.dtype(shape_var.aval.dtype).itemsize
    self.count(tally, ref, shape, mask, itemsize, active, write=True)
    # A swap whose old value is used, addupdate and atomics also read what they replace.
    if name in _READ_WRITES or reads_old:
      self.count(tally, ref, shape, mask, itemsize, active, write=False)
    return [_full_range(v.aval) for v in eqn.outvars]

  # Control flow.

  def call(self, eqn, values, active, tally):
    (sub,) = [v for v in eqn.params.values()
              if isinstance(v, (jex_core.ClosedJaxpr, jex_core.Jaxpr))][:1] or [None]
    if sub is None:
      return _fallback(eqn, values, self.programs)
    jaxpr, _ = _open(sub)
    if not self.has_effects(jaxpr) and not any(_int_aval(v.aval) for v in eqn.outvars):
      return [None] * len(eqn.outvars)
    return self.run_closed(sub, values[-len(jaxpr.invars):] if jaxpr.invars else [],
                           active, tally)

  def run_scoped(self, eqn, values, active, tally):
    jaxpr, consts = _open(eqn.params["jaxpr"])
    scratch = [_Ref(None)] * (len(jaxpr.invars) - len(values))
    return self.run(jaxpr, consts, list(values) + scratch, active, tally)

  def scan(self, eqn, values, active, tally):
    p = eqn.params
    n_consts, n_carry, length = p["num_consts"], p["num_carry"], p["length"]
    consts, carry, xs = (values[:n_consts], values[n_consts:n_consts + n_carry],
                         values[n_consts + n_carry:])
    body = p["jaxpr"]
    ys = []
    if active is not None and not active.any():
      return [_full_range(v.aval) for v in eqn.outvars]
    for step in range(length):
      i = length - 1 - step if p["reverse"] else step
      x = [None if v is None else _Ints(*_take(v, i)) for v in xs]
      outs = self.run_closed(body, consts + carry + x, active, tally)
      carry, y = outs[:n_carry], outs[n_carry:]
      ys.append(y)
    return carry + [_stack([y[k] for y in ys], var.aval)
                    for k, var in enumerate(eqn.outvars[n_carry:])]

  def while_loop(self, eqn, values, active, tally):
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cond_consts, body_consts, carry = values[:cn], values[cn:cn + bn], values[cn + bn:]
    running = active
    for _ in range(MAX_LOOP_STEPS):
      (pred,) = self.run_closed(p["cond_jaxpr"], cond_consts + carry, running, tally)
      if pred is None:
        pred = _full_range(p["cond_jaxpr"].out_avals[0])
      maybe = _per_program_flag(pred.hi, self.programs)
      run = maybe if running is None else maybe & running
      if not pred.exact and np.any(run & ~_per_program_flag(pred.lo, self.programs)):
        tally.exact = False
      if not run.any():
        return carry
      everyone = bool(run.all())
      new = self.run_closed(p["body_jaxpr"], body_consts + carry, None if everyone else run,
                            tally)
      carry = new if everyone else [_where(run, a, b) for a, b in zip(new, carry)]
      running = None if everyone else run
    raise RuntimeError(
        f"traffic: a while loop in the kernel ran past {MAX_LOOP_STEPS} steps; its bound "
        "probably comes from memory without a clip (raise MAX_LOOP_STEPS if it is real)")

  def cond(self, eqn, values, active, tally):
    branches = eqn.params["branches"]
    index, *operands = values
    n = len(branches)
    if index is None:
      index = _Ints(np.zeros((1,), _I64), np.full((1,), n - 1, _I64))
    lo = _per_program_flag(np.clip(index.lo, 0, n - 1), self.programs, keep=True)
    hi = lo if index.exact else _per_program_flag(np.clip(index.hi, 0, n - 1), self.programs,
                                                  keep=True)
    taken, outputs, tallies = [], [], []
    for b, branch in enumerate(branches):
      maybe = (lo <= b) & (b <= hi)
      if active is not None:
        maybe &= active
      if not maybe.any():
        continue
      child = tally.child()
      outputs.append(self.run_closed(branch, operands, maybe, child))
      taken.append(maybe)
      tallies.append(child)
    if not tallies:
      return [_full_range(v.aval) for v in eqn.outvars]
    if len(taken) > 1 and np.any(np.sum(taken, axis=0) > 1):
      tally.exact = False
    tally.reads += np.maximum.reduce([t.reads for t in tallies])
    tally.writes += np.maximum.reduce([t.writes for t in tallies])
    tally.exact &= all(t.exact for t in tallies)
    return [_merge([o[k] for o in outputs], taken, var.aval)
            for k, var in enumerate(eqn.outvars)]


def _per_program(mask: np.ndarray, n: int) -> np.ndarray:
  """Elements a mask keeps in each program, for a load or store of ``n`` elements."""
  per_value = math.prod(mask.shape[1:])
  kept = mask.reshape(mask.shape[0], -1).sum(axis=1, dtype=_I64)
  return kept * (n // per_value if per_value else 0)


def _per_program_of_product(factors: Sequence[np.ndarray], n: int) -> np.ndarray:
  """:func:`_per_program` of the conjunction of ``factors``, without building it: each factor
  is first summed over the axes along which only it varies."""
  rank = max(f.ndim for f in factors)
  factors = [_align(f, rank - 1) for f in factors]
  # How many factors vary along each axis, and the value's extent there.
  varying = [sum(f.shape[a] > 1 for f in factors) for a in range(rank)]
  extent = [max(f.shape[a] for f in factors) for a in range(rank)]
  product = None
  for f in factors:
    own = tuple(a for a in range(1, rank) if f.shape[a] > 1 and varying[a] == 1)
    f = f.sum(axis=own, keepdims=True, dtype=_I64) if own else f.astype(_I64)
    product = f if product is None else product * f
  per_value = math.prod(extent[1:])
  kept = product.reshape(product.shape[0], -1).sum(axis=1, dtype=_I64)
  return kept * (n // per_value if per_value else 0)


def _per_program_flag(x: np.ndarray, programs: int, keep: bool = False) -> np.ndarray:
  """A scalar value's per-program vector, of length P (bool unless ``keep``)."""
  x = x.reshape(x.shape[0])
  x = np.broadcast_to(x, (programs,))
  return x if keep else x.astype(bool, copy=False)


def _program_mask(run: np.ndarray, ndim: int) -> np.ndarray:
  return run.reshape((run.shape[0],) + (1,) * (ndim - 1))


def _where(run: np.ndarray, new: _Ints | None, old: _Ints | None) -> _Ints | None:
  if new is None or old is None:
    return None
  ndim = max(new.lo.ndim, old.lo.ndim)
  m = _program_mask(run, ndim)
  if new.exact and old.exact and new.lo.dtype == old.lo.dtype:
    return _Ints(np.where(m, new.lo, old.lo))
  wide = [_bounds(new), _bounds(old)]
  return _Ints(np.where(m, wide[0][0], wide[1][0]), np.where(m, wide[0][1], wide[1][1]))


def _merge(values, taken, aval) -> _Ints | None:
  """The output of a ``cond``: each program's branch, or the union of those it may take."""
  if any(v is None for v in values):
    return None
  if len(values) == 1:
    return values[0]
  ndim = 1 + len(aval.shape)
  los, his = [], []
  for value, maybe in zip(values, taken):
    lo, hi = _wide(value)
    m = _program_mask(maybe, ndim)
    los.append(np.where(m, lo, np.iinfo(_I64).max))
    his.append(np.where(m, hi, np.iinfo(_I64).min))
  lo, hi = functools.reduce(np.minimum, los), functools.reduce(np.maximum, his)
  anyone = _program_mask(np.logical_or.reduce(taken), ndim)
  lo, hi = np.where(anyone, lo, 0), np.where(anyone, hi, 0)
  return _fit(lo, hi, aval.dtype)


def _take(value: _Ints, i: int):
  def pick(x):
    return x[:, i] if x.shape[1] > 1 else x[:, 0]
  lo = pick(value.lo)
  return lo, (lo if value.exact else pick(value.hi))


def _stack(values, aval) -> _Ints | None:
  if not values or any(v is None for v in values):
    return _full_range(aval)
  if all(v.exact for v in values):
    return _Ints(np.stack(np.broadcast_arrays(*[v.lo for v in values]), axis=1))
  pairs = [_wide(v) for v in values]
  lo = np.stack(np.broadcast_arrays(*[p[0] for p in pairs]), axis=1)
  hi = np.stack(np.broadcast_arrays(*[p[1] for p in pairs]), axis=1)
  return _fit(lo, hi, aval.dtype)


# Public API ------------------------------------------------------------------------------------


def _kernel_name(eqn) -> str:
  name = eqn.params.get("name")
  if not name:
    info = getattr(_open(eqn.params["jaxpr"])[0], "debug_info", None)
    name = getattr(info, "func_name", None) or "pallas_call"
  return str(name)


def pallas_call_traffic(eqn) -> KernelTraffic:
  """The bytes one ``pallas_call`` equation's loads and stores touch over its grid.

  Args:
    eqn: a jaxpr equation whose primitive is ``pallas_call``.

  Returns:
    The reads, writes and per-operand figures, and whether they are exact.

  Raises:
    ValueError: ``eqn`` is not a ``pallas_call`` or its grid is not static.
  """
  if eqn.primitive.name != "pallas_call":
    raise ValueError(f"traffic: expected a pallas_call equation, got {eqn.primitive.name!r}")
  mapping = eqn.params["grid_mapping"]
  grid = tuple(mapping.grid)
  if not all(isinstance(g, (int, np.integer)) for g in grid):
    raise ValueError(f"traffic: kernel {_kernel_name(eqn)!r} has a dynamic grid {grid}")
  grid = tuple(int(g) for g in grid)
  jaxpr, consts = _open(eqn.params["jaxpr"])
  n_index = getattr(mapping, "num_index_operands", 0)
  n_in, n_out = mapping.num_inputs, mapping.num_outputs
  n_operands = n_index + n_in + n_out
  evaluator = _Evaluator(grid)
  tally = _Tally(n_operands, evaluator.programs)
  refs = [_Ref(i) if i < n_operands else _Ref(None) for i in range(len(jaxpr.invars))]
  if evaluator.programs:
    evaluator.run(jaxpr, consts, refs, None, tally)
  avals = [v.aval for v in eqn.invars[:n_index + n_in]] + list(eqn.params["out_avals"])
  operands = []
  for i, aval in enumerate(avals):
    role, index = ("input", i) if i < n_index + n_in else ("output", i - n_index - n_in)
    operands.append(OperandTraffic(role, index, tuple(aval.shape), np.dtype(aval.dtype).name,
                                   int(tally.reads[i].sum()), int(tally.writes[i].sum())))
  return KernelTraffic(name=_kernel_name(eqn), reads=sum(o.reads for o in operands),
                       writes=sum(o.writes for o in operands), operands=tuple(operands),
                       exact=tally.exact, programs=evaluator.programs)


def pallas_calls(jaxpr) -> list[tuple[object, int]]:
  """``(eqn, launches)`` for every ``pallas_call`` in ``jaxpr``, in trace order.

  A call inside a ``scan`` launches once per step; both branches of a ``cond`` are listed.
  """
  found: list[tuple[object, int]] = []

  def walk(jaxpr, launches):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "pallas_call":
        found.append((eqn, launches))
        continue
      steps = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
      for sub in _subjaxprs(eqn):
        walk(sub, launches * steps)

  walk(_open(jaxpr)[0], 1)
  return found


def kernel_traffic(f, *args, **kwargs) -> list[KernelTraffic]:
  """The traffic of every ``pallas_call`` that ``f(*args, **kwargs)`` traces, once per launch.

  ``f`` is traced as it is (see :func:`jaxfuse.metrics.kernel_costs` for tracing our ops for
  a GPU); nothing runs.
  """
  closed = jax.make_jaxpr(lambda *a: f(*a, **kwargs))(*args)
  out = []
  for eqn, launches in pallas_calls(closed.jaxpr):
    out.extend([pallas_call_traffic(eqn)] * launches)
  return out
