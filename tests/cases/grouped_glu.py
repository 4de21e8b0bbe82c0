"""Cases of grouped_glu: uneven groups with empty ones, rows past the groups, one expert,
every row on one expert, another activation. The group sizes follow from the shapes
(:func:`tests.cases.grouped_matmul.sizes`), so that the op and its twin agree on them at every
shape a test draws."""

import jax.numpy as jnp

from jaxfuse import ops
from jaxfuse.testing.torch_ref import grouped_glu as ref
from tests.cases import Bad, Case, Mesh
from tests.cases.grouped_matmul import sizes


def _call(pattern, activation):
  def call(lhs, gate, up, implementation):
    return ops.grouped_glu(lhs, gate, up, sizes(lhs.shape[0], gate.shape[0], pattern),
                           activation=activation, implementation=implementation)
  return call


def _twin(pattern, activation):
  return lambda lhs, gate, up: ref.grouped_glu(
      lhs, gate, up, sizes(lhs.shape[0], gate.shape[0], pattern), activation)


def _reference(pattern, activation):
  return lambda lhs, gate, up: ops.grouped_glu_reference(
      lhs, gate, up, sizes(lhs.shape[0], gate.shape[0], pattern), activation)


def _draw(rng):
  m, k, n = (int(x) for x in rng.integers(0, 40, 3))
  g = int(rng.integers(1, 6))
  return (m, k + 1), (g, k + 1, n + 1), (g, k + 1, n + 1)


KERNELS = ("grouped_glu_dgate", "grouped_glu_dlhs_gate", "grouped_glu_dlhs_up",
           "grouped_glu_dproducts", "grouped_glu_dup", "grouped_glu_fwd")
SHAPES = ((1024, 256), (8, 256, 512), (8, 256, 512))
WEIRD = ((37, 23), (4, 23, 41), (4, 23, 41))


def _case(label, pattern, activation="silu", shapes=SHAPES, weird=WEIRD, **kwargs):
  return Case("grouped_glu", label, _call(pattern, activation), _twin(pattern, activation),
              shapes, weird, reference=_reference(pattern, activation), **kwargs)


CASES = [
    _case("", "", draw=_draw, kernels=KERNELS,
          mesh=Mesh(((16, 32), (4, 32, 48), (4, 32, 48)),
                    ((None, None), (None, None, "model"), (None, None, "model")))),
    _case("sum < M", "sum < M", weird=((45, 23), (5, 23, 19), (5, 23, 19)), kernels=KERNELS),
    _case("single expert", "", shapes=((256, 256), (1, 256, 512), (1, 256, 512)),
          weird=((37, 23), (1, 23, 41), (1, 23, 41))),
    _case("one expert takes all", "one expert takes all"),
    _case("gelu", "", "gelu", draw=_draw),
]

LHS, W = jnp.ones((6, 4)), jnp.ones((3, 4, 5))
SIZES = jnp.array([2, 0, 3], jnp.int32)
# Made here, not in the calls: inside a traced call they would be tracers, unchecked.
TOO_MANY, NEGATIVE = jnp.array([4, 0, 3], jnp.int32), jnp.array([4, -1, 3], jnp.int32)


def _op(lhs=LHS, gate=W, up=W, group_sizes=SIZES, **kwargs):
  return lambda i: ops.grouped_glu(lhs, gate, up, group_sizes, implementation=i, **kwargs)


# Each raises, with the same error on every implementation, before any kernel runs.
BAD = [
    Bad("grouped_glu", "sizes sum past the rows", _op(group_sizes=TOO_MANY),
        ValueError, r"^grouped_glu: group_sizes must sum to at most lhs.shape\[0\] = 6"),
    Bad("grouped_glu", "negative size", _op(group_sizes=NEGATIVE),
        ValueError, r"^grouped_glu: group_sizes must be non-negative, got \[4, -1, 3\]"),
    Bad("grouped_glu", "sizes per group", _op(group_sizes=jnp.array([2, 4], jnp.int32)),
        ValueError, r"^grouped_glu: group_sizes must have size 3 on axis 0 \(one size per "
                    r"group of gate"),
    Bad("grouped_glu", "float sizes", _op(group_sizes=SIZES.astype(jnp.float32)),
        TypeError, r"^grouped_glu: group_sizes must be an integer array \(int32\), got float32"),
    Bad("grouped_glu", "lhs rank", _op(lhs=jnp.ones((2, 3, 4))),
        ValueError, r"^grouped_glu: lhs must have rank 2, got shape \(2, 3, 4\)"),
    Bad("grouped_glu", "gate rank", _op(gate=jnp.ones((4, 5))),
        ValueError, r"^grouped_glu: gate must have rank 3, got shape \(4, 5\)"),
    Bad("grouped_glu", "contraction sizes", _op(gate=jnp.ones((3, 5, 5)), up=jnp.ones((3, 5, 5))),
        ValueError, r"^grouped_glu: gate must have size 4 on axis 1 \(gate is \[groups, K, N\]"),
    Bad("grouped_glu", "gate and up shapes", _op(up=jnp.ones((3, 4, 6))),
        ValueError, r"^grouped_glu: gate, up must have the same shape"),
    Bad("grouped_glu", "dtypes", _op(up=W.astype(jnp.bfloat16)),
        TypeError, r"^grouped_glu: lhs, gate, up must share one dtype, got lhs: float32, gate: "
                   r"float32, up: bfloat16"),
    Bad("grouped_glu", "int lhs", _op(lhs=LHS.astype(jnp.int32)),
        TypeError, r"^grouped_glu: lhs must have a floating dtype"),
    Bad("grouped_glu", "activation name", _op(activation="swish"),
        ValueError, r"^grouped_glu: activation must be a callable or one of \['gelu',"),
]
