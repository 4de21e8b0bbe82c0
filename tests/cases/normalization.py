"""Cases of layer_norm, rms_norm, their residual-add variants and the unfused chain."""

import jax.numpy as jnp

from jaxfuse import ops
from jaxfuse.testing.torch_ref import normalization as ref
from tests.cases import Bad, Case, Mesh

_ROWS = ("data", "model", None)


def _draw(n_params, residual):
  def draw(rng):
    # At least 8 features: with two or three the variance of a row is the difference of nearly
    # equal numbers, and its reciprocal amplifies every rounding (the gradient is ill-posed).
    lead = tuple(int(n) for n in rng.integers(0, 30, rng.integers(0, 3)))
    shape = lead + (int(rng.integers(8, 300)),)
    return (shape,) * (2 if residual else 1) + ((shape[-1],),) * n_params
  return draw


def _shapes(lead, hidden, n_params, residual):
  shape = lead + (hidden,)
  return (shape,) * (2 if residual else 1) + ((hidden,),) * n_params


def _case(op, n_params, residual, label="", *, hidden=(4096, 1000), twin, reference, mesh=True,
          mesh_impls=("xla", "pallas"), kernels=None):
  call = getattr(ops, op)
  shapes = _shapes((2, 64), hidden[0], n_params, residual)
  weird = _shapes((5, 37), hidden[1], n_params, residual)
  mesh_case = None
  if mesh:
    mesh_case = Mesh(_shapes((4, 8), 32, n_params, residual),
                     (_ROWS,) * (2 if residual else 1) + ((),) * n_params,
                     (0, 1) if residual else (0,), implementations=mesh_impls)
  name = op.removesuffix("_unfused")
  return Case(op, label, lambda *a, implementation: call(*a, implementation=implementation),
              twin, shapes, weird, reference=reference, draw=_draw(n_params, residual),
              mesh=mesh_case,
              kernels=kernels or (f"{name}_bwd", f"{name}_fwd_res"))


CASES = [
    _case("layer_norm", 2, False, twin=ref.layer_norm, reference=ops.layer_norm_reference),
    _case("rms_norm", 1, False, twin=ref.rms_norm, reference=ops.rms_norm_reference),
    _case("add_layer_norm", 2, True, twin=ref.add_layer_norm,
          reference=ops.add_layer_norm_reference, mesh_impls=("xla",)),
    _case("add_rms_norm", 1, True, twin=ref.add_rms_norm, reference=ops.add_rms_norm_reference),
    _case("add_rms_norm_unfused", 1, True, twin=ref.add_rms_norm,
          reference=ops.add_rms_norm_reference, mesh_impls=("xla",),
          kernels=("add", "add", "rms_norm_bwd", "rms_norm_fwd_res")),
    # Rows wider than one column chunk of the Pallas kernels, and no parameters.
    Case("rms_norm", "wide unscaled",
         lambda x, implementation: ops.rms_norm(x, implementation=implementation),
         ref.rms_norm, ((64, 8192),), ((3, 8193),), reference=ops.rms_norm_reference),
    Case("layer_norm", "bias only",
         lambda x, b, implementation: ops.layer_norm(x, None, b, implementation=implementation),
         lambda x, b: ref.layer_norm(x, None, b), ((128, 1024), (1024,)), ((7, 300), (300,)),
         reference=lambda x, b: ops.layer_norm_reference(x, None, b),
         # F.layer_norm without a weight has no double backward: the formula written out.
         second_order_twin=lambda x, b: ((x - x.mean(-1, keepdim=True))
                                         * (x.var(-1, unbiased=False, keepdim=True) + 1e-5)
                                         ** -0.5 + b)),
]

X, S = jnp.ones((4, 8)), jnp.ones(8)
I32, BF16 = jnp.int32, jnp.bfloat16

# Each raises, with the same error on every implementation, before any kernel runs.
BAD = [
    Bad("rms_norm", "int",
        lambda i: ops.rms_norm(X.astype(I32), S, implementation=i),
        TypeError, r"^rms_norm: x must have a floating dtype \(float32, bfloat16,"),
    Bad("layer_norm", "rank 0",
        lambda i: ops.layer_norm(jnp.float32(1.0), implementation=i),
        ValueError, r"^layer_norm: x must have rank >= 1 \(features on the last"),
    Bad("rms_norm", "scale size",
        lambda i: ops.rms_norm(X, jnp.ones(7), implementation=i),
        ValueError, r"^rms_norm: scale must have size 8 on axis 0 \(the last axis"),
    Bad("layer_norm", "bias rank",
        lambda i: ops.layer_norm(X, S, jnp.ones((1, 8)), implementation=i),
        ValueError, r"^layer_norm: bias must have rank 1, got shape \(1, 8\)"),
    Bad("layer_norm", "scale int",
        lambda i: ops.layer_norm(X, S.astype(I32), implementation=i),
        TypeError, r"^layer_norm: scale must have a floating dtype \(float32,"),
    Bad("add_rms_norm", "shapes",
        lambda i: ops.add_rms_norm(X, X[:1], S, implementation=i),
        ValueError, r"^add_rms_norm: x, residual must have the same shape"),
    Bad("add_layer_norm", "dtypes",
        lambda i: ops.add_layer_norm(X, X.astype(BF16), S, implementation=i),
        TypeError, r"^add_layer_norm: x, residual must share one dtype, got x:"),
    Bad("rms_norm", "eps",
        lambda i: ops.rms_norm(X, S, eps=-1, implementation=i),
        ValueError, r"^rms_norm: eps must be a non-negative number, got -1"),
    Bad("add_rms_norm_unfused", "shapes",
        lambda i: ops.add_rms_norm_unfused(X, X[:1], S, implementation=i),
        ValueError, r"^add_rms_norm_unfused: x, residual must have the same shape"),
]
