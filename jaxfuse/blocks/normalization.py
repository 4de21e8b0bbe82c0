"""Normalization blocks: LayerNorm and RMSNorm over the last axis, alone or after a residual add.

A norm's ``kind`` is :data:`LAYER` (scale and bias) or :data:`RMS` (a scale only). The NNX and
Linen modules cast their arrays by their own framework's dtype rules, then call these.

Example:
  >>> import jax.numpy as jnp
  >>> from jaxfuse.blocks import normalization
  >>> x = jnp.array([[2.0, -2.0]])
  >>> normalization.normalize(normalization.RMS, x, None, epsilon=0.0)
  Array([[ 1., -1.]], dtype=float32)
  >>> normed, total = normalization.add_normalize(normalization.LAYER, x, x, None, None,
  ...                                             epsilon=0.0)
  >>> normed, total
  (Array([[ 1., -1.]], dtype=float32), Array([[ 4., -4.]], dtype=float32))
"""

from __future__ import annotations

import jax

from jaxfuse.ops import normalization as ops

LAYER = "layer"
RMS = "rms"


def normalize(kind: str, x: jax.Array, scale: jax.Array | None, bias: jax.Array | None = None,
              *, epsilon: float, implementation: str | None = None) -> jax.Array:
  """``kind`` normalization of ``x`` over its last axis (RMSNorm takes no ``bias``)."""
  if kind == RMS:
    return ops.rms_norm(x, scale, eps=epsilon, implementation=implementation)
  return ops.layer_norm(x, scale, bias, eps=epsilon, implementation=implementation)


def add_normalize(kind: str, x: jax.Array, residual: jax.Array, scale: jax.Array | None,
                  bias: jax.Array | None = None, *, epsilon: float,
                  implementation: str | None = None) -> tuple[jax.Array, jax.Array]:
  """``(norm(x + residual), x + residual)`` in one kernel: a pre-norm block's step."""
  if kind == RMS:
    return ops.add_rms_norm(x, residual, scale, eps=epsilon, implementation=implementation)
  return ops.add_layer_norm(x, residual, scale, bias, eps=epsilon,
                            implementation=implementation)


def check_options(owner: str, x: jax.Array, module, mask: jax.Array | None) -> None:
  """Raises ``NotImplementedError`` for the Flax options (``reduction_axes``,
  ``feature_axes``, ``axis_name``, ``mask``) of ``module`` that the ops do not cover."""
  ops.check_module_options(owner, jax.numpy.ndim(x), reduction_axes=module.reduction_axes,
                           feature_axes=module.feature_axes, axis_name=module.axis_name,
                           mask=mask)
