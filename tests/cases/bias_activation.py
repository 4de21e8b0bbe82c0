"""Cases of bias_act."""

import jax.numpy as jnp

from jaxfuse import ops
from jaxfuse.testing.torch_ref import mlp as ref
from tests.cases import Bad, Case, Mesh


def _draw(rng):
  lead = tuple(int(n) for n in rng.integers(0, 30, rng.integers(0, 3)))
  features = int(rng.integers(1, 300))
  return lead + (features,), (features,)


CASES = [
    Case("bias_act", activation,
         lambda x, b, implementation, act=activation: ops.bias_act(
             x, b, act, implementation=implementation),
         lambda x, b, act=activation: ref.bias_act(x, b, act),
         ((2, 64, 4096), (4096,)), ((5, 37, 123), (123,)), scale=2.0,
         reference=lambda x, b, act=activation: ops.bias_act_reference(x, b, act), draw=_draw,
         second_order=activation != "relu",
         mesh=Mesh(((4, 8, 32), (32,)), (("data", "model", None), ())) if activation == "gelu"
         else None,
         kernels=("bias_act_bwd", "bias_act_fwd") if activation == "gelu" else None)
    for activation in ("gelu", "gelu_tanh", "silu", "relu", "squared_relu")
]

X, S = jnp.ones((4, 8)), jnp.ones(8)
BF16 = jnp.bfloat16

# Each raises, with the same error on every implementation, before any kernel runs.
BAD = [
    Bad("bias_act", "size",
        lambda i: ops.bias_act(X, jnp.ones(7), implementation=i),
        ValueError, r"^bias_act: bias must have size 8 on axis 0 \(the last axis of"),
    Bad("bias_act", "rank",
        lambda i: ops.bias_act(X, jnp.ones((1, 8)), implementation=i),
        ValueError, r"^bias_act: bias must have rank 1, got shape \(1, 8\)"),
    Bad("bias_act", "dtypes",
        lambda i: ops.bias_act(X, S.astype(BF16), implementation=i),
        TypeError, r"^bias_act: x, bias must share one dtype, got x: float32,"),
    Bad("bias_act", "name",
        lambda i: ops.bias_act(X, S, "swish", implementation=i),
        ValueError, r"^bias_act: activation must be a callable or one of \['gelu',"),
]
