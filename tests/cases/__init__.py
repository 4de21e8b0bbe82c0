"""The test-case table of every op: one module per op family, each with its ``CASES`` (ways to
call the op, at a realistic and a weird shape, with the torch twin it must match) and its
``BAD`` (bad arguments and the error they must raise).

The shared tests are parametrized from these tables: the torch twins in every dtype
(``test_op_twins.py``), second order (``test_second_order.py``), properties over random shapes
(``test_properties.py``), the error of each bad argument on every implementation
(``test_op_errors.py``), the kernels each implementation launches and their CUDA lowering
(``test_triton_parity.py``, ``test_op_lowering.py``) and the device mesh
(``sharding/test_ops.py``). A new op is tested everywhere by adding its entry here;
``test_every_registered_op_has_cases`` fails until it has one.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tests import helpers

Shapes = tuple  # one shape (a tuple of ints) per argument


@dataclasses.dataclass(frozen=True)
class Mesh:
  """How a case runs on the 2x4 ``("data", "model")`` mesh of ``sharding/test_ops.py``:
  ``shapes`` divisible by the mesh, one ``PartitionSpec`` tuple (as axis names) per argument,
  the arguments no program may gather whole, and whether each device's shards make the op's
  own problem (not where a contraction or the vocabulary is split), and the tolerance of the
  comparison with one device (a split contraction adds its partial sums in another order)."""

  shapes: Shapes
  specs: tuple
  activations: tuple[int, ...] = (0,)
  local: bool = True
  implementations: tuple[str, ...] = helpers.TABLE_IMPLEMENTATIONS
  tolerance: float = 1e-5


@dataclasses.dataclass(frozen=True)
class Case:
  """One way to call an op, with everything the shared tests need.

  Attributes:
    op: the op's registry name (:data:`jaxfuse.ops.base.REGISTRY`).
    label: its options, for test ids (``""`` for the plain call).
    call: ``call(*args, implementation=...)``: the op with those options bound; an array or
      a tuple of arrays.
    twin: the PyTorch computation of the same outputs from torch tensors (None: none).
    shapes: a realistic shape per argument (the XLA implementation runs it).
    weird: odd sizes, not multiples of any tile, small enough for interpret mode.
    ints: ``(index, high)`` of the integer arguments (drawn in ``[0, high)``; ``high`` may be
      a function of the shapes).
    wrt: the arguments differentiated (default: every float argument).
    dtypes: the dtypes the twin tests run.
    scale: inputs are standard normals times this (or, a tuple, this argument's entry).
    reference: the plain-jnp reference (``reference(*args)``, the same outputs) that the
      property tests hold the XLA implementation to over random shapes (None: no property
      test).
    draw: ``draw(rng) -> Shapes`` random shapes for the property tests (odd, tiny, empty).
    second_order: whether the Hessian-vector products are checked against the twin's double
      backward (``second_order_twin`` if the twin has none).
    mesh: how it runs on a device mesh (None: not tested there).
    kernels: the Pallas kernels ``jit(value_and_grad)`` launches at the weird shape, sorted
      (None: not checked).
    implementations: the implementations that take this call (default: all the op has).
    low_precision_k: the low-precision rule's factor (our error at most k times the twin's).
    small: shapes for the second-order test (default: the weird ones).
  """

  op: str
  label: str
  call: Callable[..., Any]
  twin: Callable[..., Any] | None
  shapes: Shapes
  weird: Shapes
  ints: tuple[tuple[int, int | Callable[[Shapes], int]], ...] = ()
  wrt: tuple[int, ...] | None = None
  dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
  scale: float | tuple[float, ...] = 1.0
  reference: Callable[..., Any] | None = None
  draw: Callable[[np.random.Generator], Shapes] | None = None
  second_order: bool = True
  second_order_twin: Callable[..., Any] | None = None
  mesh: Mesh | None = None
  kernels: tuple[str, ...] | None = None
  implementations: tuple[str, ...] | None = None
  low_precision_k: float = 2.0
  small: Shapes | None = None

  @property
  def id(self) -> str:
    return f"{self.op}-{self.label}" if self.label else self.op

  def runs_on(self, implementation: str) -> bool:
    """Whether ``implementation`` takes this call (the op has it, the case does not exclude
    it)."""
    from jaxfuse.ops import base

    return (implementation in base.REGISTRY[self.op].implementations
            and (self.implementations is None or implementation in self.implementations))

  @property
  def float_args(self) -> tuple[int, ...]:
    ints = dict(self.ints)
    return tuple(i for i in range(len(self.shapes)) if i not in ints)

  @property
  def diff_args(self) -> tuple[int, ...]:
    return self.float_args if self.wrt is None else self.wrt

  def inputs(self, shapes: Shapes | None = None, dtype=jnp.float32, seed: int = 0) -> list:
    """Arguments of ``shapes`` (default: the weird ones): float arrays in ``dtype``, integer
    ones in their range, drawn from one generator seeded with ``seed``."""
    rng = np.random.default_rng(seed)
    ints = dict(self.ints)
    shapes = self.weird if shapes is None else shapes
    out = []
    for i, shape in enumerate(shapes):
      if i in ints:
        high = ints[i](shapes) if callable(ints[i]) else ints[i]
        out.append(jnp.asarray(rng.integers(0, high, shape), jnp.int32))
      else:
        scale = self.scale[i] if isinstance(self.scale, tuple) else self.scale
        x = rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)
        out.append(jnp.asarray(x, dtype))
    return out

  def bind(self, args: Sequence, implementation: str | None = None) -> tuple[Callable, tuple]:
    """``(f, diff)``: ``f`` of the differentiated arguments alone, the others closed over."""
    diff = self.diff_args

    def f(*d):
      full = list(args)
      for i, x in zip(diff, d):
        full[i] = x
      return self.call(*full, implementation=implementation)

    return f, tuple(args[i] for i in diff)


@dataclasses.dataclass(frozen=True)
class Bad:
  """A call with a bad argument and the error every implementation must raise for it.

  ``call(implementation)`` makes the call; ``error`` is the exception type and ``match`` a
  regular expression its message must contain (it starts with the op's name).
  """

  op: str
  label: str
  call: Callable[[str | None], Any]
  error: type[BaseException]
  match: str

  @property
  def id(self) -> str:
    return f"{self.op}-{self.label}"


def outputs(out) -> tuple:
  """An op's (or a twin's) outputs as a tuple."""
  return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def cotangents(out, seed: int = 7) -> tuple:
  """A cotangent per floating output, in its dtype (zeros for integer outputs)."""
  rng = np.random.default_rng(seed)
  cts = []
  for o in outputs(out):
    if jnp.issubdtype(o.dtype, jnp.floating):
      cts.append(jnp.asarray(rng.standard_normal(o.shape, dtype=np.float32), o.dtype))
    else:
      cts.append(np.zeros(o.shape, jax.dtypes.float0))
  return tuple(cts)


def _families() -> list:
  return [importlib.import_module(f"{__name__}.{info.name}")
          for info in pkgutil.iter_modules(__path__)]


FAMILIES = _families()
CASES: list[Case] = [c for family in FAMILIES for c in getattr(family, "CASES", [])]
BAD: list[Bad] = [b for family in FAMILIES for b in getattr(family, "BAD", [])]


def by_op() -> dict[str, list[Case]]:
  table: dict[str, list[Case]] = {}
  for case in CASES:
    table.setdefault(case.op, []).append(case)
  return table
