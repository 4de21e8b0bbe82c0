"""The seed's model in Linen: a recomputed fc1, relu, then an ordinary fc2."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from jaxfuse.blocks.simple_nn import check_recompute, simple_nn_block
from jaxfuse.blocks.torch_names import SIMPLE_NN_TORCH_PARAMS
from jaxfuse.linen.linear import RecomputeLinear
from jaxfuse.ops.elementwise import relu
from jaxfuse.remat import recompute as recompute_fn


class SimpleNN(nn.Module):
  """``fc2(relu(fc1(x)))``; ``recompute`` is ``None``, ``"fc1"`` or ``"block"``.

  The same layouts and parameter names as the NNX ``SimpleNN`` (``fc1/weight``
  ``[hidden, in]``, ``fc1/bias``, ``fc2/kernel`` ``[hidden, out]``, ``fc2/bias``); the input
  size is taken from the input.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxfuse.linen import SimpleNN
    >>> model = SimpleNN(hidden_size=32, output_size=4, recompute="fc1")
    >>> variables = model.init(jax.random.key(0), jnp.ones((2, 8)))
    >>> model.apply(variables, jnp.ones((2, 8))).shape
    (2, 4)
  """

  hidden_size: int
  output_size: int
  recompute: str | None = "fc1"
  dtype: Any = None
  param_dtype: Any = jnp.float32
  implementation: str | None = None

  def setup(self):
    check_recompute(self.recompute)
    self.fc1 = RecomputeLinear(self.hidden_size, dtype=self.dtype, param_dtype=self.param_dtype,
                               implementation=self.implementation)
    self.fc2 = nn.Dense(self.output_size, dtype=self.dtype, param_dtype=self.param_dtype,
                        precision=jax.lax.Precision.HIGHEST)

  def __call__(self, x: jax.Array) -> jax.Array:
    if self.recompute == "fc1":
      return self.fc2(relu(self.fc1(x)))
    x, w1, b1 = self.fc1.arrays(x)
    if self.is_initializing():
      self.fc2(jnp.zeros((1, self.hidden_size), x.dtype))  # creates fc2's parameters
    w2 = self.fc2.variables["params"]["kernel"].astype(x.dtype)
    b2 = self.fc2.variables["params"]["bias"].astype(x.dtype)
    block = recompute_fn(simple_nn_block) if self.recompute == "block" else simple_nn_block
    return block(x, w1, b1, w2, b2)

  TORCH_PARAMS = SIMPLE_NN_TORCH_PARAMS
