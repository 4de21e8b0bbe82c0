"""What every op shares: its registry entry (implementations, kernel modules, ``None`` order),
the static config of its custom_vjp, its compute dtype, and how its kernels are called and
differentiated a second time.

An op is declared once, as an :class:`Op`: its name, the module of its kernels (the same module
name under ``jaxfuse.kernels.pallas`` and ``jaxfuse.kernels.triton``, imported on first use),
and the order ``implementation=None`` tries them. Everything that needs to know an op's
implementations reads that entry (:data:`REGISTRY`): dispatch, the error for an implementation
that cannot run, the benchmark rows, the parity tests, the kernel-resource report. An op's code
never compares implementation names: it calls kernels by name through :meth:`Config.run`.

An op file reads top to bottom in the same order (see CONTRIBUTING.md):

1. its :class:`Op`;
2. the plain-jnp reference;
3. the argument checks (:mod:`jaxfuse.ops.checks`);
4. the public op, with a doctest;
5. forward and backward, each kernel called through :meth:`Config.run`;
6. the ``custom_vjp``, whose residuals are commented.

Example:
  >>> import dataclasses
  >>> from jaxfuse.ops import base
  >>> SCALE = base.Op("scale", register=False)
  >>> @dataclasses.dataclass(frozen=True)
  ... class ScaleConfig(base.Config):
  ...   factor: float
  >>> cfg = SCALE.config(None, ScaleConfig, factor=2.0)
  >>> cfg.impl, cfg.interpret, cfg.factor
  ('xla', False, 2.0)
  >>> cfg.run("scale", lambda x: x * cfg.factor, 3.0)   # XLA: the op's own jnp formulas
  6.0
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

from jaxfuse.ops import dispatch, partitioning

# The order ``implementation=None`` tries on a GPU, by kind of op (the one rule every op follows;
# nothing here has been timed on a GPU yet, so it is a rule of reasoning, not of measurement):
# - elementwise ops (add_act, bias_act, glu, relu): XLA fuses an elementwise chain, and its
#   backward, into one loop with the same traffic as the kernel and no launch of its own, so
#   XLA comes first and the kernels are there to show and measure the fusion;
# - ops whose fused form XLA cannot produce (a row reduction and its use in one pass, tiled
#   attention, logits that never reach memory): their kernels first;
# - matmuls: XLA (cuBLAS).
# Where the installed jax has deprecated Pallas' Triton backend (0.11 and later) or lacks it, the
# jax-triton kernels take Pallas' place in each order (the same math: both pass the same twin
# tests); an op without a Triton kernel then falls to XLA.
# On CPUs an op with CPU kernels (jaxfuse.kernels.cpu) tries them first where they measure
# faster than XLA (the norm suite's jaxfuse-cpu rows); else XLA first: a kernel call is a fusion
# boundary, where XLA may fuse an op's elementwise ends with its neighbours.
CPU_KERNELS_FIRST = ("cpu", "xla")
XLA_FIRST_ON_CPU = ("xla", "cpu")
ELEMENTWISE_GPU_ORDER = ("xla", "pallas", "triton")
KERNEL_GPU_ORDER = ("pallas", "triton", "xla")
MATMUL_GPU_ORDER = ("xla", "pallas", "triton")

# Every declared op, by name (filled as the op modules are imported; jaxfuse.ops imports them
# all).
REGISTRY: dict[str, "Op"] = {}


@dataclasses.dataclass(frozen=True)
class Op:
  """An op's registry entry: its name, its kernels and the order ``None`` tries them.

  Attributes:
    name: the op's public name; every error message starts with it.
    kernels: the name of its kernel modules (``"normalization"`` is
      ``jaxfuse.kernels.pallas.normalization`` and ``jaxfuse.kernels.triton.normalization``,
      which define the same functions with the same signatures), or None for an op that XLA
      alone implements. Every op has ``"xla"``: its own jnp formulas.
    gpu_order: the order ``None`` tries on GPUs (one of the ``*_GPU_ORDER`` rules above).
    cpu_order: the order ``None`` tries on CPUs, for an op with CPU kernels
      (:data:`CPU_KERNELS_FIRST` or :data:`XLA_FIRST_ON_CPU`); on TPUs it is ``"xla"``.
      Pallas runs on CPUs only in interpret mode, which is for tests.
    kinds: the kernel kinds it has (default: every kind of :data:`dispatch.KINDS` whose
      package holds a module named ``kernels``).
    register: whether it enters :data:`REGISTRY` (False for examples and tests).

  A kernel module may define ``refuses(**facts) -> str | None``: given what a call passes to
  :meth:`config` as ``facts`` (a row width, an activation), why its kernels cannot take it
  (None: they can). ``None`` then skips that implementation; asked for by name, it raises. It
  may define ``ready() -> bool``: whether its kernels load here (:meth:`ready`), which ``None``
  asks last.
  """

  name: str
  kernels: str | None = None
  gpu_order: tuple[str, ...] = KERNEL_GPU_ORDER
  kinds: tuple[str, ...] | None = None
  cpu_order: tuple[str, ...] = CPU_KERNELS_FIRST
  register: bool = dataclasses.field(default=True, compare=False, repr=False)

  def __post_init__(self):
    if self.kinds is None:
      kinds = tuple(k.name for k in dispatch.KINDS.values()
                    if self.kernels and k.has_module(self.kernels))
      object.__setattr__(self, "kinds", kinds)
    unknown = set(self.kinds) - {k.name for k in dispatch.KINDS.values() if k.package}
    if unknown or (self.kinds and not self.kernels):
      raise ValueError(f"Op {self.name}: kinds {self.kinds} need a kernels module and must be "
                       f"kernel kinds of {dispatch.IMPLEMENTATIONS}")
    if self.register:
      REGISTRY[self.name] = self

  @property
  def implementations(self) -> tuple[str, ...]:
    """Every implementation it has: its kernel kinds, then ``"xla"``."""
    return self.kinds + ("xla",)

  def module_name(self, implementation: str) -> str | None:
    """The dotted name of ``implementation``'s kernel module (None for XLA)."""
    package = dispatch.KINDS[implementation].package
    return None if package is None else f"{package}.{self.kernels}"

  def module(self, implementation: str):
    """``implementation``'s kernel module, imported now (None for XLA)."""
    name = self.module_name(implementation)
    return None if name is None else importlib.import_module(name)

  @property
  def preference(self) -> Mapping[str, Sequence[str]]:
    order = [i for i in self.gpu_order if i in self.implementations]
    if "xla" not in order:
      order.append("xla")
    if not dispatch.pallas_triton_current() and "pallas" in order:
      order.remove("pallas")
      if "triton" in order:   # the Triton kernels take Pallas' place
        order.remove("triton")
        order.insert(list(self.gpu_order).index("pallas"), "triton")
    on_cpu = tuple(i for i in self.cpu_order if i in self.implementations)
    return {"gpu": tuple(order), "cpu": on_cpu, "tpu": ("xla",)}

  def refuses(self, implementation: str, facts: Mapping | None) -> str | None:
    """Why ``implementation``'s kernels cannot take a call with ``facts`` (None: they can)."""
    if not facts or dispatch.KINDS[implementation].package is None:
      return None
    check = getattr(self.module(implementation), "refuses", None)
    return None if check is None else check(**facts)

  def ready(self, implementation: str) -> bool:
    """Whether ``implementation``'s kernels load here, for ``None`` (a kernel module may define
    ``ready() -> bool``: the CPU kernels build on first use, and warn once where they cannot)."""
    if dispatch.KINDS[implementation].package is None:
      return True
    check = getattr(self.module(implementation), "ready", None)
    return True if check is None else check()

  def resolve(self, implementation: str | None, facts: Mapping | None = None) -> str:
    """The implementation this op runs with (see :func:`dispatch.resolve` for the errors)."""
    return dispatch.resolve(self.name, implementation, self.implementations, self.preference,
                            refuses=lambda name: self.refuses(name, facts), ready=self.ready)

  def config(self, implementation: str | None, cls: type[Config] | None = None, *,
             facts: Mapping | None = None, **fields) -> Config:
    """The static config of one call: the implementation resolved (with ``facts`` for the
    kernels' limits), its kernel module, interpret mode, and the op's own ``fields``."""
    impl = self.resolve(implementation, facts)
    return (cls or Config)(impl=impl, interpret=dispatch.interprets(impl),
                           kernels=self.module_name(impl), **fields)

  def table(self) -> list[dict]:
    """Its registry rows, one per implementation: what a report of the registry prints."""
    order = self.preference["gpu"]
    return [{"op": self.name, "implementation": impl, "module": self.module_name(impl),
             "platforms": dispatch.KINDS[impl].platforms,
             "available": dispatch.runs_natively(impl),
             "gpu_rank": order.index(impl) + 1 if impl in order else None}
            for impl in self.implementations]


