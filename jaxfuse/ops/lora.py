"""LoRA: a dense layer and its low-rank adapter in one op,
``x @ kernel + bias + scale * (x @ lora_a) @ lora_b``.

``lora_dense`` is Flax's dense layer (kernel ``[in, out]``) plus the adapter of Hu et al. (2021):
``lora_a`` ``[in, rank]``, ``lora_b`` ``[rank, out]``, ``scale = alpha / rank`` as peft has it.
Its forward keeps the operands (``x`` and the weights, which exist anyway) and the small
``x @ lora_a`` (``[..., rank]``, named ``lora.xa`` so that a recomputation policy may keep it or
recompute it); never the ``[..., out]`` output. The backward computes every gradient, the
kernel's and the bias' included: when only the adapters are trained, the kernel's gradient is
dead code that XLA removes under ``jit`` (the step has no ``[in, out]`` product).

Every product accumulates in float32; the output is rounded once, from float32.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxfuse.ops import base, checks, names, partitioning
from jaxfuse.ops import linear as linear_ops

# XLA-only: its products are cuBLAS's on GPUs; the rank-r products are too thin for a kernel of
# their own to pay.
LORA_DENSE = base.Op("lora_dense", None, base.MATMUL_GPU_ORDER)


def _product(a, b, precision):
  """``a @ b`` contracted over ``a``'s last axis and ``b``'s first, in float32."""
  return jax.lax.dot_general(a, b, (((a.ndim - 1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32,
                             out_sharding=partitioning.typed_product_sharding(a, b, 1))


def _down(x, lora_a, precision):
  """``x @ lora_a`` (``[..., rank]``) in x's dtype: what the forward keeps."""
  return _product(x, lora_a, precision).astype(x.dtype)


def _combine(x, kernel, xa, lora_b, bias, scale, precision):
  y = _product(x, kernel, precision) + scale * _product(xa, lora_b, precision)
  if bias is not None:
    y = y + bias.astype(jnp.float32)
  return y.astype(x.dtype)


def lora_dense_reference(x: jax.Array, kernel: jax.Array, lora_a: jax.Array, lora_b: jax.Array,
                         bias: jax.Array | None = None, *, scale: float, precision=None
                         ) -> jax.Array:
  """Plain-jnp ``x @ kernel + bias + scale * (x @ lora_a) @ lora_b``, accumulated in float32,
  ``x @ lora_a`` rounded to x's dtype as :func:`lora_dense` keeps it; its autodiff gradients
  are what :func:`lora_dense` computes."""
  return _combine(x, kernel, _down(x, lora_a, precision), lora_b, bias, scale, precision)


def _check(x, kernel, lora_a, lora_b, bias, scale):
  op = LORA_DENSE.name
  if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
    raise TypeError(f"{op}: scale must be a finite Python number (alpha / rank), got "
                    f"{scale!r}")
  arrays = {"x": x, "kernel": kernel, "lora_a": lora_a, "lora_b": lora_b}
  if bias is not None:
    arrays["bias"] = bias
  for name, array in arrays.items():
    checks.floating(op, name, array)
  if x.ndim < 1:
    raise ValueError(f"{op}: x must have rank >= 1, got shape {tuple(x.shape)}")
  for name in ("kernel", "lora_a", "lora_b"):
    checks.rank(op, name, arrays[name], 2)
  n_in, n_out = kernel.shape
  checks.dim(op, "x", x, -1, n_in, "kernel is [in, out]: x's last axis is `in`")
  checks.dim(op, "lora_a", lora_a, 0, n_in, "lora_a is [in, rank], kernel is [in, out]")
  checks.dim(op, "lora_b", lora_b, 0, lora_a.shape[1],
             "lora_b is [rank, out]: the rank is lora_a's last axis")
  checks.dim(op, "lora_b", lora_b, 1, n_out, "lora_b is [rank, out], kernel is [in, out]")
  if bias is not None:
    checks.rank(op, "bias", bias, 1)
    checks.dim(op, "bias", bias, 0, n_out, "bias is [out], kernel is [in, out]")
  checks.same_dtype(op, list(arrays), list(arrays.values()))


