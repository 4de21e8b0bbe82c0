"""Linen linear layers over :mod:`jaxfuse.ops.linear`."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import linen as nn

from jaxfuse.blocks import linear
from jaxfuse.blocks.torch_names import recompute_linear_torch_params

default_weight_init = nn.initializers.lecun_normal(in_axis=-1, out_axis=-2)


class RecomputeLinear(nn.Module):
  """``x @ weight.T + bias`` that keeps only its inputs for the backward pass.

  Parameters (torch ``nn.Linear`` names and layout): ``weight`` ``[features, in]``, ``bias``
  ``[features]``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxfuse.linen import RecomputeLinear
    >>> layer = RecomputeLinear(4)
    >>> params = layer.init(jax.random.key(0), jnp.ones((2, 3)))
    >>> params["params"]["weight"].shape
    (4, 3)
  """

  features: int
  use_bias: bool = True
  dtype: Any = None
  param_dtype: Any = jnp.float32
  weight_init: Callable = default_weight_init
  bias_init: Callable = nn.initializers.zeros_init()
  implementation: str | None = None

  @nn.compact
  def arrays(self, x: jax.Array):
    """Creates (or reads) the parameters; returns ``(x, weight, bias)`` in the compute dtype."""
    weight = self.param("weight", self.weight_init, (self.features, x.shape[-1]),
                        self.param_dtype)
    bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) \
        if self.use_bias else None
    return linear.cast(x, weight, bias, self.dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    return linear.recompute_linear(*self.arrays(x), implementation=self.implementation)

  @property
  def TORCH_PARAMS(self) -> dict:  # noqa: N802 (the name every module's map has)
    """``weight`` and ``bias`` (with ``use_bias``) under torch ``nn.Linear``'s names and
    layout."""
    return recompute_linear_torch_params(self.use_bias)
