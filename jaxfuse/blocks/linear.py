"""Linear layers over arrays: the recomputed linear of the seed (torch's ``[out, in]`` weight)
and the projection a decoder's ``Linear`` layers compute (a flax ``[in, out]`` kernel).

Example:
  >>> import jax.numpy as jnp
  >>> from jaxfuse.blocks import linear
  >>> x, weight = jnp.ones((2, 3), jnp.bfloat16), jnp.ones((4, 3))
  >>> [a.dtype.name for a in linear.cast(x, weight, None)[:2]]   # promoted, as flax does
  ['float32', 'float32']
  >>> linear.recompute_linear(x, weight, jnp.zeros(4)).shape
  (2, 4)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxfuse.ops import dense
from jaxfuse.ops import linear as linear_ops

HIGHEST = jax.lax.Precision.HIGHEST


def cast(x: jax.Array, weight: jax.Array, bias: jax.Array | None, dtype: Any = None) -> tuple:
  """``(x, weight, bias)`` in ``dtype`` (default: ``x`` and the weight promoted)."""
  dtype = dtype or jnp.result_type(x, weight)
  return x.astype(dtype), weight.astype(dtype), None if bias is None else bias.astype(dtype)


def recompute_linear(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None, *,
                     dtype: Any = None, implementation: str | None = None) -> jax.Array:
  """``x @ weight.T + bias`` (weight ``[out, in]``) that keeps only its inputs for the backward
  pass (:func:`jaxfuse.ops.recompute_linear`), in ``dtype`` (see :func:`cast`)."""
  return linear_ops.recompute_linear(*cast(x, weight, bias, dtype),
                                     implementation=implementation)


def project(x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None, *,
            precision=HIGHEST) -> jax.Array:
  """``x @ kernel + bias`` (kernel ``[in, out]``) in ``x``'s dtype with jaxfuse's
  :func:`jaxfuse.ops.dense` (its weight gradient in XLA:CPU's fast layout)."""
  bias = None if bias is None else bias.astype(x.dtype)
  return dense(x, kernel.astype(x.dtype), bias, precision=precision)
