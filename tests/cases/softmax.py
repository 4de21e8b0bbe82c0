"""Cases of softmax."""

import jax.numpy as jnp

from jaxfuse import ops
from jaxfuse.testing.torch_ref import mlp as ref
from tests.cases import Bad, Case, Mesh


def _draw(rng):
  return (tuple(int(n) for n in rng.integers(0, 40, rng.integers(1, 4))),)


CASES = [
    Case("softmax", "",
         lambda x, implementation: ops.softmax(x, implementation=implementation),
         lambda x: ref.softmax(x), ((2, 8, 64, 512),), ((5, 37, 123),), scale=3.0,
         reference=lambda x: ops.softmax_reference(x), draw=_draw,
         mesh=Mesh(((4, 8, 32),), (("data", "model", None),)),
         kernels=("softmax_bwd", "softmax_fwd")),
    Case("softmax", "scale axis=0",
         lambda x, implementation: ops.softmax(x, axis=0, scale=0.7,
                                               implementation=implementation),
         lambda x: ref.softmax(x, axis=0, scale=0.7), ((512, 256),), ((37, 123),), scale=3.0,
         reference=lambda x: ops.softmax_reference(x, axis=0, scale=0.7), draw=_draw),
]

X = jnp.ones((4, 8))
I32 = jnp.int32

# Each raises, with the same error on every implementation, before any kernel runs.
BAD = [
    Bad("softmax", "int",
        lambda i: ops.softmax(X.astype(I32), implementation=i),
        TypeError, r"^softmax: x must have a floating dtype \(float32, bfloat16,"),
    Bad("softmax", "axis",
        lambda i: ops.softmax(X, axis=2, implementation=i),
        ValueError, r"^softmax: axis 2 is out of range for x of shape \(4, 8\)"),
    Bad("softmax", "axis type",
        lambda i: ops.softmax(X, axis=1.0, implementation=i),
        TypeError, r"^softmax: axis must be an int, got float"),
    Bad("softmax", "scale",
        lambda i: ops.softmax(X, scale=jnp.ones(()), implementation=i),
        TypeError, r"^softmax: scale must be a Python float, got"),
    Bad("softmax", "mask dtype",
        lambda i: ops.softmax(X, mask=X, implementation=i),
        TypeError, r"^softmax: mask must be a boolean array \(True = keep\), got"),
    Bad("softmax", "mask shape",
        lambda i: ops.softmax(X, mask=jnp.ones((3, 8), bool), implementation=i),
        ValueError, r"^softmax: mask must broadcast to the shape of x \(4, 8\), got"),
]
