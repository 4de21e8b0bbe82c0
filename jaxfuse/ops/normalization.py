"""LayerNorm and RMSNorm over the last axis, alone or after a residual add, fused forward and back.

Four ops, one kernel each way:

- :func:`layer_norm` and :func:`rms_norm` normalize ``x``;
- :func:`add_layer_norm` and :func:`add_rms_norm` compute ``z = x + residual`` and normalize it in
  the same kernel, returning ``(normalized, z)``: the pre-norm transformer block, where ``z``
  continues as the residual stream.

What the backward pass keeps: the input rows (``x``, or ``z``, which is an output anyway) and
float32 per-row statistics (the mean for LayerNorm, and the reciprocal standard deviation), never
the normalized output. The backward kernel recomputes the normalized rows from them. Statistics
and arithmetic are float32 for every input dtype; outputs are rounded once.

Implementations: ``"pallas"`` (GPU kernels; interpret mode on CPU for tests), ``"triton"``
(``@triton.jit`` kernels through jax-triton), ``"cpu"`` (C++ kernels through XLA's FFI: one
pass over memory each way, where XLA:CPU takes a loop per reduction and output) and ``"xla"``, a ``custom_vjp`` with hand-written
backward formulas, arranged so that XLA:CPU fuses each reduction with its elementwise inputs and
keeps no full-size temporaries.

Derivatives: reverse mode to any order, on every implementation: ``jax.grad`` of a function of
``jax.grad`` and Hessian-vector products by forward over reverse
(``jax.jvp(jax.grad(f), ...)``) differentiate the backward pass, whose kernels take the
derivative of their XLA twins (:func:`jaxfuse.ops.base.kernel_call`). Forward mode on an op
itself (``jax.jvp(rms_norm, ...)``) is not supported: the ops are ``jax.custom_vjp`` functions,
for which JAX raises a TypeError.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jaxfuse.ops import add_rms_norm, rms_norm
  >>> x = jnp.array([[2.0, -2.0], [0.5, 0.5]])
  >>> rms_norm(x, jnp.ones(2), eps=0.0)
  Array([[ 1., -1.],
         [ 1.,  1.]], dtype=float32)
  >>> normed, stream = add_rms_norm(x, x, jnp.ones(2), eps=0.0)
  >>> stream
  Array([[ 4., -4.],
         [ 1.,  1.]], dtype=float32)
"""

from __future__ import annotations

import dataclasses
import functools
from numbers import Real

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxfuse.ops import base, checks, names, partitioning

# On CPUs the CPU kernels run forward + backward (4096 x 1024 float32, the norm suite, four runs)
# in 0.66-0.73x XLA's time for LayerNorm, 0.82-0.96x for add + RMSNorm and 0.97-1.04x for
# RMSNorm alone. XLA keeps the RMSNorms: RMSNorm's kernels gain nothing, and with add +
# RMSNorm's the decoder's gradients under recomputation are no longer bitwise those without it
# (they differ by about 1e-7; tests/test_remat_decoder.py).
LAYER_NORM = base.Op("layer_norm", "normalization")
RMS_NORM = base.Op("rms_norm", "normalization", cpu_order=base.XLA_FIRST_ON_CPU)
ADD_LAYER_NORM = base.Op("add_layer_norm", "normalization")
ADD_RMS_NORM = base.Op("add_rms_norm", "normalization", cpu_order=base.XLA_FIRST_ON_CPU)
# The unfused baseline has no CPU kernels: its add is the elementwise kernels' own.
ADD_RMS_NORM_UNFUSED = base.Op("add_rms_norm_unfused", "normalization", kinds=("pallas", "triton"))


# Plain-jnp references ---------------------------------------------------------------------------


