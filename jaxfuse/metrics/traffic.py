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

This module is the API; the values are :mod:`jaxfuse.metrics.traffic_values`, the rules per
primitive :mod:`jaxfuse.metrics.traffic_rules`, and the evaluator of a kernel's jaxpr over its
grid :mod:`jaxfuse.metrics.traffic_eval`.

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

import jax
import numpy as np

from jaxfuse.metrics.jaxprs import open_jaxpr, sub_jaxprs
from jaxfuse.metrics.traffic_eval import Evaluator, Ref, Tally

# A ``while`` loop stops with an error after this many steps (a bound read from memory that
# nothing clips would otherwise run for 2**31 steps).
MAX_LOOP_STEPS = 1 << 17


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


# Public API ------------------------------------------------------------------------------------


def _kernel_name(eqn) -> str:
  name = eqn.params.get("name")
  if not name:
    info = getattr(open_jaxpr(eqn.params["jaxpr"])[0], "debug_info", None)
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
  jaxpr, consts = open_jaxpr(eqn.params["jaxpr"])
  n_index = getattr(mapping, "num_index_operands", 0)
  n_in, n_out = mapping.num_inputs, mapping.num_outputs
  n_operands = n_index + n_in + n_out
  evaluator = Evaluator(grid, MAX_LOOP_STEPS)
  tally = Tally(n_operands, evaluator.programs)
  refs = [Ref(i) if i < n_operands else Ref(None) for i in range(len(jaxpr.invars))]
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


def _calls(jaxpr, match) -> list[tuple[object, int]]:
  """``(eqn, launches)`` for every equation of ``jaxpr`` that ``match`` accepts, in trace order.

  A call inside a ``scan`` launches once per step; both branches of a ``cond`` are listed.
  """
  found: list[tuple[object, int]] = []

  def walk(jaxpr, launches):
    for eqn in jaxpr.eqns:
      if match(eqn):
        found.append((eqn, launches))
        continue
      steps = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
      for sub in sub_jaxprs(eqn):
        walk(sub, launches * steps)

  walk(open_jaxpr(jaxpr)[0], 1)
  return found


def pallas_calls(jaxpr) -> list[tuple[object, int]]:
  """``(eqn, launches)`` for every ``pallas_call`` in ``jaxpr``, in trace order.

  A call inside a ``scan`` launches once per step; both branches of a ``cond`` are listed.
  """
  return _calls(jaxpr, lambda eqn: eqn.primitive.name == "pallas_call")


CPU_KERNEL_PREFIX = "jaxfuse_"   # the FFI targets of jaxfuse.kernels.cpu


def cpu_kernel_traffic(f, *args, **kwargs) -> list[KernelTraffic]:
  """The traffic of every CPU kernel (:mod:`jaxfuse.kernels.cpu`) that ``f(*args, **kwargs)``
  traces on this machine, once per call: each reads its operands and writes its results once
  (the kernels' one-pass loops), so the figure is exact. Nothing runs."""
  closed = jax.make_jaxpr(lambda *a: f(*a, **kwargs))(*args)
  out = []
  for eqn, launches in _calls(closed.jaxpr, lambda e: e.primitive.name == "ffi_call" and str(
      e.params.get("target_name", "")).startswith(CPU_KERNEL_PREFIX)):
    operands = tuple(
        OperandTraffic(role, i, tuple(v.aval.shape), str(v.aval.dtype),
                       v.aval.size * v.aval.dtype.itemsize if role == "input" else 0,
                       v.aval.size * v.aval.dtype.itemsize if role == "output" else 0)
        for role, group in (("input", eqn.invars), ("output", eqn.outvars))
        for i, v in enumerate(group))
    traffic = KernelTraffic(eqn.params["target_name"], sum(o.reads for o in operands),
                            sum(o.writes for o in operands), operands, exact=True, programs=1)
    out.extend([traffic] * launches)
  return out


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
