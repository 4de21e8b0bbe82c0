"""How ops partition over a device mesh: each kernel call declares which of its array axes may
be split, and runs on every device's shard.

A ``pallas_call`` (or a jax-triton call, or the XLA path's tile loops) is opaque to XLA's SPMD
partitioner: left alone, XLA gathers its inputs onto every device and computes the whole op
there. So every kernel call goes through :func:`partitioned_call` with a :class:`Rule`, an
einsum-like map of each operand's and result's axes onto named *factors*:

- a factor that the inputs arrive split over some mesh axes stays split, on those axes, for
  every operand and result that has it (the batch, the heads, the rows of a norm);
- a factor in ``whole`` is gathered first (a norm's feature axis, attention's sequence);
- a factor split in the inputs but absent from a result is summed: the result is
  ``psum``-reduced over the factor's mesh axes (a norm's scale gradient over the rows, a
  row-parallel matmul over its contraction);
- a factor in ``own`` is the kernel's to combine: it receives ``axes={factor: mesh_axes}`` and
  calls the collectives itself (the vocabulary of the vocab-parallel cross-entropy).

The rule is declared with :func:`jax.experimental.custom_partitioning` (its partition callback
reads the operands' shardings when XLA partitions, so it works for inputs placed by
``NamedSharding`` on Auto mesh axes, under Explicit axes, and with no mesh in context). Inside
``jax.shard_map`` every mesh axis is manual and the kernel simply runs on the local shard;
:func:`match_vma` makes an op's arguments agree on the axes they vary over, as ``check_vma=True``
requires. Under ``jax.vmap`` the call falls back to the vmapped kernel (custom_partitioning has
no batching rule), and its derivatives are the caller's (:func:`jaxfuse.ops.base.kernel_call`
differentiates the kernel's XLA twin). On one device the kernel is called directly.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jaxfuse.ops.partitioning import Rule, partitioned_call
  >>> rule = Rule(operands=(("n", "d"), ("d",)), results=(("n", "d"),), whole=("d",))
  >>> scale_rows = lambda x, w: x * w
  >>> partitioned_call(scale_rows, rule, jnp.ones((4, 3)), jnp.arange(3.0)).shape
  (4, 3)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax
from jax.experimental.custom_partitioning import (CompoundFactor, SdyShardingRule,
                                                  custom_partitioning)
from jax.sharding import NamedSharding, PartitionSpec

Factor = str | tuple[str, ...]   # a tuple: one array axis made of several factors, major first


@dataclasses.dataclass(frozen=True)
class MergedRows:
  """``lead`` leading axes of the operands and results marked True, merged into one row axis
  for the kernel (``lead=0``: a row axis of 1 is added)."""

  lead: int
  operands: tuple[bool, ...]
  results: tuple[bool, ...]


@dataclasses.dataclass(frozen=True)
class Rule:
  """Which axes of a kernel's operands and results may be split over a mesh.

  Attributes:
    operands: one tuple of factors per operand, one factor per array axis (``()`` for a
      scalar). A factor is a name, or a tuple of names for an axis made of several (the query
      heads of grouped-query attention, ``("k", "g")``): such an axis is split by its first
      factor only. Operands that are ``None`` at the call are skipped with their entry.
    results: the same for each result (``None`` results are skipped too).
    whole: factors never split: the kernel needs them whole on every device.
    own: factors the kernel combines across devices itself; it is called with
      ``axes={factor: mesh_axes}`` for them (``()`` where the factor is not split), and its
      results are not summed over them.
    told: factors whose mesh axes the kernel is told (in ``axes``, as for ``own``) while its
      results are still summed over them (a vocabulary shard's offset, say).
    sizes: the sizes of factors that appear only inside tuples.
    rows: for a kernel on ``[rows, features]`` called on arrays of any rank, which operands
      and results have leading row axes, and how many (:class:`MergedRows`): the kernel
      receives them merged into one axis, reshaped on each device after the split is chosen on
      the unmerged axes, so that no split array is ever reshaped (which would move data).
  """

  operands: tuple[tuple[Factor, ...], ...]
  results: tuple[tuple[Factor, ...], ...]
  whole: tuple[str, ...] = ()
  own: tuple[str, ...] = ()
  told: tuple[str, ...] = ()
  sizes: tuple[tuple[str, int], ...] = ()
  rows: MergedRows | None = None

  def select(self, args: Sequence, outs: Sequence) -> Rule:
    """This rule for the operands and results that are not None."""
    return dataclasses.replace(
        self, operands=tuple(m for m, a in zip(self.operands, args, strict=True) if a is not None),
        results=tuple(m for m, o in zip(self.results, outs, strict=True) if o is not None))


# The axes of a kernel on rows: ``[rows, features]``, ``[features]``, ``[rows, 1]`` statistics.
# "n" stands for the row axes: one per leading axis of the arrays (see :func:`rows_rule`).
ROWS, FEATURES, ROW_STATS = ("n", "d"), ("d",), ("n", "one")


def row_factors(lead: int) -> tuple[str, ...]:
  """The factors of ``lead`` leading row axes."""
  return tuple(f"n{i}" for i in range(lead))


def rows_rule(operands: Sequence, results: Sequence, *, lead: int = 1,
              split_features: bool = False) -> Rule:
  """A kernel on rows (a norm, a softmax, an activation with a bias) of arrays with ``lead``
  leading row axes (``[batch, seq, features]``: 2): split over any of the row axes, its
  features whole unless ``split_features`` (elementwise in them); a ``[features]`` result is
  summed over the rows. The kernel receives the row axes merged into one.

  Example:
    >>> from jaxfuse.ops.partitioning import ROWS, FEATURES, rows_rule
    >>> rows_rule((ROWS, FEATURES), (ROWS,), lead=2).operands
    (('n0', 'n1', 'd'), ('d',))
  """
  rows = row_factors(lead)

  def expand(mapping):
    return tuple(f for factor in mapping for f in (rows if factor == "n" else (factor,)))

  merged = MergedRows(lead, tuple(m[:1] == ("n",) for m in operands),
                      tuple(m[:1] == ("n",) for m in results))
  return Rule(tuple(expand(m) for m in operands), tuple(expand(m) for m in results),
              whole=("one",) if split_features else ("d", "one"),
              rows=None if lead == 1 else merged)


def elementwise_rule(operands: int, results: int, ndim: int) -> Rule:
  """An elementwise kernel on same-shape arrays: every axis may be split."""
  axes = tuple(f"x{i}" for i in range(ndim))
  return Rule((axes,) * operands, (axes,) * results)


def _major(factor: Factor) -> str:
  return factor[0] if isinstance(factor, tuple) else factor


def _factors(mapping) -> set[str]:
  out = set()
  for f in mapping:
    out.update(f if isinstance(f, tuple) else (f,))
  return out


def _names(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def _factor_size(rule: Rule, factor: Factor, size: int) -> int:
  """The size of an axis's splittable (major) factor."""
  if not isinstance(factor, tuple):
    return size
  sizes = dict(rule.sizes)
  return size // math.prod(sizes[f] for f in factor[1:])


def choose_axes(rule: Rule, mesh, specs: Sequence[tuple], shapes: Sequence[tuple]) -> dict:
  """``{factor: mesh axes}``: for each factor that is not ``whole``, the mesh axes the first
  operand split along it arrives on, keeping only axes that divide it and no axis twice."""
  axes, used = {}, set()
  sizes = dict(mesh.shape)
  for mapping, spec, shape in zip(rule.operands, specs, shapes, strict=True):
    for dim, factor in enumerate(mapping):
      f = _major(factor)
      if f in axes or f in rule.whole:
        continue
      names = [a for a in _names(spec[dim] if dim < len(spec) else None)
               if a not in used and sizes.get(a, 1) > 1]
      size = _factor_size(rule, factor, shape[dim])
      while names and size % math.prod(sizes[a] for a in names):
        names.pop()
      if names:
        axes[f] = tuple(names)
        used.update(names)
  return axes


def _spec(mapping, axes) -> PartitionSpec:
  entries = []
  for factor in mapping:
    names = axes.get(_major(factor), ())
    entries.append(None if not names else names[0] if len(names) == 1 else names)
  return PartitionSpec(*entries)


def _sdy_rule(rule: Rule) -> SdyShardingRule:
  def mapping(m):
    return tuple(CompoundFactor(*f) if isinstance(f, tuple) else f for f in m)

  used = []   # in order of first appearance: Shardy wants its special factors sorted
  for m in rule.operands + rule.results:
    for factor in m:
      used += [f for f in (factor if isinstance(factor, tuple) else (factor,)) if f not in used]
  return SdyShardingRule(tuple(mapping(m) for m in rule.operands),
                         tuple(mapping(m) for m in rule.results),
                         need_replication_factors=tuple(f for f in used if f in rule.whole),
                         **{f: n for f, n in rule.sizes if f in used})


def _mesh_devices() -> int:
  return jax.device_count()


def _merging_rows(kernel: Callable, rows: MergedRows) -> Callable:
  """``kernel`` on arrays whose leading row axes it receives merged into one (a reshape of
  each device's own shard: no data moves)."""
  lead = rows.lead

  def call(*args, **kw):
    shape = next(a.shape[:lead] for a, m in zip(args, rows.operands, strict=True)
                 if a is not None and m)
    flat = [a.reshape(-1, *a.shape[lead:]) if a is not None and m else a
            for a, m in zip(args, rows.operands, strict=True)]
    out = kernel(*flat, **kw)
    single = not isinstance(out, tuple)
    outs = [o.reshape(*shape, *o.shape[1:]) if o is not None and m else o
            for o, m in zip((out,) if single else out, rows.results, strict=True)]
    return outs[0] if single else tuple(outs)

  return call


def partitioned_call(kernel: Callable, rule: Rule, *args):
  """``kernel(*args)``, partitioned over the mesh as ``rule`` declares (see the module
  docstring). ``args`` are arrays or None; ``kernel`` returns an array or a tuple of arrays
  (or None)."""
  if rule.rows is not None:
    kernel = _merging_rows(kernel, rule.rows)
  if rule.own or rule.told:
    unsplit = functools.partial(kernel, axes={f: () for f in rule.own + rule.told})
  else:
    unsplit = kernel
  if _mesh_devices() == 1:
    return unsplit(*args)
  context = jax.sharding.get_abstract_mesh()
  if not context.empty and context.manual_axes:
    return unsplit(*args)   # inside shard_map: this device's shard is the whole problem
  call = _Call(kernel, rule, args)
  typed = call.explicit_mesh()
  results = call.shard_mapped(typed) if typed is not None else call.custom_partitioned()
  it = iter(results)
  full_out = [next(it) if o is not None else None for o in call.outs]
  return full_out[0] if call.single else tuple(full_out)


class _Call:
  """One partitioned call: the operands that are not None, the results' structure, and the
  kernel on one device's shards."""

  def __init__(self, kernel, rule, args):
    self.kernel, self.args, self.own = kernel, args, rule.own + rule.told
    self.present = [a for a in args if a is not None]
    self.where = [i for i, a in enumerate(args) if a is not None]
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in self.present]
    out_shape = jax.eval_shape(lambda *arrays: self.call_kernel(arrays, {}), *structs)
    self.single = not isinstance(out_shape, tuple)
    self.outs = (out_shape,) if self.single else out_shape
    self.out_where = [i for i, o in enumerate(self.outs) if o is not None]
    self.rule = rule.select(args, self.outs)

  def call_kernel(self, arrays, axes):
    full_args = [None] * len(self.args)
    for i, a in zip(self.where, arrays, strict=True):
      full_args[i] = a
    kw = {"axes": {f: axes.get(f, ()) for f in self.own}} if self.own else {}
    return self.kernel(*full_args, **kw)

  def run(self, *arrays, axes):
    """The kernel on the operands' local shards (``axes``: the mesh axes of each factor), its
    results that are not None."""
    result = self.call_kernel(arrays, axes)
    result = (result,) if self.single else result
    return tuple(result[i] for i in self.out_where)

  def plan(self, mesh, specs):
    """``(axes, operand specs, result specs, reductions)`` for operands arriving as ``specs``."""
    rule = self.rule
    axes = choose_axes(rule, mesh, specs, [a.shape for a in self.present])
    reduce = []
    for m in rule.results:
      kept = _factors(m)
      reduce.append(tuple(a for f, names in axes.items()
                          if f not in kept and f not in rule.own for a in names))
    return (axes, tuple(_spec(m, axes) for m in rule.operands),
            tuple(_spec(m, axes) for m in rule.results), tuple(reduce))

  def lowered(self, axes, reduce):
    def lower(*arrays):
      results = self.run(*arrays, axes=axes)
      return tuple(jax.lax.psum(r, names) if names else r for r, names in zip(results, reduce))
    return lower

  def explicit_mesh(self):
    """The mesh of an operand whose type carries Explicit-axis shardings, or None."""
    for a in self.present:
      sharding = getattr(jax.typeof(a), "sharding", None)
      mesh = getattr(sharding, "mesh", None)
      if mesh is not None and not mesh.empty and mesh.explicit_axes:
        return mesh
    return None

  def shard_mapped(self, mesh):
    """Explicit axes: the operands' shardings are in their types, so the split is chosen here
    and the kernel runs under ``shard_map``."""
    explicit = set(mesh.explicit_axes)
    specs = [tuple(_only(e, explicit) for e in jax.typeof(a).sharding.spec)
             for a in self.present]
    axes, in_specs, out_specs, reduce = self.plan(mesh, specs)
    operands = [jax.sharding.reshard(a, s) for a, s in zip(self.present, in_specs)]
    mapped = jax.shard_map(self.lowered(axes, reduce), mesh=mesh, in_specs=in_specs,
                           out_specs=out_specs, axis_names=explicit, check_vma=False)
    results = mapped(*operands)
    # Each result goes back to the split its factors arrived with, as its type promises (a
    # gradient has its primal's sharding): a factor gathered for the kernel is split again.
    arrived = choose_axes(dataclasses.replace(self.rule, whole=()), mesh, specs,
                          [a.shape for a in self.present])
    homes = [_spec(m, arrived) for m in self.rule.results]
    return tuple(r if home == spec else jax.sharding.reshard(r, home)
                 for r, spec, home in zip(results, out_specs, homes))

  def custom_partitioned(self):
    """Auto axes (or no mesh in context): XLA's partitioner calls back with the operands'
    shardings."""
    def partition(mesh, arg_infos, result_infos):
      del result_infos
      specs = [tuple(a.sharding.spec) if isinstance(a.sharding, NamedSharding) else ()
               for a in arg_infos]
      axes, in_specs, out_specs, reduce = self.plan(mesh, specs)
      return (mesh, self.lowered(axes, reduce),
              tuple(NamedSharding(mesh, s) for s in out_specs),
              tuple(NamedSharding(mesh, s) for s in in_specs))

    def infer(mesh, arg_infos, result_infos):
      return partition(mesh, arg_infos, result_infos)[2]

    whole = functools.partial(self.run, axes={})
    partitioned = custom_partitioning(lambda *arrays: whole(*arrays))
    partitioned.def_partition(partition=partition, infer_sharding_from_operands=infer,
                              sharding_rule=_sdy_rule(self.rule))
    batched = jax.custom_batching.custom_vmap(lambda *arrays: partitioned(*arrays))

    @batched.def_vmap
    def _vmap(axis_size, in_batched, *arrays):
      del axis_size
      result = jax.vmap(whole, in_axes=tuple(0 if b else None for b in in_batched))(*arrays)
      return result, tuple(True for _ in result)

    return batched(*self.present)


