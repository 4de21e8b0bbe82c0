"""The grouped gated linear unit: a Mixture-of-Experts layer's first half as one op.

``grouped_glu(lhs, gate, up, group_sizes)`` is
``activation(grouped_matmul(lhs, gate)) * grouped_matmul(lhs, up)``: the rows of ``lhs``
``[M, K]``, sorted by group (expert), times each group's ``gate[g]`` and ``up[g]`` ``[K, N]``,
gated. Rows past ``sum(group_sizes)`` belong to no group and come out as zeros, as in
:func:`jaxfuse.ops.grouped_matmul`.

The kernels compute both products of a row tile in one program and apply the activation and
the product to the float32 accumulators: one ``[M, N]`` write where the unfused layer writes
the two ``[M, N]`` products and reads them back for the gated unit.

The backward keeps the inputs only (no computed residual, so none is named in
:mod:`jaxfuse.ops.names`): it recomputes the two products and computes

- ``d_gate_out = g * up_out * act'(gate_out)`` and ``d_up_out = g * act(gate_out)``
  (elementwise, :mod:`jaxfuse.ops.activation_grads`; in the kernels, the recomputing kernel's
  epilogue), rounded to the inputs' dtype;
- ``d lhs = grouped_matmul(d_gate_out, gate^T) + grouped_matmul(d_up_out, up^T)``, summed in
  float32 and rounded once;
- ``d gate[e] = lhs_e^T @ d_gate_out_e`` and ``d up[e] = lhs_e^T @ d_up_out_e``: the
  transposed grouped products of :mod:`jaxfuse.ops.grouped_matmul` (and of its kernels).

Both products accumulate in float32 and the gated unit is rounded once, to the inputs' dtype.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse.ops import activation_grads, activations, base, checks, partitioning
from jaxfuse.ops import grouped_matmul as gmm

# A matmul with an epilogue: XLA (two of cuBLAS' grouped GEMMs and one fused elementwise loop)
# first, as grouped_matmul; the kernels are there for the fusion and its measurement.
GROUPED_GLU = base.Op("grouped_glu", "grouped_glu", base.MATMUL_GPU_ORDER)


# Reference --------------------------------------------------------------------------------------


def grouped_glu_reference(lhs: jax.Array, gate: jax.Array, up: jax.Array,
                          group_sizes: jax.Array, activation: str | Callable = "silu", *,
                          precision=None) -> jax.Array:
  """Plain-jnp ``activation(lhs_e @ gate[e]) * (lhs_e @ up[e])`` (two
  :func:`jax.lax.ragged_dot`), the products in float32 and the result rounded once to lhs's
  dtype."""
  fn = activations.get(activation, op="grouped_glu_reference")
  sizes = jnp.asarray(group_sizes, jnp.int32)
  gate_out, up_out = (
      jax.lax.ragged_dot(lhs, w, sizes, precision=gmm._precision(lhs.dtype, precision),
                         preferred_element_type=jnp.float32,
                         out_sharding=gmm._out_sharding(lhs, w))
      for w in (gate, up))
  return (fn(gate_out) * up_out).astype(lhs.dtype)


# Checks -----------------------------------------------------------------------------------------


def _check(op, lhs, gate, up, group_sizes):
  for name, x in (("lhs", lhs), ("gate", gate), ("up", up)):
    checks.floating(op, name, x)
  checks.rank(op, "lhs", lhs, 2)
  checks.rank(op, "gate", gate, 3)
  checks.dim(op, "gate", gate, 1, lhs.shape[1], "gate is [groups, K, N]: lhs is [M, K]")
  checks.same_shape(op, ("gate", "up"), (gate, up))
  checks.same_dtype(op, ("lhs", "gate", "up"), (lhs, gate, up))
  gmm._check_sizes(op, lhs, gate.shape[0], group_sizes, weights="gate")


@dataclasses.dataclass(frozen=True)
class GroupedGluConfig(activations.Config):
  precision: object = None


# The op -----------------------------------------------------------------------------------------


def grouped_glu(lhs: jax.Array, gate: jax.Array, up: jax.Array, group_sizes: jax.Array, *,
                activation: str | Callable = "silu", implementation: str | None = None,
                precision=None) -> jax.Array:
  """The experts' gated first layer: ``activation(lhs_e @ gate[e]) * (lhs_e @ up[e])`` for the
  rows of each group ``e``, fused.

  The forward keeps only its inputs for the backward pass, which recomputes the two grouped
  products (see the module docstring); no computed value is kept, so the op tags no residual
  name.

  Args:
    lhs: ``[M, K]``, rows sorted by group.
    gate: ``[G, K, N]``, each group's gate projection, lhs's dtype.
    up: ``[G, K, N]``, each group's up projection, lhs's dtype.
    group_sizes: ``[G]`` integers (int32), non-negative, summing to at most ``M``; rows past
      the sum give zeros. Checked when its value is known while tracing.
    activation: ``"silu"`` (SwiGLU), ``"gelu"`` / ``"gelu_tanh"`` (GEGLU), ``"relu"``, another
      name of :data:`jaxfuse.ops.activations.ACTIVATIONS`, or an elementwise jnp function (not
      with ``implementation="triton"``).
    implementation: ``None``, ``"xla"`` (two grouped products and the gated unit in jnp),
      ``"pallas"`` or ``"triton"`` (one kernel computes both products of a row tile and writes
      the gated unit).
    precision: the XLA products' precision (``None``: HIGHEST for float32, as torch; the
      default for bfloat16 and float16). The kernels always multiply in full precision.

  Returns:
    ``[M, N]`` in lhs's dtype.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxfuse.ops import grouped_glu
    >>> lhs = jnp.ones((5, 2))
    >>> gate = jnp.stack([jnp.eye(2), -jnp.eye(2), 2 * jnp.eye(2)])
    >>> up = 3 * jnp.ones((3, 2, 2))
    >>> grouped_glu(lhs, gate, up, jnp.array([2, 0, 2], jnp.int32), activation="relu")
    Array([[ 6.,  6.],
           [ 6.,  6.],
           [12., 12.],
           [12., 12.],
           [ 0.,  0.]], dtype=float32)
    >>> f = lambda w: grouped_glu(lhs, gate, w, jnp.array([2, 0, 2]), activation="relu").sum()
    >>> jax.grad(f)(up)[:, 0, 0]
    Array([2., 0., 4.], dtype=float32)
  """
  op = GROUPED_GLU.name
  lhs, gate, up = checks.as_array(lhs), checks.as_array(gate), checks.as_array(up)
  if not hasattr(group_sizes, "dtype"):
    group_sizes = np.asarray(group_sizes)
  _check(op, lhs, gate, up, group_sizes)
  activation = activations.canonical(activation, op=op)
  cfg = GROUPED_GLU.config(implementation, GroupedGluConfig, facts={"activation": activation},
                           activation=activation, precision=precision)
  with jax.named_scope(activations.scope(GROUPED_GLU, cfg)):
    return _grouped_glu(cfg, lhs, gate, up, jnp.asarray(group_sizes, jnp.int32))


# Forward and backward ---------------------------------------------------------------------------


def _products(lhs, weights, group_sizes, precision, tiled):
  """``lhs_e @ w[e]`` in float32 for each of ``weights``: the grouped matmul's row-tile loop on
  CPUs (``tiled``), XLA's ragged products elsewhere."""
  if tiled:
    return gmm._tiled_product(lhs, tuple(weights), group_sizes, precision,
                              out_dtype=jnp.float32)
  return tuple(jax.lax.ragged_dot(lhs, w, group_sizes,
                                  precision=gmm._precision(lhs.dtype, precision),
                                  preferred_element_type=jnp.float32,
                                  out_sharding=gmm._out_sharding(lhs, w))
               for w in weights)


