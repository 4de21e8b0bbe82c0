"""Every op of jaxfuse.ops on a 2x4 mesh of simulated devices (each case of the op tables,
``tests/cases``, that has a ``Mesh``): under ``jit`` with inputs placed
by ``NamedSharding`` on Auto and on Explicit mesh axes, and inside ``jax.shard_map`` with
``check_vma=True``. Each gives the single-device loss and gradients, and the compiled program
never all-gathers a whole activation."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxfuse
from jaxfuse.metrics.collectives import collectives
from jaxfuse.ops import partitioning
from tests import cases, helpers

# The sizes of the table's mesh shapes (tests/cases), which the checks below count with.
B, T, D, V = 4, 8, 32, 64


@dataclasses.dataclass(frozen=True)
class Case:
  """An op applied to arrays of ``shapes`` placed as ``specs``; ``wrt``: the arguments it is
  differentiated in; ``activations``: the arguments no program may gather whole."""

  name: str
  fn: Callable
  shapes: tuple
  specs: tuple
  wrt: tuple[int, ...]
  activations: tuple[int, ...] = (0,)
  ints: tuple[int, ...] = ()   # integer arguments: (index, high)
  implementations: tuple[str, ...] = ("xla",)
  # Whether each device's shards make the op's own problem (so it runs inside shard_map as it
  # is): not where a contraction or the vocabulary is split, which the caller then combines.
  local: bool = True
  tolerance: float = 1e-5


def _sum_outputs(out):
  """A scalar of every output, not symmetric in their elements (a scalar output as it is)."""
  return sum(o if o.ndim == 0 else jnp.sum(jnp.sin(o.astype(jnp.float32)))
             for o in jax.tree.leaves(out))


def _from_table(c: cases.Case) -> Case:
  """A case of the op tables (tests/cases) with a device mesh."""
  mesh = c.mesh
  return Case(c.id, c.call, mesh.shapes, tuple(P(*spec) for spec in mesh.specs), c.diff_args,
              mesh.activations, tuple((i, h(mesh.shapes) if callable(h) else h)
                                      for i, h in c.ints),
              tuple(i for i in mesh.implementations if c.runs_on(i)), mesh.local,
              mesh.tolerance)


CASES = [_from_table(c) for c in cases.CASES if c.mesh is not None]
PARAMS = [pytest.param(c, impl, id=f"{c.name}-{impl}") for c in CASES
          for impl in c.implementations]


def _inputs(case: Case):
  rng = np.random.default_rng(0)
  ints = dict(case.ints)
  out = []
  for i, shape in enumerate(case.shapes):
    if i in ints:
      out.append(jnp.asarray(rng.integers(0, ints[i], shape), jnp.int32))
    else:
      out.append(jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * 0.5))
  return out


def _loss_and_grads(case: Case, implementation: str):
  def loss(*args):
    return _sum_outputs(case.fn(*args, implementation=implementation))

  return jax.value_and_grad(loss, argnums=case.wrt)


def _expected(case, implementation, args):
  with jaxfuse.pallas_interpret(True):
    loss, grads = jax.jit(_loss_and_grads(case, implementation))(*args)
  return loss, grads


def _mesh(axis_type):
  return jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type, axis_type))


def _assert_matches(got, want, tolerance=1e-5):
  loss, grads = got
  helpers.assert_close(loss, want[0], rtol=tolerance, atol=tolerance)
  for g, w in zip(grads, want[1], strict=True):
    helpers.assert_close(g, w, rtol=tolerance, atol=tolerance)


def _gathered_activations(text: str, case: Case) -> list:
  whole = {tuple(case.shapes[i]) for i in case.activations}
  return [c for c in collectives(text) if c.kind == "all-gather" and c.shape in whole]


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("case, implementation", PARAMS)
def test_op_partitions_under_jit(case, implementation, axis_type):
  args = _inputs(case)
  want = _expected(case, implementation, args)
  mesh = _mesh(axis_type)
  with jax.set_mesh(mesh), jaxfuse.pallas_interpret(True):
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, case.specs)]
    step = jax.jit(_loss_and_grads(case, implementation))
    got = step(*placed)
    text = step.lower(*placed).compile().as_text()
  _assert_matches(got, want, case.tolerance)
  for g, i in zip(got[1], case.wrt, strict=True):   # a gradient is placed as its primal
    assert g.sharding.is_equivalent_to(placed[i].sharding, g.ndim), (i, g.sharding)
  assert not _gathered_activations(text, case)


LOCAL = [p for p in PARAMS if p.values[0].local]


def _in_shard_map(case, implementation, mesh):
  step = _loss_and_grads(case, implementation)

  def local(*shards):
    loss, grads = step(*shards)
    # Devices that hold the same shards compute the same loss: it is summed over the others.
    return jax.lax.psum(loss, tuple(sorted(partitioning.varying_axes(loss)))), grads

  out_specs = (P(), tuple(case.specs[i] for i in case.wrt))
  return jax.shard_map(local, mesh=mesh, in_specs=case.specs, out_specs=out_specs,
                       check_vma=True)


@pytest.mark.parametrize("case, implementation", [p for p in LOCAL if p.values[1] == "xla"])
def test_op_runs_inside_shard_map_with_vma_checks(case, implementation):
  """Each device computes its shard's loss; the gradients of replicated arguments are summed
  over the devices by JAX (the op matches its arguments' varying axes), so the sum of the
  local losses and the gradients are the single-device ones."""
  args = _inputs(case)
  want = _expected(case, implementation, args)
  mesh = _mesh(AxisType.Explicit)
  with jax.set_mesh(mesh):
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, case.specs)]
    got = jax.jit(_in_shard_map(case, implementation, mesh))(*placed)
  _assert_matches(got, want)


@pytest.mark.parametrize("case, implementation", [p for p in LOCAL if p.values[1] == "pallas"])
def test_pallas_kernels_lower_for_cuda_inside_shard_map_with_vma_checks(case, implementation):
  """Pallas' interpreter itself fails type checks inside shard_map (its grid loop starts from
  unvarying values), so the kernels are lowered for CUDA there instead, forward and backward,
  their results typed to vary as their operands do."""
  args = _inputs(case)
  mesh = _mesh(AxisType.Explicit)
  with jax.set_mesh(mesh), jaxfuse.pallas_interpret(False):
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, case.specs)]
    text = helpers.lower_for_gpu(_in_shard_map(case, implementation, mesh), *placed)
  kernels = [n for n in helpers.triton_kernel_names(text) if n not in ("data", "model")]
  assert len(kernels) >= 2, kernels   # a forward and a backward kernel


def test_collectives_of_a_sharded_norm_are_its_scale_gradient_only():
  """rms_norm on rows split over both mesh axes: the forward needs no collective, and the
  backward one all-reduce of the ``[features]`` scale gradient."""
  case = next(c for c in CASES if c.name == "rms_norm")
  args = _inputs(case)
  mesh = _mesh(AxisType.Auto)
  with jax.set_mesh(mesh):
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, case.specs)]
    forward = jax.jit(functools.partial(case.fn, implementation="xla"))
    backward = jax.jit(_loss_and_grads(case, "xla"))
    fwd = collectives(forward.lower(*placed).compile().as_text())
    bwd = collectives(backward.lower(*placed).compile().as_text())
  assert fwd == []
  kinds = sorted((c.kind, c.shape) for c in bwd)
  assert ("all-reduce", (D,)) in kinds and all(k == "all-reduce" for k, _ in kinds), kinds


@pytest.mark.parametrize("name", ["linear_cross_entropy-vocab-parallel",
                                  "linear_cross_entropy-grad_in_forward vocab-parallel"])
def test_vocab_parallel_cross_entropy_never_gathers_logits_or_the_weight(name):
  """The weight split over the vocabulary: the collectives are over ``[tokens]`` vectors (and
  scalars), never over ``[tokens, V]`` logits or the ``[V, D]`` weight."""
  case = next(c for c in CASES if c.name == name)
  args = _inputs(case)
  mesh = _mesh(AxisType.Auto)
  with jax.set_mesh(mesh):
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, case.specs)]
    text = jax.jit(_loss_and_grads(case, "xla")).lower(*placed).compile().as_text()
  found = collectives(text)
  assert found, "a vocab-parallel loss combines its shards"
  for c in found:
    assert V not in c.shape, c   # neither logits nor the whole weight
  # The largest: dh, summed over the vocabulary shards (chunk by chunk with the gradients in
  # the forward, its last chunk padded to the chunk size: at most twice the shard's rows).
  h_shard = (B * T // 2) * D * 4
  assert max(math.prod(c.shape) * 4 for c in found) <= 2 * h_shard
