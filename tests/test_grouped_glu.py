"""grouped_glu: what the op table (tests/cases/grouped_glu.py) cannot express.

- group sizes passed as a traced argument under ``jit``, on XLA, Pallas (interpret mode) and
  Triton (its interpreter), against the torch per-expert loop in float32: tiles that straddle
  groups, an empty group, rows past the sum (also with an activation that is not zero at 0),
  no row in any group;
- bfloat16 on every implementation: the error against the float64 loop at most twice that of
  the torch loop in bfloat16;
- the fused forward: one kernel, which writes the ``[M, N]`` output only;
- the XLA implementation's row-tile loops on CPUs, XLA's ragged products on GPUs;
- what the backward keeps: the inputs only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxfuse
from jaxfuse import ops
from jaxfuse.metrics import residuals
from jaxfuse.ops import dispatch
from jaxfuse.testing.torch_ref import grouped_glu as ref
from tests import helpers

M, K, N, G = 40, 24, 40, 4
# With 16-row tiles (interpret mode): groups that straddle tiles, an empty one, rows past the
# sum, and no row in any group.
SIZES = {
    "straddling": ([5, 11, 0, 24], "silu"),
    "sum < M": ([7, 0, 13, 9], "gelu"),
    "sum < M sigmoid": ([7, 0, 13, 9], "sigmoid"),
    "none": ([0, 0, 0, 0], "silu"),
}


def _inputs(dtype=jnp.float32, rows=M):
  arrays = helpers.numpy_normals(0, (rows, K), (G, K, N), (G, K, N), (rows, N))
  return helpers.to_jax(dtype, *arrays)


def _run(impl, lhs, gate, up, sizes, g, activation):
  """Output and gradients under jit, the group sizes a traced argument."""
  def step(lhs, gate, up, sizes, g):
    out, vjp = jax.vjp(lambda *a: ops.grouped_glu(*a, sizes, activation=activation,
                                                  implementation=impl), lhs, gate, up)
    return (out, *vjp(g))
  return jax.jit(step, compiler_options=helpers.FAST_COMPILE)(lhs, gate, up, sizes, g)


def _torch(lhs, gate, up, sizes, g, activation, dtype=None):
  return helpers.torch_value_and_grads(
      lambda *a: ref.grouped_glu(*a, torch.tensor(sizes), activation), (lhs, gate, up), g, dtype)


def _context(impl, monkeypatch):
  if impl == "triton":
    pytest.importorskip("triton")
    from jaxfuse.testing import triton_interpreter
    return triton_interpreter.triton_ops(monkeypatch)
  return jaxfuse.pallas_interpret(impl == "pallas")


IMPLEMENTATIONS = ("xla", "pallas", "triton")


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("label", list(SIZES))
def test_traced_group_sizes_match_the_torch_loop_in_float32(impl, label, monkeypatch):
  lhs, gate, up, g = _inputs()
  sizes, activation = SIZES[label]
  with _context(impl, monkeypatch):
    got = _run(impl, lhs, gate, up, jnp.array(sizes, jnp.int32), g, activation)
  want = _torch(lhs, gate, up, sizes, g, activation)
  for what, a, b in zip(("out", "d lhs", "d gate", "d up"), got, want):
    helpers.assert_close(a, b, what=f"{impl} {label} {what}")
  past = int(np.sum(sizes))
  assert not np.asarray(got[0][past:]).any() and not np.asarray(got[1][past:]).any()


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_bfloat16_within_twice_the_torch_loops_error(impl, monkeypatch):
  lhs, gate, up, g = _inputs(jnp.bfloat16)
  sizes, activation = SIZES["straddling"]
  with _context(impl, monkeypatch):
    got = _run(impl, lhs, gate, up, jnp.array(sizes, jnp.int32), g, activation)
  exact = _torch(lhs, gate, up, sizes, g, activation, torch.float64)
  low = _torch(lhs, gate, up, sizes, g, activation)
  for what, a, e, t in zip(("out", "d lhs", "d gate", "d up"), got, exact, low):
    assert a.dtype == jnp.bfloat16, what
    helpers.assert_within_low_precision_error(a, e, t, what=f"{impl} {what}")


def test_the_pallas_forward_is_one_kernel_writing_the_output_only():
  lhs, gate, up, _ = _inputs()
  sizes = jnp.array(SIZES["straddling"][0], jnp.int32)
  with jaxfuse.pallas_interpret(True):
    jaxpr = jax.make_jaxpr(lambda *a: ops.grouped_glu(*a, sizes, implementation="pallas"))(
        lhs, gate, up)
  calls = []

  def walk(jaxpr):   # nested jaxprs (custom_vjp, custom_jvp, pjit) included
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "pallas_call":
        calls.append(eqn)
      for param in eqn.params.values():
        for sub in param if isinstance(param, (list, tuple)) else (param,):
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns"):
            walk(inner)

  walk(jaxpr.jaxpr)
  assert len(calls) == 1, jaxpr
  assert [tuple(v.aval.shape) for v in calls[0].outvars] == [(M, N)]


@pytest.mark.parametrize("platform,ragged", [("cpu", False), ("gpu", True)])
def test_xla_loops_over_row_tiles_on_cpus_only(platform, ragged):
  lhs, gate, up, _ = _inputs()
  sizes = jnp.array(SIZES["straddling"][0], jnp.int32)
  loss = lambda *a: ops.grouped_glu(*a, sizes, implementation="xla").sum()
  with dispatch.target_platform(platform):
    text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(lhs, gate, up))
  assert ("ragged_dot" in text) == ragged
  assert ("while" in text) != ragged


def test_the_backward_keeps_only_the_inputs():
  lhs, gate, up, _ = _inputs()
  sizes = jnp.array(SIZES["straddling"][0], jnp.int32)
  kept = residuals(lambda *a: ops.grouped_glu(*a, sizes), lhs, gate, up)
  assert kept == [], kept


def test_a_callable_activation_is_refused_by_the_triton_kernels_by_name(monkeypatch):
  lhs, gate, up, _ = _inputs()
  sizes = jnp.array(SIZES["straddling"][0], jnp.int32)
  with _context("triton", monkeypatch), pytest.raises(
      ValueError, match=r"^grouped_glu: implementation='triton' supports the named activations"):
    ops.grouped_glu(lhs, gate, up, sizes, activation=jnp.tanh, implementation="triton")