def _xla_forward(lhs, gate, up, group_sizes, activation, precision=None, tiled=False):
  gate_out, up_out = _products(lhs, (gate, up), group_sizes, precision, tiled)
  return (activation_grads.value(activation, gate_out) * up_out).astype(lhs.dtype)


def _xla_backward(lhs, gate, up, group_sizes, g, activation, precision=None, tiled=False,
                  products=None):
  """``(d lhs, d gate, d up)``: the products recomputed (or given, float32, as ``products``),
  their gradients elementwise, then the grouped matmul's backward products (its row-tile loops
  with ``tiled``, else XLA's ragged products, which never transpose a weight in memory)."""
  gate_out, up_out = products or _products(lhs, (gate, up), group_sizes, precision, tiled)
  act, grad = activation_grads.value_and_grad(activation, gate_out)
  g32 = g.astype(jnp.float32)
  d_gate_out = (g32 * up_out * grad).astype(lhs.dtype)
  d_up_out = (g32 * act).astype(lhs.dtype)
  pairs = ((d_gate_out, gate), (d_up_out, up))
  if tiled:
    dlhs = sum(gmm._tiled_product(d, w, group_sizes, precision, transpose_rhs=True,
                                  out_dtype=jnp.float32) for d, w in pairs)
    d_gate, d_up = gmm._tiled_rows_product(lhs, (d_gate_out, d_up_out), group_sizes, precision)
  else:
    dlhs = sum(jax.lax.ragged_dot_general(d, w, group_sizes, gmm._LHS_GRAD_DIMS,
                                          precision=gmm._precision(d.dtype, precision),
                                          preferred_element_type=jnp.float32,
                                          out_sharding=gmm._out_sharding())
               for d, w in pairs)
    d_gate, d_up = (gmm._rows_product(lhs, d, group_sizes, precision) for d, _ in pairs)
  return dlhs.astype(lhs.dtype), d_gate.astype(gate.dtype), d_up.astype(up.dtype)


