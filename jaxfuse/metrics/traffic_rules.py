"""How :mod:`jaxfuse.metrics.traffic` evaluates a primitive on the integer values of a kernel
body (:mod:`jaxfuse.metrics.traffic_values`), in every program at once.

- elementwise primitives: exact numpy arithmetic that wraps as on the device, interval
  arithmetic on ``[lo, hi]`` bounds, three-state logic on bools; a tile mask built with ``&`` is
  kept as its factors (:class:`~jaxfuse.metrics.traffic_values.Conjunction`);
- structural primitives (broadcast, reshape, slice, ...): the same numpy op on both bounds;
- reductions, ``argmax`` / ``argmin``, ``iota``, ``convert_element_type``, ``integer_pow``;
- anything else: :func:`fallback`, ``jax.vmap`` of the primitive over the programs when its
  inputs are known, the whole range otherwise.

:data:`RULES` maps a primitive's name to ``rule(eqn, values) -> outputs``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jaxfuse.metrics.traffic_values import (I64, I64_MAX, I64_MIN, Conjunction, Ints, align,
                                            at_full_shape, bounds, fit, full_range, int_aval,
                                            is_int, map_bounds, saturate, wide)


# Elementwise rules ------------------------------------------------------------------------------


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
  return saturate(functools.reduce(np.logical_or, loose), lo, hi)


def _interval_div(a, b):
  blo, bhi = b
  one_sign = (blo > 0) | (bhi < 0)
  return saturate(~one_sign, *_corners(_trunc_div, a, b))


def _interval_rem(a, b):
  (alo, ahi), (blo, bhi) = a, b
  m = np.maximum(np.abs(blo), np.abs(bhi)) - 1
  lo = np.where(alo < 0, np.maximum(alo, -m), 0)
  hi = np.where(ahi > 0, np.minimum(ahi, m), 0)
  same = (alo >= 0) & (ahi <= np.minimum(np.abs(blo), np.abs(bhi)) - 1) & ((blo > 0) | (bhi < 0))
  lo, hi = np.where(same, alo, lo), np.where(same, ahi, hi)
  return saturate((blo <= 0) & (bhi >= 0), lo, hi)   # a divisor that may be zero


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


def _interval_select(which: Ints, cases: Sequence[Ints]):
  wlo, whi = wide(which)
  los, his = [], []
  for i, case in enumerate(cases):
    clo, chi = wide(case)
    maybe = (wlo <= i) & (i <= whi)
    los.append(np.where(maybe, clo, I64_MAX))
    his.append(np.where(maybe, chi, I64_MIN))
  return functools.reduce(np.minimum, los), functools.reduce(np.maximum, his)


def _spreads(values: Sequence[Ints]) -> bool:
  """Whether broadcasting the values together makes something much bigger than any of them."""
  shapes = [v.lo.shape for v in values]
  biggest = max(math.prod(shape) for shape in shapes)
  return math.prod(np.broadcast_shapes(*shapes)) >= 4 * biggest >= 4 * 64


def _elementwise(eqn, values):
  name = eqn.primitive.name
  out_aval = eqn.outvars[0].aval
  if any(v is None for v in values):
    return [full_range(out_aval)]
  rank = len(out_aval.shape)
  dtype = np.dtype(out_aval.dtype)
  if name == "and" and dtype == np.bool_:
    factors = [f for v in values for f in (v.factors if isinstance(v, Conjunction) else (v,))]
    factors = [map_bounds(f, lambda x: align(x, rank)) for f in factors]
    if len(factors) > len(values) or _spreads(factors):
      return [Conjunction(factors)]
    values = factors
  values = [map_bounds(v, lambda x: align(x, rank)) for v in values]
  if all(v.exact for v in values):
    with np.errstate(over="ignore"):
      out = _EXACT[name](*[v.lo for v in values])
    return [Ints(np.asarray(out).astype(dtype, copy=False))]
  if name == "select_n":
    lo, hi = _interval_select(values[0], values[1:])
    return [fit(lo, hi, dtype)]
  if name in _LOGIC and all(v.lo.dtype == np.bool_ for v in values):
    lo, hi = _LOGIC[name](*[(v.lo, v.hi) for v in values])
    return [Ints(lo, hi)]
  rule = _INTERVAL.get(name)
  if rule is None:
    return [full_range(out_aval)]
  lo, hi = rule(*[wide(v) for v in values])
  return [fit(np.asarray(lo), np.asarray(hi), dtype)]


def _convert(eqn, values):
  (value,), aval = values, eqn.outvars[0].aval
  dtype = np.dtype(eqn.params["new_dtype"])
  if value is None or not is_int(dtype):
    return [full_range(aval)]
  if value.exact:
    return [Ints(value.lo.astype(dtype, copy=False))]
  lo, hi = wide(value)
  if dtype == np.bool_:
    return [Ints((lo > 0) | (hi < 0), ~((lo == 0) & (hi == 0)))]
  return [fit(lo, hi, dtype)]


def _integer_pow(eqn, values):
  (value,), y = values, eqn.params["y"]
  if value is None:
    return [full_range(eqn.outvars[0].aval)]
  if value.exact:
    with np.errstate(over="ignore"):
      return [Ints(np.power(value.lo, y).astype(value.lo.dtype, copy=False))]
  lo, hi = wide(value)
  if y == 2:
    a = _interval_abs((lo, hi))
    return [fit(a[0] * a[0], a[1] * a[1], eqn.outvars[0].aval.dtype)]
  return [full_range(eqn.outvars[0].aval)]


# Structural rules: the same numpy op on lo and hi -------------------------------------------------


def _structural(op, per_axis=False):
  """A rule applying ``op`` to the bounds; ``per_axis`` ops also apply factor by factor to a
  :class:`Conjunction`, which then stays one."""
  def rule(eqn, values):
    if any(v is None for v in values):
      return [full_range(v.aval) for v in eqn.outvars]
    if per_axis and isinstance(values[0], Conjunction):
      return [Conjunction([map_bounds(f, lambda x: op(eqn, x)) for f in values[0].factors])]
    if all(v.exact for v in values):
      return [Ints(op(eqn, *[v.lo for v in values]))]
    if len(values) == 1:
      return [map_bounds(values[0], lambda x: op(eqn, x))]
    pairs = [bounds(v) for v in values]
    return [Ints(op(eqn, *[b[0] for b in pairs]), op(eqn, *[b[1] for b in pairs]))]
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
  full = at_full_shape(x, eqn.invars[0].aval.shape)
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
  if all(o in (1, w) for o, w in zip(out.shape[1:], want)):
    return out
  return at_full_shape(out, want)


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


def iota(eqn):
  p = eqn.params
  shape = [1] * (1 + len(p["shape"]))
  shape[1 + p["dimension"]] = p["shape"][p["dimension"]]
  return [Ints(np.arange(p["shape"][p["dimension"]], dtype=np.dtype(p["dtype"])).reshape(shape))]


_REDUCE = {"reduce_max": np.max, "reduce_min": np.min, "reduce_sum": np.sum,
           "reduce_and": np.all, "reduce_or": np.any}


def _reduce(eqn, values):
  (value,) = values
  aval = eqn.outvars[0].aval
  if value is None:
    return [full_range(aval)]
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
    return [full_range(aval)]
  if value.exact:
    return [Ints(reduce(value.lo))]
  if name == "reduce_sum":
    lo, hi = wide(value)
    return [fit(reduce(lo, I64), reduce(hi, I64), aval.dtype)]
  return [Ints(reduce(value.lo), reduce(value.hi))]


def _argminmax(eqn, values):
  (value,) = values
  aval = eqn.outvars[0].aval
  if value is None or not value.exact:
    (axis,) = eqn.params["axes"]
    n = eqn.invars[0].aval.shape[axis]
    shape = (1,) * (1 + len(aval.shape))
    return [Ints(np.zeros(shape, I64), np.full(shape, max(n - 1, 0), I64))]
  (axis,) = eqn.params["axes"]
  full = at_full_shape(value.lo, eqn.invars[0].aval.shape)
  op = np.argmax if eqn.primitive.name == "argmax" else np.argmin
  return [Ints(op(full, axis=axis + 1).astype(np.dtype(eqn.params["index_dtype"])))]


def fallback(eqn, values, programs):
  """Evaluates a primitive without a rule of its own with jax, vmapped over the programs."""
  if any(v is None or not v.exact for v in values) or eqn.params.get("jaxpr") is not None:
    return [full_range(v.aval) for v in eqn.outvars]
  arrays, axes = [], []
  for value, var in zip(values, eqn.invars):
    full = at_full_shape(value.lo, var.aval.shape)
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
    if not int_aval(var.aval):
      results.append(None)
      continue
    o = np.asarray(o)
    results.append(Ints(o if batched else o[None]))
  return results


RULES: dict[str, Callable] = {name: _elementwise for name in _EXACT}
RULES.update({
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