def layer_norm_reference(x: jax.Array, scale: jax.Array | None = None,
                         bias: jax.Array | None = None, *, eps: float = 1e-5) -> jax.Array:
  """Plain-jnp LayerNorm over the last axis, in float32 (or wider), differentiated by JAX."""
  xf = x.astype(base.compute_dtype(x.dtype))
  mean = jnp.mean(xf, axis=-1, keepdims=True)
  centered = xf - mean
  var = jnp.mean(centered * centered, axis=-1, keepdims=True)
  y = centered * jax.lax.rsqrt(var + eps)
  if scale is not None:
    y = y * scale.astype(y.dtype)
  if bias is not None:
    y = y + bias.astype(y.dtype)
  return y.astype(x.dtype)


def rms_norm_reference(x: jax.Array, scale: jax.Array | None = None, *,
                       eps: float = 1e-6) -> jax.Array:
  """Plain-jnp RMSNorm over the last axis, in float32 (or wider), differentiated by JAX."""
  xf = x.astype(base.compute_dtype(x.dtype))
  y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  if scale is not None:
    y = y * scale.astype(y.dtype)
  return y.astype(x.dtype)


def add_layer_norm_reference(x, residual, scale=None, bias=None, *, eps: float = 1e-5):
  """Plain-jnp ``(layer_norm(x + residual), x + residual)``."""
  z = x + residual
  return layer_norm_reference(z, scale, bias, eps=eps), z


def add_rms_norm_reference(x, residual, scale=None, *, eps: float = 1e-6):
  """Plain-jnp ``(rms_norm(x + residual), x + residual)``."""
  z = x + residual
  return rms_norm_reference(z, scale, eps=eps), z


# Checks and config ------------------------------------------------------------------------------


def _check(op, x, residual, scale, bias, eps):
  checks.floating(op, "x", x)
  if x.ndim < 1:
    raise ValueError(f"{op}: x must have rank >= 1 (features on the last axis), got shape ()")
  hidden = x.shape[-1]
  if residual is not None:
    checks.floating(op, "residual", residual)
    checks.same_shape(op, ("x", "residual"), (x, residual))
    checks.same_dtype(op, ("x", "residual"), (x, residual))
  for name, p in (("scale", scale), ("bias", bias)):
    if p is None:
      continue
    checks.floating(op, name, p)
    checks.rank(op, name, p, 1)
    checks.dim(op, name, p, 0, hidden, "the last axis of x")
  if isinstance(eps, bool) or not isinstance(eps, Real) or not eps >= 0:
    raise ValueError(f"{op}: eps must be a non-negative number, got {eps!r}")


@dataclasses.dataclass(frozen=True)
class _Config(base.Config):
  centered: bool   # LayerNorm (subtract the mean) or RMSNorm
  eps: float


def _config(op: base.Op, x, implementation, *, centered, eps) -> _Config:
  """``None`` takes XLA for rows wider than the kernels hold; asked for by name, a kernel set
  that cannot hold them raises."""
  return op.config(implementation, _Config, facts={"hidden": x.shape[-1]}, centered=centered,
                   eps=float(eps))


# Public ops -------------------------------------------------------------------------------------


def layer_norm(x: jax.Array, scale: jax.Array | None = None, bias: jax.Array | None = None, *,
               eps: float = 1e-5, implementation: str | None = None) -> jax.Array:
  """LayerNorm over the last axis: ``(x - mean) / sqrt(var + eps) * scale + bias``.

  As ``torch.nn.LayerNorm(H, eps)``; ``scale=None`` is ``elementwise_affine=False`` and
  ``bias=None`` is ``bias=False``.

  Args:
    x: float32, bfloat16 or float16, any shape ``(..., H)``.
    scale: ``(H,)`` or None. May have another float dtype than ``x`` (its gradient has its own).
    bias: ``(H,)`` or None.
    eps: added to the variance.
    implementation: ``None`` (the fastest here), ``"pallas"``, ``"triton"``, ``"cpu"`` or
      ``"xla"``.

  Returns:
    The normalized ``x``, in ``x``'s dtype.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxfuse.ops import layer_norm
    >>> layer_norm(jnp.array([[1.0, 3.0]]), jnp.ones(2), jnp.zeros(2), eps=0.0)
    Array([[-1.,  1.]], dtype=float32)
  """
  return _apply(LAYER_NORM, x, None, scale, bias, eps, implementation, centered=True)


