"""Gated linear units, ``act(a) * b``, forward and backward kernels for CPUs (``gated_linear.cc``).

Over ``rows x h`` arrays, separate (``a`` and ``b``) or packed (one ``rows x 2h`` array
``[a | b]``, ``b=None``). The forward reads ``a`` and ``b`` and writes ``act(a) * b``; the
backward reads ``a``, ``b`` and ``g`` once and writes ``da = g * b * act'(a)`` and
``db = g * act(a)`` from the same loop, where XLA:CPU runs two. The math is float32 for every
storage dtype (float32, bfloat16, float16), with the activations of
:data:`jaxfuse.kernels.activations.ACTIVATIONS` by name.
"""

from __future__ import annotations

import jax
import numpy as np

from .. import activations
from . import Library

ACTIVATIONS = tuple(activations.ACTIVATIONS)   # the C++ side indexes them in this order
_TARGETS = ("jaxfuse_glu_forward", "jaxfuse_glu_forward_packed", "jaxfuse_glu_backward",
            "jaxfuse_glu_backward_packed")
LIBRARY = Library("gated_linear", _TARGETS)
ready = LIBRARY.ready   # asked by implementation=None (False, warned, where it cannot load)


def refuses(*, activation=None, **_) -> str | None:
  """Why these kernels cannot take a call (None: they can): an activation they lack."""
  if activation is not None and activation not in ACTIVATIONS:
    return f"supports the named activations {ACTIVATIONS}, got activation={activation!r}"
  return None


def _call(target: str, results, *args, activation: str):
  LIBRARY.load()
  return jax.ffi.ffi_call(target, results, vmap_method="broadcast_all")(
      *args, activation=np.int32(ACTIVATIONS.index(activation)))


def glu_forward(a: jax.Array, b: jax.Array | None, activation: str) -> jax.Array:
  """``activation(a) * b`` for 2-D ``a`` and ``b``; with ``b=None``, ``a`` is packed
  ``[a | b]``."""
  if b is None:
    out = jax.ShapeDtypeStruct((a.shape[0], a.shape[1] // 2), a.dtype)
    return _call("jaxfuse_glu_forward_packed", out, a, activation=activation)
  return _call("jaxfuse_glu_forward", jax.ShapeDtypeStruct(a.shape, a.dtype), a, b,
               activation=activation)


def glu_backward(a: jax.Array, b: jax.Array | None, g: jax.Array, activation: str):
  """``(da, db)`` of ``activation(a) * b`` for the output gradient ``g`` (``dx``, packed, if
  b=None)."""
  like = jax.ShapeDtypeStruct(a.shape, a.dtype)
  if b is None:
    return _call("jaxfuse_glu_backward_packed", like, a, g, activation=activation)
  return _call("jaxfuse_glu_backward", (like, like), a, b, g, activation=activation)
