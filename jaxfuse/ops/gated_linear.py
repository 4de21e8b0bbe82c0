"""Gated linear units, ``act(a) * b``, fused, keeping only the inputs for the backward pass.

SwiGLU is ``act="silu"`` (LLaMA's ``F.silu(gate_proj(x)) * up_proj(x)``), GEGLU ``"gelu"`` or
``"gelu_tanh"``, ReGLU ``"relu"``. The forward reads ``a`` and ``b`` and writes the product. The
backward recomputes ``act(a)`` from the inputs and writes ``da = g * b * act'(a)`` and
``db = g * act(a)``: nothing but the inputs is kept between the passes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxfuse.kernels.pallas import gated_linear as pallas_gated_linear
from jaxfuse.ops import activation_grads, activations, checks, dispatch

_IMPLEMENTATIONS = ("pallas", "triton", "xla")
_PREFERENCE = {"gpu": ("pallas", "triton", "xla"), "cpu": ("xla",)}


def _compute_dtype(dtype):
  return jnp.promote_types(dtype, jnp.float32)


def _split(x):
  h = x.shape[-1] // 2
  return x[..., :h], x[..., h:]


def glu_reference(a: jax.Array, b: jax.Array | None = None,
                  act: str | Callable = "silu") -> jax.Array:
  """Plain-jnp ``act(a) * b`` (packed ``a = [a | b]`` when ``b`` is None), in float32."""
  if b is None or isinstance(b, str) or callable(b):
    act = "silu" if b is None else b
    a, b = _split(a)
  fn = activations.get(act, arg="act")
  cd = _compute_dtype(a.dtype)
  return (fn(a.astype(cd)) * b.astype(cd)).astype(a.dtype)


def _check(op, a, b):
  if b is None:
    checks.floating(op, "x", a)
    if a.ndim == 0 or a.shape[-1] % 2:
      raise ValueError(f"{op}: x must have an even last axis (it is split into [a | b]), got "
                       f"shape {tuple(a.shape)}")
    return
  checks.floating(op, "a", a)
  checks.floating(op, "b", b)
  checks.same_shape(op, ("a", "b"), (a, b))
  checks.same_dtype(op, ("a", "b"), (a, b))
  if a.ndim == 0:
    raise ValueError(f"{op}: a must have rank >= 1, got shape ()")


def _resolve(op, act, implementation):
  impl = dispatch.resolve(op, implementation, _IMPLEMENTATIONS, _PREFERENCE)
  if impl == "triton":
    from jaxfuse.kernels.triton import gated_linear as triton_gated_linear

    if activations.name_of(act) not in triton_gated_linear.ACTIVATIONS:
      raise ValueError(f"{op}: implementation='triton' supports the named activations "
                       f"{triton_gated_linear.ACTIVATIONS}, got act={act!r}")
  return impl


def glu(a: jax.Array, b: jax.Array | str | Callable | None = None,
        act: str | Callable = "silu", *, implementation: str | None = None) -> jax.Array:
  """The gated linear unit ``act(a) * b``, fused forward and backward; keeps only its inputs.

  Two forms:

  - ``glu(a, b, act)``: ``a`` (the gate) and ``b`` (the value) are arrays of one shape;
  - ``glu(x, act)`` or ``glu(x, act=...)``: packed, ``x = [a | b]`` on the last axis, which is
    split in half: ``act(x[..., :h]) * x[..., h:]``. Note that ``torch.nn.functional.glu`` gates
    the other way round (``x[..., :h] * sigmoid(x[..., h:])``); here the gate comes first, as in
    fused ``[gate | up]`` projections.

  Args:
    a: the gate, a float array (float32, bfloat16 or float16); or packed ``x``.
    b: the value, same shape and dtype as ``a``; or, for the packed form, the activation (or
      None).
    act: ``"silu"`` (SwiGLU), ``"gelu"`` / ``"gelu_tanh"`` (GEGLU), ``"relu"`` (ReGLU), another
      name from :data:`jaxfuse.ops.activations.ACTIVATIONS`, or an elementwise jnp function
      (not with ``implementation="triton"``).
    implementation: ``None`` (the fastest here), ``"pallas"``, ``"triton"`` or ``"xla"``.

  Returns:
    ``act(a) * b`` in the dtype of ``a``; for the packed form the last axis is halved.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxfuse.ops import glu
    >>> gate, up = jnp.array([0.0, 2.0]), jnp.array([3.0, 0.5])
    >>> glu(gate, up, "relu")
    Array([0., 1.], dtype=float32)
    >>> glu(jnp.concatenate([gate, up]), "relu")
    Array([0., 1.], dtype=float32)
  """
  op = "glu"
  if isinstance(b, str) or callable(b):
    act, b = b, None
  _check(op, a, b)
  fn = activations.get(act, arg="act")
  impl = _resolve(op, act, implementation)
  interpret = impl == "pallas" and not dispatch.on_gpu()
  name = activations.name_of(act)
  with jax.named_scope(f"jaxfuse.glu[{name or 'fn'}]"):
    if b is None:
      return _glu_packed(a, fn, name, impl, interpret)
    return _glu(a, b, fn, name, impl, interpret)


def _rows(x):
  return x.reshape(-1, x.shape[-1])


def _forward(a, b, fn, name, impl, interpret):
  """``act(a) * b``; packed ``a`` when ``b`` is None."""
  shape = a.shape[:-1] + ((a.shape[-1] // 2,) if b is None else (a.shape[-1],))
  if impl == "pallas":
    y = pallas_gated_linear.glu_forward(_rows(a), None if b is None else _rows(b), fn,
                                        interpret=interpret)
    return y.reshape(shape)
  if impl == "triton":
    from jaxfuse.kernels.triton import gated_linear as triton_gated_linear

    y = triton_gated_linear.glu_forward(_rows(a), None if b is None else _rows(b), name)
    return y.reshape(shape)
  if b is None:
    a, b = _split(a)
  cd = _compute_dtype(a.dtype)
  return (activation_grads.value(fn, a.astype(cd)) * b.astype(cd)).astype(a.dtype)


def _backward(a, b, g, fn, name, impl, interpret):
  """``(da, db)``; for packed ``a`` (``b`` None), ``dx = [da | db]``."""
  if impl in ("pallas", "triton"):
    args = (_rows(a), None if b is None else _rows(b), _rows(g))
    if impl == "pallas":
      out = pallas_gated_linear.glu_backward(*args, fn, interpret=interpret)
    else:
      from jaxfuse.kernels.triton import gated_linear as triton_gated_linear

      out = triton_gated_linear.glu_backward(*args, name)
    if b is None:
      return out.reshape(a.shape)
    return out[0].reshape(a.shape), out[1].reshape(b.shape)
  packed = b is None
  if packed:
    a, b = _split(a)
  da, db = _xla_backward(a, b, g, fn)
  if packed:
    return jnp.concatenate([da, db], axis=-1)
  return da, db


def _xla_backward(a, b, g, fn):
  """``da = g * b * act'(a)`` and ``db = g * act(a)``, each one fused loop over the inputs.

  The activation is recomputed in each loop. The barriers keep XLA from computing it once and
  sharing it (between the two gradients, or with the forward pass): XLA:CPU would then write it
  to memory and read it back in three more loops, which measures about 1.5x slower here.
  """
  cd = _compute_dtype(a.dtype)
  a1, b1, g1 = jax.lax.optimization_barrier((a, b, g))
  _, grad = activation_grads.value_and_grad(fn, a1.astype(cd))
  da = g1.astype(cd) * b1.astype(cd) * grad
  a2, g2 = jax.lax.optimization_barrier((a, g))
  db = g2.astype(cd) * activation_grads.value(fn, a2.astype(cd))
  return da.astype(a.dtype), db.astype(b.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _glu(a, b, fn, name, impl, interpret):
  return _forward(a, b, fn, name, impl, interpret)


def _glu_fwd(a, b, fn, name, impl, interpret):
  # Residuals: the inputs only; act(a) is recomputed in the backward.
  return _forward(a, b, fn, name, impl, interpret), (a, b)


def _glu_bwd(fn, name, impl, interpret, residuals, g):
  a, b = residuals
  return _backward(a, b, g, fn, name, impl, interpret)


_glu.defvjp(_glu_fwd, _glu_bwd, optimize_remat=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _glu_packed(x, fn, name, impl, interpret):
  return _forward(x, None, fn, name, impl, interpret)


def _glu_packed_fwd(x, fn, name, impl, interpret):
  # Residual: the input only.
  return _forward(x, None, fn, name, impl, interpret), x


def _glu_packed_bwd(fn, name, impl, interpret, x, g):
  return (_backward(x, None, g, fn, name, impl, interpret),)


_glu_packed.defvjp(_glu_packed_fwd, _glu_packed_bwd, optimize_remat=True)