def rms_norm(x: jax.Array, scale: jax.Array | None = None, *, eps: float = 1e-6,
             implementation: str | None = None) -> jax.Array:
  """RMSNorm over the last axis: ``x / sqrt(mean(x**2) + eps) * scale``.

  As ``torch.nn.RMSNorm(H, eps)``; ``scale=None`` is ``elementwise_affine=False``.

  Args:
    x: float32, bfloat16 or float16, any shape ``(..., H)``.
    scale: ``(H,)`` or None.
    eps: added to the mean square.
    implementation: ``None`` (the fastest here), ``"pallas"``, ``"triton"``, ``"cpu"`` or
      ``"xla"``.

  Returns:
    The normalized ``x``, in ``x``'s dtype.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxfuse.ops import rms_norm
    >>> rms_norm(jnp.array([[2.0, -2.0]]), eps=0.0)
    Array([[ 1., -1.]], dtype=float32)
  """
  return _apply(RMS_NORM, x, None, scale, None, eps, implementation, centered=False)


def add_layer_norm(x: jax.Array, residual: jax.Array, scale: jax.Array | None = None,
                   bias: jax.Array | None = None, *, eps: float = 1e-5,
                   implementation: str | None = None) -> tuple[jax.Array, jax.Array]:
  """``z = x + residual`` and ``layer_norm(z)`` in one kernel; returns ``(normalized, z)``.

  ``z`` is rounded to ``x``'s dtype before it is normalized, exactly as the two-step chain
  ``z = x + residual; layer_norm(z)`` would do.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxfuse.ops import add_layer_norm
    >>> normed, z = add_layer_norm(jnp.array([[1.0, 2.0]]), jnp.array([[0.0, 1.0]]), eps=0.0)
    >>> normed, z
    (Array([[-1.,  1.]], dtype=float32), Array([[1., 3.]], dtype=float32))
  """
  return _apply(ADD_LAYER_NORM, x, residual, scale, bias, eps, implementation, centered=True)


def add_rms_norm(x: jax.Array, residual: jax.Array, scale: jax.Array | None = None, *,
                 eps: float = 1e-6,
                 implementation: str | None = None) -> tuple[jax.Array, jax.Array]:
  """``z = x + residual`` and ``rms_norm(z)`` in one kernel; returns ``(normalized, z)``.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxfuse.ops import add_rms_norm
    >>> normed, z = add_rms_norm(jnp.array([[1.0, 3.0]]), jnp.array([[2.0, 1.0]]), eps=0.0)
    >>> z
    Array([[3., 4.]], dtype=float32)
  """
  return _apply(ADD_RMS_NORM, x, residual, scale, None, eps, implementation, centered=False)


def _apply(op: base.Op, x, residual, scale, bias, eps, implementation, *, centered):
  x = checks.as_array(x)
  residual = None if residual is None else checks.as_array(residual)
  scale = None if scale is None else checks.as_array(scale)
  bias = None if bias is None else checks.as_array(bias)
  _check(op.name, x, residual, scale, bias, eps)
  cfg = _config(op, x, implementation, centered=centered, eps=eps)
  if x.size == 0:  # Nothing to normalize (or no features): the plain formulas handle it.
    reference = layer_norm_reference if centered else rms_norm_reference
    params = (scale, bias) if centered else (scale,)
    if residual is None:
      return reference(x, *params, eps=eps)
    z = x + residual
    return reference(z, *params, eps=eps), z
  with jax.named_scope(f"jaxfuse.{op.name}"):
    return _normalize(x, residual, scale, bias, cfg)


