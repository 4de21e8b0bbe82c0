"""Small helpers for walking jaxprs, shared by the metrics that read them."""

from __future__ import annotations

from collections.abc import Iterator

from jax.extend import core as jex_core


def open_jaxpr(jaxpr) -> tuple:
  """``(jaxpr, consts)`` of a Jaxpr or ClosedJaxpr."""
  if isinstance(jaxpr, jex_core.ClosedJaxpr):
    return jaxpr.jaxpr, jaxpr.consts
  return jaxpr, ()


def sub_jaxprs(eqn) -> Iterator:
  """The jaxprs in an equation's parameters (a body, branches, ...), opened."""
  for value in eqn.params.values():
    for item in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(item, jex_core.ClosedJaxpr):
        yield item.jaxpr
      elif isinstance(item, jex_core.Jaxpr):
        yield item


def is_var(v) -> bool:
  """Whether an equation's input is a variable (not a literal)."""
  return not isinstance(v, jex_core.Literal)
