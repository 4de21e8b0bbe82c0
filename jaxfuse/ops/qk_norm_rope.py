"""RMSNorm of query or key heads, then the rotary embedding, fused (Qwen3, Gemma 3, OLMo 2).

``qk_norm_rope(x, scale, cos, sin)`` normalizes each head of ``x`` (or, with
``over="projection"``, the whole projection across heads, as OLMo 2 does), scales it by
``scale + scale_offset`` (Gemma's ``1 + w``) and rotates it by the rotary embedding's ``cos``
and ``sin`` (the rotate-half convention of Llama and its successors). The kernels read ``x``
once and write the result once; unfused, the norm's output is written and read back by the
rotation. The backward keeps only the inputs: it recomputes the statistics from ``x``, rotates
the output gradient back and writes ``dx`` and the scale's gradient. Arithmetic is float32 for
every input dtype; the output is rounded once.
"""

from __future__ import annotations

import dataclasses
import functools
from numbers import Real

import jax
import jax.numpy as jnp

from jaxfuse.ops import base, checks, partitioning

QK_NORM_ROPE = base.Op("qk_norm_rope", "qk_norm_rope", base.KERNEL_GPU_ORDER)
_OVER = ("head", "projection")


# Reference --------------------------------------------------------------------------------------


def qk_norm_rope_reference(x: jax.Array, scale: jax.Array | None, cos: jax.Array,
                           sin: jax.Array, *, eps: float = 1e-6, scale_offset: float = 0.0,
                           over: str = "head") -> jax.Array:
  """Plain-jnp RMSNorm (per head or over the projection) then the rotation, in float32."""
  xf = x.astype(base.compute_dtype(x.dtype))
  axes = (-1,) if over == "head" else (-2, -1)
  y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=axes, keepdims=True) + eps)
  if scale is not None:
    y = y * (scale.astype(y.dtype).reshape(x.shape[-2:] if over == "projection" else (-1,))
             + scale_offset)
  half = x.shape[-1] // 2
  c = cos.astype(y.dtype)[..., None, :]
  s = sin.astype(y.dtype)[..., None, :]
  y1, y2 = y[..., :half], y[..., half:]
  return jnp.concatenate([y1 * c - y2 * s, y2 * c + y1 * s], axis=-1).astype(x.dtype)


# Checks and config ------------------------------------------------------------------------------


def _check(op, x, scale, cos, sin, eps, over, scale_offset):
  checks.floating(op, "x", x)
  if x.ndim < 3:
    raise ValueError(f"{op}: x must be [batch..., seq, heads, head_dim], got shape "
                     f"{tuple(x.shape)}")
  heads, d = x.shape[-2:]
  if d % 2:
    raise ValueError(f"{op}: x must have an even head dim, got shape {tuple(x.shape)}")
  if over not in _OVER:
    raise ValueError(f"{op}: over must be one of {_OVER}, got {over!r}")
  if scale is not None:
    checks.floating(op, "scale", scale)
    checks.rank(op, "scale", scale, 1)
    width = d if over == "head" else heads * d
    checks.dim(op, "scale", scale, 0, width,
               "the head dim" if over == "head" else "heads * head_dim, over='projection'")
  for name, table in (("cos", cos), ("sin", sin)):
    checks.floating(op, name, table)
    lead = x.shape[:-2]
    if table.shape[-1:] != (d // 2,) or table.ndim < 2 or (
        table.shape[:-1] != lead[-1:] and table.shape[:-1] != lead):
      raise ValueError(f"{op}: {name} must be [seq, head_dim // 2] or [batch..., seq, "
                       f"head_dim // 2] = {lead + (d // 2,)}, got shape {tuple(table.shape)}")
  if isinstance(eps, bool) or not isinstance(eps, Real) or not eps >= 0:
    raise ValueError(f"{op}: eps must be a non-negative number, got {eps!r}")
  if isinstance(scale_offset, bool) or not isinstance(scale_offset, Real):
    raise TypeError(f"{op}: scale_offset must be a Python number, got {scale_offset!r}")


@dataclasses.dataclass(frozen=True)
class _Config(base.Config):
  eps: float
  offset: float
  whole: bool   # the norm spans the projection (all heads)


# The op -----------------------------------------------------------------------------------------