# The XLA implementation (and the kernels' twin) -------------------------------------------------
#
# Written for XLA:CPU, whose reductions run as YNNPACK fusions that take elementwise producers
# along but not every broadcast: a reduction whose operand needs a broadcast it cannot take makes
# XLA write that operand out in full. Measured on 16384 x 4096 float32, each such full-size
# temporary costs about as much as the whole rest of the backward pass, so the formulas below
# are arranged to have none:
# - per-row and per-feature vectors enter the reductions as (rows, 1) and (1, H) arrays, passed
#   through an optimization barrier so that XLA keeps that form;
# - the two reductions over x and g are written with different association, so that XLA does not
#   share (and so materialize) their common product;
# - the per-row coefficients of the input gradient go through a select, which keeps them out of
#   the reduction's fusion when there are more than 4096 rows (otherwise XLA merges the input
#   gradient into that fusion and materializes its broadcasts).
#
# The functions return exactly what the kernels return (the same outputs, None entries, dtypes
# and shapes): they are the kernels' twins, whose derivatives second-order gradients take.


def _opaque(value, rstd):
  """``value``, through a select XLA cannot see through (NaN where ``rstd`` is NaN, as
  ``value`` is then anyway)."""
  return jnp.where(jnp.isnan(rstd), rstd, value)


def _xla_forward(x, residual, scale, bias, *, centered, eps, store_stats):
  """``(y, z, mean, rstd)`` as :func:`jaxfuse.kernels.pallas.normalization.forward` returns
  them: z None without a residual; mean None unless centered and ``store_stats``; rstd None
  unless ``store_stats``."""
  cd = base.compute_dtype(x.dtype)
  z = None
  if residual is not None:
    z = (x.astype(cd) + residual.astype(cd)).astype(x.dtype)
    xf = z.astype(cd)
  else:
    xf = x.astype(cd)
  hidden = x.shape[-1]
  if centered:
    mean = jnp.sum(xf, axis=-1, keepdims=True) * (1.0 / hidden)
    mean_1 = jax.lax.optimization_barrier(mean)
    d = xf - mean_1
    var = jnp.sum(d * d, axis=-1, keepdims=True) * (1.0 / hidden)
    rstd = jax.lax.rsqrt(var + eps)
    y = (xf - mean) * rstd
  else:
    mean = None
    rstd = jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) * (1.0 / hidden) + eps)
    y = xf * rstd
  if scale is not None:
    y = y * scale.astype(cd)
  if bias is not None:
    y = y + bias.astype(cd)
  if not store_stats:
    mean = rstd = None
  return y.astype(x.dtype), z, mean, rstd


def _xla_backward(rows, g, g_sum, scale, mean, rstd, *, has_bias):
  """``(dx, dscale, dbias)`` as :func:`jaxfuse.kernels.pallas.normalization.backward` returns
  them: dx in the rows' dtype, the parameter gradients in float32 (None where absent)."""
  cd = base.compute_dtype(rows.dtype)
  x = rows.astype(cd)
  g = g.astype(cd)
  hidden = x.shape[-1]
  lead = tuple(range(x.ndim - 1))   # the row axes (one on the kernels' 2-D rows)
  s = None if scale is None else scale.astype(cd)
  s_row = None if s is None else s.reshape((1,) * len(lead) + (hidden,))
  # (1, H) and (rows, 1) forms of the per-feature and per-row vectors, kept as such (see above).
  s_1, rstd_1, mean_1 = jax.lax.optimization_barrier((s_row, rstd, mean))
  if mean is None:
    # Row sums sum(g*s * x); feature sums sum(g * xhat) = sum(x * g*rstd).
    c1 = jnp.sum((g if s is None else g * s_1) * x, axis=-1, keepdims=True)
    dscale = None if s is None else jnp.sum(x * (g * rstd_1), axis=lead)
    c2 = None
  else:
    # Row sums sum(g*s * (x - mean)) and sum(g*s); feature sums sum(g * xhat). Each is written
    # with its own association, so that no product is shared (and so written out) between them.
    s_2, mean_2 = jax.lax.optimization_barrier((s_row, mean))
    xc_1 = x - mean_1
    c1 = jnp.sum(g * (xc_1 if s is None else s_1 * xc_1), axis=-1, keepdims=True)
    c2 = jnp.sum(g if s is None else g * s_2, axis=-1, keepdims=True)
    dscale = None if s is None else -jnp.sum((g * rstd_1) * (mean_2 - x), axis=lead)
  dbias = jnp.sum(g, axis=lead) if has_bias else None
  r3 = rstd * rstd * rstd * (1.0 / hidden)
  coef1 = _opaque(r3 * c1, rstd)
  xc = x if mean is None else x - mean
  gs = g if s is None else g * s
  dx = rstd * gs - xc * coef1
  if c2 is not None:
    dx = dx - _opaque(rstd * (1.0 / hidden) * c2, rstd)
  if g_sum is not None:
    dx = dx + g_sum.astype(cd)
  return dx.astype(rows.dtype), dscale, dbias


