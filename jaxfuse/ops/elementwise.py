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

from jaxfuse.kernels.pallas import elementwise as pallas_elementwise
from jaxfuse.ops import activation_grads, activations, checks, dispatch

_IMPLEMENTATIONS = ("pallas", "triton", "xla")
# XLA fuses elementwise chains on GPUs as well as a hand-written kernel does, without a launch
# of its own; the Pallas kernel is there to show and measure the fusion explicitly.
_PREFERENCE = {"gpu": ("xla", "pallas"), "cpu": ("xla",)}


def _compute_dtype(dtype):
  return jnp.promote_types(dtype, jnp.float32)


def add_act_reference(a: jax.Array, b: jax.Array, fn: str | Callable = "relu") -> jax.Array:
  """Plain-jnp ``fn(a + b)``, computed in float32 for low-precision inputs."""
  fn = activations.get(fn)
  cd = _compute_dtype(a.dtype)
  return fn(a.astype(cd) + b.astype(cd)).astype(a.dtype)


def _check(op, a, b):
  checks.floating(op, "a", a)
  checks.floating(op, "b", b)
  checks.same_shape(op, ("a", "b"), (a, b))
  checks.same_dtype(op, ("a", "b"), (a, b))


def _resolve(op, fn, implementation):
  impl = dispatch.resolve(op, implementation, _IMPLEMENTATIONS, _PREFERENCE)
  if impl == "triton":
    from jaxfuse.kernels.triton import elementwise as triton_elementwise

    name = activations.name_of(fn)
    if name not in triton_elementwise.ACTIVATIONS:
      raise ValueError(f"{op}: implementation='triton' supports the named activations "
                       f"{triton_elementwise.ACTIVATIONS}, got fn={fn!r}")
  return impl


def add_act(a: jax.Array, b: jax.Array, fn: str | Callable = "relu", *,
            implementation: str | None = None) -> jax.Array:
  """``fn(a + b)`` elementwise, fused into one kernel forward and one backward.

  Args:
    a: a float array (float32, bfloat16 or float16) of any shape.
    b: an array of the same shape and dtype (broadcasting is rejected).
    fn: an activation name from :data:`jaxfuse.ops.activations.ACTIVATIONS` (``"relu"``,
      ``"gelu"``, ``"silu"``, ...) or any elementwise jnp function. The Pallas kernel takes any
      function it can lower; the Triton kernel takes the names only.
    implementation: ``None`` (the fastest here), ``"pallas"``, ``"triton"`` or ``"xla"``.

  Returns:
    ``fn(a + b)`` in the dtype of ``a``. Low-precision inputs are added and activated in float32
    and rounded once.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxfuse.ops import add_act
    >>> add_act(jnp.array([1.0, -2.0]), jnp.array([0.5, 1.0]), "relu")
    Array([1.5, 0. ], dtype=float32)
  """
  op = "add_act"
  _check(op, a, b)
  fn_callable = activations.get(fn)
  impl = _resolve(op, fn, implementation)
  interpret = impl == "pallas" and not dispatch.on_gpu()
  name = activations.name_of(fn)
  with jax.named_scope(f"jaxfuse.add_act[{name or 'fn'}]"):
    return _add_act(a, b, fn_callable, name, impl, interpret)


def _forward(a, b, fn, name, impl, interpret):
  if impl == "pallas":
    return pallas_elementwise.add_act_forward(a, b, fn, interpret=interpret)
  if impl == "triton":
    from jaxfuse.kernels.triton import elementwise as triton_elementwise

    return triton_elementwise.add_act_forward(a, b, name)
  cd = _compute_dtype(a.dtype)
  return activation_grads.value(fn, a.astype(cd) + b.astype(cd)).astype(a.dtype)


