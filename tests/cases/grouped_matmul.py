"""Cases of grouped_matmul: uneven groups with empty ones, rows past the groups, one expert,
every row on one expert. The group sizes follow from the shapes (``sizes``), so that the op
and its twin agree on them at every shape a test draws."""

import jax.numpy as jnp
import numpy as np

from jaxfuse import ops
from jaxfuse.testing.torch_ref import grouped_matmul as ref
from tests.cases import Bad, Case, Mesh

# Relative sizes of the groups, cycled: uneven, with an empty group from the second on.
_WEIGHTS = (2, 0, 3, 1, 5, 0, 4, 1)


def sizes(rows: int, groups: int, pattern: str = "") -> np.ndarray:
  """int32 group sizes for ``rows`` rows and ``groups`` groups:

  - ``""``: uneven, some groups empty, summing to ``rows``;
  - ``"sum < M"``: the same over about three quarters of the rows (the rest in no group);
  - ``"one expert takes all"``: every row in the middle group, the others empty.
  """
  if pattern == "one expert takes all":
    out = np.zeros(groups, np.int32)
    out[groups // 2] = rows
    return out
  used = rows * 3 // 4 if pattern == "sum < M" else rows
  weights = np.array([_WEIGHTS[i % len(_WEIGHTS)] for i in range(groups)], np.int64)
  if not weights.any():
    weights[0] = 1
  ends = used * np.cumsum(weights) // weights.sum()
  return np.diff(ends, prepend=0).astype(np.int32)


def _call(pattern):
  def call(lhs, rhs, implementation):
    return ops.grouped_matmul(lhs, rhs, sizes(lhs.shape[0], rhs.shape[0], pattern),
                              implementation=implementation)
  return call


def _twin(pattern):
  return lambda lhs, rhs: ref.grouped_matmul(lhs, rhs, sizes(lhs.shape[0], rhs.shape[0], pattern))


def _reference(pattern):
  return lambda lhs, rhs: ops.grouped_matmul_reference(
      lhs, rhs, sizes(lhs.shape[0], rhs.shape[0], pattern))


def _draw(rng):
  m, k, n = (int(x) for x in rng.integers(0, 50, 3))
  g = int(rng.integers(1, 7))
  return (m, k + 1), (g, k + 1, n + 1)


KERNELS = ("grouped_matmul_dlhs", "grouped_matmul_drhs", "grouped_matmul_fwd")

CASES = [
    Case("grouped_matmul", "", _call(""), _twin(""), ((1024, 256), (8, 256, 512)),
         ((37, 23), (4, 23, 41)), reference=_reference(""), draw=_draw,
         mesh=Mesh(((16, 32), (4, 32, 48)), ((None, None), (None, None, "model"))),
         kernels=KERNELS),
    Case("grouped_matmul", "sum < M", _call("sum < M"), _twin("sum < M"),
         ((1024, 256), (8, 256, 512)), ((45, 23), (5, 23, 19)), reference=_reference("sum < M"),
         kernels=KERNELS),
    Case("grouped_matmul", "single expert", _call(""), _twin(""), ((256, 256), (1, 256, 512)),
         ((37, 23), (1, 23, 41)), reference=_reference("")),
    Case("grouped_matmul", "one expert takes all", _call("one expert takes all"),
         _twin("one expert takes all"), ((1024, 256), (8, 256, 512)), ((37, 23), (4, 23, 41)),
         reference=_reference("one expert takes all")),
]

LHS, RHS = jnp.ones((6, 4)), jnp.ones((3, 4, 5))
SIZES = jnp.array([2, 0, 3], jnp.int32)
# Made here, not in the calls: inside a traced call they would be tracers, unchecked.
TOO_MANY, NEGATIVE = jnp.array([4, 0, 3], jnp.int32), jnp.array([4, -1, 3], jnp.int32)

# Each raises, with the same error on every implementation, before any kernel runs.
BAD = [
    Bad("grouped_matmul", "sizes sum past the rows",
        lambda i: ops.grouped_matmul(LHS, RHS, TOO_MANY, implementation=i),
        ValueError, r"^grouped_matmul: group_sizes must sum to at most lhs.shape\[0\] = 6"),
    Bad("grouped_matmul", "negative size",
        lambda i: ops.grouped_matmul(LHS, RHS, NEGATIVE, implementation=i),
        ValueError, r"^grouped_matmul: group_sizes must be non-negative, got \[4, -1, 3\]"),
    Bad("grouped_matmul", "sizes per group",
        lambda i: ops.grouped_matmul(LHS, RHS, jnp.array([2, 4], jnp.int32), implementation=i),
        ValueError, r"^grouped_matmul: group_sizes must have size 3 on axis 0 \(one size per"),
    Bad("grouped_matmul", "float sizes",
        lambda i: ops.grouped_matmul(LHS, RHS, SIZES.astype(jnp.float32), implementation=i),
        TypeError, r"^grouped_matmul: group_sizes must be an integer array \(int32\), got "
                   r"float32"),
    Bad("grouped_matmul", "lhs rank",
        lambda i: ops.grouped_matmul(jnp.ones((2, 3, 4)), RHS, SIZES, implementation=i),
        ValueError, r"^grouped_matmul: lhs must have rank 2, got shape \(2, 3, 4\)"),
    Bad("grouped_matmul", "rhs rank",
        lambda i: ops.grouped_matmul(LHS, jnp.ones((4, 5)), SIZES, implementation=i),
        ValueError, r"^grouped_matmul: rhs must have rank 3, got shape \(4, 5\)"),
    Bad("grouped_matmul", "contraction sizes",
        lambda i: ops.grouped_matmul(LHS, jnp.ones((3, 5, 5)), SIZES, implementation=i),
        ValueError, r"^grouped_matmul: rhs must have size 4 on axis 1 \(rhs is \[groups, K, N\]"),
    Bad("grouped_matmul", "dtypes",
        lambda i: ops.grouped_matmul(LHS, RHS.astype(jnp.bfloat16), SIZES, implementation=i),
        TypeError, r"^grouped_matmul: lhs, rhs must share one dtype, got lhs: float32, rhs: "
                   r"bfloat16"),
    Bad("grouped_matmul", "int lhs",
        lambda i: ops.grouped_matmul(LHS.astype(jnp.int32), RHS, SIZES, implementation=i),
        TypeError, r"^grouped_matmul: lhs must have a floating dtype"),
]
