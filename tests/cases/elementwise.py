"""Cases of add_act, add_act_unfused and relu."""

import jax
import jax.numpy as jnp
import torch.nn.functional as F

from jaxfuse import ops
from jaxfuse.testing.torch_ref import elementwise as ref
from tests.cases import Bad, Case, Mesh

_ROWS = ("data", "model", None)


def _rank(rng, low=0, high=40):
  return tuple(int(n) for n in rng.integers(low, high, rng.integers(1, 4)))


def _pair(rng):
  shape = _rank(rng)
  return shape, shape


CASES = [
    Case("add_act", activation,
         lambda a, b, implementation, act=activation: ops.add_act(
             a, b, act, implementation=implementation),
         lambda a, b, act=activation: ref.add_act_unfused(a, b, act),
         ((2, 64, 1024), (2, 64, 1024)), ((5, 37, 123), (5, 37, 123)), scale=2.0,
         reference=lambda a, b, act=activation: ops.add_act_reference(a, b, act), draw=_pair,
         second_order=activation != "relu",
         mesh=Mesh(((4, 8, 32), (4, 8, 32)), (_ROWS, _ROWS), (0, 1)) if activation == "gelu"
         else None,
         kernels=("add_act_bwd", "add_act_fwd") if activation == "gelu" else None)
    for activation in ("gelu", "silu", "relu", "gelu_tanh", "squared_relu")
] + [
    Case("add_act_unfused", "silu",
         lambda a, b, implementation: ops.add_act_unfused(a, b, "silu",
                                                          implementation=implementation),
         lambda a, b: ref.add_act_unfused(a, b, "silu"),
         ((2, 64, 1024), (2, 64, 1024)), ((5, 37, 123), (5, 37, 123)), scale=2.0,
         reference=lambda a, b: ops.add_act_reference(a, b, "silu"), draw=_pair,
         mesh=Mesh(((4, 8, 32), (4, 8, 32)), (_ROWS, _ROWS), (0, 1), implementations=("xla",)),
         kernels=("act_bwd", "act_fwd", "add")),
    Case("relu", "",
         lambda x, implementation: ops.relu(x, implementation=implementation), F.relu,
         ((2, 64, 1024),), ((5, 37, 123),), reference=jax.nn.relu,
         draw=lambda rng: (_rank(rng),), second_order=False,
         mesh=Mesh(((4, 8, 32),), (_ROWS,), implementations=("xla",)),
         kernels=("act_fwd", "relu_bwd")),
]

X = jnp.ones((4, 8))
I32, BF16 = jnp.int32, jnp.bfloat16

# Each raises, with the same error on every implementation, before any kernel runs.
BAD = [
    Bad("add_act", "shapes",
        lambda i: ops.add_act(X, jnp.ones((4, 1)), implementation=i),
        ValueError, r"^add_act: a, b must have the same shape \(broadcasting is not"),
    Bad("add_act", "int",
        lambda i: ops.add_act(X.astype(I32), X.astype(I32), implementation=i),
        TypeError, r"^add_act: a must have a floating dtype \(float32, bfloat16,"),
    Bad("add_act", "dtypes",
        lambda i: ops.add_act(X, X.astype(BF16), implementation=i),
        TypeError, r"^add_act: a, b must share one dtype, got a: float32, b:"),
    Bad("add_act", "name",
        lambda i: ops.add_act(X, X, "geluu", implementation=i),
        ValueError, r"^add_act: activation must be a callable or one of \['gelu',"),
    Bad("add_act_unfused", "shapes",
        lambda i: ops.add_act_unfused(X, X[:1, :3], implementation=i),
        ValueError, r"^add_act_unfused: a, b must have the same shape"),
    Bad("add_act_unfused", "name",
        lambda i: ops.add_act_unfused(X, X, "swish", implementation=i),
        ValueError, r"^add_act_unfused: activation must be a callable or one of"),
    Bad("relu", "int",
        lambda i: ops.relu(X.astype(I32), implementation=i),
        TypeError, r"^relu: x must have a floating dtype \(float32, bfloat16,"),
]
