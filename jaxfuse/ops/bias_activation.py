"""``act(x + bias)`` fused, keeping only the inputs for the backward pass.

The forward reads ``x`` and the bias and writes the result. The backward recomputes ``x + bias``
from the inputs (nothing else is kept), writes ``dx = g * act'(x + bias)`` and reduces it over
every leading axis into the bias gradient. Low-precision inputs are computed in float32 and rounded
once; the bias gradient is accumulated in float32.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxfuse.kernels.pallas import bias_activation as pallas_bias_activation
from jaxfuse.ops import activation_grads, activations, base, checks, partitioning

BIAS_ACT = base.Op("bias_act", ("pallas", "triton", "xla"), base.ELEMENTWISE_GPU_ORDER)
BIAS_ACT_ACTIVATIONS = ("gelu", "gelu_tanh", "silu", "relu", "squared_relu")


# Reference --------------------------------------------------------------------------------------


def bias_act_reference(x: jax.Array, bias: jax.Array, act: str | Callable = "gelu") -> jax.Array:
  """Plain-jnp ``act(x + bias)``, computed in float32 for low-precision inputs."""
  fn = activations.get(act, arg="act", op="bias_act_reference")
  cd = base.compute_dtype(x.dtype)
  return fn(x.astype(cd) + bias.astype(cd)).astype(x.dtype)


# Checks -----------------------------------------------------------------------------------------


def _check(op, x, bias):
  checks.floating(op, "x", x)
  checks.floating(op, "bias", bias)
  checks.same_dtype(op, ("x", "bias"), (x, bias))
  if x.ndim == 0:
    raise ValueError(f"{op}: x must have rank >= 1 (features last), got shape ()")
  checks.rank(op, "bias", bias, 1)
  checks.dim(op, "bias", bias, 0, x.shape[-1], "the last axis of x")


@dataclasses.dataclass(frozen=True)
class _Config(base.Config):
  fn: Callable
  name: str | None   # the activation's registry name (the Triton kernels take names only)


def _config(act, implementation) -> _Config:
  op = BIAS_ACT.name
  cfg = _Config(**BIAS_ACT.backend(implementation), fn=activations.get(act, arg="act", op=op),
                name=activations.name_of(act))
  if cfg.impl == "triton":
    from jaxfuse.kernels.triton import bias_activation as triton_bias_activation

    if cfg.name not in triton_bias_activation.ACTIVATIONS:
      raise ValueError(f"{op}: implementation='triton' supports the named activations "
                       f"{triton_bias_activation.ACTIVATIONS}, got act={act!r}")
  return cfg


# The op -----------------------------------------------------------------------------------------


def bias_act(x: jax.Array, bias: jax.Array, act: str | Callable = "gelu", *,
             implementation: str | None = None) -> jax.Array:
  """``act(x + bias)`` over the last axis, fused, keeping only the inputs for the backward.

  Args:
    x: a float array ``(..., features)`` (float32, bfloat16 or float16), e.g. a matmul output.
    bias: ``(features,)``, the same dtype as ``x``.
    act: ``"gelu"`` (exact, as ``F.gelu``), ``"gelu_tanh"`` (``F.gelu(approximate="tanh")``),
      ``"silu"``, ``"relu"``, ``"squared_relu"``, another name from
      :data:`jaxfuse.ops.activations.ACTIVATIONS`, or an elementwise jnp function (not with
      ``implementation="triton"``).
    implementation: ``None`` (XLA: it fuses this chain by itself), ``"pallas"``, ``"triton"``
      or ``"xla"``.

  Returns:
    ``act(x + bias)`` in the dtype of ``x``. Its gradient for ``bias`` is the sum over every
    leading axis of ``x``.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxfuse.ops import bias_act
    >>> bias_act(jnp.array([[1.0, -2.0]]), jnp.array([0.5, 1.0]), "relu")
    Array([[1.5, 0. ]], dtype=float32)
  """
  _check(BIAS_ACT.name, x, bias)
  cfg = _config(act, implementation)
  with jax.named_scope(f"jaxfuse.bias_act[{cfg.name or 'fn'}]"):
    return _bias_act(x, bias, cfg)


# Forward and backward ---------------------------------------------------------------------------


def _xla_forward(x, bias, fn):
  cd = base.compute_dtype(x.dtype)
  return activation_grads.value(fn, x.astype(cd) + bias.astype(cd)).astype(x.dtype)


def _xla_backward(x, bias, g, fn):
  cd = base.compute_dtype(x.dtype)
  _, grad = activation_grads.value_and_grad(fn, x.astype(cd) + bias.astype(cd))
  dz = g.astype(cd) * grad
  dbias = jnp.sum(dz.astype(jnp.float32), axis=tuple(range(x.ndim - 1)))
  return dz.astype(x.dtype), dbias.astype(bias.dtype)


def _kernels(cfg):
  """The forward and backward kernels of ``cfg.impl`` over 2-D rows."""
  if cfg.impl == "pallas":
    forward = functools.partial(pallas_bias_activation.bias_act_forward, fn=cfg.fn,
                                interpret=cfg.interpret)
    backward = functools.partial(pallas_bias_activation.bias_act_backward, fn=cfg.fn,
                                 interpret=cfg.interpret)
    return forward, backward
  from jaxfuse.kernels.triton import bias_activation as triton_bias_activation

  forward = functools.partial(triton_bias_activation.bias_act_forward, act=cfg.name)
  backward = functools.partial(triton_bias_activation.bias_act_backward, act=cfg.name)
  return forward, backward


def _rule(x, *, backward: bool) -> partitioning.Rule:
  """The kernels are elementwise over the rows (any of ``x``'s leading axes) and features; the
  bias's gradient is summed over the rows."""
  r, f, lead = partitioning.ROWS, partitioning.FEATURES, x.ndim - 1
  if backward:
    return partitioning.rows_rule((r, f, r), (r, f), lead=lead, split_features=True)
  return partitioning.rows_rule((r, f), (r,), lead=lead, split_features=True)


def _forward(x, bias, cfg):
  if cfg.impl in ("pallas", "triton"):
    kernel, _ = _kernels(cfg)
    twin = functools.partial(_xla_forward, fn=cfg.fn)
    return base.kernel_call(kernel, twin, x, bias, rule=_rule(x, backward=False))
  return _xla_forward(x, bias, cfg.fn)


def _backward(x, bias, g, cfg):
  if cfg.impl in ("pallas", "triton"):
    _, kernel = _kernels(cfg)
    twin = functools.partial(_xla_backward, fn=cfg.fn)
    return base.kernel_call(kernel, twin, x, bias, g, rule=_rule(x, backward=True))
  # The barrier keeps XLA from sharing the activation's intermediates with the forward pass
  # (which would write them to memory and read them back): the backward is one fused loop over
  # the inputs, plus the bias reduction.
  x, bias, g = jax.lax.optimization_barrier((x, bias, g))
  return _xla_backward(x, bias, g, cfg.fn)


# The custom VJP ---------------------------------------------------------------------------------


@partitioning.matching_vma
@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _bias_act(x, bias, cfg):
  return _forward(x, bias, cfg)


def _bias_act_fwd(x, bias, cfg):
  # Residuals: the inputs only; x + bias and the activation are recomputed in the backward.
  return _forward(x, bias, cfg), (x, bias)


def _bias_act_bwd(cfg, residuals, g):
  x, bias = residuals
  return _backward(x, bias, g, cfg)


_bias_act.defvjp(_bias_act_fwd, _bias_act_bwd)
