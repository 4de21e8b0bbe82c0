"""The evaluator of :mod:`jaxfuse.metrics.traffic`: a Pallas kernel's jaxpr run for every
program of its grid at once, counting the bytes its loads and stores touch.

Only what decides the traffic runs: the loads and stores, and the integer values their masks,
indices, loop bounds and branch indices are computed from (:mod:`jaxfuse.metrics.traffic_rules`);
float values are never computed. ``scan`` runs its steps, ``while`` runs until its predicate is
false in every program, ``cond`` runs each branch some program may take and adds, per program,
the costlier one. Where a mask, a loop bound or a branch depends on loaded data the count is an
upper bound and the :class:`Tally` says it is not exact.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.extend import core as jex_core

from jaxfuse.metrics.jaxprs import is_var, open_jaxpr, sub_jaxprs
from jaxfuse.metrics.traffic_rules import RULES, fallback, iota
from jaxfuse.metrics.traffic_values import (I64, I64_MAX, I64_MIN, Conjunction, Ints, align,
                                            bounds, constant, fit, full_range, int_aval, wide)

_LOADS = ("masked_load", "get")
_STORES = ("masked_swap", "swap")
_READ_WRITES = ("addupdate", "atomic_rmw", "atomic_cas")
_EFFECTS = frozenset(_LOADS + _STORES + _READ_WRITES)
_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "custom_jvp_call",
                    "custom_vjp_call", "custom_vjp_call_jaxpr", "remat", "checkpoint",
                    "custom_lin"})


@dataclasses.dataclass(frozen=True)
class Ref:
  """A kernel's memory reference: operand ``operand`` of the ``pallas_call``."""

  operand: int | None  # None: scratch memory, whose traffic is not counted


class Tally:
  """Bytes read and written, per operand and per program."""

  def __init__(self, operands: int, programs: int):
    self.reads = np.zeros((operands, programs), I64)
    self.writes = np.zeros((operands, programs), I64)
    self.exact = True

  def child(self) -> Tally:
    return Tally(*self.reads.shape)


