"""Named elementwise activations (defined with the kernels, :mod:`jaxfuse.kernels.activations`),
and what the ops with an activation share: their config and the reference of ``fn(a + b)``.

Example:
  >>> import jax.numpy as jnp
  >>> from jaxfuse.ops import activations
  >>> activations.get("silu")(jnp.array([0.0, 1.0]))
  Array([0.       , 0.7310586], dtype=float32)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from jaxfuse.kernels.activations import (ACTIVATIONS, Activation, canonical, erf,
                                         erfc_nonnegative, gelu, gelu_tanh, get, identity,
                                         name_of, normal_cdf, silu, squared_relu, tanh)
from jaxfuse.ops import base

__all__ = ["ACTIVATIONS", "Activation", "Config", "canonical", "config", "erf",
           "erfc_nonnegative", "gelu", "gelu_tanh", "get", "identity", "name_of", "normal_cdf",
           "of_sum", "silu", "squared_relu", "tanh"]


@dataclasses.dataclass(frozen=True)
class Config(base.Config):
  """The static config of an op with an activation: its name when it has one (the Triton
  kernels take names only), else the function."""

  activation: str | Callable


def config(op: base.Op, activation, implementation) -> Config:
  """The call's config: the activation checked (an unknown name raises, naming ``op``) and
  the implementation resolved (a kernel set without the activation is skipped or refused)."""
  activation = canonical(activation, op=op.name)
  return op.config(implementation, Config, facts={"activation": activation},
                   activation=activation)


def scope(op: base.Op, cfg: Config) -> str:
  """The named scope of a call: the op and its activation."""
  return f"jaxfuse.{op.name}[{name_of(cfg.activation) or 'fn'}]"


def of_sum(activation, a: jax.Array, b: jax.Array, *, op: str) -> jax.Array:
  """Plain-jnp ``activation(a + b)`` (``b`` may broadcast), computed in float32 for
  low-precision inputs and rounded once: the references of add_act and bias_act."""
  fn = get(activation, op=op)
  cd = base.compute_dtype(a.dtype)
  return fn(a.astype(cd) + b.astype(cd)).astype(a.dtype)
