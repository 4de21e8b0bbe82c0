"""Flax NNX MLP blocks over jaxfuse's fused ops: ``GatedMLP`` (LLaMA's SwiGLU MLP) and ``MLP``.

Parameters live in ``flax.nnx.Linear`` submodules, so their names and layouts are Flax's:

- ``GatedMLP``: ``gate_proj``, ``up_proj`` (kernels ``(in_features, hidden_features)``) and
  ``down_proj`` (kernel ``(hidden_features, out_features)``), each with ``kernel`` and, with
  ``use_bias=True``, ``bias``. A torch ``nn.Linear`` weight is the transposed kernel.
- ``MLP``: ``up_proj`` (kernel ``(in_features, hidden_features)``, bias ``(hidden_features,)``)
  and ``down_proj``.

The submodules are not called: the modules pass their arrays to the blocks of
:mod:`jaxfuse.blocks.mlp`, which fuse the activation, through :mod:`jaxfuse.remat.mlp`, which
recomputes the hidden activation in the backward pass (``recompute=``, see there). Projections
given LoRA adapters by :func:`jaxfuse.nnx.apply_lora` add them in the same ops.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes, initializers

from jaxfuse.blocks import mlp as blocks
from jaxfuse.blocks.torch_names import linear_torch_params
from jaxfuse.nnx.lora import adapter_of
from jaxfuse.remat import mlp as remat_mlp

_DEFAULT_KERNEL_INIT = initializers.lecun_normal()
_ZEROS = initializers.zeros_init()


class _Block(nnx.Module):
  """What both MLPs do: create the ``nnx.Linear`` projections of their kind
  (:func:`jaxfuse.blocks.mlp.projections`), and call its block with their arrays."""

  KIND: str

  def __init__(self, in_features: int, hidden_features: int, out_features: int | None = None, *,
               activation: str | Callable, use_bias: bool, dtype=None, param_dtype=jnp.float32,
               precision=jax.lax.Precision.HIGHEST, kernel_init=_DEFAULT_KERNEL_INIT,
               bias_init=_ZEROS, recompute: str | None = "activation",
               implementation: str | None = None, rngs: nnx.Rngs):
    remat_mlp.check_recompute(recompute, type(self).__name__)
    self.activation = activation
    self.dtype = dtype
    self.precision = precision
    self.recompute = recompute
    self.implementation = implementation
    out_features = in_features if out_features is None else out_features
    layout = blocks.projections(self.KIND, in_features, hidden_features, out_features, use_bias)
    for name, (n_in, n_out, has_bias) in layout.items():
      setattr(self, name, nnx.Linear(n_in, n_out, use_bias=has_bias, dtype=dtype,
                                     param_dtype=param_dtype, precision=precision,
                                     kernel_init=kernel_init, bias_init=bias_init, rngs=rngs))

  def _projections(self) -> dict[str, nnx.Linear]:
    return {name: getattr(self, name) for name in blocks.PROJECTIONS[self.KIND]}

  def __call__(self, x: jax.Array) -> jax.Array:
    values = [x]
    for proj in self._projections().values():
      values += [proj.kernel[...], None if proj.bias is None else proj.bias[...]]
    x, *arrays = dtypes.promote_dtype(values, dtype=self.dtype)
    params = dict(zip(self._projections(), zip(arrays[::2], arrays[1::2])))
    # LoRA adapters (jaxfuse.nnx.apply_lora), in the computation's dtype.
    adapters = {name: adapter.astype(x.dtype) for name, proj in self._projections().items()
                if (adapter := adapter_of(proj)) is not None}
    return remat_mlp.mlp_block(self.KIND, x, params, recompute=self.recompute,
                               adapters=adapters, activation=self.activation,
                               precision=self.precision, implementation=self.implementation)

  @property
  def TORCH_PARAMS(self) -> dict:  # noqa: N802 (the name every module's map has)
    """The projections as torch ``nn.Linear`` submodules of the same names: ``name.weight``
    (torch ``[out, in]``: the kernel transposed) and, where there is one, ``name.bias``."""
    return linear_torch_params({name: proj.bias is not None
                                for name, proj in self._projections().items()})


class GatedMLP(_Block):
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

  Its ``TORCH_PARAMS`` are Hugging Face ``LlamaMLP``'s names: ``gate_proj.weight``,
  ``up_proj.weight``, ``down_proj.weight`` and, with ``use_bias``, their biases.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxfuse.nnx import GatedMLP
    >>> mlp = GatedMLP(8, 32, activation="gelu", rngs=nnx.Rngs(0))   # GEGLU
    >>> mlp.gate_proj.kernel.shape, mlp(jnp.ones((2, 8))).shape
    ((8, 32), (2, 8))
    >>> sorted(key for key, _ in mlp.TORCH_PARAMS.values())
    ['down_proj.weight', 'gate_proj.weight', 'up_proj.weight']
  """

  KIND = blocks.GATED
  __init__ = functools.partialmethod(_Block.__init__, activation="silu", use_bias=False)


class MLP(_Block):
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

  Its ``TORCH_PARAMS``: ``up_proj.weight``, ``up_proj.bias``, ``down_proj.weight`` and (with
  ``use_bias``) ``down_proj.bias``, torch ``nn.Linear`` submodules of those names.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxfuse.nnx import MLP
    >>> mlp = MLP(8, 32, 4, use_bias=False, recompute="block", rngs=nnx.Rngs(0))
    >>> mlp(jnp.ones((3, 8))).shape, mlp.down_proj.bias is None
    ((3, 4), True)
  """

  KIND = blocks.PLAIN
  __init__ = functools.partialmethod(_Block.__init__, activation="gelu", use_bias=True)
