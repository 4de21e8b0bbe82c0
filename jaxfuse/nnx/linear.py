"""NNX linear layers over :mod:`jaxfuse.ops.linear`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfuse.blocks import linear
from jaxfuse.blocks.torch_names import recompute_linear_torch_params

# Weight is [out, in] (torch's layout): fan-in is the last axis.
default_weight_init = nnx.initializers.lecun_normal(in_axis=-1, out_axis=-2)


class RecomputeLinear(nnx.Module):
  """``x @ weight.T + bias`` that keeps only its inputs for the backward pass.

  Parameters (torch ``nn.Linear`` names and layout): ``weight`` ``[out_features, in_features]``
  and ``bias`` ``[out_features]``, so a torch state dict loads without transposes.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxfuse.nnx import RecomputeLinear
    >>> layer = RecomputeLinear(3, 4, rngs=nnx.Rngs(0))
    >>> layer.weight.shape, layer(jnp.ones((2, 3))).shape   # torch's [out, in] weight
    ((4, 3), (2, 4))
  """

  def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True,
               dtype=None, param_dtype=jnp.float32, weight_init=default_weight_init,
               bias_init=nnx.initializers.zeros_init(), implementation: str | None = None,
               rngs: nnx.Rngs):
    self.in_features = in_features
    self.out_features = out_features
    self.dtype = dtype
    self.implementation = implementation
    self.weight = nnx.Param(weight_init(rngs.params(), (out_features, in_features), param_dtype))
    self.bias = (nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype))
                 if use_bias else nnx.data(None))

  def arrays(self, x: jax.Array):
    """``(x, weight, bias)`` cast to the computation dtype."""
    bias = None if self.bias is None else self.bias[...]
    return linear.cast(x, self.weight[...], bias, self.dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    return linear.recompute_linear(*self.arrays(x), implementation=self.implementation)

  @property
  def TORCH_PARAMS(self) -> dict:  # noqa: N802 (the name every module's map has)
    """``weight`` and ``bias`` under torch ``nn.Linear``'s names, in its layout.

    Example:
      >>> from flax import nnx
      >>> from jaxfuse.nnx import RecomputeLinear
      >>> RecomputeLinear(3, 4, use_bias=False, rngs=nnx.Rngs(0)).TORCH_PARAMS
      {('weight',): ('weight', False)}
    """
    return recompute_linear_torch_params(self.bias is not None)
