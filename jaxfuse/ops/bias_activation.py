"""``activation(x + bias)`` fused, keeping only the inputs for the backward pass.

The forward reads ``x`` and the bias and writes the result. The backward recomputes
``x + bias`` from the inputs (nothing else is kept), writes ``dx = g * activation'(x + bias)``
and reduces it over every leading axis into the bias gradient. Low-precision inputs are
computed in float32 and rounded once; the bias gradient is accumulated in float32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxfuse.ops import activation_grads, activations, base, checks, partitioning

BIAS_ACT = base.Op("bias_act", "bias_activation", base.ELEMENTWISE_GPU_ORDER)
BIAS_ACT_ACTIVATIONS = ("gelu", "gelu_tanh", "silu", "relu", "squared_relu")


# Reference --------------------------------------------------------------------------------------


def bias_act_reference(x: jax.Array, bias: jax.Array, activation: str | Callable = "gelu", *,
                       act: str | Callable | None = None) -> jax.Array:
  """Plain-jnp ``activation(x + bias)``, computed in float32 for low-precision inputs."""
  activation = checks.renamed("bias_act_reference", "act", "activation", act, activation)
  return activations.of_sum(activation, x, bias, op="bias_act_reference")


# Checks -----------------------------------------------------------------------------------------


def _check(op, x, bias):
  checks.floating(op, "x", x)
  checks.floating(op, "bias", bias)
  checks.same_dtype(op, ("x", "bias"), (x, bias))
  if x.ndim == 0:
    raise ValueError(f"{op}: x must have rank >= 1 (features last), got shape ()")
  checks.rank(op, "bias", bias, 1)
  checks.dim(op, "bias", bias, 0, x.shape[-1], "the last axis of x")


# The op -----------------------------------------------------------------------------------------


def bias_act(x: jax.Array, bias: jax.Array, activation: str | Callable = "gelu", *,
             implementation: str | None = None, act: str | Callable | None = None) -> jax.Array:
  """``activation(x + bias)`` over the last axis, fused, keeping only the inputs for the backward.

  Args:
    x: a float array ``(..., features)`` (float32, bfloat16 or float16), e.g. a matmul output.
    bias: ``(features,)``, the same dtype as ``x``.
    activation: ``"gelu"`` (exact, as ``F.gelu``), ``"gelu_tanh"``
      (``F.gelu(approximate="tanh")``),
      ``"silu"``, ``"relu"``, ``"squared_relu"``, another name from
      :data:`jaxfuse.ops.activations.ACTIVATIONS`, or an elementwise jnp function (not with
      ``implementation="triton"``).
    implementation: ``None`` (XLA: it fuses this chain by itself), ``"pallas"``, ``"triton"``
      or ``"xla"``.
    act: the former name of ``activation`` (deprecated).

  Returns:
    ``activation(x + bias)`` in the dtype of ``x``. Its gradient for ``bias`` is the sum over every
    leading axis of ``x``.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxfuse.ops import bias_act
    >>> bias_act(jnp.array([[1.0, -2.0]]), jnp.array([0.5, 1.0]), "relu")
    Array([[1.5, 0. ]], dtype=float32)
  """
  activation = checks.renamed(BIAS_ACT.name, "act", "activation", act, activation)
  _check(BIAS_ACT.name, x, bias)
  cfg = activations.config(BIAS_ACT, activation, implementation)
  with jax.named_scope(activations.scope(BIAS_ACT, cfg)):
    return _bias_act(cfg, x, bias)


# Forward and backward ---------------------------------------------------------------------------


def _xla_forward(x, bias, activation):
  cd = base.compute_dtype(x.dtype)
  return activation_grads.value(activation, x.astype(cd) + bias.astype(cd)).astype(x.dtype)


def _xla_backward(x, bias, g, activation):
  cd = base.compute_dtype(x.dtype)
  _, grad = activation_grads.value_and_grad(activation, x.astype(cd) + bias.astype(cd))
  dz = g.astype(cd) * grad
  dbias = jnp.sum(dz.astype(jnp.float32), axis=tuple(range(x.ndim - 1)))
  return dz.astype(x.dtype), dbias.astype(bias.dtype)


def _xla_backward_apart(x, bias, g, activation):
  """:func:`_xla_backward` behind a barrier, which keeps XLA from sharing the activation's
  intermediates with the forward pass (which would write them to memory and read them back):
  the backward is one fused loop over the inputs, plus the bias reduction."""
  x, bias, g = jax.lax.optimization_barrier((x, bias, g))
  return _xla_backward(x, bias, g, activation)


def _rule(x, *, backward: bool) -> partitioning.Rule:
  """The kernels are elementwise over the rows (any of ``x``'s leading axes) and features; the
  bias's gradient is summed over the rows."""
  r, f, lead = partitioning.ROWS, partitioning.FEATURES, x.ndim - 1
  if backward:
    return partitioning.rows_rule((r, f, r), (r, f), lead=lead, split_features=True)
  return partitioning.rows_rule((r, f), (r,), lead=lead, split_features=True)


def _forward(x, bias, cfg):
  twin = functools.partial(_xla_forward, activation=cfg.activation)
  return cfg.run("bias_act_forward", twin, x, bias, rule=_rule(x, backward=False),
                 activation=cfg.activation)


def _backward(x, bias, g, cfg):
  twin = functools.partial(_xla_backward, activation=cfg.activation)
  return cfg.run("bias_act_backward", twin, x, bias, g, rule=_rule(x, backward=True),
                 xla=functools.partial(_xla_backward_apart, activation=cfg.activation),
                 activation=cfg.activation)


# The custom VJP ---------------------------------------------------------------------------------


# Residuals: the inputs only; x + bias and the activation are recomputed in the backward.
_bias_act = base.recomputing_vjp(lambda cfg, x, bias: _forward(x, bias, cfg),
                                 lambda cfg, x, bias, g: _backward(x, bias, g, cfg))
