"""The seed's kernel-fusion example: ``fn(a + b)`` in one kernel, and the unfused chain beside it.

Fused, the forward reads ``a`` and ``b`` and writes the result: 3 arrays of HBM traffic instead of
5 for an add kernel followed by an ``fn`` kernel (which writes ``a + b`` and reads it back). The
backward is one kernel too: it keeps only the inputs and recomputes ``a + b`` there, so nothing
beyond the inputs stays alive between the passes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxfuse.kernels.pallas import elementwise as pallas_elementwise
from jaxfuse.ops import activation_grads, activations, base, checks, partitioning

ADD_ACT = base.Op("add_act", ("pallas", "triton", "xla"), base.ELEMENTWISE_GPU_ORDER)
ADD_ACT_UNFUSED = base.Op("add_act_unfused", ("pallas", "triton", "xla"),
                          ("pallas", "triton", "xla"))
RELU = base.Op("relu", ("pallas", "triton", "xla"), base.ELEMENTWISE_GPU_ORDER)


# Reference --------------------------------------------------------------------------------------


def add_act_reference(a: jax.Array, b: jax.Array, fn: str | Callable = "relu") -> jax.Array:
  """Plain-jnp ``fn(a + b)``, computed in float32 for low-precision inputs."""
  fn = activations.get(fn, op="add_act_reference")
  cd = base.compute_dtype(a.dtype)
  return fn(a.astype(cd) + b.astype(cd)).astype(a.dtype)


# Checks -----------------------------------------------------------------------------------------


def _check(op, a, b):
  checks.floating(op, "a", a)
  checks.floating(op, "b", b)
  checks.same_shape(op, ("a", "b"), (a, b))
  checks.same_dtype(op, ("a", "b"), (a, b))


@dataclasses.dataclass(frozen=True)
class _Config(base.Config):
  fn: Callable
  name: str | None   # the activation's registry name (the Triton kernels take names only)


def _config(op: base.Op, fn, implementation) -> _Config:
  fn_callable = activations.get(fn, op=op.name)
  cfg = _Config(**op.backend(implementation), fn=fn_callable, name=activations.name_of(fn))
  if cfg.impl == "triton":
    from jaxfuse.kernels.triton import elementwise as triton_elementwise

    if cfg.name not in triton_elementwise.ACTIVATIONS:
      raise ValueError(f"{op.name}: implementation='triton' supports the named activations "
                       f"{triton_elementwise.ACTIVATIONS}, got fn={fn!r}")
  return cfg


# The op -----------------------------------------------------------------------------------------


def add_act(a: jax.Array, b: jax.Array, fn: str | Callable = "relu", *,
            implementation: str | None = None) -> jax.Array:
  """``fn(a + b)`` elementwise, fused into one kernel forward and one backward.

  Args:
    a: a float array (float32, bfloat16 or float16) of any shape.
    b: an array of the same shape and dtype (broadcasting is rejected).
    fn: an activation name from :data:`jaxfuse.ops.activations.ACTIVATIONS` (``"relu"``,
      ``"gelu"``, ``"silu"``, ...) or any elementwise jnp function. The Pallas kernel takes any
      function it can lower; the Triton kernel takes the names only.
    implementation: ``None`` (XLA: it fuses this chain by itself), ``"pallas"``, ``"triton"``
      or ``"xla"``.

  Returns:
    ``fn(a + b)`` in the dtype of ``a``. Low-precision inputs are added and activated in float32
    and rounded once.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxfuse.ops import add_act
    >>> add_act(jnp.array([1.0, -2.0]), jnp.array([0.5, 1.0]), "relu")
    Array([1.5, 0. ], dtype=float32)
  """
  _check(ADD_ACT.name, a, b)
  cfg = _config(ADD_ACT, fn, implementation)
  with jax.named_scope(f"jaxfuse.add_act[{cfg.name or 'fn'}]"):
    return _add_act(a, b, cfg)


# Forward and backward ---------------------------------------------------------------------------


def _elementwise(operands, x):
  """The kernels' partitioning: elementwise, every axis may be split."""
  return partitioning.elementwise_rule(operands, 1, x.ndim)


def _xla_forward(a, b, fn):
  cd = base.compute_dtype(a.dtype)
  return activation_grads.value(fn, a.astype(cd) + b.astype(cd)).astype(a.dtype)


