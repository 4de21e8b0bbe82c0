"""The seed's kernel-fusion example: ``fn(a + b)`` in one kernel, and the unfused chain beside it.

Fused, the forward reads ``a`` and ``b`` and writes the result: 3 arrays of HBM traffic instead of
5 for an add kernel followed by an ``fn`` kernel (which writes ``a + b`` and reads it back). The
backward is one kernel too: it keeps only the inputs and recomputes ``a + b`` there, so nothing
beyond the inputs stays alive between the passes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxfuse.ops import activation_grads, activations, base, checks, partitioning

ADD_ACT = base.Op("add_act", "elementwise", base.ELEMENTWISE_GPU_ORDER)
ADD_ACT_UNFUSED = base.Op("add_act_unfused", "elementwise", base.KERNEL_GPU_ORDER)
RELU = base.Op("relu", "elementwise", base.ELEMENTWISE_GPU_ORDER)


# Reference --------------------------------------------------------------------------------------


def add_act_reference(a: jax.Array, b: jax.Array, activation: str | Callable = "relu", *,
                      fn: str | Callable | None = None) -> jax.Array:
  """Plain-jnp ``activation(a + b)``, computed in float32 for low-precision inputs."""
  activation = checks.renamed("add_act_reference", "fn", "activation", fn, activation)
  return activations.of_sum(activation, a, b, op="add_act_reference")


# Checks -----------------------------------------------------------------------------------------


def _check(op, a, b):
  checks.floating(op, "a", a)
  checks.floating(op, "b", b)
  checks.same_shape(op, ("a", "b"), (a, b))
  checks.same_dtype(op, ("a", "b"), (a, b))


def _prepare(op: base.Op, a, b, activation, fn, implementation) -> tuple:
  """The checked call's config, and its named scope."""
  activation = checks.renamed(op.name, "fn", "activation", fn, activation)
  _check(op.name, a, b)
  cfg = activations.config(op, activation, implementation)
  return cfg, activations.scope(op, cfg)


# The op -----------------------------------------------------------------------------------------


def add_act(a: jax.Array, b: jax.Array, activation: str | Callable = "relu", *,
            implementation: str | None = None, fn: str | Callable | None = None) -> jax.Array:
  """``activation(a + b)`` elementwise, fused into one kernel forward and one backward.

  Args:
    a: a float array (float32, bfloat16 or float16) of any shape.
    b: an array of the same shape and dtype (broadcasting is rejected).
    activation: an activation name from :data:`jaxfuse.ops.activations.ACTIVATIONS`
      (``"relu"``, ``"gelu"``, ``"silu"``, ...) or any elementwise jnp function. The Pallas
      kernel takes any function it can lower; the Triton kernel takes the names only.
    implementation: ``None`` (XLA: it fuses this chain by itself), ``"pallas"``, ``"triton"``
      or ``"xla"``.
    fn: the former name of ``activation`` (deprecated).

  Returns:
    ``activation(a + b)`` in the dtype of ``a``. Low-precision inputs are added and activated
    in float32 and rounded once.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxfuse.ops import add_act
    >>> add_act(jnp.array([1.0, -2.0]), jnp.array([0.5, 1.0]), "relu")
    Array([1.5, 0. ], dtype=float32)
  """
  cfg, scope = _prepare(ADD_ACT, a, b, activation, fn, implementation)
  with jax.named_scope(scope):
    return _add_act(cfg, a, b)


# Forward and backward ---------------------------------------------------------------------------


def _elementwise(operands, x):
  """The kernels' partitioning: elementwise, every axis may be split."""
  return partitioning.elementwise_rule(operands, 1, x.ndim)


def _xla_forward(a, b, activation):
  cd = base.compute_dtype(a.dtype)
  return activation_grads.value(activation, a.astype(cd) + b.astype(cd)).astype(a.dtype)


def _xla_backward(a, b, g, activation):
  cd = base.compute_dtype(a.dtype)
  _, grad = activation_grads.value_and_grad(activation, a.astype(cd) + b.astype(cd))
  return (g.astype(cd) * grad).astype(a.dtype)


def _forward(a, b, cfg):
  twin = functools.partial(_xla_forward, activation=cfg.activation)
  return cfg.run("add_act_forward", twin, a, b, rule=_elementwise(2, a),
                 activation=cfg.activation)


