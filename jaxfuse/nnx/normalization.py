"""Flax NNX ``LayerNorm`` and ``RMSNorm`` over jaxfuse's fused normalization ops.

Drop-in for ``flax.nnx.LayerNorm`` / ``flax.nnx.RMSNorm``: the same constructor arguments, the
same parameters (``scale`` and ``bias``, shape ``(num_features,)``) and the same dtype rules.
The backward pass keeps the input and float32 per-row statistics, not the normalized output.
Normalization is over the last axis; other ``reduction_axes`` / ``feature_axes``, ``axis_name``
and ``mask`` raise ``NotImplementedError``. Statistics are always computed in float32 with a
numerically stable variance, so ``use_fast_variance`` changes nothing.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from jaxfuse.nnx import RMSNorm
  >>> norm = RMSNorm(4, rngs=nnx.Rngs(0))
  >>> norm(jnp.array([[2.0, -2.0, 2.0, -2.0]])).round(4)  # x / sqrt(mean(x**2) + eps)
  Array([[ 1., -1.,  1., -1.]], dtype=float32)
"""

from __future__ import annotations

import typing as tp
from types import MappingProxyType

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes, initializers

from jaxfuse.blocks import normalization
from jaxfuse.blocks.torch_names import norm_torch_params


class _LastAxisNorm(nnx.Module):
  """What LayerNorm and RMSNorm share: flax's attributes, the scale, the option checks, the
  call of the block (:mod:`jaxfuse.blocks.normalization`) of the subclass's ``KIND``."""

  KIND: str

  def _setup(self, num_features, epsilon, dtype, param_dtype, use_scale, scale_init,
             scale_metadata, reduction_axes, feature_axes, axis_name, axis_index_groups,
             use_fast_variance, promote_dtype, rngs, implementation):
    self.scale = (nnx.Param(scale_init(rngs.params(), (num_features,), param_dtype),
                            **scale_metadata) if use_scale else nnx.data(None))
    self.num_features = num_features
    self.epsilon = epsilon
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.use_scale = use_scale
    self.reduction_axes = reduction_axes
    self.feature_axes = feature_axes
    self.axis_name = axis_name
    self.axis_index_groups = axis_index_groups
    self.use_fast_variance = use_fast_variance
    self.promote_dtype = promote_dtype
    self.implementation = implementation

  def _params(self) -> tuple:
    """The values of the parameters the kind takes: ``(scale,)`` or ``(scale, bias)``."""
    names = ("scale",) if self.KIND == normalization.RMS else ("scale", "bias")
    return tuple(None if getattr(self, n) is None else getattr(self, n)[...] for n in names)

  def _normalize(self, x, mask):
    normalization.check_options(type(self).__name__, x, self, mask)
    x, *params = self.promote_dtype((x, *self._params()), dtype=self.dtype)
    return normalization.normalize(self.KIND, x, *params, epsilon=self.epsilon,
                                   implementation=self.implementation)

  def add(self, x: jax.Array, residual: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(norm(x + residual), x + residual)`` in one kernel (a pre-norm block's step).

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxfuse.nnx import RMSNorm
      >>> normed, stream = RMSNorm(2, rngs=nnx.Rngs(0)).add(jnp.ones((1, 2)), jnp.ones((1, 2)))
      >>> stream
      Array([[2., 2.]], dtype=float32)
    """
    x, residual, *params = self.promote_dtype((x, residual, *self._params()), dtype=self.dtype)
    return normalization.add_normalize(self.KIND, x, residual, *params, epsilon=self.epsilon,
                                       implementation=self.implementation)

  @property
  def TORCH_PARAMS(self) -> dict:  # noqa: N802 (the name every module's map has)
    """``scale`` and ``bias`` (those the module has) as ``torch.nn.LayerNorm`` /
    ``torch.nn.RMSNorm`` name them: ``weight`` and ``bias``.

    Example:
      >>> from flax import nnx
      >>> from jaxfuse.nnx import LayerNorm
      >>> LayerNorm(8, rngs=nnx.Rngs(0)).TORCH_PARAMS
      {('scale',): ('weight', False), ('bias',): ('bias', False)}
    """
    return norm_torch_params(self.scale is not None, getattr(self, "bias", None) is not None)


class LayerNorm(_LastAxisNorm):
  """Layer normalization over the last axis (as ``flax.nnx.LayerNorm``).

  Args:
    num_features: the size of the last axis.
    epsilon: added to the variance.
    dtype: the dtype of the computation's inputs and result (default: promoted from the input
      and the parameters, as flax does).
    param_dtype: the parameters' dtype.
    use_bias, use_scale: whether to learn a bias / a scale.
    bias_init, scale_init: their initializers.
    reduction_axes, feature_axes, axis_name, axis_index_groups, use_fast_variance,
      promote_dtype, bias_metadata, scale_metadata: as in flax.
    rngs: the random number generators (one ``params`` key per parameter, as flax takes them).
    implementation: ``None``, ``"pallas"`` or ``"xla"`` (see :func:`jaxfuse.ops.layer_norm`).
  """

  KIND = normalization.LAYER

  def __init__(self, num_features: int, *, epsilon: float = 1e-6, dtype=None,
               param_dtype=jnp.float32, use_bias: bool = True, use_scale: bool = True,
               bias_init=initializers.zeros_init(), scale_init=initializers.ones_init(),
               reduction_axes=-1, feature_axes=-1, axis_name: str | None = None,
               axis_index_groups: tp.Any = None, use_fast_variance: bool = True,
               promote_dtype=dtypes.promote_dtype, rngs: nnx.Rngs,
               bias_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
               scale_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
               implementation: str | None = None):
    self._setup(num_features, epsilon, dtype, param_dtype, use_scale, scale_init, scale_metadata,
                reduction_axes, feature_axes, axis_name, axis_index_groups, use_fast_variance,
                promote_dtype, rngs, implementation)
    # After the scale, as flax draws them.
    self.bias = (nnx.Param(bias_init(rngs.params(), (num_features,), param_dtype),
                           **bias_metadata) if use_bias else nnx.data(None))
    self.use_bias = use_bias

  def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
    return self._normalize(x, mask)


class RMSNorm(_LastAxisNorm):
  """RMS normalization over the last axis (as ``flax.nnx.RMSNorm``).

  Args:
    num_features: the size of the last axis.
    epsilon: added to the mean square.
    dtype: the dtype of the computation's inputs and result (default: promoted from the input
      and the scale, as flax does).
    param_dtype: the scale's dtype.
    use_scale: whether to learn a scale.
    scale_init: its initializer.
    reduction_axes, feature_axes, axis_name, axis_index_groups, use_fast_variance,
      promote_dtype, scale_metadata: as in flax.
    rngs: the random number generators.
    implementation: ``None``, ``"pallas"``, ``"triton"`` or ``"xla"`` (see
      :func:`jaxfuse.ops.rms_norm`).
  """

  KIND = normalization.RMS

  def __init__(self, num_features: int, *, epsilon: float = 1e-6, dtype=None,
               param_dtype=jnp.float32, use_scale: bool = True,
               scale_init=initializers.ones, reduction_axes=-1, feature_axes=-1,
               axis_name: str | None = None, axis_index_groups: tp.Any = None,
               use_fast_variance: bool = True, promote_dtype=dtypes.promote_dtype,
               rngs: nnx.Rngs,
               scale_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
               implementation: str | None = None):
    self._setup(num_features, epsilon, dtype, param_dtype, use_scale, scale_init, scale_metadata,
                reduction_axes, feature_axes, axis_name, axis_index_groups, use_fast_variance,
                promote_dtype, rngs, implementation)

  def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    return self._normalize(x, mask)