def _xla_backward(a, b, g, fn):
  cd = base.compute_dtype(a.dtype)
  _, grad = activation_grads.value_and_grad(fn, a.astype(cd) + b.astype(cd))
  return (g.astype(cd) * grad).astype(a.dtype)


def _forward(a, b, cfg):
  twin = functools.partial(_xla_forward, fn=cfg.fn)
  if cfg.impl == "pallas":
    kernel = functools.partial(pallas_elementwise.add_act_forward, fn=cfg.fn,
                               interpret=cfg.interpret)
    return base.kernel_call(kernel, twin, a, b, rule=_elementwise(2, a))
  if cfg.impl == "triton":
    from jaxfuse.kernels.triton import elementwise as triton_elementwise

    kernel = functools.partial(triton_elementwise.add_act_forward, act=cfg.name)
    return base.kernel_call(kernel, twin, a, b, rule=_elementwise(2, a))
  return twin(a, b)


def _backward(a, b, g, cfg):
  twin = functools.partial(_xla_backward, fn=cfg.fn)
  if cfg.impl == "pallas":
    kernel = functools.partial(pallas_elementwise.add_act_backward, fn=cfg.fn,
                               interpret=cfg.interpret)
    return base.kernel_call(kernel, twin, a, b, g, rule=_elementwise(3, a))
  if cfg.impl == "triton":
    from jaxfuse.kernels.triton import elementwise as triton_elementwise

    kernel = functools.partial(triton_elementwise.add_act_backward, act=cfg.name)
    return base.kernel_call(kernel, twin, a, b, g, rule=_elementwise(3, a))
  return twin(a, b, g)


# The custom VJP ---------------------------------------------------------------------------------


@partitioning.matching_vma
@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _add_act(a, b, cfg):
  return _forward(a, b, cfg)


def _add_act_fwd(a, b, cfg):
  # Residuals: the inputs only. a + b is recomputed in the backward kernel.
  return _forward(a, b, cfg), (a, b)


def _add_act_bwd(cfg, residuals, g):
  # The barrier keeps XLA from merging the recomputed a + b (and fn's intermediates) with the
  # forward's: merged, XLA:CPU materializes the shared intermediates (19 arrays of traffic
  # instead of 11 for gelu, measured).
  a, b = jax.lax.optimization_barrier(residuals)
  da = _backward(a, b, g, cfg)
  return da, da


_add_act.defvjp(_add_act_fwd, _add_act_bwd)


# The unfused chain ------------------------------------------------------------------------------


def add_act_unfused(a: jax.Array, b: jax.Array, fn: str | Callable = "relu", *,
                    implementation: str | None = None) -> jax.Array:
  """The baseline the fusion is measured against: an add kernel, then an ``fn`` kernel.

  ``c = a + b`` is written to memory and read back, and the backward keeps ``c`` alive, as two
  separately written kernels would. With ``implementation="xla"`` an optimization barrier keeps
  the two apart on GPUs (XLA:CPU drops barriers and fuses them anyway).

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxfuse.ops import add_act_unfused
    >>> add_act_unfused(jnp.array([1.0, -2.0]), jnp.array([0.5, 1.0]), "relu")
    Array([1.5, 0. ], dtype=float32)
  """
  _check(ADD_ACT_UNFUSED.name, a, b)
  cfg = _config(ADD_ACT_UNFUSED, fn, implementation)
  c = _add(a, b, cfg)
  if cfg.impl == "xla":
    c = jax.lax.optimization_barrier(c)
  return _act(c, cfg)


def _xla_add(a, b):
  return a + b


def _xla_act(c, fn):
  cd = base.compute_dtype(c.dtype)
  return fn(c.astype(cd)).astype(c.dtype)


def _xla_act_backward(c, g, fn):
  cd = base.compute_dtype(c.dtype)
  return jax.vjp(fn, c.astype(cd))[1](g.astype(cd))[0].astype(c.dtype)


def _add_forward(a, b, cfg):
  if cfg.impl == "pallas":
    kernel = functools.partial(pallas_elementwise.add_forward, interpret=cfg.interpret)
    return base.kernel_call(kernel, _xla_add, a, b, rule=_elementwise(2, a))
  if cfg.impl == "triton":
    from jaxfuse.kernels.triton import elementwise as triton_elementwise

    return base.kernel_call(triton_elementwise.add_forward, _xla_add, a, b,
                            rule=_elementwise(2, a))
  return _xla_add(a, b)


@partitioning.matching_vma
@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _add(a, b, cfg):
  return _add_forward(a, b, cfg)


