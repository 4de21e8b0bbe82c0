"""Cases of glu: gate and value apart, and packed ``[a | b]``."""

import jax.numpy as jnp

from jaxfuse import ops
from jaxfuse.testing.torch_ref import mlp as ref
from tests.cases import Bad, Case, Mesh


def _draw(rng):
  shape = tuple(int(n) for n in rng.integers(0, 40, rng.integers(1, 4)))
  return shape, shape


def _draw_packed(rng):
  shape = tuple(int(n) for n in rng.integers(0, 30, rng.integers(0, 3)))
  return (shape + (2 * int(rng.integers(0, 100)),),)


CASES = [
    Case("glu", activation,
         lambda a, b, implementation, act=activation: ops.glu(a, b, act,
                                                              implementation=implementation),
         lambda a, b, act=activation: ref.glu(a, b, act),
         ((2, 64, 4096), (2, 64, 4096)), ((5, 37, 123), (5, 37, 123)), scale=2.0,
         reference=lambda a, b, act=activation: ops.glu_reference(a, b, act), draw=_draw,
         second_order=activation != "relu",
         mesh=Mesh(((4, 8, 32), (4, 8, 32)), (("data", "model", None),) * 2, (0, 1))
         if activation == "silu" else None,
         kernels=("glu_bwd", "glu_fwd") if activation == "silu" else None)
    for activation in ("silu", "gelu", "gelu_tanh", "relu")
] + [
    Case("glu", f"packed {activation}",
         lambda x, implementation, act=activation: ops.glu(x, act, implementation=implementation),
         lambda x, act=activation: ref.glu_packed(x, act),
         ((2, 64, 8192),), ((5, 37, 2 * 123),), scale=2.0,
         reference=lambda x, act=activation: ops.glu_reference(x, act), draw=_draw_packed,
         kernels=("glu_bwd", "glu_fwd"))
    for activation in ("silu", "gelu")
]

X = jnp.ones((4, 8))
I32 = jnp.int32

# Each raises, with the same error on every implementation, before any kernel runs.
BAD = [
    Bad("glu", "shapes",
        lambda i: ops.glu(X, jnp.ones((4, 1)), implementation=i),
        ValueError, r"^glu: a, b must have the same shape \(broadcasting is not"),
    Bad("glu", "dtypes",
        lambda i: ops.glu(X, X.astype(jnp.float16), implementation=i),
        TypeError, r"^glu: a, b must share one dtype, got a: float32, b: float16"),
    Bad("glu", "odd packed",
        lambda i: ops.glu(jnp.ones((4, 5)), "silu", implementation=i),
        ValueError, r"^glu: x must have an even last axis \(it is split into \[a \|"),
    Bad("glu", "int",
        lambda i: ops.glu(X.astype(I32), implementation=i),
        TypeError, r"^glu: x must have a floating dtype \(float32, bfloat16,"),
    Bad("glu", "name",
        lambda i: ops.glu(X, X, "swish", implementation=i),
        ValueError, r"^glu: activation must be a callable or one of \['gelu',"),
]
