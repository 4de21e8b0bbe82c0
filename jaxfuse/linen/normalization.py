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

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.linen import dtypes

from jaxfuse.blocks import normalization
from jaxfuse.blocks.torch_names import norm_torch_params


class _LastAxisNorm:
  """The call both norms share: flax's fields come from the flax class each one extends (so
  they are flax's, in flax's order: a drop-in), the computation from
  :mod:`jaxfuse.blocks.normalization`."""

  KIND: str
  implementation: str | None

  def _normalize(self, x: jax.Array, mask: jax.Array | None) -> jax.Array:
    normalization.check_options(type(self).__name__, x, self, mask)
    features = (jnp.shape(x)[-1],)
    scale = (self.param("scale", self.scale_init, features, self.param_dtype)
             if self.use_scale else None)
    bias = (self.param("bias", self.bias_init, features, self.param_dtype)
            if getattr(self, "use_bias", False) else None)
    # flax computes in (at least) the inputs' promoted dtype and returns its canonical dtype.
    present = [p for p in (scale, bias) if p is not None]
    out_dtype = dtypes.canonicalize_dtype(x, *present, dtype=self.dtype)
    x = jnp.asarray(x, jnp.result_type(x, *present))
    y = normalization.normalize(self.KIND, x, scale, bias, epsilon=self.epsilon,
                                implementation=self.implementation)
    return y.astype(out_dtype)

  @property
  def TORCH_PARAMS(self) -> dict:  # noqa: N802 (the name every module's map has)
    """``scale`` and ``bias`` (with ``use_scale``, ``use_bias``) as ``torch.nn.LayerNorm`` /
    ``torch.nn.RMSNorm`` name them: ``weight`` and ``bias``."""
    return norm_torch_params(self.use_scale, getattr(self, "use_bias", False))


class LayerNorm(_LastAxisNorm, nn.LayerNorm):
  """Layer normalization over the last axis (as ``flax.linen.LayerNorm``).

  Attributes: those of ``flax.linen.LayerNorm``, and ``implementation`` (``None``, ``"pallas"``
  or ``"xla"``, see :func:`jaxfuse.ops.layer_norm`).
  """

  KIND = normalization.LAYER
  implementation: str | None = None

  @nn.compact
  def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
    return self._normalize(x, mask)


class RMSNorm(_LastAxisNorm, nn.RMSNorm):
  """RMS normalization over the last axis (as ``flax.linen.RMSNorm``).

  Attributes: those of ``flax.linen.RMSNorm``, and ``implementation`` (``None``, ``"pallas"``,
  ``"triton"`` or ``"xla"``, see :func:`jaxfuse.ops.rms_norm`).
  """

  KIND = normalization.RMS
  implementation: str | None = None

  @nn.compact
  def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
    return self._normalize(x, mask)
