"""MLP blocks as pure functions, with the hidden activation recomputed in the backward pass.

The Flax modules in :mod:`jaxfuse.nnx` and :mod:`jaxfuse.linen` hold the parameters and call
these. Each block is wrapped in :func:`jaxfuse.recompute` with one of three choices of what the
backward keeps (``recompute=``):

- ``"activation"`` (the default): the projections' outputs (``gate`` and ``up``, or the
  pre-activation), which the fused op needs anyway; the hidden activation ``act(gate) * up``
  (``act(z + bias)``), which the down projection's weight gradient needs, is recomputed from them
  by the fused forward kernel.
- ``"block"``: only the block's input; the projections are recomputed too (two or one extra
  matmuls in the backward).
- ``None``: no recomputation: the fused op keeps its inputs, and the hidden activation is kept for
  the down projection.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.ad_checkpoint import checkpoint_name

from jaxfuse.ops import bias_act, dense, glu, names
from jaxfuse.parallel.rules import constrain
from jaxfuse.remat.recompute import recompute as _recompute

RECOMPUTE = ("activation", "block", None)


def _wrap(block: Callable, recompute: str | None, names: list[str]) -> Callable:
  if recompute not in RECOMPUTE:
    raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
  if recompute is None:
    return block
  return _recompute(block, policy=names if recompute == "activation" else "nothing")


def gated_mlp(x: jax.Array, gate_kernel: jax.Array, up_kernel: jax.Array,
              down_kernel: jax.Array, *, gate_bias: jax.Array | None = None,
              up_bias: jax.Array | None = None, down_bias: jax.Array | None = None,
              activation: str | Callable = "silu", recompute: str | None = "activation",
              precision=jax.lax.Precision.HIGHEST,
              implementation: str | None = None) -> jax.Array:
  """``(act(x @ gate_kernel) * (x @ up_kernel)) @ down_kernel``, the LLaMA MLP (SwiGLU).

  Args:
    x: ``(..., in_features)``.
    gate_kernel, up_kernel: ``(in_features, hidden_features)``.
    down_kernel: ``(hidden_features, out_features)``.
    gate_bias, up_bias, down_bias: optional biases of the projections' output sizes.
    activation: the gate's activation, as :func:`jaxfuse.ops.glu` takes it.
    recompute: what the backward keeps, see the module docstring.
    precision: the matmuls' precision (HIGHEST: no TF32 for float32 on GPUs, as torch).
    implementation: passed to :func:`jaxfuse.ops.glu`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxfuse.remat.mlp import gated_mlp
    >>> x, wg, wu, wd = (jnp.ones(s) for s in ((4, 8), (8, 16), (8, 16), (16, 8)))
    >>> gated_mlp(x, wg, wu, wd).shape
    (4, 8)
  """

  def block(x, gate_kernel, up_kernel, down_kernel, gate_bias, up_bias, down_bias):
    # Under a mesh the hidden width is split (Megatron's column- then row-parallel MLP).
    gate = checkpoint_name(constrain(dense(x, gate_kernel, gate_bias, precision=precision),
                                     ..., "act_mlp"), names.MLP_GATE)
    up = checkpoint_name(constrain(dense(x, up_kernel, up_bias, precision=precision),
                                   ..., "act_mlp"), names.MLP_UP)
    hidden = checkpoint_name(glu(gate, up, activation, implementation=implementation),
                             names.MLP_HIDDEN)
    return checkpoint_name(dense(hidden, down_kernel, down_bias, precision=precision),
                           names.MLP_DOWN)

  return _wrap(block, recompute, [names.MLP_GATE, names.MLP_UP])(
      x, gate_kernel, up_kernel, down_kernel, gate_bias, up_bias, down_bias)


def mlp(x: jax.Array, up_kernel: jax.Array, up_bias: jax.Array, down_kernel: jax.Array,
        down_bias: jax.Array | None = None, *, activation: str | Callable = "gelu",
        recompute: str | None = "activation", precision=jax.lax.Precision.HIGHEST,
        implementation: str | None = None) -> jax.Array:
  """``act(x @ up_kernel + up_bias) @ down_kernel + down_bias``, with the bias and activation
  fused by :func:`jaxfuse.ops.bias_act`.

  Args:
    x: ``(..., in_features)``.
    up_kernel: ``(in_features, hidden_features)``; up_bias: ``(hidden_features,)``.
    down_kernel: ``(hidden_features, out_features)``; down_bias: ``(out_features,)`` or None.
    activation: as :func:`jaxfuse.ops.bias_act` takes it.
    recompute: what the backward keeps, see the module docstring.
    precision: the matmuls' precision.
    implementation: passed to :func:`jaxfuse.ops.bias_act`.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxfuse.remat.mlp import mlp
    >>> x, w1, b1, w2 = jnp.ones((4, 8)), jnp.ones((8, 16)), jnp.zeros(16), jnp.ones((16, 8))
    >>> mlp(x, w1, b1, w2).shape
    (4, 8)
  """

  def block(x, up_kernel, up_bias, down_kernel, down_bias):
    pre = checkpoint_name(dense(x, up_kernel, None, precision=precision), names.MLP_PRE)
    hidden = checkpoint_name(bias_act(pre, up_bias, activation, implementation=implementation),
                             names.MLP_HIDDEN)
    return checkpoint_name(dense(hidden, down_kernel, down_bias, precision=precision),
                           names.MLP_DOWN)

  return _wrap(block, recompute, [names.MLP_PRE])(x, up_kernel, up_bias, down_kernel, down_bias)
