"""Flax Linen MLP blocks over jaxfuse's fused ops: ``GatedMLP`` (LLaMA's SwiGLU MLP) and ``MLP``.

The parameter tree matches the NNX modules' (and ``flax.linen.Dense``'s layout):
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

from jaxfuse.blocks import mlp as blocks
from jaxfuse.remat import mlp as remat_mlp

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


class _Block(nn.Module):
  """What both MLPs do: create the projections of their kind
  (:func:`jaxfuse.blocks.mlp.projections`) and call its block with their arrays.

  Attributes (``in_features`` comes from the input; each MLP has its own defaults of
  ``activation`` and ``use_bias``):
    hidden_features: the hidden size.
    out_features: the output's last dimension (default: the input's).
    activation: as :func:`jaxfuse.ops.glu` (gated) or :func:`jaxfuse.ops.bias_act` takes it.
    use_bias: whether the projections have biases (an ``MLP``'s ``up_proj`` always has one).
    dtype, param_dtype, precision, kernel_init, bias_init: as ``flax.linen.Dense``.
    recompute: what the backward keeps: ``"activation"``, ``"block"`` or ``None`` (see
      :mod:`jaxfuse.remat.mlp`).
    implementation: passed to the fused op.
  """

  KIND = blocks.GATED

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
    remat_mlp.check_recompute(self.recompute, type(self).__name__)
    d = x.shape[-1]
    out = d if self.out_features is None else self.out_features
    layout = blocks.projections(self.KIND, d, self.hidden_features, out, self.use_bias)
    created = [_Projection(n_in, n_out, has_bias, self.param_dtype, self.kernel_init,
                           self.bias_init, name=name)()
               for name, (n_in, n_out, has_bias) in layout.items()]
    x, *arrays = nn.dtypes.promote_dtype(x, *(a for pair in created for a in pair),
                                         dtype=self.dtype)
    params = dict(zip(layout, zip(arrays[::2], arrays[1::2])))
    return remat_mlp.mlp_block(self.KIND, x, params, recompute=self.recompute,
                               activation=self.activation, precision=self.precision,
                               implementation=self.implementation)

  @property
  def TORCH_PARAMS(self) -> dict:  # noqa: N802 (the name every module's map has)
    """The projections as torch ``nn.Linear`` submodules of the same names (Hugging Face
    ``LlamaMLP``'s for ``GatedMLP``): ``name.weight`` (the kernel, transposed), ``name.bias``."""
    return blocks.torch_params(self.KIND, self.use_bias)


class GatedMLP(_Block):
  """``down_proj(act(gate_proj(x)) * up_proj(x))`` with the gated unit fused.

  Attributes: see ``_Block``; defaults ``activation="silu"`` (SwiGLU), ``use_bias=False``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxfuse.linen import GatedMLP
    >>> mlp = GatedMLP(hidden_features=32)
    >>> params = mlp.init(jax.random.key(0), jnp.ones((2, 8)))
    >>> mlp.apply(params, jnp.ones((2, 8))).shape
    (2, 8)
  """

  KIND = blocks.GATED


class MLP(_Block):
  """``down_proj(act(up_proj(x)))`` with ``up_proj``'s bias and the activation fused.

  Attributes: see ``_Block``; defaults ``activation="gelu"``, ``use_bias=True``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxfuse.linen import MLP
    >>> mlp = MLP(hidden_features=32, out_features=4, activation="relu")
    >>> params = mlp.init(jax.random.key(0), jnp.ones((2, 8)))
    >>> jax.tree.map(jnp.shape, params["params"]["down_proj"])
    {'bias': (4,), 'kernel': (32, 4)}
  """

  KIND = blocks.PLAIN
  activation: str | Callable = "gelu"
  use_bias: bool = True
