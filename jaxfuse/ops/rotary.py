"""Rotary position embedding (RoPE) for attention queries and keys.

Plain jnp: XLA fuses it into the projection that feeds it. The "rotate half" convention of
GPT-NeoX and Llama: the head dim is split into two halves ``(x1, x2)``, and each pair
``(x1[i], x2[i])`` is rotated by the angle ``position * base ** (-2 i / head_dim)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfuse.ops import base as op_base, checks

# XLA only: the rotation is elementwise, and XLA fuses it into the projection that feeds it.
ROTARY_EMBEDDING = op_base.Op("rotary_embedding", None, op_base.ELEMENTWISE_GPU_ORDER)


def rotary_embedding(x: jax.Array, positions: jax.Array | None = None, *,
                     base: float = 10000.0, cos: jax.Array | None = None,
                     sin: jax.Array | None = None,
                     implementation: str | None = None) -> jax.Array:
  """Rotates query or key vectors by their positions.

  Args:
    x: ``[batch..., seq, heads, head_dim]`` with an even ``head_dim``.
    positions: integer or float positions, ``[seq]`` or ``[batch..., seq]``: the rotation of
      RoPE's paper with this ``base``.
    base: the wavelength base (10000 in RoPE's paper).
    cos, sin: instead of ``positions``, each position's rotation, ``[seq, head_dim // 2]`` or
      ``[batch..., seq, head_dim // 2]`` (:meth:`jaxfuse.blocks.rope.Rope.cos_sin` makes them
      for every rotary scaling transformers has).
    implementation: ``None`` or ``"xla"`` (the only one).

  Returns:
    ``x`` rotated, in its dtype (computed in float32).

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxfuse.ops import rotary_embedding
    >>> x = jnp.ones((1, 3, 2, 4))
    >>> rotary_embedding(x, jnp.arange(3)).shape
    (1, 3, 2, 4)
  """
  op = ROTARY_EMBEDDING.name
  ROTARY_EMBEDDING.resolve(implementation)
  checks.floating(op, "x", x)
  if x.ndim < 3:
    raise ValueError(f"{op}: x must be [batch..., seq, heads, head_dim], got shape {x.shape}")
  d = x.shape[-1]
  if d % 2:
    raise ValueError(f"{op}: x must have an even head dim, got shape {x.shape}")
  half = d // 2
  if (positions is None) == (cos is None or sin is None):
    raise ValueError(f"{op}: give positions, or cos and sin")
  if positions is not None:
    positions = checks.as_array(positions)
    if positions.ndim < 1 or positions.shape[-1] != x.shape[-3]:
      raise ValueError(f"{op}: positions must cover the {x.shape[-3]} positions of x "
                       f"(axis -3), got shape {positions.shape}")
    inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / d)
    angles = positions.astype(jnp.float32)[..., :, None] * inv_freq   # [..., seq, half]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
  for name, table in (("cos", cos), ("sin", sin)):
    if table.shape[-1] != half or table.ndim < 2 or table.shape[-2] != x.shape[-3]:
      raise ValueError(f"{op}: {name} must be [..., {x.shape[-3]}, {half}] (the positions of "
                       f"x and half its head dim), got shape {table.shape}")
  c, s = (t.astype(jnp.float32)[..., None, :] for t in (cos, sin))   # [..., seq, 1, half]
  xf = x.astype(jnp.float32)
  x1, x2 = xf[..., :half], xf[..., half:]
  out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
  return out.astype(x.dtype)