class Evaluator:
  """Evaluates kernel jaxprs for all programs of one grid, adding what their loads and stores
  move to a :class:`Tally`; a ``while`` loop stops with an error after ``max_loop_steps``."""

  def __init__(self, grid: tuple[int, ...], max_loop_steps: int):
    self.grid = grid
    self.max_loop_steps = max_loop_steps
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
          eqn.primitive.name in _EFFECTS or any(self.has_effects(s) for s in sub_jaxprs(eqn))
          for eqn in jaxpr.eqns)
    return self._effects[key]

  def plan(self, jaxpr) -> list:
    key = id(jaxpr)
    cached = self._plans.get(key)
    if cached is not None and cached[0] is jaxpr:
      return cached[1]
    needed = {v for v in jaxpr.outvars if is_var(v) and int_aval(v.aval)}
    used = {v for eqn in jaxpr.eqns for v in eqn.invars if is_var(v)}
    used.update(v for v in jaxpr.outvars if is_var(v))
    steps = []
    for eqn in reversed(jaxpr.eqns):
      effects = eqn.primitive.name in _EFFECTS or any(
          self.has_effects(s) for s in sub_jaxprs(eqn))
      if not effects and not any(v in needed for v in eqn.outvars):
        continue
      for v in eqn.invars:
        if is_var(v) and (int_aval(v.aval) or hasattr(v.aval, "inner_aval")):
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
      inputs = tuple((None, constant(v.val, v.aval)) if isinstance(v, jex_core.Literal)
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
    if name in _CALLS or (effects and len(list(sub_jaxprs(eqn))) == 1):
      return self.call
    if effects:
      raise NotImplementedError(f"traffic: no rule for {name!r}, which contains loads or stores")
    if name == "iota":
      return lambda eqn, values, active, tally: iota(eqn)
    rule = RULES.get(name)
    if rule is not None:
      return lambda eqn, values, active, tally: rule(eqn, values)
    return lambda eqn, values, active, tally: fallback(eqn, values, self.programs)

  def run(self, jaxpr, consts, args, active, tally) -> list:
    env = {}
    for v, c in zip(jaxpr.constvars, consts):
      env[v] = c if isinstance(c, (Ints, Ref)) or c is None else constant(c, v.aval)
    for v, a in zip(jaxpr.invars, args):
      env[v] = a

    get = env.get
    for eqn, handler, inputs in self.plan(jaxpr):
      # Floats are never computed: they read as None.
      outs = handler(eqn, [c if v is None else get(v) for v, c in inputs], active, tally)
      for v, out in zip(eqn.outvars, outs):
        env[v] = out
    return [constant(v.val, v.aval) if isinstance(v, jex_core.Literal)
            else env[v] if v in env else full_range(v.aval) for v in jaxpr.outvars]

  def run_closed(self, closed, args, active, tally) -> list:
    jaxpr, consts = open_jaxpr(closed)
    return self.run(jaxpr, consts, args, active, tally)

  # Programs.

  def program_id(self, eqn, values, active, tally):
    return [Ints(self.program_ids[eqn.params["axis"]])]

  def num_programs(self, eqn, values, active, tally):
    return [Ints(np.full((1,), self.grid[eqn.params["axis"]], np.int32))]

  # Loads and stores.

  def count(self, tally, ref, shape, mask, itemsize, active, write):
    if not isinstance(ref, Ref) or ref.operand is None:
      return
    n = math.prod(shape)
    if mask is None:
      hi = lo = np.full((1,), n * itemsize, I64)
    elif isinstance(mask, Conjunction):
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
    return [full_range(out.aval)]

  def store(self, eqn, values, active, tally, reads_old=False, mask_at=None):
    name = eqn.primitive.name
    mask = None if mask_at is None else values[mask_at]
    ref = values[0]
    if name in ("masked_swap", "atomic_rmw", "atomic_cas"):
      shape_var = eqn.outvars[0]
    else:  # swap, addupdate: ref, value, *indices
      shape_var = eqn.invars[1]
    shape = shape_var.aval.shape
    itemsize = np.dtype(shape_var.aval.dtype).itemsize
    self.count(tally, ref, shape, mask, itemsize, active, write=True)
    # A swap whose old value is used, addupdate and atomics also read what they replace.
    if name in _READ_WRITES or reads_old:
      self.count(tally, ref, shape, mask, itemsize, active, write=False)
    return [full_range(v.aval) for v in eqn.outvars]

  # Control flow.

  def call(self, eqn, values, active, tally):
    (sub,) = [v for v in eqn.params.values()
              if isinstance(v, (jex_core.ClosedJaxpr, jex_core.Jaxpr))][:1] or [None]
    if sub is None:
      return fallback(eqn, values, self.programs)
    jaxpr, _ = open_jaxpr(sub)
    if not self.has_effects(jaxpr) and not any(int_aval(v.aval) for v in eqn.outvars):
      return [None] * len(eqn.outvars)
    return self.run_closed(sub, values[-len(jaxpr.invars):] if jaxpr.invars else [],
                           active, tally)

  def run_scoped(self, eqn, values, active, tally):
    jaxpr, consts = open_jaxpr(eqn.params["jaxpr"])
    scratch = [Ref(None)] * (len(jaxpr.invars) - len(values))
    return self.run(jaxpr, consts, list(values) + scratch, active, tally)

  def scan(self, eqn, values, active, tally):
    p = eqn.params
    n_consts, n_carry, length = p["num_consts"], p["num_carry"], p["length"]
    consts, carry, xs = (values[:n_consts], values[n_consts:n_consts + n_carry],
                         values[n_consts + n_carry:])
    body = p["jaxpr"]
    ys = []
    if active is not None and not active.any():
      return [full_range(v.aval) for v in eqn.outvars]
    for step in range(length):
      i = length - 1 - step if p["reverse"] else step
      x = [None if v is None else Ints(*_take(v, i)) for v in xs]
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
    for _ in range(self.max_loop_steps):
      (pred,) = self.run_closed(p["cond_jaxpr"], cond_consts + carry, running, tally)
      if pred is None:
        pred = full_range(p["cond_jaxpr"].out_avals[0])
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
        f"traffic: a while loop in the kernel ran past {self.max_loop_steps} steps; its bound "
        "probably comes from memory without a clip (raise MAX_LOOP_STEPS if it is real)")

  def cond(self, eqn, values, active, tally):
    branches = eqn.params["branches"]
    index, *operands = values
    n = len(branches)
    if index is None:
      index = Ints(np.zeros((1,), I64), np.full((1,), n - 1, I64))
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
      return [full_range(v.aval) for v in eqn.outvars]
    if len(taken) > 1 and np.any(np.sum(taken, axis=0) > 1):
      tally.exact = False
    tally.reads += np.maximum.reduce([t.reads for t in tallies])
    tally.writes += np.maximum.reduce([t.writes for t in tallies])
    tally.exact &= all(t.exact for t in tallies)
    return [_merge([o[k] for o in outputs], taken, var.aval)
            for k, var in enumerate(eqn.outvars)]


