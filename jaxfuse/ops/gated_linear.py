"""Gated linear units, ``activation(a) * b``, fused, keeping only the inputs for the backward pass.

SwiGLU is ``activation="silu"`` (LLaMA's ``F.silu(gate_proj(x)) * up_proj(x)``), GEGLU ``"gelu"`` or
``"gelu_tanh"``, ReGLU ``"relu"``. The forward reads ``a`` and ``b`` and writes the product. The
backward recomputes ``act(a)`` from the inputs and writes ``da = g * b * act'(a)`` and
``db = g * act(a)``: nothing but the inputs is kept between the passes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxfuse.ops import activation_grads, activations, base, checks, partitioning

GLU = base.Op("glu", "gated_linear", base.ELEMENTWISE_GPU_ORDER)


# Reference --------------------------------------------------------------------------------------


def _split(x):
  h = x.shape[-1] // 2
  return x[..., :h], x[..., h:]


def glu_reference(a: jax.Array, b: jax.Array | None = None,
                  activation: str | Callable = "silu", *,
                  act: str | Callable | None = None) -> jax.Array:
  """Plain-jnp ``activation(a) * b`` (packed ``a = [a | b]`` when ``b`` is None), in
  float32."""
  activation = checks.renamed("glu_reference", "act", "activation", act, activation)
  if b is None or isinstance(b, str) or callable(b):
    activation = activation if b is None else b
    a, b = _split(a)
  fn = activations.get(activation, op="glu_reference")
  cd = base.compute_dtype(a.dtype)
  return (fn(a.astype(cd)) * b.astype(cd)).astype(a.dtype)


# Checks -----------------------------------------------------------------------------------------


def _check(op, a, b):
  if b is None:
    checks.floating(op, "x", a)
    if a.ndim == 0 or a.shape[-1] % 2:
      raise ValueError(f"{op}: x must have an even last axis (it is split into [a | b]), got "
                       f"shape {tuple(a.shape)}")
    return
  checks.floating(op, "a", a)
  checks.floating(op, "b", b)
  checks.same_shape(op, ("a", "b"), (a, b))
  checks.same_dtype(op, ("a", "b"), (a, b))
  if a.ndim == 0:
    raise ValueError(f"{op}: a must have rank >= 1, got shape ()")


# The op -----------------------------------------------------------------------------------------


def glu(a: jax.Array, b: jax.Array | str | Callable | None = None,
        activation: str | Callable = "silu", *, implementation: str | None = None,
        act: str | Callable | None = None) -> jax.Array:
  """The gated linear unit ``activation(a) * b``, fused forward and backward; keeps only its inputs.

  Two forms:

  - ``glu(a, b, activation)``: ``a`` (the gate) and ``b`` (the value) are arrays of one shape;
  - ``glu(x, activation)`` or ``glu(x, activation=...)``: packed, ``x = [a | b]`` on the last
    axis, which is split in half: ``activation(x[..., :h]) * x[..., h:]``. Note that
    ``torch.nn.functional.glu`` gates the other way round (``x[..., :h] * sigmoid(x[..., h:])``);
    here the gate comes first, as in fused ``[gate | up]`` projections.

  Args:
    a: the gate, a float array (float32, bfloat16 or float16); or packed ``x``.
    b: the value, same shape and dtype as ``a``; or, for the packed form, the activation (or
      None).
    activation: ``"silu"`` (SwiGLU), ``"gelu"`` / ``"gelu_tanh"`` (GEGLU), ``"relu"``
      (ReGLU), another name from :data:`jaxfuse.ops.activations.ACTIVATIONS`, or an
      elementwise jnp function (not with ``implementation="triton"`` or ``"cpu"``).
    implementation: ``None`` (on GPUs XLA, which fuses this by itself; on CPUs the CPU
      kernels, which write both gradients from one loop where XLA:CPU runs two),
      ``"pallas"``, ``"triton"``, ``"cpu"`` or ``"xla"``.
    act: the former name of ``activation`` (deprecated).

  Returns:
    ``activation(a) * b`` in the dtype of ``a``; for the packed form the last axis is halved.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxfuse.ops import glu
    >>> gate, up = jnp.array([0.0, 2.0]), jnp.array([3.0, 0.5])
    >>> glu(gate, up, "relu")
    Array([0., 1.], dtype=float32)
    >>> glu(jnp.concatenate([gate, up]), "relu")
    Array([0., 1.], dtype=float32)
  """
  activation = checks.renamed(GLU.name, "act", "activation", act, activation)
  if isinstance(b, str) or callable(b):
    activation, b = b, None
  _check(GLU.name, a, b)
  cfg = activations.config(GLU, activation, implementation)
  with jax.named_scope(activations.scope(GLU, cfg)):
    if b is None:
      return _glu_packed(cfg, a)
    return _glu(cfg, a, b)


# Forward and backward ---------------------------------------------------------------------------


def _xla_forward(a, b, activation):
  """``act(a) * b``; packed ``a`` when ``b`` is None."""
  if b is None:
    a, b = _split(a)
  cd = base.compute_dtype(a.dtype)
  return (activation_grads.value(activation, a.astype(cd)) * b.astype(cd)).astype(a.dtype)


def _xla_backward(a, b, g, activation):
  """``(da, db)``, or for packed ``a`` (``b`` None) ``dx = [da | db]``.

  ``da = g * b * act'(a)`` and ``db = g * act(a)`` are each one fused loop over the inputs; the
  activation is recomputed in each. The barriers keep XLA from computing it once and sharing it
  (between the two gradients, or with the forward pass): XLA:CPU would then write it to memory
  and read it back in three more loops, which measures about 1.5x slower here.
  """
  packed = b is None
  if packed:
    a, b = _split(a)
  cd = base.compute_dtype(a.dtype)
  a1, b1, g1 = jax.lax.optimization_barrier((a, b, g))
  _, grad = activation_grads.value_and_grad(activation, a1.astype(cd))
  da = (g1.astype(cd) * b1.astype(cd) * grad).astype(a.dtype)
  a2, g2 = jax.lax.optimization_barrier((a, g))
  db = (g2.astype(cd) * activation_grads.value(activation, a2.astype(cd))).astype(b.dtype)
  if packed:
    return jnp.concatenate([da, db], axis=-1)
  return da, db


def _rule(a, b, *, backward: bool):
  """The kernels' partitioning: over the rows (any of the leading axes); the features too when
  gate and value are two arrays (the kernel is then elementwise), not when they are the halves
  of one."""
  r = partitioning.ROWS
  operands = (r, r, r) if backward else (r, r)        # (a, b, g) or (a, b)
  results = (r, r) if backward and b is not None else (r,)
  return partitioning.rows_rule(operands, results, lead=a.ndim - 1,
                                split_features=b is not None)


def _forward(a, b, cfg):
  twin = functools.partial(_xla_forward, activation=cfg.activation)
  return cfg.run("glu_forward", twin, a, b, rule=_rule(a, b, backward=False),
                 activation=cfg.activation)


def _backward(a, b, g, cfg):
  twin = functools.partial(_xla_backward, activation=cfg.activation)
  return cfg.run("glu_backward", twin, a, b, g, rule=_rule(a, b, backward=True),
                 activation=cfg.activation)


# The custom VJPs --------------------------------------------------------------------------------


# Residuals: the inputs only; activation(a) is recomputed in the backward.
_glu = base.recomputing_vjp(lambda cfg, a, b: _forward(a, b, cfg),
                            lambda cfg, a, b, g: _backward(a, b, g, cfg))
_glu_packed = base.recomputing_vjp(lambda cfg, x: _forward(x, None, cfg),
                                   lambda cfg, x, g: (_backward(x, None, g, cfg),))
