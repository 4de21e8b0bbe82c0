"""Activations with hand-written derivatives, for the XLA paths of the fused ops' backward passes.

:func:`value_and_grad` returns ``(act(x), act'(x))`` from shared intermediates: one sigmoid for
SiLU, one normal CDF (XLA's ``erf``) and one Gaussian for GELU, and for tanh-GELU one sigmoid,
since ``(1 + tanh(u)) / 2 = sigmoid(2u)`` and ``1 - tanh(u)^2 = 4 sigmoid(2u) (1 - sigmoid(2u))``
have no cancellation in the tails (XLA's own tanh rounds to -1 early there, which zeroes
gradients that torch keeps). Each agrees with its torch namesake to float32 rounding over
[-30, 30] (``tests/test_activation_grads.py``). Activations without an entry here fall back to
``jax.jvp`` of :mod:`jaxfuse.ops.activations`.

Example:
  >>> import jax.numpy as jnp
  >>> from jaxfuse.ops import activation_grads
  >>> y, dy = activation_grads.value_and_grad("relu", jnp.array([-1.0, 2.0]))
  >>> y, dy
  (Array([0., 2.], dtype=float32), Array([0., 1.], dtype=float32))
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxfuse.ops import activations

_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_TANH_GELU_K = math.sqrt(2.0 / math.pi)
_TANH_GELU_C = 0.044715


def _sigmoid_parts(z):
  """``(sigmoid(z), 1 - sigmoid(z))`` from one exp and one division, with neither cancellation
  nor overflow: with ``t = exp(-|z|)`` they are ``1 / (1 + t)`` and ``t / (1 + t)``.

  Written out rather than ``jax.nn.sigmoid``, whose XLA:CPU expansion costs about 1.5x more.
  """
  t = jnp.exp(-jnp.abs(z))
  r = 1.0 / (1.0 + t)
  tr = t * r
  positive = z >= 0
  return jnp.where(positive, r, tr), jnp.where(positive, tr, r)


def _silu(x):
  s, one_minus_s = _sigmoid_parts(x)
  return x * s, s * (1.0 + x * one_minus_s)


def _gelu(x):
  cdf = 0.5 + 0.5 * jax.lax.erf(x * _INV_SQRT2)
  return x * cdf, cdf + x * (_INV_SQRT_2PI * jnp.exp(-0.5 * x * x))


def _gelu_tanh(x):
  x2 = x * x
  s, one_minus_s = _sigmoid_parts(2.0 * _TANH_GELU_K * x * (1.0 + _TANH_GELU_C * x2))
  grad = s + x * (s * one_minus_s) * (2.0 * _TANH_GELU_K) * (1.0 + 3.0 * _TANH_GELU_C * x2)
  return x * s, grad


def _relu(x):
  positive = x > 0
  return jnp.maximum(x, 0.0), positive.astype(x.dtype)


def _squared_relu(x):
  r = jnp.maximum(x, 0.0)
  return r * r, 2.0 * r


_VALUE_AND_GRAD: dict[str, Callable[[jax.Array], tuple[jax.Array, jax.Array]]] = {
    "silu": _silu,
    "gelu": _gelu,
    "gelu_tanh": _gelu_tanh,
    "relu": _relu,
    "squared_relu": _squared_relu,
}


def value(act, x: jax.Array) -> jax.Array:
  """``act(x)`` in the same form as :func:`value_and_grad` computes it."""
  name = activations.name_of(act)
  if name in _VALUE_AND_GRAD:
    return _VALUE_AND_GRAD[name](x)[0]
  return activations.get(act, arg="act")(x)


def value_and_grad(act, x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(act(x), act'(x))`` elementwise; ``act`` is a name or a function of
  :mod:`jaxfuse.ops.activations`, or any elementwise jnp function (through ``jax.jvp``)."""
  name = activations.name_of(act)
  if name in _VALUE_AND_GRAD:
    return _VALUE_AND_GRAD[name](x)
  fn = activations.get(act, arg="act")
  return jax.jvp(fn, (x,), (jnp.ones_like(x),))
