"""The seed's model over arrays: fc1 (torch's ``[hidden, in]`` weight), relu, fc2 (a flax
``[hidden, out]`` kernel), and the choices of what its backward keeps (``recompute=``):

- ``None``: plain autodiff (keeps fc1's input, the relu's output and nothing more, as torch);
- ``"fc1"`` (the seed's layout): fc1 keeps only its inputs, the relu reads its mask off its
  output, which fc2 keeps anyway;
- ``"block"``: the three run as one recomputed region that keeps only its input.

Example:
  >>> import jax.numpy as jnp
  >>> from jaxfuse.blocks.simple_nn import simple_nn_block
  >>> x, w1, b1 = jnp.ones((2, 3)), jnp.ones((5, 3)), jnp.zeros(5)
  >>> simple_nn_block(x, w1, b1, jnp.ones((5, 4)), jnp.zeros(4))
  Array([[15., 15., 15., 15.],
         [15., 15., 15., 15.]], dtype=float32)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfuse.ops import linear as linear_ops
from jaxfuse.ops.elementwise import relu

RECOMPUTE_CHOICES = (None, "fc1", "block")


def check_recompute(recompute) -> None:
  """Raises ``ValueError`` unless ``recompute`` is one of :data:`RECOMPUTE_CHOICES`."""
  if recompute not in RECOMPUTE_CHOICES:
    raise ValueError(f"recompute must be one of {RECOMPUTE_CHOICES}, got {recompute!r}")


def simple_nn_block(x, w1, b1, w2, b2):
  """fc1 (weight ``[hidden, in]``), relu, fc2 (kernel ``[hidden, out]``) in plain jnp, but for
  the relu, whose backward reads its mask off its output (:func:`jaxfuse.ops.relu`, as torch's
  does): fc2 keeps that output anyway, so the relu keeps nothing of its own (``jax.nn.relu``
  would keep a boolean mask of the hidden width)."""
  h = relu(linear_ops.linear_reference(x, w1, b1))
  precision = jax.lax.Precision.HIGHEST if h.dtype == jnp.float32 else None
  return jnp.dot(h, w2, precision=precision) + b2
