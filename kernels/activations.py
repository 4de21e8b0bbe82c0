"""Named elementwise activations, written so that Pallas can lower them for GPUs.

They live with the kernels (their bodies call them) and are re-exported as
:mod:`jaxfuse.ops.activations`. An op's kernels take an activation as its name (the Triton
kernels take names only) or, for Pallas and XLA, any elementwise jnp function.

Each matches its PyTorch namesake: ``"gelu"`` is the exact (erf) GELU, as ``F.gelu`` by default,
and ``"gelu_tanh"`` is ``F.gelu(approximate="tanh")``. Pallas' Triton lowering has no ``erf``, so
``gelu`` carries its own normal CDF (from an erfc fit with fractional error below 1.2e-7) and an
analytic derivative.

Example:
  >>> import jax.numpy as jnp
  >>> from jaxfuse.ops import activations
  >>> activations.get("silu")(jnp.array([0.0, 1.0]))
  Array([0.       , 0.7310586], dtype=float32)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

Activation = Callable[[jax.Array], jax.Array]

_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)

# erfc(z) for z >= 0 with fractional error below 1.2e-7 everywhere (Numerical Recipes' erfcc,
# a Chebyshev fit). Fractional accuracy matters in the tails: gelu(x) = x * erfc(-x/sqrt2) / 2 for
# negative x, where 1 + erf(x) would cancel.
_ERFC_COEFFICIENTS = (0.17087277, -0.82215223, 1.48851587, -1.13520398, 0.27886807, -0.18628806,
                      0.09678418, 0.37409196, 1.00002368, -1.26551223)


def erfc_nonnegative(z: jax.Array) -> jax.Array:
  """erfc(z) for z >= 0 from exp, multiplies and one divide (so it lowers inside GPU kernels)."""
  t = 1.0 / (1.0 + 0.5 * z)
  poly = jnp.full_like(z, _ERFC_COEFFICIENTS[0])
  for c in _ERFC_COEFFICIENTS[1:]:
    poly = poly * t + c
  return t * jnp.exp(poly - z * z)


def erf(x: jax.Array) -> jax.Array:
  """erf built on :func:`erfc_nonnegative`; absolute error below 1.2e-7."""
  return jnp.sign(x) * (1.0 - erfc_nonnegative(jnp.abs(x)))


def normal_cdf(x: jax.Array) -> jax.Array:
  """Phi(x) with fractional error below 1.2e-7, also deep in the lower tail."""
  half_tail = 0.5 * erfc_nonnegative(jnp.abs(x) * _INV_SQRT2)
  return jnp.where(x < 0, half_tail, 1.0 - half_tail)


@jax.custom_jvp
def gelu(x: jax.Array) -> jax.Array:
  """Exact GELU, ``x * Phi(x)``, as ``torch.nn.functional.gelu(x)``.

  ``gelu(+inf)`` is ``+inf`` (its limit) where torch's CPU kernel returns NaN.
  """
  return x * normal_cdf(x)


@gelu.defjvp
def _gelu_jvp(primals, tangents):
  (x,), (t,) = primals, tangents
  cdf = normal_cdf(x)
  pdf = _INV_SQRT_2PI * jnp.exp(-0.5 * x * x)
  return x * cdf, t * (cdf + x * pdf)


@jax.custom_jvp
def tanh(x: jax.Array) -> jax.Array:
  """tanh from ``expm1``: within 2 ulp in float32 (XLA:CPU's own tanh is off by up to 4e-7)."""
  m = jnp.expm1(-2.0 * jnp.abs(x))
  t = -m / (2.0 + m)
  return jnp.where(x < 0, -t, t)


@tanh.defjvp
def _tanh_jvp(primals, tangents):
  (x,), (dx,) = primals, tangents
  t = tanh(x)
  return t, dx * (1.0 - t * t)


def gelu_tanh(x: jax.Array) -> jax.Array:
  """Tanh-approximated GELU, as ``F.gelu(x, approximate="tanh")``."""
  return 0.5 * x * (1.0 + tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def silu(x: jax.Array) -> jax.Array:
  """``x * sigmoid(x)``, as ``F.silu``."""
  return x * jax.nn.sigmoid(x)


def squared_relu(x: jax.Array) -> jax.Array:
  """``relu(x) ** 2`` (Primer)."""
  r = jax.nn.relu(x)
  return r * r


def identity(x: jax.Array) -> jax.Array:
  return x


ACTIVATIONS: dict[str, Activation] = {
    "relu": jax.nn.relu,
    "gelu": gelu,
    "gelu_tanh": gelu_tanh,
    "silu": silu,
    "sigmoid": jax.nn.sigmoid,
    "tanh": tanh,
    "squared_relu": squared_relu,
    "identity": identity,
}


def get(activation: str | Activation, *, arg: str = "activation",
        op: str | None = None) -> Activation:
  """Returns the activation named ``activation``, or ``activation`` itself when callable.

  Raises:
    ValueError: it is neither; the message names ``op`` and its argument ``arg``.
  """
  if callable(activation):
    return activation
  if isinstance(activation, str) and activation in ACTIVATIONS:
    return ACTIVATIONS[activation]
  where = f"{op}: " if op else ""
  raise ValueError(f"{where}{arg} must be a callable or one of {sorted(ACTIVATIONS)}, "
                   f"got {activation!r}")


def name_of(activation: str | Activation) -> str | None:
  """The registry name of ``activation``, or None for a user's callable."""
  if isinstance(activation, str):
    return activation if activation in ACTIVATIONS else None
  for name, candidate in ACTIVATIONS.items():
    if candidate is activation:
      return name
  return None


def canonical(activation: str | Activation, *, arg: str = "activation",
              op: str | None = None) -> str | Activation:
  """``activation`` as the kernels take it: its name when it has one, else the callable
  (checked: an unknown name raises as :func:`get` does)."""
  fn = get(activation, arg=arg, op=op)
  return name_of(activation) or fn