def typed_sharding(x):
  """The sharding ``x``'s type carries on Explicit mesh axes, or None (Auto axes, no mesh,
  inside ``shard_map``). A product contracted over split axes must name its result's sharding
  there; a gradient takes its primal's."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or mesh.empty or not mesh.explicit_axes or mesh.manual_axes:
    return None
  return sharding


def typed_product_sharding(x, w, w_axis: int):
  """For Explicit axes, the sharding of ``x @ w`` contracted over ``x``'s last axis: ``x``'s
  leading axes as they are split, then ``w``'s axis ``w_axis`` as it is (unless a leading
  axis uses its mesh axes already); a split contraction is summed. None otherwise."""
  sx, sw = typed_sharding(x), typed_sharding(w)
  if sx is None and sw is None:
    return None
  mesh = (sx or sw).mesh
  lead = tuple(sx.spec)[:x.ndim - 1] if sx is not None else ()
  lead = lead + (None,) * (x.ndim - 1 - len(lead))
  w_spec = tuple(sw.spec) if sw is not None else ()
  last = w_spec[w_axis] if w_axis < len(w_spec) else None
  used = {a for e in lead for a in _names(e)}
  if any(a in used for a in _names(last)):
    last = None
  return NamedSharding(mesh, PartitionSpec(*lead, last))


def _only(entry, keep):
  """A PartitionSpec entry restricted to the mesh axes in ``keep``."""
  names = tuple(a for a in _names(entry) if a in keep)
  return None if not names else names[0] if len(names) == 1 else names


def varying_axes(x) -> frozenset:
  """The manual mesh axes ``x`` varies over (empty outside ``shard_map``, and for None).

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxfuse.ops.partitioning import varying_axes
    >>> varying_axes(jnp.ones(3))
    frozenset()
  """
  if x is None:
    return frozenset()
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)   # jax 0.10
  if manual is not None:
    return frozenset(manual.varying)
  return frozenset(getattr(aval, "vma", ()))


def match_vma(*arrays):
  """``arrays`` each made to vary over every manual mesh axis that any of them varies over.

  Inside ``jax.shard_map`` with ``check_vma=True``, an op whose arguments differ (an activation
  that varies over the data axis, a replicated weight) must widen the invariant ones first, so
  that the gradient of the weight varies like the activation's; JAX transposes that widening
  into the ``psum`` a replicated weight's gradient needs. Outside ``shard_map`` it returns the
  arrays unchanged. None entries stay None.
  """
  union = frozenset().union(*(varying_axes(x) for x in arrays))
  if not union:
    return arrays

  def widen(x):
    if x is None:
      return None
    missing = tuple(sorted(union - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  return tuple(widen(x) for x in arrays)


def vary_like(tree, *refs):
  """``tree``'s arrays made to vary over the manual mesh axes that ``refs`` vary over (a loop
  carry created from constants must match what the loop body makes of the op's inputs).
  Outside ``shard_map`` it returns ``tree`` unchanged."""
  union = frozenset().union(*(varying_axes(r) for r in refs))
  if not union:
    return tree

  def widen(x):
    missing = tuple(sorted(union - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(widen, tree)


class matching_vma:  # noqa: N801 - used as a decorator, named like a function
  """Decorates an op's ``jax.custom_vjp`` function: its array arguments are made to agree on
  the manual mesh axes they vary over (:func:`match_vma`) before each call, so that the op
  works inside ``jax.shard_map`` with ``check_vma=True`` (a replicated weight's gradient then
  varies like the activation's, and JAX sums it). ``defvjp`` and every other attribute are
  the decorated function's.

  Example:
    >>> import functools, jax
    >>> @matching_vma
    ... @jax.custom_vjp
    ... def scale(x, w):
    ...   return x * w
    >>> scale.defvjp(lambda x, w: (x * w, (x, w)), lambda r, g: (g * r[1], g * r[0]))
    >>> float(jax.grad(scale, argnums=1)(2.0, 3.0))
    2.0
  """

  def __init__(self, fn):
    self.fn = fn
    functools.update_wrapper(self, fn)

  def __call__(self, *args):
    positions = [i for i, a in enumerate(args) if isinstance(a, jax.Array)]
    matched = match_vma(*(args[i] for i in positions))
    args = list(args)
    for i, a in zip(positions, matched):
      args[i] = a
    return self.fn(*args)

  def __getattr__(self, name):
    return getattr(self.fn, name)
