"""Linear layers: the seed's ``recompute_linear`` and ``dense``, with fast weight gradients.

``recompute_linear(x, weight, bias)`` computes ``x @ weight.T + bias`` with torch's layout
(``weight`` is ``[out, in]``). Its forward keeps ``(x, weight, bias)`` and nothing else; its
backward recomputes the layer from them and takes the gradients there, as the seed's
``RecomputationLayer`` does. The residuals are fenced with an optimization barrier so that XLA on
GPUs cannot merge the recomputation back into the forward pass.

A linear layer's gradients need only its inputs, so the recomputed output itself is dead code in
the backward (XLA drops it): what the layer saves is its output, which plain autodiff does not
keep either. The saving shows in a model when the next layer does not keep that output in its
place, see :class:`jaxfuse.nnx.SimpleNN`.

``dense(x, kernel, bias)`` is Flax's ``x @ kernel + bias`` (kernel ``[in, out]``) for the MLP
blocks. Its gradients are autodiff's, but the kernel gradient ``x^T @ g`` (a product over the
rows of both operands) is taken in the layout XLA:CPU multiplies fastest, as is the weight
gradient of ``recompute_linear`` (see :func:`_rows_product`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jaxfuse.ops import base, checks, dispatch, partitioning

# Matmuls: XLA (cuBLAS on GPUs) comes first; the Pallas and Triton kernels are there for fusion
# work and for measurement. dense has no kernel of its own: its products are XLA's.
RECOMPUTE_LINEAR = base.Op("recompute_linear", "linear", base.MATMUL_GPU_ORDER)
DENSE = base.Op("dense", None, base.MATMUL_GPU_ORDER)


def _precision(dtype):
  # Full float32 products, as torch (XLA on GPUs would otherwise use TF32).
  return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def linear_reference(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None
                     ) -> jax.Array:
  """Plain-jnp ``x @ weight.T + bias`` (weight ``[out, in]``), accumulated in float32."""
  y = jax.lax.dot_general(x, weight, (((x.ndim - 1,), (1,)), ((), ())),
                          precision=_precision(x.dtype), preferred_element_type=jnp.float32,
                          out_sharding=partitioning.typed_product_sharding(x, weight, 0))
  if bias is not None:
    y = y + bias.astype(jnp.float32)
  return y.astype(x.dtype)


def _check(op, x, weight, bias, *, name="weight", in_axis=1):
  """Validates a linear layer's arguments; ``weight`` is ``[out, in]`` (``in_axis=1``, torch)
  or ``[in, out]`` (``in_axis=0``, Flax's kernel)."""
  layout = f"{name} is {'[out, in]' if in_axis == 1 else '[in, out]'}"
  checks.floating(op, "x", x)
  checks.floating(op, name, weight)
  checks.rank(op, name, weight, 2)
  if x.ndim < 1:
    raise ValueError(f"{op}: x must have rank >= 1, got shape {tuple(x.shape)}")
  checks.dim(op, "x", x, -1, weight.shape[in_axis], f"{layout}: x's last axis is `in`")
  names, arrays = ["x", name], [x, weight]
  if bias is not None:
    checks.floating(op, "bias", bias)
    checks.rank(op, "bias", bias, 1)
    checks.dim(op, "bias", bias, 0, weight.shape[1 - in_axis], f"{layout}: bias is [out]")
    names.append("bias")
    arrays.append(bias)
  checks.same_dtype(op, names, arrays)


# Below this many multiply-adds the transposed copy of _rows_product costs more than it saves.
_TRANSPOSE_MIN_MACS = 1 << 28


def _rows_product(a, b, out_dtype, precision, out_sharding=None):
  """``a^T @ b`` for ``a`` ``[..., p]`` and ``b`` ``[..., q]``, contracted over every leading
  axis (the rows, not reshaped into one, so that rows split over a mesh stay split): a weight
  gradient.

  XLA:CPU multiplies operands that are both contracted over their rows more slowly than
  row-major ones when ``a`` is the narrower (``p < q``); with ``p >= q`` both layouts ran at the
  same speed. So on CPU, large products with ``p < q`` go through a transposed copy of ``a``
  (kept by an optimization barrier, which XLA would otherwise fold back into the product) and
  a row-major product; everything else is left to XLA. ``python -m benchmarks layouts``
  measures both ways at the MLP shapes. ``out_sharding``: the result's, on Explicit mesh axes
  (the weight's).
  """
  p, q = a.shape[-1], b.shape[-1]
  n = math.prod(a.shape[:-1])
  rows = tuple(range(a.ndim - 1))
  if dispatch.platform() == "cpu" and p < q and n * p * q >= _TRANSPOSE_MIN_MACS:
    a_t = jax.lax.optimization_barrier(jnp.moveaxis(a, -1, 0))
    out = jax.lax.dot_general(a_t, b, ((tuple(r + 1 for r in rows), rows), ((), ())),
                              precision=precision, preferred_element_type=jnp.float32,
                              out_sharding=out_sharding)
  else:
    out = jax.lax.dot_general(a, b, ((rows, rows), ((), ())), precision=precision,
                              preferred_element_type=jnp.float32, out_sharding=out_sharding)
  return out.astype(out_dtype)


def dense(x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None, *,
          precision=None, implementation: str | None = None) -> jax.Array:
  """``x @ kernel + bias`` (Flax's ``Dense`` layout, kernel ``[in, out]``), float32-accumulated.

  The backward keeps what autodiff keeps (``x`` and ``kernel``) and computes the same gradients;
  the kernel gradient ``x^T @ g`` is taken in XLA:CPU's fast layout (see :func:`_rows_product`).

  Args:
    x: ``[..., in]``.
    kernel: ``[in, out]``, x's dtype.
    bias: ``[out]`` or None.
    precision: the products' precision (``None``: the default; HIGHEST avoids TF32 on GPUs).
    implementation: ``None`` or ``"xla"`` (the only one: the products are XLA's).

  Returns:
    ``[..., out]`` in x's dtype, rounded once from float32.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxfuse.ops import dense
    >>> x, k = jnp.ones((2, 3)), jnp.ones((3, 4))
    >>> dense(x, k, jnp.zeros(4))
    Array([[3., 3., 3., 3.],
           [3., 3., 3., 3.]], dtype=float32)
    >>> jax.grad(lambda k: dense(x, k).sum())(k).shape
    (3, 4)
  """
  _check(DENSE.name, x, kernel, bias, name="kernel", in_axis=0)
  DENSE.resolve(implementation)
  with jax.named_scope("jaxfuse.dense"):
    return _dense(x, kernel, bias, precision)


def dense_reference(x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None, *,
                    precision=None) -> jax.Array:
  """Plain-jnp ``x @ kernel + bias`` (kernel ``[in, out]``), accumulated in float32; its
  autodiff gradients are what :func:`dense` computes."""
  y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=precision,
                          preferred_element_type=jnp.float32,
                          out_sharding=partitioning.typed_product_sharding(x, kernel, 1))
  if bias is not None:
    y = y + bias.astype(jnp.float32)
  return y.astype(x.dtype)


