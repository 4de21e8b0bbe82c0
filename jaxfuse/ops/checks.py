"""Argument checks shared by the ops; every error names the op, the argument and what it got."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import jax
import jax.numpy as jnp


def floating(op: str, name: str, x) -> None:
  """Raises TypeError unless ``x`` is a floating-point array."""
  dtype = getattr(x, "dtype", None)
  if dtype is None:
    raise TypeError(f"{op}: {name} must be an array, got {type(x).__name__}")
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"{op}: {name} must have a floating dtype (float32, bfloat16, float16), "
                    f"got {jnp.dtype(dtype).name}")


def same_dtype(op: str, names: Sequence[str], xs: Sequence) -> None:
  """Raises TypeError unless all of ``xs`` share one dtype (no silent promotion)."""
  dtypes = [jnp.dtype(x.dtype) for x in xs]
  if any(d != dtypes[0] for d in dtypes):
    got = ", ".join(f"{n}: {d.name}" for n, d in zip(names, dtypes))
    raise TypeError(f"{op}: {', '.join(names)} must share one dtype, got {got}")


def same_shape(op: str, names: Sequence[str], xs: Sequence) -> None:
  """Raises ValueError unless all of ``xs`` share one shape (no broadcasting)."""
  shapes = [tuple(x.shape) for x in xs]
  if any(s != shapes[0] for s in shapes):
    got = ", ".join(f"{n}: {s}" for n, s in zip(names, shapes))
    raise ValueError(f"{op}: {', '.join(names)} must have the same shape (broadcasting is not "
                     f"supported), got {got}")


def rank(op: str, name: str, x, expected: int | Sequence[int]) -> None:
  """Raises ValueError unless ``x.ndim`` is ``expected`` (or one of them)."""
  allowed = (expected,) if isinstance(expected, int) else tuple(expected)
  if x.ndim not in allowed:
    want = " or ".join(str(r) for r in allowed)
    raise ValueError(f"{op}: {name} must have rank {want}, got shape {tuple(x.shape)}")


def dim(op: str, name: str, x, axis: int, expected: int, what: str) -> None:
  """Raises ValueError unless ``x.shape[axis] == expected``; ``what`` says where it comes from."""
  if x.shape[axis] != expected:
    raise ValueError(f"{op}: {name} must have size {expected} on axis {axis} ({what}), "
                     f"got shape {tuple(x.shape)}")


def as_array(x) -> jax.Array:
  return x if isinstance(x, jax.Array) or hasattr(x, "aval") else jnp.asarray(x)


def renamed(op: str, old: str, new: str, old_value, new_value):
  """``new_value``, or ``old_value`` passed under a keyword's former name ``old`` (with a
  DeprecationWarning); kept for one release after a rename."""
  if old_value is None:
    return new_value
  warnings.warn(f"{op}: the keyword {old}= is deprecated, use {new}=", DeprecationWarning,
                stacklevel=3)
  return old_value
