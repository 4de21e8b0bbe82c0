"""What every op shares: its implementations, the static config of its custom_vjp, its compute
dtype, and how its kernels are differentiated a second time.

An op file reads top to bottom in the same order (see CONTRIBUTING.md):

1. its :class:`Op` (name, implementations, the order ``implementation=None`` tries them);
2. the plain-jnp reference;
3. the argument checks (:mod:`jaxfuse.ops.checks`);
4. the public op, with a doctest;
5. forward and backward, one branch per implementation;
6. the ``custom_vjp``, whose residuals are commented.

Example:
  >>> import dataclasses
  >>> from jaxfuse.ops import base
  >>> SCALE = base.Op("scale", ("xla",))
  >>> @dataclasses.dataclass(frozen=True)
  ... class ScaleConfig(base.Config):
  ...   factor: float
  >>> cfg = ScaleConfig(**SCALE.backend(None), factor=2.0)
  >>> cfg.impl, cfg.interpret, cfg.factor
  ('xla', False, 2.0)
"""

from __future__ import annotations

import dataclasses
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
ELEMENTWISE_GPU_ORDER = ("xla", "pallas", "triton")
KERNEL_GPU_ORDER = ("pallas", "triton", "xla")
MATMUL_GPU_ORDER = ("xla", "pallas")


@dataclasses.dataclass(frozen=True)
class Op:
  """An op's name, its implementations and the order ``implementation=None`` tries them.

  Attributes:
    name: the op's public name; every error message starts with it.
    implementations: the implementations it has, out of :data:`dispatch.IMPLEMENTATIONS`.
    gpu_order: the order ``None`` tries on GPUs (one of the ``*_GPU_ORDER`` rules above).
      On CPUs (and TPUs) ``None`` is always ``"xla"``: Pallas runs there only in interpret
      mode, which is for tests.
  """

  name: str
  implementations: tuple[str, ...]
  gpu_order: tuple[str, ...] = KERNEL_GPU_ORDER

  def __post_init__(self):
    unknown = set(self.implementations) - set(dispatch.IMPLEMENTATIONS)
    if unknown or "xla" not in self.implementations:
      raise ValueError(f"Op {self.name}: implementations must include 'xla' and be among "
                       f"{dispatch.IMPLEMENTATIONS}, got {self.implementations}")

  @property
  def preference(self) -> Mapping[str, Sequence[str]]:
    order = [i for i in self.gpu_order if i in self.implementations]
    if not dispatch.pallas_triton_current() and "pallas" in order:
      order.remove("pallas")
      if "triton" in order:   # the Triton kernels take Pallas' place
        order.remove("triton")
        order.insert(list(self.gpu_order).index("pallas"), "triton")
    return {"gpu": tuple(order), "cpu": ("xla",), "tpu": ("xla",)}

  def resolve(self, implementation: str | None) -> str:
    """The implementation this op runs with (see :func:`dispatch.resolve` for the errors)."""
    return dispatch.resolve(self.name, implementation, self.implementations, self.preference)

  def backend(self, implementation: str | None) -> dict:
    """``{"impl": ..., "interpret": ...}``: the fields of :class:`Config` for this call."""
    impl = self.resolve(implementation)
    return {"impl": impl, "interpret": impl == "pallas" and not dispatch.on_gpu()}


@dataclasses.dataclass(frozen=True)
class Config:
  """The non-differentiable arguments of an op's custom_vjp: hashable, compared by value.

  Each op subclasses it with its own static fields (an activation, eps, tile sizes, ...).
  """

  impl: str
  interpret: bool


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
    if rule is None:
      return kernel(*args)
    return partitioning.partitioned_call(kernel, rule, *args)

  @call.defjvp
  def call_jvp(primals, tangents):
    _, tangent_out = jax.jvp(twin, primals, tangents)
    return call(*primals), tangent_out

  return call(*args)
