"""Cases of grouped_mlp: uneven groups with empty ones, rows past the groups, a single expert
that takes every row, another activation (group sizes as in :mod:`tests.cases.grouped_glu`;
grouped_matmul's and grouped_glu's tables cover the other patterns of the same row loops)."""

import jax.numpy as jnp

from jaxfuse import ops
from jaxfuse.testing.torch_ref import grouped_glu as ref
from tests.cases import Bad, Case, Mesh
from tests.cases.grouped_matmul import sizes


def _call(pattern, activation, keep):
  def call(lhs, gate, up, down, implementation):
    return ops.grouped_mlp(lhs, gate, up, down, sizes(lhs.shape[0], gate.shape[0], pattern),
                           activation=activation, implementation=implementation, keep=keep)
  return call


def _twin(pattern, activation):
  return lambda lhs, gate, up, down: ref.grouped_mlp(
      lhs, gate, up, down, sizes(lhs.shape[0], gate.shape[0], pattern), activation)


def _reference(pattern, activation):
  return lambda lhs, gate, up, down: ops.grouped_mlp_reference(
      lhs, gate, up, down, sizes(lhs.shape[0], gate.shape[0], pattern), activation)


def _draw(rng):
  m, k, f, n = (int(x) for x in rng.integers(0, 40, 4))
  g = int(rng.integers(1, 6))
  return (m, k + 1), (g, k + 1, f + 1), (g, k + 1, f + 1), (g, f + 1, n + 1)


# jit(value_and_grad) on kernels: the forward's fused gated unit and down product; the
# backward's d hidden, one recomputation of the products (writing the gated unit for d down
# too), d down and grouped_glu's four backward products. No second forward kernel.
KERNELS = ("grouped_glu_dgate", "grouped_glu_dlhs_gate", "grouped_glu_dlhs_up",
           "grouped_glu_dup", "grouped_glu_fwd", "grouped_mlp_ddown", "grouped_mlp_dhidden",
           "grouped_mlp_down", "grouped_mlp_dproducts")
# Keeping products: the forward's first kernel also writes them (another name), the backward
# reads them in the same kernels.
KEEP_KERNELS = tuple(sorted(("grouped_mlp_fwd" if k == "grouped_glu_fwd" else k)
                            for k in KERNELS))
SHAPES = ((1024, 256), (8, 256, 512), (8, 256, 512), (8, 512, 256))
WEIRD = ((37, 23), (4, 23, 41), (4, 23, 41), (4, 41, 19))


def _case(label, pattern, activation="silu", shapes=SHAPES, weird=WEIRD, keep=(), **kwargs):
  return Case("grouped_mlp", label, _call(pattern, activation, keep), _twin(pattern, activation),
              shapes, weird, reference=_reference(pattern, activation), **kwargs)


CASES = [
    _case("", "", draw=_draw, kernels=KERNELS,
          mesh=Mesh(((16, 32), (4, 32, 48), (4, 32, 48), (4, 48, 32)),
                    ((None, None), (None, None, "model"), (None, None, "model"),
                     (None, "model", None)),
               # down's rows are split (Megatron's MLP): each device a partial sum.
               local=False, tolerance=1e-4)),
    _case("sum < M", "sum < M", weird=((45, 23), (5, 23, 19), (5, 23, 19), (5, 19, 7)),
          kernels=KERNELS),
    _case("one expert takes all", "one expert takes all", weird=((37, 23), (1, 23, 41),
                                                                (1, 23, 41), (1, 41, 23))),
    _case("gelu", "", "gelu", draw=_draw),
    # Kept products: the backward reads them instead of recomputing them.
    _case("keep gate", "", keep="gate", draw=_draw, kernels=KEEP_KERNELS,
          mesh=Mesh(((16, 32), (4, 32, 48), (4, 32, 48), (4, 48, 32)),
                    ((None, None), (None, None, "model"), (None, None, "model"),
                     (None, "model", None)), local=False, tolerance=1e-4)),
    _case("keep gate, up", "sum < M", keep=("up", "gate"),
          weird=((45, 23), (5, 23, 19), (5, 23, 19), (5, 19, 7)), kernels=KEEP_KERNELS),
    _case("keep up, gelu", "", "gelu", keep="up"),
]

LHS, W, D = jnp.ones((6, 4)), jnp.ones((3, 4, 5)), jnp.ones((3, 5, 2))
SIZES = jnp.array([2, 0, 3], jnp.int32)
# Made here, not in the calls: inside a traced call they would be tracers, unchecked.
TOO_MANY = jnp.array([4, 0, 3], jnp.int32)


def _op(lhs=LHS, gate=W, up=W, down=D, group_sizes=SIZES, **kwargs):
  return lambda i: ops.grouped_mlp(lhs, gate, up, down, group_sizes, implementation=i, **kwargs)


# Each raises, with the same error on every implementation, before any kernel runs.
BAD = [
    Bad("grouped_mlp", "sizes sum past the rows", _op(group_sizes=TOO_MANY),
        ValueError, r"^grouped_mlp: group_sizes must sum to at most lhs.shape\[0\] = 6"),
    Bad("grouped_mlp", "down rank", _op(down=jnp.ones((5, 2))),
        ValueError, r"^grouped_mlp: down must have rank 3, got shape \(5, 2\)"),
    Bad("grouped_mlp", "down groups", _op(down=jnp.ones((2, 5, 2))),
        ValueError, r"^grouped_mlp: down must have size 3 on axis 0 \(one down matrix per "
                    r"group of gate"),
    Bad("grouped_mlp", "down width", _op(down=jnp.ones((3, 4, 2))),
        ValueError, r"^grouped_mlp: down must have size 5 on axis 1 \(down is \[groups, F, N\]"),
    Bad("grouped_mlp", "down dtype", _op(down=D.astype(jnp.bfloat16)),
        TypeError, r"^grouped_mlp: lhs, down must share one dtype, got lhs: float32, down: "
                   r"bfloat16"),
    Bad("grouped_mlp", "gate and up shapes", _op(up=jnp.ones((3, 4, 6))),
        ValueError, r"^grouped_mlp: gate, up must have the same shape"),
    Bad("grouped_mlp", "activation name", _op(activation="swish"),
        ValueError, r"^grouped_mlp: activation must be a callable or one of \['gelu',"),
    Bad("grouped_mlp", "keep a product it has not", _op(keep=("gate", "hidden")),
        ValueError, r"^grouped_mlp: keep takes distinct names among \('gate', 'up'\), got "
                    r"\('gate', 'hidden'\)"),
    Bad("grouped_mlp", "keep one twice", _op(keep=("up", "up")),
        ValueError, r"^grouped_mlp: keep takes distinct names among"),
]
