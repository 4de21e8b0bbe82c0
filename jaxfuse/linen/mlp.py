"""Flax Linen MLP blocks over jaxfuse's fused ops: ``GatedMLP`` (LLaMA's SwiGLU MLP) and ``MLP``.

The parameter tree matches :mod:`jaxfuse.nnx.mlp` (and ``flax.linen.Dense``'s layout):
``{"gate_proj": {"kernel", ["bias"]}, "up_proj": {...}, "down_proj": {...}}`` for ``GatedMLP``
and ``{"up_proj": {"kernel", "bias"}, "down_proj": {"kernel", ["bias"]}}`` for ``MLP``, kernels
``(in, out)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from jaxfuse.nnx.mlp import linear_torch_params
from jaxfuse.remat import mlp as blocks

_DEFAULT_KERNEL_INIT = nn.initializers.lecun_normal()


class _Projection(nn.Module):
  """The parameters of a ``Dense`` layer (``kernel`` and optional ``bias``), not applied."""

  in_features: int
  out_features: int
  use_bias: bool
  param_dtype: Any
  kernel_init: Callable
  bias_init: Callable

  @nn.compact
  def __call__(self):
    kernel = self.param("kernel", self.kernel_init, (self.in_features, self.out_features),
                        self.param_dtype)
    bias = None
    if self.use_bias:
      bias = self.param("bias", self.bias_init, (self.out_features,), self.param_dtype)
    return kernel, bias


def _check(module: str, recompute):
  if recompute not in blocks.RECOMPUTE:
    raise ValueError(f"{module}: recompute must be one of {blocks.RECOMPUTE}, got {recompute!r}")


class GatedMLP(nn.Module):
  """``down_proj(act(gate_proj(x)) * up_proj(x))`` with the gated unit fused.

  Attributes are those of :class:`jaxfuse.nnx.GatedMLP` (``in_features`` comes from the input).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxfuse.linen import GatedMLP
    >>> mlp = GatedMLP(hidden_features=32)
    >>> params = mlp.init(jax.random.key(0), jnp.ones((2, 8)))
    >>> mlp.apply(params, jnp.ones((2, 8))).shape
    (2, 8)
  """

  hidden_features: int
  out_features: int | None = None
  activation: str | Callable = "silu"
  use_bias: bool = False
  dtype: Any = None
  param_dtype: Any = jnp.float32
  precision: Any = jax.lax.Precision.HIGHEST
  kernel_init: Callable = _DEFAULT_KERNEL_INIT
  bias_init: Callable = nn.initializers.zeros_init()
  recompute: str | None = "activation"
  implementation: str | None = None

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    _check("GatedMLP", self.recompute)
    d = x.shape[-1]
    out = d if self.out_features is None else self.out_features
    shared = dict(use_bias=self.use_bias, param_dtype=self.param_dtype,
                  kernel_init=self.kernel_init, bias_init=self.bias_init)
    wg, bg = _Projection(d, self.hidden_features, name="gate_proj", **shared)()
    wu, bu = _Projection(d, self.hidden_features, name="up_proj", **shared)()
    wd, bd = _Projection(self.hidden_features, out, name="down_proj", **shared)()
    x, wg, wu, wd, bg, bu, bd = nn.dtypes.promote_dtype(x, wg, wu, wd, bg, bu, bd,
                                                        dtype=self.dtype)
    return blocks.gated_mlp(x, wg, wu, wd, gate_bias=bg, up_bias=bu, down_bias=bd,
                            activation=self.activation, recompute=self.recompute,
                            precision=self.precision, implementation=self.implementation)

  @property
  def TORCH_PARAMS(self) -> dict:  # noqa: N802 (the name every module's map has)
    """Hugging Face ``LlamaMLP``'s names, as :attr:`jaxfuse.nnx.GatedMLP.TORCH_PARAMS`."""
    return linear_torch_params(dict.fromkeys(("gate_proj", "up_proj", "down_proj"),
                                             self.use_bias))


class MLP(nn.Module):
  """``down_proj(act(up_proj(x)))`` with ``up_proj``'s bias and the activation fused.

  Attributes are those of :class:`jaxfuse.nnx.MLP` (``in_features`` comes from the input).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxfuse.linen import MLP
    >>> mlp = MLP(hidden_features=32)
    >>> params = mlp.init(jax.random.key(0), jnp.ones((2, 8)))
    >>> mlp.apply(params, jnp.ones((2, 8))).shape
    (2, 8)
  """

  hidden_features: int
  out_features: int | None = None
  activation: str | Callable = "gelu"
  use_bias: bool = True
  dtype: Any = None
  param_dtype: Any = jnp.float32
  precision: Any = jax.lax.Precision.HIGHEST
  kernel_init: Callable = _DEFAULT_KERNEL_INIT
  bias_init: Callable = nn.initializers.zeros_init()
  recompute: str | None = "activation"
  implementation: str | None = None

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    _check("MLP", self.recompute)
    d = x.shape[-1]
    out = d if self.out_features is None else self.out_features
    shared = dict(param_dtype=self.param_dtype, kernel_init=self.kernel_init,
                  bias_init=self.bias_init)
    w1, b1 = _Projection(d, self.hidden_features, True, name="up_proj", **shared)()
    w2, b2 = _Projection(self.hidden_features, out, self.use_bias, name="down_proj", **shared)()
    x, w1, b1, w2, b2 = nn.dtypes.promote_dtype(x, w1, b1, w2, b2, dtype=self.dtype)
    return blocks.mlp(x, w1, b1, w2, b2, activation=self.activation, recompute=self.recompute,
                      precision=self.precision, implementation=self.implementation)

  @property
  def TORCH_PARAMS(self) -> dict:  # noqa: N802 (the name every module's map has)
    """``up_proj`` and ``down_proj`` torch ``nn.Linear`` names, as
    :attr:`jaxfuse.nnx.MLP.TORCH_PARAMS`."""
    return linear_torch_params({"up_proj": True, "down_proj": self.use_bias})