def _backward(a, b, g, cfg):
  twin = functools.partial(_xla_backward, activation=cfg.activation)
  return cfg.run("add_act_backward", twin, a, b, g, rule=_elementwise(3, a),
                 activation=cfg.activation)


# The custom VJP ---------------------------------------------------------------------------------


def _add_act_backward(cfg, a, b, g):
  da = _backward(a, b, g, cfg)
  return da, da


# Residuals: the inputs only; a + b is recomputed in the backward kernel, behind a barrier that
# keeps XLA from merging it (and the activation's intermediates) with the forward's: merged,
# XLA:CPU materializes the shared intermediates (19 arrays of traffic instead of 11 for gelu,
# measured).
_add_act = base.recomputing_vjp(lambda cfg, a, b: _forward(a, b, cfg), _add_act_backward,
                                barrier=True)


# The unfused chain ------------------------------------------------------------------------------


def add_act_unfused(a: jax.Array, b: jax.Array, activation: str | Callable = "relu", *,
                    implementation: str | None = None,
                    fn: str | Callable | None = None) -> jax.Array:
  """The baseline the fusion is measured against: an add kernel, then an ``activation`` kernel.

  ``c = a + b`` is written to memory and read back, and the backward keeps ``c`` alive, as two
  separately written kernels would. With ``implementation="xla"`` an optimization barrier keeps
  the two apart on GPUs (XLA:CPU drops barriers and fuses them anyway). ``fn`` is the former
  name of ``activation`` (deprecated).

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxfuse.ops import add_act_unfused
    >>> add_act_unfused(jnp.array([1.0, -2.0]), jnp.array([0.5, 1.0]), "relu")
    Array([1.5, 0. ], dtype=float32)
  """
  cfg, scope = _prepare(ADD_ACT_UNFUSED, a, b, activation, fn, implementation)
  with jax.named_scope(scope):
    return _act(cfg, _add(a, b, cfg))


def _xla_add(a, b):
  return a + b


def _xla_add_apart(a, b):
  """``a + b`` kept apart from its consumer (XLA's own fusion would merge the chain)."""
  return jax.lax.optimization_barrier(a + b)


def _xla_act(c, activation):
  cd = base.compute_dtype(c.dtype)
  return activations.get(activation)(c.astype(cd)).astype(c.dtype)


def _xla_act_backward(c, g, activation):
  cd = base.compute_dtype(c.dtype)
  fn = activations.get(activation)
  return jax.vjp(fn, c.astype(cd))[1](g.astype(cd))[0].astype(c.dtype)


def _add_forward(a, b, cfg):
  # On XLA the barrier stands where the add kernel's output would be written.
  return cfg.run("add_forward", _xla_add, a, b, rule=_elementwise(2, a), xla=_xla_add_apart)


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
  twin = functools.partial(_xla_act, activation=cfg.activation)
  return cfg.run("act_forward", twin, c, rule=_elementwise(1, c), activation=cfg.activation)


def _act_backward(cfg, c, g):
  twin = functools.partial(_xla_act_backward, activation=cfg.activation)
  return (cfg.run("act_backward", twin, c, g, rule=_elementwise(2, c),
                  activation=cfg.activation),)


# Residual: the sum c, written by the add kernel and kept, as a two-kernel chain does.
_act = base.recomputing_vjp(lambda cfg, c: _act_forward(c, cfg), _act_backward)


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
  return _relu(x, activations.config(RELU, "relu", implementation))


def _xla_relu(x):
  return jnp.maximum(x, jnp.zeros_like(x))


def _xla_relu_backward(y, g):
  return jnp.where(y > 0, g, jnp.zeros_like(g))


def _relu_forward(x, cfg):
  return cfg.run("act_forward", _xla_relu, x, rule=_elementwise(1, x), activation="relu")


@partitioning.matching_vma
@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _relu(x, cfg):
  return _relu_forward(x, cfg)


def _relu_fwd(x, cfg):
  # Residual: the output (the next layer usually keeps it anyway).
  y = _relu_forward(x, cfg)
  return y, y


def _relu_bwd(cfg, y, g):
  return (cfg.run("relu_backward_from_output", _xla_relu_backward, y, g,
                  rule=_elementwise(2, y)),)


_relu.defvjp(_relu_fwd, _relu_bwd)
