"""Flax Linen ``LayerNorm`` and ``RMSNorm`` over jaxfuse's fused normalization ops.

Drop-in for ``flax.linen.LayerNorm`` / ``flax.linen.RMSNorm``: the same fields, the same
parameters (``scale`` and ``bias``, shape ``(features,)``) and the same result dtype. The
backward pass keeps the input and float32 per-row statistics, not the normalized output.
Normalization is over the last axis; other ``reduction_axes`` / ``feature_axes``, ``axis_name``
and ``mask`` raise ``NotImplementedError``. Statistics are always float32 with a numerically
stable variance, so ``use_fast_variance`` and ``force_float32_reductions`` change nothing.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jaxfuse.linen import LayerNorm
  >>> x = jnp.array([[1.0, 3.0]])
  >>> norm = LayerNorm(epsilon=0.0)
  >>> params = norm.init(jax.random.key(0), x)
  >>> norm.apply(params, x)
  Array([[-1.,  1.]], dtype=float32)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.linen import dtypes
from jax.nn import initializers

from jaxfuse.ops import normalization as ops


def _inputs(x, params, dtype):
  """x cast to the dtype flax computes in (at least the inputs' promoted dtype), and the result
  dtype flax returns."""
  present = [p for p in params if p is not None]
  out_dtype = dtypes.canonicalize_dtype(x, *present, dtype=dtype)
  compute = jnp.result_type(x, *present)
  return jnp.asarray(x, compute), out_dtype


def _norm_params(use_scale: bool, use_bias: bool) -> dict:
  """The torch map of a norm's parameters: ``scale`` is ``weight``, ``bias`` is ``bias``."""
  params = {("scale",): ("weight", False)} if use_scale else {}
  if use_bias:
    params[("bias",)] = ("bias", False)
  return params


def _checked_scale(module, x, mask):
  """Rejects the options jaxfuse does not take; creates the module's scale (None if unused).
  The field declarations stay in each class: they are flax's, in flax's order (drop-in)."""
  ops.check_module_options(type(module).__name__, jnp.ndim(x),
                           reduction_axes=module.reduction_axes,
                           feature_axes=module.feature_axes, axis_name=module.axis_name, mask=mask)
  if not module.use_scale:
    return None
  return module.param("scale", module.scale_init, (jnp.shape(x)[-1],), module.param_dtype)


class LayerNorm(nn.Module):
  """Layer normalization over the last axis (as ``flax.linen.LayerNorm``).

  Attributes: those of ``flax.linen.LayerNorm``, and ``implementation`` (``None``, ``"pallas"``
  or ``"xla"``, see :func:`jaxfuse.ops.layer_norm`).
  """

  epsilon: float = 1e-6
  dtype: Any = None
  param_dtype: Any = jnp.float32
  use_bias: bool = True
  use_scale: bool = True
  bias_init: Any = initializers.zeros
  scale_init: Any = initializers.ones
  reduction_axes: Any = -1
  feature_axes: Any = -1
  axis_name: str | None = None
  axis_index_groups: Any = None
  use_fast_variance: bool = True
  force_float32_reductions: bool = True
  implementation: str | None = None

  @nn.compact
  def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
    scale = _checked_scale(self, x, mask)
    bias = (self.param("bias", self.bias_init, (jnp.shape(x)[-1],), self.param_dtype)
            if self.use_bias else None)
    x, out_dtype = _inputs(x, (scale, bias), self.dtype)
    y = ops.layer_norm(x, scale, bias, eps=self.epsilon, implementation=self.implementation)
    return y.astype(out_dtype)

  @property
  def TORCH_PARAMS(self) -> dict:  # noqa: N802 (the name every module's map has)
    """``scale`` and ``bias`` (with ``use_scale``, ``use_bias``) as ``torch.nn.LayerNorm``
    names them: ``weight`` and ``bias``."""
    return _norm_params(self.use_scale, self.use_bias)


class RMSNorm(nn.Module):
  """RMS normalization over the last axis (as ``flax.linen.RMSNorm``).

  Attributes: those of ``flax.linen.RMSNorm``, and ``implementation`` (``None``, ``"pallas"``,
  ``"triton"`` or ``"xla"``, see :func:`jaxfuse.ops.rms_norm`).
  """

  epsilon: float = 1e-6
  dtype: Any = None
  param_dtype: Any = jnp.float32
  use_scale: bool = True
  scale_init: Any = initializers.ones
  reduction_axes: Any = -1
  feature_axes: Any = -1
  axis_name: str | None = None
  axis_index_groups: Any = None
  use_fast_variance: bool = True
  force_float32_reductions: bool = True
  implementation: str | None = None

  @nn.compact
  def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
    scale = _checked_scale(self, x, mask)
    x, out_dtype = _inputs(x, (scale,), self.dtype)
    y = ops.rms_norm(x, scale, eps=self.epsilon, implementation=self.implementation)
    return y.astype(out_dtype)

  @property
  def TORCH_PARAMS(self) -> dict:  # noqa: N802 (the name every module's map has)
    """``scale`` (with ``use_scale``) as ``torch.nn.RMSNorm`` names it: ``weight``."""
    return _norm_params(self.use_scale, False)