# Forward and backward ---------------------------------------------------------------------------


def _rules(ndim: int):
  """The kernels' partitioning for arrays of rank ``ndim``: over any of the row axes; the
  features stay whole; the parameters' gradients are summed over the rows. The XLA formulas
  go through the same rules (on one device, on 2-D rows as the kernels)."""
  r, f, s, lead = partitioning.ROWS, partitioning.FEATURES, partitioning.ROW_STATS, ndim - 1
  return (partitioning.rows_rule((r, r, f, f), (r, r, s, s), lead=lead),
          partitioning.rows_rule((r, r, r, f, s, s), (r, f, f), lead=lead),
          partitioning.rows_rule((r, r), (r,), lead=lead, split_features=True))


def _forward(x, residual, scale, bias, cfg, *, store_stats):
  """``(y, z, mean, rstd)``: z is None without a residual; the float32 ``(..., 1)``
  statistics are None unless ``store_stats`` (and the mean for RMSNorm always is)."""
  twin = functools.partial(_xla_forward, centered=cfg.centered, eps=cfg.eps,
                           store_stats=store_stats)
  return cfg.run("forward", twin, x, residual, scale, bias, rule=_rules(x.ndim)[0],
                 xla_kernel=twin, eps=cfg.eps, centered=cfg.centered, store_stats=store_stats)


def _backward(rows, g, g_sum, scale, bias, mean, rstd, cfg):
  """``(dx, dscale, dbias)``; the parameter gradients in float32 (None where absent)."""
  twin = functools.partial(_xla_backward, has_bias=bias is not None)
  return cfg.run("backward", twin, rows, g, g_sum, scale, mean, rstd, rule=_rules(rows.ndim)[1],
                 xla_kernel=twin, has_bias=bias is not None)


# The custom VJP ---------------------------------------------------------------------------------


@partitioning.matching_vma
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _normalize(x, residual, scale, bias, cfg):
  y, z, _, _ = _forward(x, residual, scale, bias, cfg, store_stats=False)
  return y if residual is None else (y, z)


def _normalize_fwd(x, residual, scale, bias, cfg):
  y, z, mean, rstd = _forward(x, residual, scale, bias, cfg, store_stats=True)
  # Residuals: the rows that were normalized (x, or z = x + residual, which is an output) and the
  # float32 per-row statistics. The normalized rows are recomputed in the backward pass.
  rows = x if residual is None else z
  rows, y = checkpoint_name(rows, names.NORM_INPUT), checkpoint_name(y, names.NORM_OUT)
  rstd = checkpoint_name(rstd, names.NORM_RSTD)
  mean = None if mean is None else checkpoint_name(mean, names.NORM_MEAN)
  out = y if residual is None else (y, rows)
  return out, (rows, scale, bias, mean, rstd)


def _normalize_bwd(cfg, saved, cotangents):
  rows, scale, bias, mean, rstd = saved
  has_residual = isinstance(cotangents, tuple)  # (dy, dz) for the add variants
  g, g_sum = cotangents if has_residual else (cotangents, None)
  dx, dscale, dbias = _backward(rows, g, g_sum, scale, bias, mean, rstd, cfg)
  dscale = None if scale is None else dscale.astype(scale.dtype)
  dbias = None if bias is None else dbias.astype(bias.dtype)
  return dx, (dx if has_residual else None), dscale, dbias


# Plain defvjp: optimize_remat=True would let the primal pass under remat run the kernel that
# stores no statistics, but it breaks reverse over reverse.
_normalize.defvjp(_normalize_fwd, _normalize_bwd)