def _backward_kernel(a, b, g, fn, name, impl, interpret):
  if impl == "pallas":
    return pallas_elementwise.add_act_backward(a, b, g, fn, interpret=interpret)
  if impl == "triton":
    from jaxfuse.kernels.triton import elementwise as triton_elementwise

    return triton_elementwise.add_act_backward(a, b, g, name)
  cd = _compute_dtype(a.dtype)
  _, grad = activation_grads.value_and_grad(fn, a.astype(cd) + b.astype(cd))
  return (g.astype(cd) * grad).astype(a.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _add_act(a, b, fn, name, impl, interpret):
  return _forward(a, b, fn, name, impl, interpret)


def _add_act_fwd(a, b, fn, name, impl, interpret):
  # Residuals: the inputs only. a + b is recomputed in the backward kernel.
  return _forward(a, b, fn, name, impl, interpret), (a, b)


def _add_act_bwd(fn, name, impl, interpret, residuals, g):
  # The barrier keeps XLA from merging the recomputed a + b (and fn's intermediates) with the
  # forward's: merged, XLA:CPU materializes the shared intermediates (19 arrays of traffic
  # instead of 11 for gelu, measured).
  a, b = jax.lax.optimization_barrier(residuals)
  da = _backward_kernel(a, b, g, fn, name, impl, interpret)
  return da, da


_add_act.defvjp(_add_act_fwd, _add_act_bwd, optimize_remat=True)


# The unfused chain ------------------------------------------------------------------------------

_UNFUSED_IMPLEMENTATIONS = ("pallas", "xla")


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
  op = "add_act_unfused"
  _check(op, a, b)
  fn_callable = activations.get(fn)
  impl = dispatch.resolve(op, implementation, _UNFUSED_IMPLEMENTATIONS,
                          {"gpu": ("pallas",), "cpu": ("xla",)})
  interpret = impl == "pallas" and not dispatch.on_gpu()
  c = _add(a, b, impl, interpret)
  if impl == "xla":
    c = jax.lax.optimization_barrier(c)
  return _act(c, fn_callable, impl, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _add(a, b, impl, interpret):
  if impl == "pallas":
    return pallas_elementwise.add_forward(a, b, interpret=interpret)
  return a + b


def _add_fwd(a, b, impl, interpret):
  return _add(a, b, impl, interpret), None


def _add_bwd(impl, interpret, _, g):
  return g, g


_add.defvjp(_add_fwd, _add_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _act(c, fn, impl, interpret):
  if impl == "pallas":
    return pallas_elementwise.act_forward(c, fn, interpret=interpret)
  cd = _compute_dtype(c.dtype)
  return fn(c.astype(cd)).astype(c.dtype)


def _act_fwd(c, fn, impl, interpret):
  return _act(c, fn, impl, interpret), c


def _act_bwd(fn, impl, interpret, c, g):
  if impl == "pallas":
    return (pallas_elementwise.act_backward(c, g, fn, interpret=interpret),)
  cd = _compute_dtype(c.dtype)
  return (jax.vjp(fn, c.astype(cd))[1](g.astype(cd))[0].astype(c.dtype),)


_act.defvjp(_act_fwd, _act_bwd)


# relu that keeps its output ------------------------------------------------------------------------


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
  op = "relu"
  checks.floating(op, "x", x)
  impl = dispatch.resolve(op, implementation, _UNFUSED_IMPLEMENTATIONS, _PREFERENCE)
  interpret = impl == "pallas" and not dispatch.on_gpu()
  return _relu(x, impl, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _relu(x, impl, interpret):
  if impl == "pallas":
    return pallas_elementwise.act_forward(x, jax.nn.relu, interpret=interpret)
  return jnp.maximum(x, jnp.zeros_like(x))


def _relu_fwd(x, impl, interpret):
  y = _relu(x, impl, interpret)
  return y, y


def _relu_bwd(impl, interpret, y, g):
  if impl == "pallas":
    return (pallas_elementwise.relu_backward_from_output(y, g, interpret=interpret),)
  return (jnp.where(y > 0, g, jnp.zeros_like(g)),)


_relu.defvjp(_relu_fwd, _relu_bwd)
