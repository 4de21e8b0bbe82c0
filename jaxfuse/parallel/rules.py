"""Logical axes: one table of rules maps the axes of parameters and activations onto the mesh.

Parameters carry the names of their axes as flax sharding metadata (``out_sharding`` on the
``nnx.Variable``; :func:`annotate` sets them from a table of paths), and activations are
constrained by name (:func:`constrain`) at the block boundaries. :data:`RULES` maps each name
onto mesh axes of :data:`jaxfuse.parallel.MESH_AXES`; the mesh's shape then chooses the
strategy, the model code stays the same:

==============  ===========================================  ===============================
strategy        mesh                                         what is split
==============  ===========================================  ===============================
data parallel   ``data=8``                                   the batch
FSDP            ``fsdp=8``                                   the batch, and the parameters
                                                             (gathered per layer by XLA)
tensor          ``tensor=8``                                 heads, MLP width, vocabulary
                                                             (Megatron), and the residual
                                                             stream over the sequence
                                                             (sequence parallelism)
context         ``context=8``                                the sequence (ring attention)
expert          ``expert=8``                                 the batch, and a MoE layer's
                                                             experts (tokens sent to them by
                                                             all-to-all)
==============  ===========================================  ===============================

and any product of them (``data=2,fsdp=2,tensor=2``). A mesh axis of size 1 splits nothing,
so one table serves every strategy; :func:`axis_rules` sets another table for a block of code
(flax's ``logical_axis_rules`` context, which ``nnx.get_partition_spec`` reads too).

Example:
  >>> import jax
  >>> from jaxfuse.parallel import make_mesh, logical_spec
  >>> mesh = make_mesh({"data": 1})
  >>> logical_spec(("batch", "residual_seq", "act_embed"), mesh) == jax.P(None, None, None)
  True
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

import jax
from flax import nnx
from flax.core import spmd as flax_spmd
from jax.sharding import NamedSharding, PartitionSpec

# (logical axis, mesh axes) pairs, MaxText's form. Names starting with "act_" are activations'.
RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # Activations.
    ("batch", ("data", "fsdp", "expert")),   # the expert axis holds distinct tokens too
    ("seq", "context"),                        # inside attention and the MLP
    ("residual_seq", ("context", "tensor")),   # the residual stream and norms: sequence parallel
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    # Parameters.
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("expert", "expert"),                      # a MoE layer's stacked experts [E, ...]
    ("norm", None),
    ("layers", None),
)


def axis_rules(rules: Sequence = RULES):
  """A context in which ``rules`` map logical axes onto mesh axes (flax's
  ``logical_axis_rules``)."""
  return flax_spmd.logical_axis_rules(tuple(rules))


def current_rules() -> tuple:
  """The rules of the innermost :func:`axis_rules` (or flax ``logical_axis_rules``) context,
  else :data:`RULES`."""
  return tuple(flax_spmd.get_logical_axis_rules()) or RULES


def _mesh_axes(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def _context_mesh():
  """The mesh in context (``jax.set_mesh``), or None (none, or inside ``shard_map``)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.manual_axes:
    return None
  return mesh


def logical_spec(axes: Sequence[str | None], mesh=None,
                 shape: Sequence[int] | None = None) -> PartitionSpec:
  """The ``PartitionSpec`` of logical ``axes`` on ``mesh`` (default: the mesh in context):
  each name's mesh axes by the current rules, keeping only axes the mesh has with more than
  one device, that no earlier axis uses and, given ``shape``, whose sizes divide it."""
  mesh = mesh if mesh is not None else _context_mesh()
  sizes = dict(mesh.shape) if mesh is not None else {}
  rules = dict(current_rules())
  used, entries = set(), []
  for i, name in enumerate(axes):
    if name is PartitionSpec.UNCONSTRAINED:
      entries.append(name)
      continue
    names = [a for a in _mesh_axes(rules.get(name)) if sizes.get(a, 1) > 1 and a not in used]
    if shape is not None:
      while names and shape[i] % math.prod(sizes[a] for a in names):
        names.pop()
    used.update(names)
    entries.append(None if not names else names[0] if len(names) == 1 else tuple(names))
  return PartitionSpec(*entries)


