"""grouped_mlp's kept products: what the op table (tests/cases/grouped_mlp.py) cannot express.

- ``keep`` on every implementation (XLA's CPU row-tile loops with tiles that straddle groups
  and tails, Pallas in interpret mode, Triton in its interpreter), group sizes traced under
  ``jit``, against the torch per-expert loop in float32;
- the residuals: the inputs only by default, plus each kept product ``[M, F]`` in lhs's dtype;
- the backward's grouped products: one fewer per kept product (XLA's ragged products, as
  lowered for a GPU);
- a recomputation policy that drops a kept product: the op's forward runs again for it and the
  gradients are the same.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.ad_checkpoint import checkpoint_policies

from jaxfuse import ops
from jaxfuse.metrics import residuals
from jaxfuse.ops import dispatch
from jaxfuse.testing.torch_ref import grouped_glu as ref
from tests import helpers

gmm_op = importlib.import_module("jaxfuse.ops.grouped_matmul")

M, K, F, N, G = 37, 24, 40, 16, 4
# Uneven groups with an empty one and rows past the sum.
SIZES = [7, 0, 17, 9]
KEEPS = [("gate",), ("up",), ("gate", "up")]


def _inputs(dtype=jnp.float32):
  lhs, gate, up, down, g = helpers.numpy_normals(3, (M, K), (G, K, F), (G, K, F), (G, F, N),
                                                 (M, N))
  return helpers.to_jax(dtype, lhs, gate * K ** -0.5, up * K ** -0.5, down * F ** -0.5, g)


def _run(impl, keep, lhs, gate, up, down, g, sizes):
  """Output and gradients under jit, the group sizes a traced argument."""
  def step(lhs, gate, up, down, g, sizes):
    out, vjp = jax.vjp(lambda *a: ops.grouped_mlp(*a, sizes, implementation=impl, keep=keep),
                       lhs, gate, up, down)
    return (out, *vjp(g))
  return jax.jit(step, compiler_options=helpers.FAST_COMPILE)(lhs, gate, up, down, g, sizes)


def _context(impl, monkeypatch):
  if impl == "triton":
    pytest.importorskip("triton")
    from jaxfuse.testing import triton_interpreter
    return triton_interpreter.triton_ops(monkeypatch)
  import jaxfuse
  return jaxfuse.pallas_interpret(impl == "pallas")


@pytest.mark.parametrize("keep", KEEPS, ids=["+".join(k) for k in KEEPS])
@pytest.mark.parametrize("impl", ["xla", "pallas", "triton"])
def test_kept_products_match_the_torch_loop(impl, keep, monkeypatch):
  # Small CPU tiles: whole tiles, tails of several sizes, tiles that hold two groups' rows.
  monkeypatch.setattr(gmm_op, "_CPU_TILE_ROWS", 8)
  monkeypatch.setattr(gmm_op, "_CPU_TAIL_ROWS", 3)
  args = _inputs()
  with _context(impl, monkeypatch):
    got = _run(impl, keep, *args, jnp.array(SIZES, jnp.int32))
  want = helpers.torch_value_and_grads(
      lambda *a: ref.grouped_mlp(*a, torch.tensor(SIZES)), args[:4], args[4])
  for what, a, b in zip(("out", "d lhs", "d gate", "d up", "d down"), got, want):
    helpers.assert_close(a, b, what=f"{impl} keep={keep} {what}")
  assert not np.asarray(got[0][sum(SIZES):]).any()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_residuals_are_the_inputs_and_the_kept_products(dtype):
  lhs, gate, up, down, _ = _inputs(dtype)
  sizes = jnp.array(SIZES, jnp.int32)
  for keep in [(), *KEEPS]:
    kept = residuals(lambda *a, keep=keep: ops.grouped_mlp(*a, sizes, keep=keep),
                     lhs, gate, up, down)
    assert [(r.shape, r.dtype) for r in kept] == [((M, F), jnp.dtype(dtype).name)] * len(keep)


def _grouped_products(closed) -> int:
  """The ragged products of a closed jaxpr, nested jaxprs included."""
  def walk(jaxpr):
    total = 0
    for eqn in jaxpr.eqns:
      total += eqn.primitive.name in ("ragged_dot", "ragged_dot_general")
      for param in eqn.params.values():
        for sub in param if isinstance(param, (list, tuple)) else (param,):
          if isinstance(sub, jax.extend.core.ClosedJaxpr):
            total += walk(sub.jaxpr)
          elif isinstance(sub, jax.extend.core.Jaxpr):
            total += walk(sub)
    return total
  return walk(closed.jaxpr)


def test_each_kept_product_saves_one_grouped_product_of_the_backward():
  lhs, gate, up, down, _ = _inputs()
  sizes = jnp.array(SIZES, jnp.int32)
  counts = {}
  for keep in [(), *KEEPS]:
    loss = lambda *a, keep=keep: ops.grouped_mlp(*a, sizes, implementation="xla",
                                                 keep=keep).sum()
    with dispatch.target_platform("gpu"):
      counts[keep] = _grouped_products(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(
          lhs, gate, up, down))
  # Three forward products, then d hidden, d down, two d lhs, two weight gradients and the
  # gate and up products recomputed where not kept.
  assert counts == {(): 11, ("gate",): 10, ("up",): 10, ("gate", "up"): 9}, counts


def test_a_policy_that_drops_the_kept_product_runs_the_forward_again():
  lhs, gate, up, down, g = _inputs()
  sizes = jnp.array(SIZES, jnp.int32)

  def grads(keep, policy):
    f = lambda *a: ops.grouped_mlp(*a, sizes, keep=keep)
    if policy is not None:
      f = jax.checkpoint(f, policy=policy)
    return jax.vjp(f, lhs, gate, up, down)[1](g)

  want = grads((), None)
  for policy in (checkpoint_policies.nothing_saveable,
                 checkpoint_policies.save_only_these_names("moe.gate")):
    got = grads(("gate",), policy)
    for a, b in zip(got, want):
      helpers.assert_close(a, b, what=str(policy))
  dropped = residuals(jax.checkpoint(lambda *a: ops.grouped_mlp(*a, sizes, keep="gate"),
                                     policy=checkpoint_policies.nothing_saveable),
                      lhs, gate, up, down)
  assert dropped == [], dropped


def test_a_call_that_is_not_differentiated_writes_no_product():
  import jaxfuse

  lhs, gate, up, down, _ = _inputs()
  sizes = jnp.array(SIZES, jnp.int32)
  call = lambda *a: ops.grouped_mlp(*a, sizes, implementation="pallas", keep="gate")
  with jaxfuse.pallas_interpret(True):
    forward = str(jax.make_jaxpr(call)(lhs, gate, up, down))
    both = str(jax.make_jaxpr(jax.grad(lambda *a: call(*a).sum()))(lhs, gate, up, down))
  assert "grouped_glu_fwd" in forward and "grouped_mlp_fwd" not in forward
  assert "grouped_mlp_fwd" in both and "grouped_glu_fwd" not in both
