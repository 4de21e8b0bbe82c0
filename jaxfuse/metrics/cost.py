"""Bytes moved and FLOPs of the Pallas kernels a function launches.

``bytes_moved`` is the bytes the kernels' loads and stores touch, counted from each kernel's
body over its grid, before any cache (:mod:`jaxfuse.metrics.traffic`): a tile that several
programs load counts once per program, a tile one program loads twice counts twice. Nothing in
it is typed by hand: it follows the kernels as they are written. On a GPU some of those loads
hit L2 instead of HBM, so it is an upper bound on HBM traffic, and exact for streaming kernels
that touch every byte once.

Functions are traced for a GPU by default (``platform="gpu"``), so that the kernels are
counted with the tiles they use there (interpret mode picks bigger tiles); nothing runs.

FLOPs and transcendentals come from each ``pallas_call``'s ``CostEstimate`` (the scheduling
hint the wrappers give XLA). :func:`xla_cost` is XLA's own cost analysis of compiled code: a
different quantity, from XLA's model of its fusions, never mixed into ``bytes_moved``.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax

from jaxfuse.metrics import traffic
from jaxfuse.ops import dispatch


@dataclasses.dataclass(frozen=True)
class KernelCost:
  """One kernel launch: its name, bytes read + written, FLOPs and transcendentals.

  ``bytes_accessed = reads + writes``, counted from the kernel's loads and stores;
  ``exact`` is False where data-dependent masks or loops made them upper bounds; ``operands``
  breaks them down per input and output.
  """

  name: str
  bytes_accessed: int
  flops: int
  transcendentals: int
  reads: int = 0
  writes: int = 0
  exact: bool = True
  operands: tuple[traffic.OperandTraffic, ...] = ()


def _cost(eqn) -> KernelCost:
  counted = traffic.pallas_call_traffic(eqn)
  estimate = eqn.params.get("cost_estimate")
  return KernelCost(name=counted.name, bytes_accessed=counted.bytes,
                    flops=int(getattr(estimate, "flops", 0) or 0),
                    transcendentals=int(getattr(estimate, "transcendentals", 0) or 0),
                    reads=counted.reads, writes=counted.writes, exact=counted.exact,
                    operands=counted.operands)


def _tracing_for(platform: str | None):
  return contextlib.nullcontext() if platform is None else dispatch.target_platform(platform)


def kernel_costs(f, *args, platform: str | None = "gpu", **kwargs) -> list[KernelCost]:
  """The Pallas kernels ``f(*args, **kwargs)`` launches, in trace order, with their costs.

  Both branches of a ``cond`` are counted, and a kernel inside ``scan`` counts once per step.
  Kernels whose outputs are unused are counted too (XLA would drop them): measure the function
  whose outputs you use, e.g. ``value_and_grad`` rather than ``grad`` of a loss. A ``jax.jit``
  function that was already traced for these shapes keeps the kernels it was traced with (jit
  caches its trace): pass the function itself to count it for ``platform``.

  Args:
    f: the function; it is traced, not run.
    *args: its arguments (arrays or ``jax.ShapeDtypeStruct``).
    platform: trace the ops as if on this platform (default ``"gpu"``, so that the kernels
      have their GPU tiles); None traces for the current one.
    **kwargs: passed to ``f``.
  """
  with _tracing_for(platform):
    closed = jax.make_jaxpr(lambda *a: f(*a, **kwargs))(*args)
  out: list[KernelCost] = []
  counted: dict[int, KernelCost] = {}
  for eqn, launches in traffic.pallas_calls(closed.jaxpr):
    if id(eqn) not in counted:
      counted[id(eqn)] = _cost(eqn)
    out.extend([counted[id(eqn)]] * launches)
  return out


def bytes_moved(f, *args, platform: str | None = "gpu", **kwargs) -> int | None:
  """Bytes the Pallas kernels of ``f(*args)`` read + write; None if it launches none.

  The kernels' loads and stores, counted over their grids (see the module docstring).

  Example:
    >>> import jax.numpy as jnp, jaxfuse
    >>> from jaxfuse.metrics import bytes_moved
    >>> a = jnp.ones(1024)
    >>> bytes_moved(lambda a, b: jaxfuse.ops.add_act(a, b, "relu", implementation="pallas"), a, a)
    12288
  """
  costs = kernel_costs(f, *args, platform=platform, **kwargs)
  if not costs:
    return None
  return sum(c.bytes_accessed for c in costs)


def xla_cost(f, *args, **kwargs) -> dict[str, float | None]:
  """XLA's own estimate for the compiled ``f``: ``bytes_accessed`` and ``flops``.

  This is XLA's cost model of the compiled program on this machine's backend, a different
  quantity from :func:`bytes_moved` (which counts kernel loads and stores); report it apart.
  """
  compiled = jax.jit(lambda *a: f(*a, **kwargs)).lower(*args).compile()
  analysis = compiled.cost_analysis()
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0] if analysis else {}
  analysis = analysis or {}
  def get(key):
    value = analysis.get(key)
    return None if value is None or value < 0 else float(value)
  return {"bytes_accessed": get("bytes accessed"), "flops": get("flops")}