def mesh_size(name: str) -> int:
  """How many devices the logical axis ``name`` is split over in the mesh in context (1
  without one)."""
  mesh = _context_mesh()
  if mesh is None:
    return 1
  sizes = dict(mesh.shape)
  return math.prod(sizes.get(a, 1) for a in _mesh_axes(dict(current_rules()).get(name)))


def constrain(x: jax.Array, *axes: str | None) -> jax.Array:
  """``x`` constrained to the sharding of its logical ``axes`` under the mesh in context; ``x``
  itself without a mesh (or inside ``shard_map``). ``...`` first stands for the leading axes
  that are left to XLA (``constrain(hidden, ..., "act_mlp")``)."""
  mesh = _context_mesh()
  if mesh is None:
    return x
  if axes[:1] == (Ellipsis,):
    axes = (PartitionSpec.UNCONSTRAINED,) * (x.ndim - len(axes) + 1) + axes[1:]
  if x.ndim != len(axes):
    raise ValueError(f"constrain: {len(axes)} axes {axes} for an array of shape {x.shape}")
  spec = logical_spec(axes, mesh, x.shape)
  if mesh.explicit_axes:
    if PartitionSpec.UNCONSTRAINED in spec:
      return x   # an Explicit type is always complete: nothing to leave to XLA
    return jax.sharding.reshard(x, spec)
  return jax.lax.with_sharding_constraint(x, spec)


# Parameters -------------------------------------------------------------------------------------


def annotate(module: nnx.Module, table: Mapping[str, tuple[str | None, ...]],
             *, leading: tuple[str, ...] = ()) -> nnx.Module:
  """Sets the logical axes of ``module``'s parameters from ``table``: the first pattern (a
  regular expression) that matches the end of a parameter's dotted path (``layers.0.mlp.
  up_proj.kernel``) gives its axes, after ``leading`` ones (``("layers",)`` for parameters
  stacked for a scan; a parameter with one more axis than its entry gets ``"layers"`` first).
  Unmatched parameters are left as they are (replicated). Returns ``module``.

  The axes are flax sharding metadata (``out_sharding``, without eager sharding, so that a
  module is still created and used without a mesh); :func:`param_specs` reads them.

  Example:
    >>> from flax import nnx
    >>> from jaxfuse.parallel import annotate, param_specs, make_mesh
    >>> layer = annotate(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), {r"kernel": ("embed", "mlp")})
    >>> layer.kernel.get_metadata()["out_sharding"]
    ('embed', 'mlp')
  """
  compiled = [(re.compile(rf"(^|\.)({pattern})$"), axes) for pattern, axes in table.items()]
  for path, variable in nnx.iter_graph(module):
    if not isinstance(variable, nnx.Param):
      continue
    dotted = ".".join(str(p) for p in path)
    for pattern, axes in compiled:
      if pattern.search(dotted):
        axes = tuple(leading) + tuple(axes)
        if variable.ndim == len(axes) + 1:
          axes = ("layers",) + axes
        if variable.ndim != len(axes):
          raise ValueError(f"annotate: {dotted} has shape {variable.shape}, its axes {axes} "
                           f"(from {pattern.pattern!r}) do not match")
        variable.set_metadata(out_sharding=axes, eager_sharding=False)
        break
  return module


def _spec_of(variable, mesh) -> PartitionSpec:
  axes = variable.get_metadata().get("out_sharding")
  if not axes:
    return PartitionSpec()
  return logical_spec(axes, mesh, variable.shape)


def param_specs(tree, mesh=None):
  """``PartitionSpec`` of every ``nnx.Variable`` in ``tree`` (a module's or optimizer's state)
  from its logical axes under the current rules (the mesh in context by default), as
  ``nnx.get_partition_spec`` gives them, but keeping only splits the mesh and shapes allow."""
  return jax.tree.map(lambda v: v.replace(_spec_of(v, mesh)) if isinstance(v, nnx.Variable)
                      else PartitionSpec(), tree,
                      is_leaf=lambda x: isinstance(x, nnx.Variable))


def place(tree, mesh):
  """``tree`` (a state of ``nnx.Variable`` values) placed on ``mesh`` as its logical axes say."""
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(tree, mesh),
                           is_leaf=lambda x: isinstance(x, PartitionSpec))
  return jax.device_put(tree, shardings)