def lora_dense(x: jax.Array, kernel: jax.Array, lora_a: jax.Array, lora_b: jax.Array,
               bias: jax.Array | None = None, *, scale: float, precision=None,
               implementation: str | None = None) -> jax.Array:
  """``x @ kernel + bias + scale * (x @ lora_a) @ lora_b``, keeping ``x`` and ``x @ lora_a``.

  The backward keeps no ``[..., out]`` value: it takes every gradient from ``x``, the weights
  and ``x @ lora_a`` (``[..., rank]``, named ``lora.xa`` of :mod:`jaxfuse.ops.names`: under
  ``jax.checkpoint`` a policy that does not keep it recomputes it from ``x``). With the kernel
  and bias frozen (not differentiated), their gradients are dead code XLA drops under ``jit``.

  Args:
    x: ``[..., in]``.
    kernel: ``[in, out]`` (Flax's layout).
    lora_a: ``[in, rank]``.
    lora_b: ``[rank, out]``.
    bias: ``[out]`` or None. All arrays share x's dtype (float32, bfloat16 or float16).
    scale: the adapter's factor, a Python number (peft's ``lora_alpha / r``).
    precision: the products' precision (``None``: the default; HIGHEST avoids TF32 on GPUs).
    implementation: ``None`` or ``"xla"`` (the only one: the products are XLA's).

  Returns:
    ``[..., out]`` in x's dtype, rounded once from float32.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxfuse.ops import lora_dense
    >>> x, kernel = jnp.ones((2, 3)), jnp.ones((3, 4))
    >>> lora_a, lora_b = jnp.ones((3, 1)), jnp.full((1, 4), 0.5)
    >>> lora_dense(x, kernel, lora_a, lora_b, scale=2.0)
    Array([[6., 6., 6., 6.],
           [6., 6., 6., 6.]], dtype=float32)
    >>> grad_b = jax.grad(lambda b: lora_dense(x, kernel, lora_a, b, scale=2.0).sum())(lora_b)
    >>> grad_b
    Array([[12., 12., 12., 12.]], dtype=float32)
  """
  _check(x, kernel, lora_a, lora_b, bias, scale)
  LORA_DENSE.resolve(implementation)
  with jax.named_scope("jaxfuse.lora_dense"):
    return _lora_dense(x, kernel, lora_a, lora_b, bias, float(scale), precision)


@partitioning.matching_vma
@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _lora_dense(x, kernel, lora_a, lora_b, bias, scale, precision):
  return lora_dense_reference(x, kernel, lora_a, lora_b, bias, scale=scale, precision=precision)


def _lora_dense_fwd(x, kernel, lora_a, lora_b, bias, scale, precision):
  xa = checkpoint_name(_down(x, lora_a, precision), names.LORA_XA)
  # Residuals: the operands, which exist anyway, and x @ lora_a ([..., rank], named: a policy
  # may recompute it from x). Not the [..., out] output: no gradient needs it.
  return (_combine(x, kernel, xa, lora_b, bias, scale, precision),
          (x, kernel, lora_a, lora_b, bias, xa))


def _lora_dense_bwd(scale, precision, residuals, g):
  x, kernel, lora_a, lora_b, bias, xa = residuals
  last = g.ndim - 1
  # The cotangent of x @ lora_a, [..., rank]: rounded once, like the value it belongs to.
  dxa = scale * jax.lax.dot_general(g, lora_b, (((last,), (1,)), ((), ())), precision=precision,
                                    preferred_element_type=jnp.float32,
                                    out_sharding=partitioning.typed_sharding(xa))
  dxa = dxa.astype(x.dtype)
  dx = (jax.lax.dot_general(g, kernel, (((last,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32,
                            out_sharding=partitioning.typed_sharding(x))
        + jax.lax.dot_general(dxa, lora_a, (((last,), (1,)), ((), ())), precision=precision,
                              preferred_element_type=jnp.float32,
                              out_sharding=partitioning.typed_sharding(x)))
  # Weight gradients, products over the rows: the kernel's is dead code when it is frozen.
  rows_product = linear_ops._rows_product   # dense's, in XLA:CPU's fast layout
  dkernel = rows_product(x, g, kernel.dtype, precision, partitioning.typed_sharding(kernel))
  dlora_a = rows_product(x, dxa, lora_a.dtype, precision, partitioning.typed_sharding(lora_a))
  dlora_b = scale * rows_product(xa, g, jnp.float32, precision,
                                 partitioning.typed_sharding(lora_b))
  dbias = None
  if bias is not None:
    dbias = jnp.sum(g, axis=tuple(range(last)), dtype=jnp.float32).astype(bias.dtype)
  return dx.astype(x.dtype), dkernel, dlora_a, dlora_b.astype(lora_b.dtype), dbias


_lora_dense.defvjp(_lora_dense_fwd, _lora_dense_bwd)
