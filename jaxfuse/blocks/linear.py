"""Linear layers over arrays: the recomputed linear of the seed (torch's ``[out, in]`` weight)
and the projection a decoder's ``Linear`` layers compute (a flax ``[in, out]`` kernel), with a
LoRA :class:`Adapter` where one is given.

Example:
  >>> import jax.numpy as jnp
  >>> from jaxfuse.blocks import linear
  >>> x, weight = jnp.ones((2, 3), jnp.bfloat16), jnp.ones((4, 3))
  >>> [a.dtype.name for a in linear.cast(x, weight, None)[:2]]   # promoted, as flax does
  ['float32', 'float32']
  >>> linear.recompute_linear(x, weight, jnp.zeros(4)).shape
  (2, 4)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxfuse.ops import dense, lora_dense
from jaxfuse.ops import linear as linear_ops

HIGHEST = jax.lax.Precision.HIGHEST


def cast(x: jax.Array, weight: jax.Array, bias: jax.Array | None, dtype: Any = None) -> tuple:
  """``(x, weight, bias)`` in ``dtype`` (default: ``x`` and the weight promoted)."""
  dtype = dtype or jnp.result_type(x, weight)
  return x.astype(dtype), weight.astype(dtype), None if bias is None else bias.astype(dtype)


def recompute_linear(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None, *,
                     dtype: Any = None, implementation: str | None = None) -> jax.Array:
  """``x @ weight.T + bias`` (weight ``[out, in]``) that keeps only its inputs for the backward
  pass (:func:`jaxfuse.ops.recompute_linear`), in ``dtype`` (see :func:`cast`)."""
  return linear_ops.recompute_linear(*cast(x, weight, bias, dtype),
                                     implementation=implementation)


@functools.partial(jax.tree_util.register_dataclass, data_fields=("lora_a", "lora_b"),
                   meta_fields=("scale",))
@dataclasses.dataclass(frozen=True)
class Adapter:
  """A LoRA adapter of a projection: ``lora_a`` ``[..., in, rank]``, ``lora_b``
  ``[..., rank, out]`` and ``scale`` (``alpha / rank``). A pytree whose ``scale`` is static, so
  that it passes through ``jax.checkpoint`` and ``jax.lax.scan`` as a Python number.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxfuse.blocks.linear import Adapter
    >>> adapter = Adapter(jnp.ones((3, 2)), jnp.zeros((2, 4)), scale=2.0)
    >>> len(jax.tree.leaves(adapter)), adapter.rank
    (2, 2)
  """

  lora_a: jax.Array
  lora_b: jax.Array
  scale: float

  @property
  def rank(self) -> int:
    return self.lora_a.shape[-1]

  def astype(self, dtype) -> Adapter:
    """Its arrays in ``dtype`` (the computation's)."""
    return Adapter(self.lora_a.astype(dtype), self.lora_b.astype(dtype), self.scale)

  def delta(self, x: jax.Array, precision=HIGHEST) -> jax.Array:
    """``scale * (x @ lora_a) @ lora_b`` from plain ``jnp`` products in ``x``'s dtype: the
    unfused baseline's adapter term."""
    a, b = self.astype(x.dtype).lora_a, self.astype(x.dtype).lora_b
    return self.scale * jnp.matmul(jnp.matmul(x, a, precision=precision), b,
                                   precision=precision)


def project(x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None, *,
            precision=HIGHEST, adapter: Adapter | None = None) -> jax.Array:
  """``x @ kernel + bias`` (kernel ``[in, out]``) in ``x``'s dtype with jaxfuse's
  :func:`jaxfuse.ops.dense` (its weight gradient in XLA:CPU's fast layout); with an
  ``adapter``, plus ``scale * (x @ lora_a) @ lora_b`` in the same op
  (:func:`jaxfuse.ops.lora_dense`, which keeps ``x @ lora_a`` and never the output).

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxfuse.blocks.linear import Adapter, project
    >>> x, kernel = jnp.ones((2, 3)), jnp.zeros((3, 4))
    >>> project(x, kernel, adapter=Adapter(jnp.ones((3, 1)), jnp.ones((1, 4)), 0.5))[0]
    Array([1.5, 1.5, 1.5, 1.5], dtype=float32)
  """
  bias = None if bias is None else bias.astype(x.dtype)
  kernel = kernel.astype(x.dtype)
  if adapter is None:
    return dense(x, kernel, bias, precision=precision)
  adapter = adapter.astype(x.dtype)
  return lora_dense(x, kernel, adapter.lora_a, adapter.lora_b, bias, scale=adapter.scale,
                    precision=precision)
