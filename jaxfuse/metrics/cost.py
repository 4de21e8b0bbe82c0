"""Bytes moved and FLOPs, read from the kernels a function launches.

Every Pallas kernel in jaxfuse sets a ``pl.CostEstimate`` whose ``bytes_accessed`` is the HBM
traffic its block specs imply; :func:`kernel_costs` finds the ``pallas_call``s in a function's
jaxpr (inside jit, custom_vjp, checkpoint, scan, ...) and reads them back. For XLA code,
:func:`xla_cost` asks the compiler's own cost analysis.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.extend import core as jex_core


@dataclasses.dataclass(frozen=True)
class KernelCost:
  """One kernel launch: its name, HBM bytes read + written, FLOPs and transcendentals."""

  name: str
  bytes_accessed: int
  flops: int
  transcendentals: int


def _subjaxprs(eqn):
  for value in eqn.params.values():
    for item in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(item, jex_core.ClosedJaxpr):
        yield item.jaxpr
      elif isinstance(item, jex_core.Jaxpr):
        yield item


def _walk(jaxpr, out, multiplier=1):
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      estimate = eqn.params.get("cost_estimate")
      name = eqn.params.get("name") or getattr(eqn.params.get("debug"), "func_name", "pallas")
      if estimate is None:
        raise ValueError(f"pallas_call {name!r} has no cost_estimate")
      out.extend([KernelCost(str(name), int(estimate.bytes_accessed), int(estimate.flops),
                             int(estimate.transcendentals))] * multiplier)
      continue
    repeat = multiplier * (eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1)
    for sub in _subjaxprs(eqn):
      _walk(sub, out, repeat)


def kernel_costs(f, *args, **kwargs) -> list[KernelCost]:
  """The Pallas kernels ``f(*args)`` launches, in trace order, with their cost estimates.

  Both branches of a ``cond`` are counted, and a kernel inside ``scan`` counts once per step.
  Kernels whose outputs are unused are counted too (XLA would drop them): measure the function
  whose outputs you use, e.g. ``value_and_grad`` rather than ``grad`` of a loss.
  """
  closed = jax.make_jaxpr(lambda *a: f(*a, **kwargs))(*args)
  out: list[KernelCost] = []
  _walk(closed.jaxpr, out)
  return out


def bytes_moved(f, *args, **kwargs) -> int | None:
  """HBM bytes read + written by the Pallas kernels of ``f(*args)``; None if it launches none.

  Example:
    >>> import jax.numpy as jnp, jaxfuse
    >>> from jaxfuse.metrics import bytes_moved
    >>> a = jnp.ones(1024)
    >>> with jaxfuse.pallas_interpret():
    ...   bytes_moved(lambda a, b: jaxfuse.ops.add_act(a, b, "relu", implementation="pallas"), a, a)
    12288
  """
  costs = kernel_costs(f, *args, **kwargs)
  if not costs:
    return None
  return sum(c.bytes_accessed for c in costs)


def xla_cost(f, *args, **kwargs) -> dict[str, float | None]:
  """XLA's own estimate for the compiled ``f``: ``bytes_accessed`` and ``flops``."""
  compiled = jax.jit(lambda *a: f(*a, **kwargs)).lower(*args).compile()
  analysis = compiled.cost_analysis()
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0] if analysis else {}
  analysis = analysis or {}
  def get(key):
    value = analysis.get(key)
    return None if value is None or value < 0 else float(value)
  return {"bytes_accessed": get("bytes accessed"), "flops": get("flops")}