@dataclasses.dataclass(frozen=True)
class Config:
  """The non-differentiable arguments of an op's custom_vjp: hashable, compared by value.

  Each op subclasses it with its own static fields (an activation, eps, tile sizes, ...).

  Attributes:
    impl: the implementation, resolved.
    interpret: whether kernels are traced in Pallas' interpret mode.
    kernels: the dotted name of the kernel module, or None when XLA runs the op's own jnp
      formulas.
  """

  impl: str
  interpret: bool
  kernels: str | None

  @property
  def on_kernels(self) -> bool:
    """Whether this call runs kernels (Pallas or Triton) rather than XLA's formulas."""
    return self.kernels is not None

  def kernel(self, name: str, **static) -> Callable:
    """The kernel ``name`` of this call's kernel module, with ``static`` bound (and
    ``interpret`` for kinds that interpret). ``name`` may be ``"module.function"`` for a
    kernel of another module of the same kind."""
    module, _, function = name.rpartition(".")
    package = self.kernels if not module else f"{self.kernels.rpartition('.')[0]}.{module}"
    fn = getattr(importlib.import_module(package), function)
    if dispatch.KINDS[self.impl].interpretable:
      static["interpret"] = self.interpret
    return functools.partial(fn, **static)

  def run(self, name: str, twin: Callable, *args, rule=None, xla: Callable | None = None,
          xla_kernel: Callable | None = None, **static):
    """Runs this call's implementation of one computation on ``args``.

    With kernels: the kernel ``name`` (see :meth:`kernel`), differentiable as ``twin`` and
    partitioned by ``rule`` (:func:`kernel_call`). On XLA: ``xla_kernel`` as if it were a
    kernel (through the same rule, differentiated as ``twin``: an XLA implementation that
    partitions as the kernels do, or that autodiff cannot differentiate); else ``xla`` or, by
    default, ``twin`` itself, called as it is.
    """
    if self.on_kernels:
      return kernel_call(self.kernel(name, **static), twin, *args, rule=rule)
    if xla_kernel is not None:
      return kernel_call(xla_kernel, twin, *args, rule=rule)
    return (xla or twin)(*args)


