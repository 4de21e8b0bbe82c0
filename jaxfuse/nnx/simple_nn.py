"""The seed's model: a recomputed fc1, relu, then an ordinary fc2."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfuse.blocks.simple_nn import (RECOMPUTE_CHOICES,  # noqa: F401 (re-exported)
                                       check_recompute, simple_nn_block)
from jaxfuse.blocks.torch_names import SIMPLE_NN_TORCH_PARAMS
from jaxfuse.nnx.linear import RecomputeLinear
from jaxfuse.ops.elementwise import relu
from jaxfuse.remat import recompute as recompute_fn


class SimpleNN(nnx.Module):
  """``fc2(relu(fc1(x)))`` with a choice of what the backward pass keeps.

  ``recompute`` selects the memory layout:

  - ``None``: plain autodiff. ``jax.nn.relu`` keeps its input's sign mask and fc2 keeps the relu
    output.
  - ``"fc1"`` (the seed's layout): fc1 is :class:`RecomputeLinear`, which keeps only its inputs,
    and the relu reads its mask off its own output (as torch's does), which fc2 keeps anyway:
    what stays alive is the relu output alone.
  - ``"block"``: fc1, relu and fc2 run as one recomputed region (:func:`jaxfuse.recompute`) that
    keeps only its input; all three are recomputed in the backward pass.

  Parameters: ``fc1.weight`` ``[hidden, in]``, ``fc1.bias`` ``[hidden]`` (torch's ``fc1_weight``,
  ``fc1_bias``), ``fc2.kernel`` ``[hidden, out]`` (torch's ``fc2.weight`` transposed),
  ``fc2.bias`` ``[out]``. See :mod:`jaxfuse.interop` to load or export a torch state dict.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxfuse.nnx import SimpleNN
    >>> model = SimpleNN(8, 32, 4, recompute="block", rngs=nnx.Rngs(0))
    >>> model(jnp.ones((2, 8))).shape
    (2, 4)
  """

  def __init__(self, input_size: int, hidden_size: int, output_size: int, *,
               recompute: str | None = "fc1", dtype=None, param_dtype=jnp.float32,
               implementation: str | None = None, rngs: nnx.Rngs):
    check_recompute(recompute)
    self.input_size, self.hidden_size, self.output_size = input_size, hidden_size, output_size
    self.recompute = recompute
    self.dtype = dtype
    self.fc1 = RecomputeLinear(input_size, hidden_size, dtype=dtype, param_dtype=param_dtype,
                               implementation=implementation, rngs=rngs)
    self.fc2 = nnx.Linear(hidden_size, output_size, dtype=dtype, param_dtype=param_dtype,
                          precision=jax.lax.Precision.HIGHEST, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    if self.recompute == "fc1":
      return self.fc2(relu(self.fc1(x)))
    x, w1, b1 = self.fc1.arrays(x)
    w2 = self.fc2.kernel[...].astype(x.dtype)
    b2 = self.fc2.bias[...].astype(x.dtype)
    block = recompute_fn(simple_nn_block) if self.recompute == "block" else simple_nn_block
    return block(x, w1, b1, w2, b2)

  TORCH_PARAMS = SIMPLE_NN_TORCH_PARAMS