# The unfused chain ------------------------------------------------------------------------------


def add_rms_norm_unfused(x: jax.Array, residual: jax.Array, scale: jax.Array | None = None, *,
                         eps: float = 1e-6,
                         implementation: str | None = None) -> tuple[jax.Array, jax.Array]:
  """The baseline :func:`add_rms_norm` is measured against: an add kernel, then rms_norm.

  ``z = x + residual`` is written by its own kernel and read back by the normalization kernels.
  In the backward pass the normalization's gradient for ``z`` and ``z``'s own output gradient
  are combined by another add kernel, as two separately written layers (or PyTorch's autograd)
  would do. With ``implementation="xla"`` the adds are plain jnp.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxfuse.ops import add_rms_norm_unfused
    >>> add_rms_norm_unfused(jnp.array([[1.0, -3.0]]), jnp.array([[1.0, 1.0]]), eps=0.0)[0]
    Array([[ 1., -1.]], dtype=float32)
  """
  op = ADD_RMS_NORM_UNFUSED
  x, residual = checks.as_array(x), checks.as_array(residual)
  scale = None if scale is None else checks.as_array(scale)
  _check(op.name, x, residual, scale, None, eps)
  cfg = _config(op, x, implementation, centered=False, eps=eps)
  if x.size == 0:
    z = x + residual
    return rms_norm_reference(z, scale, eps=eps), z
  with jax.named_scope(f"jaxfuse.{op.name}"):
    return _add_then_norm(x, residual, scale, cfg)


def _xla_add(a, b):
  return a + b


def _add(a, b, cfg):
  """``a + b`` by the elementwise add kernel of ``cfg``'s kind (plain jnp on XLA)."""
  return cfg.run("elementwise.add_forward", _xla_add, a, b, rule=_rules(a.ndim)[2])


@partitioning.matching_vma
@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _add_then_norm(x, residual, scale, cfg):
  return _add_then_norm_fwd(x, residual, scale, cfg)[0]


def _add_then_norm_fwd(x, residual, scale, cfg):
  z = _add(x, residual, cfg)
  y, _, _, rstd = _forward(z, None, scale, None, cfg, store_stats=True)
  # Residuals: the sum z, written by the add kernel and kept, and the float32 rstd.
  z, y = checkpoint_name(z, names.NORM_INPUT), checkpoint_name(y, names.NORM_OUT)
  rstd = checkpoint_name(rstd, names.NORM_RSTD)
  return (y, z), (z, scale, rstd)


def _add_then_norm_bwd(cfg, saved, cotangents):
  z, scale, rstd = saved
  g, g_sum = cotangents
  dz, dscale, _ = _backward(z, g, None, scale, None, None, rstd, cfg)
  dz = _add(dz, g_sum.astype(dz.dtype), cfg)
  return dz, dz, None if scale is None else dscale.astype(scale.dtype)


_add_then_norm.defvjp(_add_then_norm_fwd, _add_then_norm_bwd)


# For the Flax modules ---------------------------------------------------------------------------


def check_module_options(module: str, ndim: int, *, reduction_axes, feature_axes, axis_name,
                         mask) -> None:
  """Raises for the Flax normalization options these ops do not cover, naming the option.

  The ops normalize over the last axis of one array, with per-feature parameters on that axis.
  """
  last = ndim - 1
  for name, axes in (("reduction_axes", reduction_axes), ("feature_axes", feature_axes)):
    listed = axes if isinstance(axes, (tuple, list)) else (axes,)
    if len(listed) != 1 or not isinstance(listed[0], int) or listed[0] % max(ndim, 1) != last:
      raise NotImplementedError(f"{module}: {name} must be the last axis (-1), got {axes!r}")
  if axis_name is not None:
    raise NotImplementedError(f"{module}: axis_name (statistics across devices) is not "
                              f"supported, got {axis_name!r}")
  if mask is not None:
    raise NotImplementedError(f"{module}: mask is not supported")