@partitioning.matching_vma
@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dense(x, kernel, bias, precision):
  return dense_reference(x, kernel, bias, precision=precision)


def _dense_fwd(x, kernel, bias, precision):
  # Residuals: what autodiff keeps for a matmul, the two operands (and the bias, for its dtype).
  return dense_reference(x, kernel, bias, precision=precision), (x, kernel, bias)


def _dense_bwd(precision, residuals, g):
  x, kernel, bias = residuals
  rows = tuple(range(g.ndim - 1))
  dx = jax.lax.dot_general(g, kernel, (((g.ndim - 1,), (1,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32,
                           out_sharding=partitioning.typed_sharding(x))
  dkernel = _rows_product(x, g, kernel.dtype, precision, partitioning.typed_sharding(kernel))
  dbias = None if bias is None else jnp.sum(g, axis=rows, dtype=jnp.float32).astype(bias.dtype)
  return dx.astype(x.dtype), dkernel, dbias


_dense.defvjp(_dense_fwd, _dense_bwd)


def recompute_linear(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None, *,
                     implementation: str | None = None) -> jax.Array:
  """``x @ weight.T + bias``, keeping only the inputs for the backward pass.

  Args:
    x: ``[..., in]`` float array.
    weight: ``[out, in]`` (torch's ``nn.Linear`` layout), same dtype as ``x``.
    bias: ``[out]`` or None.
    implementation: ``None``, ``"xla"``, or ``"pallas"`` / ``"triton"`` (tiled matmul kernels
      with the bias add fused into the forward and ``dx``, ``dweight``, ``dbias`` as kernels).

  Returns:
    ``[..., out]`` in ``x``'s dtype (float32 accumulation).

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxfuse.ops import recompute_linear
    >>> recompute_linear(jnp.ones((2, 3)), jnp.ones((4, 3)), jnp.zeros(4)).shape
    (2, 4)
  """
  _check(RECOMPUTE_LINEAR.name, x, weight, bias)
  cfg = RECOMPUTE_LINEAR.config(implementation)
  with jax.named_scope("jaxfuse.recompute_linear"):
    return _recompute_linear(cfg, x, weight, bias)


def _xla_backward(x, weight, bias, g):
  """linear_reference's gradients, with the weight gradient in the fast layout.

  The layer's output is not needed: a linear layer's gradients are products of its inputs and
  ``g``.
  """
  rows = tuple(range(g.ndim - 1))
  precision = _precision(x.dtype)
  dx = jax.lax.dot_general(g, weight, (((g.ndim - 1,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32,
                           out_sharding=partitioning.typed_sharding(x)).astype(x.dtype)
  dw = _rows_product(g, x, weight.dtype, precision, partitioning.typed_sharding(weight))
  db = None if bias is None else jnp.sum(g, axis=rows, dtype=jnp.float32).astype(bias.dtype)
  return dx, dw, db


def _rule(x, bias, *, backward):
  """The kernels' partitioning (weight ``[out, in]``): over the rows (any of ``x``'s leading
  axes), the output features (column-parallel) and, without a bias, the input features
  (row-parallel: the output is summed over them). With a bias the input features stay whole,
  since the bias and its gradient are not sums over them."""
  rows_in, weight, vec, rows_out = ("n", "k"), ("m", "k"), ("m",), ("n", "m")
  if backward:
    operands, results = (rows_in, weight, vec, rows_out), (rows_in, weight, vec)
  else:
    operands, results = (rows_in, weight, vec), (rows_out,)
  rule = partitioning.rows_rule(operands, results, lead=x.ndim - 1)
  return dataclasses.replace(rule, whole=("k",) if bias is not None else ())


def _forward(x, weight, bias, cfg):
  return cfg.run("linear_forward", linear_reference, x, weight, bias,
                 rule=_rule(x, bias, backward=False))


def _backward(x, weight, bias, g, cfg):
  return cfg.run("linear_backward", _xla_backward, x, weight, bias, g,
                 rule=_rule(x, bias, backward=True))


# Residuals: the inputs only; the layer is recomputed from them in the backward, behind a barrier
# that keeps XLA from reusing forward values in place of the recomputation.
_recompute_linear = base.recomputing_vjp(
    lambda cfg, x, weight, bias: _forward(x, weight, bias, cfg),
    lambda cfg, x, weight, bias, g: _backward(x, weight, bias, g, cfg), barrier=True)