def _rule(*, backward: bool):
  """The partitioning of the kernels and of the XLA products alike: over the output features
  ``n`` only (each device computes its columns of each expert's gate and up; the backward's
  ``d lhs`` is then summed over them). The contraction ``k`` stays whole, since the
  activation of a partial sum is not a partial sum; the rows and the groups stay whole, since
  the groups' row offsets are global. Inside ``jax.shard_map`` each device's rows and group
  sizes are its own problem."""
  lhs, w, sizes, out = ("m", "k"), ("g", "k", "n"), ("g",), ("m", "n")
  if backward:
    operands, results = (lhs, w, w, sizes, out), (lhs, w, w)
  else:
    operands, results = (lhs, w, w, sizes), (out,)
  return partitioning.Rule(operands, results, whole=("m", "g", "k"))


def _forward(lhs, gate, up, group_sizes, cfg):
  def twin(lhs, gate, up, group_sizes):
    return _xla_forward(lhs, gate, up, group_sizes, cfg.activation, cfg.precision)

  def kernel(lhs, gate, up, group_sizes):
    return _xla_forward(lhs, gate, up, group_sizes, cfg.activation, cfg.precision,
                        tiled=gmm._tiles_rows())

  return cfg.run("grouped_glu_forward", twin, lhs, gate, up, group_sizes,
                 rule=_rule(backward=False), xla_kernel=kernel, activation=cfg.activation)


def _backward(lhs, gate, up, group_sizes, g, cfg):
  def twin(lhs, gate, up, group_sizes, g):
    return _xla_backward(lhs, gate, up, group_sizes, g, cfg.activation, cfg.precision)

  def kernel(lhs, gate, up, group_sizes, g):
    return _xla_backward(lhs, gate, up, group_sizes, g, cfg.activation, cfg.precision,
                         tiled=gmm._tiles_rows())

  dlhs, d_gate, d_up = cfg.run("grouped_glu_backward", twin, lhs, gate, up, group_sizes, g,
                               rule=_rule(backward=True), xla_kernel=kernel,
                               activation=cfg.activation)
  return dlhs, d_gate, d_up, None


# The custom VJP ---------------------------------------------------------------------------------


# Residuals: the inputs only (lhs, gate, up and group_sizes); the two products are recomputed.
_grouped_glu = base.recomputing_vjp(
    lambda cfg, lhs, gate, up, group_sizes: _forward(lhs, gate, up, group_sizes, cfg),
    lambda cfg, lhs, gate, up, group_sizes, g: _backward(lhs, gate, up, group_sizes, g, cfg))
