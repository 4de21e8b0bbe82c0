"""Named elementwise activations (defined with the kernels, :mod:`jaxfuse.kernels.activations`).

Example:
  >>> import jax.numpy as jnp
  >>> from jaxfuse.ops import activations
  >>> activations.get("silu")(jnp.array([0.0, 1.0]))
  Array([0.       , 0.7310586], dtype=float32)
"""

from jaxfuse.kernels.activations import (ACTIVATIONS, Activation, canonical, erf,
                                         erfc_nonnegative, gelu, gelu_tanh, get, identity,
                                         name_of, normal_cdf, silu, squared_relu, tanh)

__all__ = ["ACTIVATIONS", "Activation", "canonical", "erf", "erfc_nonnegative", "gelu",
           "gelu_tanh", "get", "identity", "name_of", "normal_cdf", "silu", "squared_relu",
           "tanh"]