def _per_program(mask: np.ndarray, n: int) -> np.ndarray:
  """Elements a mask keeps in each program, for a load or store of ``n`` elements."""
  return _scaled(mask.reshape(mask.shape[0], -1).sum(axis=1, dtype=I64),
                 math.prod(mask.shape[1:]), n)


def _per_program_of_product(factors: Sequence[np.ndarray], n: int) -> np.ndarray:
  """:func:`_per_program` of the conjunction of ``factors``, without building it: each factor
  is first summed over the axes along which only it varies."""
  rank = max(f.ndim for f in factors)
  factors = [align(f, rank - 1) for f in factors]
  # How many factors vary along each axis, and the value's extent there.
  varying = [sum(f.shape[a] > 1 for f in factors) for a in range(rank)]
  extent = [max(f.shape[a] for f in factors) for a in range(rank)]
  product = None
  for f in factors:
    own = tuple(a for a in range(1, rank) if f.shape[a] > 1 and varying[a] == 1)
    f = f.sum(axis=own, keepdims=True, dtype=I64) if own else f.astype(I64)
    product = f if product is None else product * f
  return _scaled(product.reshape(product.shape[0], -1).sum(axis=1, dtype=I64),
                 math.prod(extent[1:]), n)


def _scaled(kept: np.ndarray, per_value: int, n: int) -> np.ndarray:
  """Elements kept per program of a load or store of ``n`` elements, from ``kept`` of the
  ``per_value`` elements of its mask (a mask may be smaller than the load: it broadcasts)."""
  return kept * (n // per_value if per_value else 0)


def _per_program_flag(x: np.ndarray, programs: int, keep: bool = False) -> np.ndarray:
  """A scalar value's per-program vector, of length P (bool unless ``keep``)."""
  x = x.reshape(x.shape[0])
  x = np.broadcast_to(x, (programs,))
  return x if keep else x.astype(bool, copy=False)


def _program_mask(run: np.ndarray, ndim: int) -> np.ndarray:
  return run.reshape((run.shape[0],) + (1,) * (ndim - 1))


def _where(run: np.ndarray, new: Ints | None, old: Ints | None) -> Ints | None:
  if new is None or old is None:
    return None
  ndim = max(new.lo.ndim, old.lo.ndim)
  m = _program_mask(run, ndim)
  if new.exact and old.exact and new.lo.dtype == old.lo.dtype:
    return Ints(np.where(m, new.lo, old.lo))
  (new_lo, new_hi), (old_lo, old_hi) = bounds(new), bounds(old)
  return Ints(np.where(m, new_lo, old_lo), np.where(m, new_hi, old_hi))


def _merge(values, taken, aval) -> Ints | None:
  """The output of a ``cond``: each program's branch, or the union of those it may take."""
  if any(v is None for v in values):
    return None
  if len(values) == 1:
    return values[0]
  ndim = 1 + len(aval.shape)
  los, his = [], []
  for value, maybe in zip(values, taken):
    lo, hi = wide(value)
    m = _program_mask(maybe, ndim)
    los.append(np.where(m, lo, I64_MAX))
    his.append(np.where(m, hi, I64_MIN))
  lo, hi = functools.reduce(np.minimum, los), functools.reduce(np.maximum, his)
  anyone = _program_mask(np.logical_or.reduce(taken), ndim)
  lo, hi = np.where(anyone, lo, 0), np.where(anyone, hi, 0)
  return fit(lo, hi, aval.dtype)


def _take(value: Ints, i: int):
  def pick(x):
    return x[:, i] if x.shape[1] > 1 else x[:, 0]
  lo = pick(value.lo)
  return lo, (lo if value.exact else pick(value.hi))


def _stack(values, aval) -> Ints | None:
  if not values or any(v is None for v in values):
    return full_range(aval)
  if all(v.exact for v in values):
    return Ints(np.stack(np.broadcast_arrays(*[v.lo for v in values]), axis=1))
  pairs = [wide(v) for v in values]
  lo = np.stack(np.broadcast_arrays(*[p[0] for p in pairs]), axis=1)
  hi = np.stack(np.broadcast_arrays(*[p[1] for p in pairs]), axis=1)
  return fit(lo, hi, aval.dtype)
