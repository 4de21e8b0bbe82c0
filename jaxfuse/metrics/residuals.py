"""Residual bytes: what the backward pass keeps alive beyond the inputs and parameters.

This is the activation memory that recomputation trades for compute. It is read off the traced
vjp, so it is the same on every backend; XLA:CPU's compiled memory statistics cannot show it,
because XLA:CPU drops remat barriers and merges the recomputation back into the forward pass.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core


@dataclasses.dataclass(frozen=True)
class Residual:
  """One array the backward pass keeps: its shape, dtype, size, the primitive that made it and
  where it is kept (``"device"``, or ``"host"`` when a policy offloaded it)."""

  shape: tuple[int, ...]
  dtype: str
  nbytes: int
  source: str
  memory: str = "device"


_VIEWS = frozenset({"transpose", "reshape", "squeeze", "expand_dims", "broadcast_in_dim",
                    "iota"})


def _aval_bytes(aval) -> int:
  return math.prod(aval.shape) * jnp.dtype(aval.dtype).itemsize


def _memory(aval) -> str:
  space = str(getattr(aval, "memory_space", "")).lower()
  return "host" if "host" in space else "device"


def residuals(f, *args, **kwargs) -> list[Residual]:
  """The arrays ``jax.vjp(f, *args)`` keeps for the backward pass, beyond the inputs.

  Each distinct array counts once, however many backward rules use it (a value and its
  ``checkpoint_name`` are one array). Arguments (inputs and parameters passed as arguments),
  values closed over by ``f``, scalar literals, and views of these (transposes, reshapes,
  broadcasts, which XLA folds into their users) exist anyway and are left out.
  """
  return [r for _, r in _counted(f, args, kwargs)[2]]


def _flat_vjp(f, args, kwargs):
  """``(leaves, g)``: the flat arguments and a function of them returning the vjp's leaves."""
  leaves, tree = jax.tree_util.tree_flatten((args, kwargs))

  def flat_vjp(*flat):
    a, k = jax.tree_util.tree_unflatten(tree, flat)
    _, vjp_fn = jax.vjp(lambda *p: f(*p, **k), *a)
    return jax.tree_util.tree_leaves(vjp_fn)

  return leaves, flat_vjp


def _counted(f, args, kwargs):
  """``(leaves, flat_vjp, [(index of the vjp leaf, Residual)])`` for :func:`residuals`."""
  leaves, flat_vjp = _flat_vjp(f, args, kwargs)
  closed = jax.make_jaxpr(flat_vjp)(*leaves)
  jaxpr = closed.jaxpr
  existing = set(jaxpr.invars) | set(jaxpr.constvars)
  # Views of what exists (a weight's transpose, a broadcast constant) cost nothing in compiled
  # code: XLA folds them into their consumers. They are not counted.
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in _VIEWS and all(
        isinstance(v, jex_core.Literal) or v in existing for v in eqn.invars):
      existing.update(eqn.outvars)
  # A checkpoint_name is the value it names (no copy): it counts as its operand.
  alias = {eqn.outvars[0]: eqn.invars[0] for eqn in jaxpr.eqns
           if eqn.primitive.name == "name" and not isinstance(eqn.invars[0], jex_core.Literal)}

  def root(v):
    while v in alias:
      v = alias[v]
    return v

  producers = {v: eqn.primitive.name for eqn in jaxpr.eqns for v in eqn.outvars}
  seen = set()
  out = []
  for i, v in enumerate(jaxpr.outvars):
    if isinstance(v, jex_core.Literal):
      continue
    v = root(v)
    if v in existing or v in seen:
      continue
    seen.add(v)
    out.append((i, Residual(tuple(v.aval.shape), jnp.dtype(v.aval.dtype).name,
                            _aval_bytes(v.aval), producers.get(v, "?"), _memory(v.aval))))
  return leaves, flat_vjp, out


# Python frames kept in each operation's location while compiling the vjp closure. XLA's compile
# time grows steeply with them under sharding: a decoder's closure on 8 devices compiled in 2 s
# from a script and over 10 minutes from pytest's deep stack at jax's default of 100 frames.
_LOCATION_FRAMES = 10


def _compiled_without_tracebacks(f, args):
  """``jax.jit(f)`` compiled for ``args``, with few Python frames in its locations (only its
  output shardings are read)."""
  saved = jax.config.jax_traceback_in_locations_limit
  jax.config.update("jax_traceback_in_locations_limit", min(saved, _LOCATION_FRAMES))
  try:
    return jax.jit(f).lower(*args).compile()
  finally:
    jax.config.update("jax_traceback_in_locations_limit", saved)


def per_device_residual_bytes(f, *args, **kwargs) -> int:
  """:func:`residual_bytes` on one device when ``args`` are sharded over a mesh: each residual
  counted at the size of its shard, as the compiled (jitted) forward pass lays it out. Call it
  under the mesh (``jax.set_mesh``) the arguments are placed on; the largest shard counts.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxfuse.metrics import per_device_residual_bytes
    >>> per_device_residual_bytes(lambda x: jnp.sum(jnp.sin(x)), jnp.ones(1024))  # one device
    4096
  """
  leaves, flat_vjp, counted = _counted(f, args, kwargs)
  shardings = _compiled_without_tracebacks(flat_vjp, leaves).output_shardings
  total = 0
  for i, r in counted:
    if r.memory != "device":
      continue
    shard = shardings[i].shard_shape(r.shape)
    total += math.prod(shard) * jnp.dtype(r.dtype).itemsize
  return total


def residual_bytes(f, *args, **kwargs) -> int:
  """Bytes the backward pass of ``f`` at ``args`` keeps alive in device memory beyond its inputs
  and parameters (what a policy offloads to host memory is :func:`offloaded_bytes`).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxfuse.metrics import residual_bytes
    >>> residual_bytes(lambda x: jnp.sum(jnp.sin(x)), jnp.ones(1024))  # keeps cos(x)
    4096
  """
  return sum(r.nbytes for r in residuals(f, *args, **kwargs) if r.memory == "device")


def offloaded_bytes(f, *args, **kwargs) -> int:
  """Bytes the backward pass of ``f`` keeps in host memory (offloaded by a recomputation policy).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxfuse.metrics import offloaded_bytes, residual_bytes
    >>> from jaxfuse.remat import remat, checkpoint_name
    >>> f = remat(lambda x: jnp.sum(jnp.sin(checkpoint_name(x * x, "y"))), policy={"y": "offload"})
    >>> offloaded_bytes(f, jnp.ones(1024)), residual_bytes(f, jnp.ones(1024))
    (4096, 0)
  """
  return sum(r.nbytes for r in residuals(f, *args, **kwargs) if r.memory == "host")
