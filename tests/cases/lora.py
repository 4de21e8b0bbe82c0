"""Cases of lora_dense: with a bias, and without one at rank 1."""

import jax.numpy as jnp

from jaxfuse import ops
from jaxfuse.testing.torch_ref import lora as ref
from tests.cases import Bad, Case, Mesh

SCALE = 2.0   # alpha / rank, peft's scaling


def _draw(rng):
  lead = tuple(int(n) for n in rng.integers(0, 20, rng.integers(1, 3)))
  d_in, d_out = (int(n) for n in rng.integers(1, 70, 2))
  rank = int(rng.integers(1, 9))
  return lead + (d_in,), (d_in, d_out), (d_in, rank), (rank, d_out), (d_out,)


CASES = [
    Case("lora_dense", "",
         lambda x, k, a, b, bias, implementation: ops.lora_dense(
             x, k, a, b, bias, scale=SCALE, implementation=implementation),
         lambda x, k, a, b, bias: ref.lora_dense(x, k, a, b, bias, scale=SCALE),
         ((256, 1024), (1024, 4096), (1024, 16), (16, 4096), (4096,)),
         ((5, 37, 123), (123, 67), (123, 3), (3, 67), (67,)),
         reference=lambda x, k, a, b, bias: ops.lora_dense_reference(x, k, a, b, bias,
                                                                      scale=SCALE),
         draw=_draw,
         mesh=Mesh(((4, 8, 32), (32, 48), (32, 4), (4, 48), (48,)),
                   (("data", "model", None), (), (), (), ()))),
    Case("lora_dense", "no bias rank 1",
         lambda x, k, a, b, implementation: ops.lora_dense(x, k, a, b, scale=0.5,
                                                           implementation=implementation),
         lambda x, k, a, b: ref.lora_dense(x, k, a, b, scale=0.5),
         ((256, 1024), (1024, 4096), (1024, 1), (1, 4096)),
         ((37, 123), (123, 67), (123, 1), (1, 67)),
         reference=lambda x, k, a, b: ops.lora_dense_reference(x, k, a, b, scale=0.5),
         dtypes=("float32", "bfloat16")),
]


def _call(x=(4, 5), k=(5, 3), a=(5, 2), b=(2, 3), bias=(3,), dtypes=None, scale=SCALE):
  """A call with arrays of these shapes (``dtypes``: ``{argument: dtype}``)."""
  dtypes = dtypes or {}
  shapes = {"x": x, "kernel": k, "lora_a": a, "lora_b": b, "bias": bias}
  arrays = {n: None if s is None else jnp.ones(s, dtypes.get(n, jnp.float32))
            for n, s in shapes.items()}
  return lambda i: ops.lora_dense(arrays["x"], arrays["kernel"], arrays["lora_a"],
                                  arrays["lora_b"], arrays["bias"], scale=scale,
                                  implementation=i)


# Each raises, with the same error on every implementation, before any product runs.
BAD = [
    Bad("lora_dense", "rank mismatch", _call(b=(4, 3)), ValueError,
        r"^lora_dense: lora_b must have size 2 on axis 0 \(lora_b is \[rank, out\]: the rank"),
    Bad("lora_dense", "lora_a in size", _call(a=(6, 2)), ValueError,
        r"^lora_dense: lora_a must have size 5 on axis 0 \(lora_a is \[in, rank\]"),
    Bad("lora_dense", "lora_b out size", _call(b=(2, 4)), ValueError,
        r"^lora_dense: lora_b must have size 3 on axis 1 \(lora_b is \[rank, out\]"),
    Bad("lora_dense", "x size", _call(x=(4, 6)), ValueError,
        r"^lora_dense: x must have size 5 on axis -1 \(kernel is \[in, out\]"),
    Bad("lora_dense", "lora_a rank", _call(a=(5, 2, 1)), ValueError,
        r"^lora_dense: lora_a must have rank 2, got shape \(5, 2, 1\)"),
    Bad("lora_dense", "bias size", _call(bias=(4,)), ValueError,
        r"^lora_dense: bias must have size 3 on axis 0 \(bias is \[out\]"),
    Bad("lora_dense", "dtypes", _call(dtypes={"lora_a": jnp.bfloat16}), TypeError,
        r"^lora_dense: x, kernel, lora_a, lora_b, bias must share one dtype, got .*lora_a: "
        r"bfloat16"),
    Bad("lora_dense", "integer lora_b", _call(dtypes={"lora_b": jnp.int32}), TypeError,
        r"^lora_dense: lora_b must have a floating dtype"),
    Bad("lora_dense", "traced scale", _call(scale=jnp.float32(2.0)), TypeError,
        r"^lora_dense: scale must be a finite Python number"),
]
