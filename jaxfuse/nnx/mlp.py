"""Flax NNX MLP blocks over jaxfuse's fused ops: ``GatedMLP`` (LLaMA's SwiGLU MLP) and ``MLP``.

Parameters live in ``flax.nnx.Linear`` submodules, so their names and layouts are Flax's:

- ``GatedMLP``: ``gate_proj``, ``up_proj`` (kernels ``(in_features, hidden_features)``) and
  ``down_proj`` (kernel ``(hidden_features, out_features)``), each with ``kernel`` and, with
  ``use_bias=True``, ``bias``. A torch ``nn.Linear`` weight is the transposed kernel.
- ``MLP``: ``up_proj`` (kernel ``(in_features, hidden_features)``, bias ``(hidden_features,)``)
  and ``down_proj``.

The submodules are not called: the modules pass their arrays to the pure blocks of
:mod:`jaxfuse.remat.mlp`, which fuse the activation and recompute the hidden activation in the
backward pass (``recompute=``, see there).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes, initializers

from jaxfuse.remat import mlp as blocks

_DEFAULT_KERNEL_INIT = initializers.lecun_normal()
_ZEROS = initializers.zeros_init()


def _values(*params):
  return [None if p is None else p[...] for p in params]


def linear_torch_params(projections: dict[str, bool]) -> dict:
  """The torch map of flax ``Linear`` projections: ``{name: has_bias}`` to ``name.weight``
  (the kernel, transposed) and ``name.bias``, as torch ``nn.Linear`` submodules name them."""
  params = {}
  for name, has_bias in projections.items():
    params[(name, "kernel")] = (f"{name}.weight", True)
    if has_bias:
      params[(name, "bias")] = (f"{name}.bias", False)
  return params


def _keep_settings(module, activation, dtype, precision, recompute, implementation):
  """Checks ``recompute`` and stores the settings both blocks pass to :mod:`jaxfuse.remat.mlp`."""
  if recompute not in blocks.RECOMPUTE:
    raise ValueError(f"{type(module).__name__}: recompute must be one of {blocks.RECOMPUTE}, "
                     f"got {recompute!r}")
  module.activation = activation
  module.dtype = dtype
  module.precision = precision
  module.recompute = recompute
  module.implementation = implementation


class GatedMLP(nnx.Module):
  """``down_proj(act(gate_proj(x)) * up_proj(x))`` with the gated unit fused (:func:`glu`).

  Args:
    in_features: the input's last dimension.
    hidden_features: the gate and up projections' size.
    out_features: the output's last dimension (default: ``in_features``).
    activation: the gate's activation: ``"silu"`` (SwiGLU), ``"gelu"`` / ``"gelu_tanh"``
      (GEGLU), ``"relu"`` (ReGLU), ...
    use_bias: whether the three projections have biases (LLaMA's do not).
    dtype: the computation dtype (default: inferred from the input and parameters).
    param_dtype: the parameters' dtype.
    precision: the matmuls' precision.
    kernel_init, bias_init: initializers.
    recompute: ``"activation"`` (keep the gate and up projections, recompute the hidden
      activation), ``"block"`` (keep the input only) or ``None``.
    implementation: passed to :func:`jaxfuse.ops.glu`.
    rngs: the random number generators.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxfuse.nnx import GatedMLP
    >>> mlp = GatedMLP(8, 32, rngs=nnx.Rngs(0))
    >>> mlp(jnp.ones((2, 8))).shape
    (2, 8)
  """

  def __init__(self, in_features: int, hidden_features: int, out_features: int | None = None, *,
               activation: str | Callable = "silu", use_bias: bool = False,
               dtype=None, param_dtype=jnp.float32, precision=jax.lax.Precision.HIGHEST,
               kernel_init=_DEFAULT_KERNEL_INIT, bias_init=_ZEROS,
               recompute: str | None = "activation", implementation: str | None = None,
               rngs: nnx.Rngs):
    _keep_settings(self, activation, dtype, precision, recompute, implementation)
    out_features = in_features if out_features is None else out_features
    linear = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, precision=precision,
                  kernel_init=kernel_init, bias_init=bias_init, rngs=rngs)
    self.gate_proj = nnx.Linear(in_features, hidden_features, **linear)
    self.up_proj = nnx.Linear(in_features, hidden_features, **linear)
    self.down_proj = nnx.Linear(hidden_features, out_features, **linear)

  def __call__(self, x: jax.Array) -> jax.Array:
    arrays = [x, *_values(self.gate_proj.kernel, self.up_proj.kernel, self.down_proj.kernel,
                          self.gate_proj.bias, self.up_proj.bias, self.down_proj.bias)]
    x, wg, wu, wd, bg, bu, bd = dtypes.promote_dtype(arrays, dtype=self.dtype)
    return blocks.gated_mlp(x, wg, wu, wd, gate_bias=bg, up_bias=bu, down_bias=bd,
                            activation=self.activation, recompute=self.recompute,
                            precision=self.precision, implementation=self.implementation)

  @property
  def TORCH_PARAMS(self) -> dict:  # noqa: N802 (the name every module's map has)
    """Hugging Face ``LlamaMLP``'s names: ``gate_proj.weight``, ``up_proj.weight``,
    ``down_proj.weight`` (torch ``[out, in]``: the kernels transposed) and their biases.

    Example:
      >>> from flax import nnx
      >>> from jaxfuse.nnx import GatedMLP
      >>> sorted(key for key, _ in GatedMLP(8, 32, rngs=nnx.Rngs(0)).TORCH_PARAMS.values())
      ['down_proj.weight', 'gate_proj.weight', 'up_proj.weight']
    """
    return linear_torch_params({name: getattr(self, name).bias is not None
                                for name in ("gate_proj", "up_proj", "down_proj")})


class MLP(nnx.Module):
  """``down_proj(act(up_proj(x)))`` with ``up_proj``'s bias and the activation fused
  (:func:`jaxfuse.ops.bias_act`).

  Args:
    in_features: the input's last dimension.
    hidden_features: the hidden size.
    out_features: the output's last dimension (default: ``in_features``).
    activation: ``"gelu"``, ``"gelu_tanh"``, ``"silu"``, ``"relu"``, ``"squared_relu"``, ...
    use_bias: whether ``down_proj`` has a bias (``up_proj`` always has one: it is the fused bias).
    dtype, param_dtype, precision, kernel_init, bias_init, rngs: as ``flax.nnx.Linear``.
    recompute: ``"activation"`` (keep the pre-activation, recompute the activation),
      ``"block"`` (keep the input only) or ``None``.
    implementation: passed to :func:`jaxfuse.ops.bias_act`.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxfuse.nnx import MLP
    >>> mlp = MLP(8, 32, rngs=nnx.Rngs(0))
    >>> mlp(jnp.ones((2, 8))).shape
    (2, 8)
  """

  def __init__(self, in_features: int, hidden_features: int, out_features: int | None = None, *,
               activation: str | Callable = "gelu", use_bias: bool = True, dtype=None,
               param_dtype=jnp.float32, precision=jax.lax.Precision.HIGHEST,
               kernel_init=_DEFAULT_KERNEL_INIT, bias_init=_ZEROS,
               recompute: str | None = "activation", implementation: str | None = None,
               rngs: nnx.Rngs):
    _keep_settings(self, activation, dtype, precision, recompute, implementation)
    out_features = in_features if out_features is None else out_features
    linear = dict(dtype=dtype, param_dtype=param_dtype, precision=precision,
                  kernel_init=kernel_init, bias_init=bias_init, rngs=rngs)
    self.up_proj = nnx.Linear(in_features, hidden_features, use_bias=True, **linear)
    self.down_proj = nnx.Linear(hidden_features, out_features, use_bias=use_bias, **linear)

  def __call__(self, x: jax.Array) -> jax.Array:
    arrays = [x, *_values(self.up_proj.kernel, self.up_proj.bias, self.down_proj.kernel,
                          self.down_proj.bias)]
    x, w1, b1, w2, b2 = dtypes.promote_dtype(arrays, dtype=self.dtype)
    return blocks.mlp(x, w1, b1, w2, b2, activation=self.activation, recompute=self.recompute,
                      precision=self.precision, implementation=self.implementation)

  @property
  def TORCH_PARAMS(self) -> dict:  # noqa: N802 (the name every module's map has)
    """``up_proj.weight``, ``up_proj.bias``, ``down_proj.weight`` and (with ``use_bias``)
    ``down_proj.bias``: torch ``nn.Linear`` submodules of those names (weights ``[out, in]``)."""
    return linear_torch_params({"up_proj": True,
                                "down_proj": self.down_proj.bias is not None})
