"""Cases of qk_norm_rope: per head (Qwen3), with Gemma's 1 + w, over the projection (OLMo 2)."""

import jax.numpy as jnp

from jaxfuse import ops
from jaxfuse.testing.torch_ref import normalization as ref
from tests.cases import Bad, Case, Mesh


def _angles(t, half, base=10000.0):
  inv = base ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / (2 * half))
  return jnp.arange(t, dtype=jnp.float32)[:, None] * inv


def _case(label, shapes, weird, *, over="head", offset=0.0, scale=True, mesh=None):
  """Arguments ``(x, scale)``; the rotation is the default RoPE of the positions 0..seq-1."""
  def tables(x):
    angles = _angles(x.shape[-3], x.shape[-1] // 2)
    return jnp.cos(angles), jnp.sin(angles)

  def call(x, *w, implementation):
    return ops.qk_norm_rope(x, w[0] if w else None, *tables(x), scale_offset=offset, over=over,
                            implementation=implementation)

  def twin(x, *w):
    import torch
    c, s = (torch.from_numpy(__import__("numpy").array(t)) for t in tables(x))
    return ref.qk_norm_rope(x, w[0] if w else None, c, s, scale_offset=offset, over=over)

  def reference(x, *w):
    return ops.qk_norm_rope_reference(x, w[0] if w else None, *tables(x), scale_offset=offset,
                                      over=over)

  def draw(rng):
    b, t, h = (int(n) for n in rng.integers(0, 5, 3))
    d = 2 * int(rng.integers(1, 40))
    w = (d if over == "head" else h * d,)
    return ((b, t, h, d), w) if scale else ((b, t, h, d),)

  width = lambda s: s[-1] if over == "head" else s[-2] * s[-1]  # noqa: E731
  keep = (lambda s: s) if scale else (lambda s: s[:1])  # noqa: E731
  return Case("qk_norm_rope", label, call, twin, keep((shapes, (width(shapes),))),
              keep((weird, (width(weird),))), reference=reference, draw=draw, scale=2.0,
              mesh=mesh, kernels=("qk_norm_rope_bwd", "qk_norm_rope_fwd"))


_HEADS = ("data", None, "model", None)

CASES = [
    _case("per head", (2, 512, 16, 128), (2, 37, 3, 22),
          mesh=Mesh(((4, 8, 8, 16), (16,)), (_HEADS, ()))),
    _case("gemma 1+w", (2, 512, 8, 256), (1, 29, 2, 40), offset=1.0),
    _case("projection", (2, 512, 16, 128), (2, 37, 3, 22), over="projection",
          # The sequence split: inside shard_map the table's positions would be each shard's own.
          mesh=Mesh(((4, 8, 8, 16), (128,)), (("data", "model", None, None), ()), local=False)),
    _case("no scale", (2, 512, 16, 128), (3, 11, 5, 6), scale=False),
]

X = jnp.ones((2, 5, 3, 8))
C = jnp.ones((5, 4))

# Each raises, with the same error on every implementation, before any kernel runs.
BAD = [
    Bad("qk_norm_rope", "rank",
        lambda i: ops.qk_norm_rope(X[0, 0], None, C, C, implementation=i), ValueError,
        r"^qk_norm_rope: x must be \[batch\.\.\., seq, heads, head_dim\]"),
    Bad("qk_norm_rope", "odd head dim",
        lambda i: ops.qk_norm_rope(jnp.ones((2, 5, 3, 7)), None, C, C, implementation=i),
        ValueError, r"^qk_norm_rope: x must have an even head dim"),
    Bad("qk_norm_rope", "scale size",
        lambda i: ops.qk_norm_rope(X, jnp.ones(7), C, C, implementation=i), ValueError,
        r"^qk_norm_rope: scale must have size 8 on axis 0 \(the head dim\)"),
    Bad("qk_norm_rope", "projection scale size",
        lambda i: ops.qk_norm_rope(X, jnp.ones(8), C, C, over="projection", implementation=i),
        ValueError, r"^qk_norm_rope: scale must have size 24 on axis 0"),
    Bad("qk_norm_rope", "cos shape",
        lambda i: ops.qk_norm_rope(X, None, jnp.ones((5, 8)), C, implementation=i), ValueError,
        r"^qk_norm_rope: cos must be \[seq, head_dim // 2\]"),
    Bad("qk_norm_rope", "over",
        lambda i: ops.qk_norm_rope(X, None, C, C, over="all", implementation=i), ValueError,
        r"^qk_norm_rope: over must be one of"),
    Bad("qk_norm_rope", "integer x",
        lambda i: ops.qk_norm_rope(X.astype(jnp.int32), None, C, C, implementation=i),
        TypeError, r"^qk_norm_rope: x must have a floating dtype"),
]