def _add_fwd(a, b, cfg):
  # Nothing kept: the gradient of a sum is the cotangent itself.
  return _add_forward(a, b, cfg), None


def _add_bwd(cfg, _, g):
  return g, g


_add.defvjp(_add_fwd, _add_bwd)


def _act_forward(c, cfg):
  twin = functools.partial(_xla_act, fn=cfg.fn)
  if cfg.impl == "pallas":
    kernel = functools.partial(pallas_elementwise.act_forward, fn=cfg.fn,
                               interpret=cfg.interpret)
    return base.kernel_call(kernel, twin, c, rule=_elementwise(1, c))
  if cfg.impl == "triton":
    from jaxfuse.kernels.triton import elementwise as triton_elementwise

    kernel = functools.partial(triton_elementwise.act_forward, act=cfg.name)
    return base.kernel_call(kernel, twin, c, rule=_elementwise(1, c))
  return twin(c)


@partitioning.matching_vma
@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _act(c, cfg):
  return _act_forward(c, cfg)


def _act_fwd(c, cfg):
  # Residual: the sum c, written by the add kernel and kept, as a two-kernel chain does.
  return _act_forward(c, cfg), c


def _act_bwd(cfg, c, g):
  twin = functools.partial(_xla_act_backward, fn=cfg.fn)
  if cfg.impl == "pallas":
    kernel = functools.partial(pallas_elementwise.act_backward, fn=cfg.fn,
                               interpret=cfg.interpret)
    return (base.kernel_call(kernel, twin, c, g, rule=_elementwise(2, c)),)
  if cfg.impl == "triton":
    from jaxfuse.kernels.triton import elementwise as triton_elementwise

    kernel = functools.partial(triton_elementwise.act_backward, act=cfg.name)
    return (base.kernel_call(kernel, twin, c, g, rule=_elementwise(2, c)),)
  return (twin(c, g),)


_act.defvjp(_act_fwd, _act_bwd)


# relu that keeps its output ---------------------------------------------------------------------


def relu(x: jax.Array, *, implementation: str | None = None) -> jax.Array:
  """``max(x, 0)`` whose backward reads its output, as torch's relu does.

  ``jax.nn.relu`` keeps its input (and a mask) for the backward. When the next layer keeps the
  relu's output anyway (a linear layer keeps its input), reading the mask off that output means
  the relu adds nothing to what stays alive.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxfuse.ops import relu
    >>> relu(jnp.array([-1.0, 2.0]))
    Array([0., 2.], dtype=float32)
  """
  checks.floating(RELU.name, "x", x)
  return _relu(x, base.Config(**RELU.backend(implementation)))


def _xla_relu(x):
  return jnp.maximum(x, jnp.zeros_like(x))


def _xla_relu_backward(y, g):
  return jnp.where(y > 0, g, jnp.zeros_like(g))


def _relu_forward(x, cfg):
  if cfg.impl == "pallas":
    kernel = functools.partial(pallas_elementwise.act_forward, fn=jax.nn.relu,
                               interpret=cfg.interpret)
    return base.kernel_call(kernel, _xla_relu, x, rule=_elementwise(1, x))
  if cfg.impl == "triton":
    from jaxfuse.kernels.triton import elementwise as triton_elementwise

    kernel = functools.partial(triton_elementwise.act_forward, act="relu")
    return base.kernel_call(kernel, _xla_relu, x, rule=_elementwise(1, x))
  return _xla_relu(x)


@partitioning.matching_vma
@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _relu(x, cfg):
  return _relu_forward(x, cfg)


def _relu_fwd(x, cfg):
  # Residual: the output (the next layer usually keeps it anyway).
  y = _relu_forward(x, cfg)
  return y, y


def _relu_bwd(cfg, y, g):
  if cfg.impl == "pallas":
    kernel = functools.partial(pallas_elementwise.relu_backward_from_output,
                               interpret=cfg.interpret)
    return (base.kernel_call(kernel, _xla_relu_backward, y, g, rule=_elementwise(2, y)),)
  if cfg.impl == "triton":
    from jaxfuse.kernels.triton import elementwise as triton_elementwise

    return (base.kernel_call(triton_elementwise.relu_backward_from_output, _xla_relu_backward,
                             y, g, rule=_elementwise(2, y)),)
  return (_xla_relu_backward(y, g),)


_relu.defvjp(_relu_fwd, _relu_bwd)