def recomputing_vjp(forward: Callable, backward: Callable, *, barrier: bool = False):
  """The ``custom_vjp`` of an op that keeps only its inputs for the backward pass and
  recomputes everything else there (the fused elementwise ops, the seed's linear layer).

  ``forward(cfg, *arrays)`` computes the op; ``backward(cfg, *arrays, g)`` returns one
  gradient per array (None where there is none). The result is called ``op(cfg, *arrays)``;
  its arrays agree on the mesh axes they vary over (:class:`partitioning.matching_vma`). With
  ``barrier``, the backward reads the inputs through an optimization barrier, so that XLA
  cannot reuse values of the forward pass in place of the recomputation. Plain ``defvjp``:
  ``optimize_remat=True`` breaks reverse over reverse.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxfuse.ops import base
    >>> square = base.recomputing_vjp(lambda cfg, x: x * x, lambda cfg, x, g: (2 * x * g,))
    >>> jax.grad(lambda x: square(None, x).sum())(jnp.arange(3.0))
    Array([0., 2., 4.], dtype=float32)
  """

  @partitioning.matching_vma
  @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
  def op(cfg, *arrays):
    return forward(cfg, *arrays)

  def fwd(cfg, *arrays):
    # Residuals: the inputs only.
    return forward(cfg, *arrays), arrays

  def bwd(cfg, arrays, g):
    if barrier:
      arrays = jax.lax.optimization_barrier(arrays)
    return tuple(backward(cfg, *arrays, g))

  op.defvjp(fwd, bwd)
  return op


def compute_dtype(dtype) -> jnp.dtype:
  """The dtype ops compute in: float32 for bfloat16/float16 inputs, the input's otherwise."""
  return jnp.promote_types(dtype, jnp.float32)


def kernel_call(kernel: Callable, twin: Callable, *args, rule=None):
  """``kernel(*args)``, differentiable as ``twin``, a jnp computation of the same function,
  partitioned over a device mesh as ``rule`` (a :class:`jaxfuse.ops.partitioning.Rule`)
  declares: without one, XLA gathers the kernel's inputs onto every device.

  First-order gradients of an op never differentiate its kernels: the op's custom_vjp calls a
  backward kernel instead. Second-order gradients (``grad`` of ``grad``, Hessian-vector
  products, forward over reverse as well as reverse over reverse) differentiate the first
  backward pass, kernels included; this gives every kernel the derivative of its XLA twin, so
  they work on every implementation. ``args`` are arrays (or None); close over static
  arguments.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxfuse.ops import base
    >>> square = lambda x: x * x
    >>> jax.grad(lambda x: base.kernel_call(square, square, x).sum())(jnp.ones(2))
    Array([2., 2.], dtype=float32)
  """

  @jax.custom_jvp
  def call(*args):
    out = kernel(*args) if rule is None else partitioning.partitioned_call(kernel, rule, *args)
    # Inside shard_map, a kernel's results vary over the manual axes its inputs vary over (an
    # FFI call's results would otherwise vary over none).
    return partitioning.vary_like(out, *args)

  @call.defjvp
  def call_jvp(primals, tangents):
    _, tangent_out = jax.jvp(twin, primals, tangents)
    return call(*primals), tangent_out

  return call(*args)
