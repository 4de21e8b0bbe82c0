"""Cases of recompute_linear and dense."""

import jax.numpy as jnp
import torch.nn.functional as F

from jaxfuse import ops
from tests.cases import Bad, Case, Mesh


def _draw(rng):
  lead = tuple(int(n) for n in rng.integers(0, 20, rng.integers(1, 3)))
  d_in, d_out = (int(n) for n in rng.integers(1, 70, 2))
  return lead + (d_in,), (d_out, d_in), (d_out,)


CASES = [
    Case("recompute_linear", "",
         lambda x, w, b, implementation: ops.recompute_linear(x, w, b,
                                                              implementation=implementation),
         F.linear, ((256, 1024), (4096, 1024), (4096,)), ((5, 37, 123), (67, 123), (67,)),
         reference=ops.linear_reference, draw=_draw,
         mesh=Mesh(((4, 8, 32), (48, 32), (48,)), (("data", "model", None), (), ())),
         kernels=("linear_dbias", "linear_dweight", "linear_dx", "linear_fwd")),
    Case("recompute_linear", "no bias",
         lambda x, w, implementation: ops.recompute_linear(x, w, implementation=implementation),
         F.linear, ((256, 1024), (4096, 1024)), ((37, 123), (67, 123)),
         reference=ops.linear_reference,
         mesh=Mesh(((4, 8, 32), (48, 32)), (("data", None, None), ("model", None)), (0, 1))),
    Case("dense", "",
         lambda x, k, b, implementation: ops.dense(x, k, b, implementation=implementation),
         lambda x, k, b: x @ k + b, ((256, 1024), (1024, 4096), (4096,)),
         ((5, 37, 123), (123, 67), (67,)), reference=ops.dense_reference,
         draw=lambda rng: (lambda s: (s[0], (s[1][1], s[1][0]), s[2]))(_draw(rng)),
         mesh=Mesh(((4, 8, 32), (32, 48), (48,)), (("data", "model", None), (), ()))),
    Case("dense", "row-parallel",
         lambda x, k, implementation: ops.dense(x, k, implementation=implementation),
         lambda x, k: x @ k, ((256, 1024), (1024, 4096)), ((37, 123), (123, 67)),
         reference=ops.dense_reference, second_order=False,
         mesh=Mesh(((4, 8, 32), (32, 48)), (("data", None, "model"), ("model", None)), (0, 1),
                   local=False, implementations=("xla",))),
]

BF16 = jnp.bfloat16

# Each raises, with the same error on every implementation, before any kernel runs.
BAD = [
    Bad("recompute_linear", "x size",
        lambda i: ops.recompute_linear(jnp.ones((4, 6)), jnp.ones((3, 5)), jnp.ones(3),
                                       implementation=i),
        ValueError, r"^recompute_linear: x must have size 5 on axis -1 \(weight is"),
    Bad("recompute_linear", "bias size",
        lambda i: ops.recompute_linear(jnp.ones((4, 5)), jnp.ones((3, 5)), jnp.ones(4),
                                       implementation=i),
        ValueError, r"^recompute_linear: bias must have size 3 on axis 0 \(weight"),
    Bad("recompute_linear", "weight rank",
        lambda i: ops.recompute_linear(jnp.ones((4, 5)), jnp.ones((3, 5, 1)), jnp.ones(3),
                                       implementation=i),
        ValueError, r"^recompute_linear: weight must have rank 2, got shape \(3, 5,"),
    Bad("recompute_linear", "dtypes",
        lambda i: ops.recompute_linear(jnp.ones((4, 5)), jnp.ones((3, 5), BF16), jnp.ones(3),
                                       implementation=i),
        TypeError, r"^recompute_linear: x, weight, bias must share one dtype, got"),
    Bad("dense", "in sizes differ",
        lambda i: ops.dense(jnp.ones((4, 6)), jnp.ones((5, 3)), implementation=i), ValueError,
        r"^dense: x must have size 5 on axis -1"),
]