def qk_norm_rope(x: jax.Array, scale: jax.Array | None, cos: jax.Array, sin: jax.Array, *,
                 eps: float = 1e-6, scale_offset: float = 0.0, over: str = "head",
                 implementation: str | None = None) -> jax.Array:
  """``rope(rms_norm(x) * (scale + scale_offset))`` of query or key heads, in one pass.

  As Qwen3's ``q_norm`` (``over="head"``), Gemma 3's (``scale_offset=1.0``) and OLMo 2's
  (``over="projection"``: one norm over all heads), each followed by ``apply_rotary_pos_emb``.

  Args:
    x: ``[batch..., seq, heads, head_dim]`` (the attention layout), float32, bfloat16 or
      float16, with an even head dim.
    scale: ``[head_dim]``, or ``[heads * head_dim]`` with ``over="projection"``; or None.
    cos, sin: the rotation of each position, ``[seq, head_dim // 2]`` or ``[batch..., seq,
      head_dim // 2]`` (float32 recommended; see :func:`jaxfuse.ops.rotary_embedding` for how
      they are made); they carry no gradient.
    eps: added to the mean square.
    scale_offset: added to ``scale`` (Gemma's norms multiply by ``1 + scale``).
    over: ``"head"`` (each head normalized alone) or ``"projection"`` (all heads together).
    implementation: ``None`` (the fastest here), ``"pallas"``, ``"triton"`` or ``"xla"``.

  Returns:
    The rotated, normalized ``x``, in its dtype.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxfuse.ops import qk_norm_rope
    >>> x = jnp.array([[[[3.0, 0.0, 4.0, 0.0]]]])           # [batch, seq, heads, head_dim]
    >>> angle = jnp.array([[jnp.pi / 2, 0.0]])               # [seq, head_dim // 2]
    >>> qk_norm_rope(x, None, jnp.cos(angle), jnp.sin(angle), eps=0.0).round(3)
    Array([[[[-1.6,  0. ,  1.2,  0. ]]]], dtype=float32)
  """
  op = QK_NORM_ROPE.name
  x, cos, sin = checks.as_array(x), checks.as_array(cos), checks.as_array(sin)
  scale = None if scale is None else checks.as_array(scale)
  _check(op, x, scale, cos, sin, eps, over, scale_offset)
  cfg = QK_NORM_ROPE.config(implementation, _Config, eps=float(eps),
                            offset=float(scale_offset), whole=over == "projection")
  lead = x.shape[:-2]
  cos, sin = (jnp.broadcast_to(t, lead + t.shape[-1:]).astype(jnp.float32) for t in (cos, sin))
  if x.size == 0:
    return qk_norm_rope_reference(x, scale, cos, sin, eps=eps, scale_offset=scale_offset,
                                  over=over)
  with jax.named_scope(f"jaxfuse.{op}"):
    return _qk_norm_rope(cfg, x, scale, cos, sin)


# Forward and backward ---------------------------------------------------------------------------
#
# The XLA formulas work on x as it is, ``[rows..., heads, head_dim]``, with ``cos`` and ``sin``
# ``[rows..., head_dim // 2]``; they are the kernels' twins (the same outputs and dtypes).


def _xla_forward(x, scale, cos, sin, *, eps, offset, whole):
  return qk_norm_rope_reference(x, scale, cos, sin, eps=eps, scale_offset=offset,
                                over="projection" if whole else "head")


def _xla_backward(x, scale, cos, sin, g, *, eps, offset, whole):
  """``(dx, dscale)``: dx in x's dtype, dscale float32 (None without a scale)."""
  cd = base.compute_dtype(x.dtype)
  xf, gf = x.astype(cd), g.astype(cd)
  axes = (-2, -1) if whole else (-1,)
  rstd = jax.lax.rsqrt(jnp.mean(xf * xf, axis=axes, keepdims=True) + eps)
  xhat = xf * rstd
  half = x.shape[-1] // 2
  c, s = cos.astype(cd)[..., None, :], sin.astype(cd)[..., None, :]
  g1, g2 = gf[..., :half], gf[..., half:]
  dn = jnp.concatenate([g1 * c + g2 * s, g2 * c - g1 * s], axis=-1)   # rotated back
  dxhat = dn
  dscale = None
  if scale is not None:
    w = scale.astype(cd).reshape(x.shape[-2:] if whole else (-1,)) + offset
    dxhat = dn * w
    rows = tuple(range(x.ndim - (2 if whole else 1)))
    dscale = jnp.sum(dn * xhat, axis=rows).reshape(scale.shape)
  dx = rstd * (dxhat - xhat * jnp.mean(dxhat * xhat, axis=axes, keepdims=True))
  return dx.astype(x.dtype), dscale


def _rule(x, cfg, *, backward: bool) -> partitioning.Rule:
  """The kernels' partitioning: over the tokens (any of x's leading axes) and, normalized per
  head, over the heads (the scale's gradient is then summed over them); each head whole."""
  x_map, w_map, table = ("n", "h", "d"), ("w",), ("n", "c")
  if backward:
    rule = partitioning.rows_rule((x_map, w_map, table, table, x_map), (x_map, w_map),
                                  lead=x.ndim - 2)
  else:
    rule = partitioning.rows_rule((x_map, w_map, table, table), (x_map,), lead=x.ndim - 2)
  whole = ("d", "c", "w", "one") + (("h",) if cfg.whole else ())
  return dataclasses.replace(rule, whole=whole)


def _forward(x, scale, cos, sin, cfg):
  twin = functools.partial(_xla_forward, eps=cfg.eps, offset=cfg.offset, whole=cfg.whole)
  return cfg.run("forward", twin, x, scale, cos, sin, rule=_rule(x, cfg, backward=False),
                 eps=cfg.eps, offset=cfg.offset, whole=cfg.whole)


def _backward(x, scale, cos, sin, g, cfg):
  twin = functools.partial(_xla_backward, eps=cfg.eps, offset=cfg.offset, whole=cfg.whole)
  return cfg.run("backward", twin, x, scale, cos, sin, g, rule=_rule(x, cfg, backward=True),
                 eps=cfg.eps, offset=cfg.offset, whole=cfg.whole)


# The custom VJP ---------------------------------------------------------------------------------


def _grads(cfg, x, scale, cos, sin, g):
  dx, dscale = _backward(x, scale, cos, sin, g, cfg)
  dscale = None if scale is None else dscale.astype(scale.dtype)
  return dx, dscale, jnp.zeros_like(cos), jnp.zeros_like(sin)


# Residuals: the inputs only (x is the projection's output, kept by its matmul anyway); the
# statistics and the normalized heads are recomputed in the backward.
_qk_norm_rope = base.recomputing_vjp(lambda cfg, x, scale, cos, sin: _forward(x, scale, cos, sin,
                                                                             cfg), _grads)
