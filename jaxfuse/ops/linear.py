"""The seed's recomputation example: a linear layer that saves only its inputs.

``recompute_linear(x, weight, bias)`` computes ``x @ weight.T + bias`` with torch's layout
(``weight`` is ``[out, in]``). Its forward keeps ``(x, weight, bias)`` and nothing else; its
backward recomputes the layer from them and takes the gradients there, as the seed's
``RecomputationLayer`` does. The residuals are fenced with an optimization barrier so that XLA on
GPUs cannot merge the recomputation back into the forward pass.

A linear layer's gradients need only its inputs, so the recomputed output itself is dead code in
the backward (XLA drops it): what the layer saves is its output, which plain autodiff does not
keep either. The saving shows in a model when the next layer does not keep that output in its
place, see :class:`jaxfuse.nnx.SimpleNN`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxfuse.kernels.pallas import linear as pallas_linear
from jaxfuse.ops import checks, dispatch

_IMPLEMENTATIONS = ("pallas", "xla")
# cuBLAS through XLA beats a simple Pallas tile loop on GPUs; Pallas is there for fusion work
# and for measurement.
_PREFERENCE = {"gpu": ("xla", "pallas"), "cpu": ("xla",)}


def _precision(dtype):
  # Full float32 products, as torch (XLA on GPUs would otherwise use TF32).
  return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def linear_reference(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None
                     ) -> jax.Array:
  """Plain-jnp ``x @ weight.T + bias`` (weight ``[out, in]``), accumulated in float32."""
  y = jax.lax.dot_general(x, weight, (((x.ndim - 1,), (1,)), ((), ())),
                          precision=_precision(x.dtype), preferred_element_type=jnp.float32)
  if bias is not None:
    y = y + bias.astype(jnp.float32)
  return y.astype(x.dtype)


def _check(op, x, weight, bias):
  checks.floating(op, "x", x)
  checks.floating(op, "weight", weight)
  checks.rank(op, "weight", weight, 2)
  if x.ndim < 1:
    raise ValueError(f"{op}: x must have rank >= 1, got shape {tuple(x.shape)}")
  checks.dim(op, "x", x, -1, weight.shape[1], "weight is [out, in]: x's last axis is `in`")
  names, arrays = ["x", "weight"], [x, weight]
  if bias is not None:
    checks.floating(op, "bias", bias)
    checks.rank(op, "bias", bias, 1)
    checks.dim(op, "bias", bias, 0, weight.shape[0], "weight is [out, in]: bias is [out]")
    names.append("bias")
    arrays.append(bias)
  checks.same_dtype(op, names, arrays)


def recompute_linear(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None, *,
                     implementation: str | None = None) -> jax.Array:
  """``x @ weight.T + bias``, keeping only the inputs for the backward pass.

  Args:
    x: ``[..., in]`` float array.
    weight: ``[out, in]`` (torch's ``nn.Linear`` layout), same dtype as ``x``.
    bias: ``[out]`` or None.
    implementation: ``None``, ``"pallas"`` (tiled matmul kernels with the bias add fused into
      the forward and ``dx``, ``dweight``, ``dbias`` as kernels) or ``"xla"``.

  Returns:
    ``[..., out]`` in ``x``'s dtype (float32 accumulation).

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxfuse.ops import recompute_linear
    >>> recompute_linear(jnp.ones((2, 3)), jnp.ones((4, 3)), jnp.zeros(4)).shape
    (2, 4)
  """
  op = "recompute_linear"
  _check(op, x, weight, bias)
  impl = dispatch.resolve(op, implementation, _IMPLEMENTATIONS, _PREFERENCE)
  interpret = impl == "pallas" and not dispatch.on_gpu()
  with jax.named_scope("jaxfuse.recompute_linear"):
    return _recompute_linear(x, weight, bias, impl, interpret)


def _forward(x, weight, bias, impl, interpret):
  if impl == "xla":
    return linear_reference(x, weight, bias)
  x2 = x.reshape(-1, x.shape[-1])
  y = pallas_linear.matmul(x2, weight, bias=bias, interpret=interpret, name="linear_fwd")
  return y.reshape(*x.shape[:-1], weight.shape[0])


def _backward(x, weight, bias, g, impl, interpret):
  if impl == "xla":
    # Recompute the layer from its inputs and pull the cotangent back through it.
    _, pullback = jax.vjp(linear_reference, x, weight, bias)
    return pullback(g)
  x2 = x.reshape(-1, x.shape[-1])
  g2 = g.reshape(-1, g.shape[-1])
  dx = pallas_linear.matmul(g2, weight, a_layout="ik", b_layout="kj", interpret=interpret,
                            name="linear_dx")
  dw = pallas_linear.matmul(g2, x2, a_layout="ki", b_layout="kj", out_dtype=weight.dtype,
                            interpret=interpret, name="linear_dweight")
  db = None
  if bias is not None:
    db = pallas_linear.sum_rows(g2, out_dtype=bias.dtype, interpret=interpret,
                                name="linear_dbias")
  return dx.reshape(x.shape), dw, db


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _recompute_linear(x, weight, bias, impl, interpret):
  return _forward(x, weight, bias, impl, interpret)


def _recompute_linear_fwd(x, weight, bias, impl, interpret):
  return _forward(x, weight, bias, impl, interpret), (x, weight, bias)


def _recompute_linear_bwd(impl, interpret, residuals, g):
  # The barrier keeps XLA from reusing forward values in place of the recomputation.
  x, weight, bias = jax.lax.optimization_barrier(residuals)
  return _backward(x, weight, bias, g, impl, interpret)


_recompute_linear.defvjp(_recompute_linear_fwd, _recompute_linear_bwd, optimize_remat=True)
