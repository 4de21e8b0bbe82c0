"""add_act and add_act_unfused against their torch twins: forward and both gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxfuse
from jaxfuse.metrics import bytes_moved, residual_bytes
from jaxfuse.ops import activations, add_act, add_act_unfused
from tests import helpers
from jaxfuse.testing.torch_ref import elementwise as ref

NAMED = sorted(activations.ACTIVATIONS)
SHAPES = [(4096,), (3, 7), ()]


_inputs = helpers.random_pair


def _jax_value_and_grads(op, a, b, g, fn, impl):
  return helpers.jax_value_and_grads(lambda a, b: op(a, b, fn, implementation=impl), (a, b), g)


def _torch_value_and_grads(a, b, g, act, dtype=None, chain=ref.add_act_unfused):
  return helpers.torch_value_and_grads(lambda a, b: chain(a, b, act), (a, b), g, dtype)


# The activations the op table (tests/cases/elementwise.py) has no add_act case for: those it has
# are checked against the twin in every dtype by test_op_twins.py.
UNTABLED = [act for act in NAMED
            if act not in ("gelu", "silu", "relu", "gelu_tanh", "squared_relu")]


@pytest.mark.parametrize("impl", helpers.CPU_IMPLEMENTATIONS)
@pytest.mark.parametrize("act", UNTABLED)
def test_fp32_matches_torch_for_every_activation(impl, act, pallas_mode):
  a, b, g = _inputs((5, 123, 123), jnp.float32)
  got = _jax_value_and_grads(add_act, a, b, g, act, impl)
  want = _torch_value_and_grads(a, b, g, act)
  for x, y, what in zip(got, want, ("out", "grad a", "grad b")):
    helpers.assert_close(x, y, what=f"{act} {what}")


@pytest.mark.parametrize("impl", helpers.CPU_IMPLEMENTATIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_any_shape_and_rank(impl, shape, pallas_mode):
  a, b, g = _inputs(shape, jnp.float32, seed=1)
  got = _jax_value_and_grads(add_act, a, b, g, "silu", impl)
  want = _torch_value_and_grads(a, b, g, "silu")
  for x, y in zip(got, want):
    helpers.assert_close(x, y)
    assert x.shape == shape


@pytest.mark.parametrize("impl", helpers.CPU_IMPLEMENTATIONS)
def test_user_function(impl, pallas_mode):
  fn = lambda c: jnp.sin(c) * c  # noqa: E731
  a, b, g = _inputs((77, 33), jnp.float32, seed=3)
  out, da, db = _jax_value_and_grads(add_act, a, b, g, fn, impl)
  c = np.asarray(a, np.float64) + np.asarray(b, np.float64)
  helpers.assert_close(out, np.sin(c) * c)
  helpers.assert_close(da, np.asarray(g) * (np.cos(c) * c + np.sin(c)))
  helpers.assert_close(db, da, rtol=0, atol=0)


@pytest.mark.parametrize("impl", helpers.CPU_IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_unfused_chain_matches_torch(impl, dtype, pallas_mode):
  a, b, g = _inputs((5, 123, 123), dtype, seed=4)
  got = _jax_value_and_grads(add_act_unfused, a, b, g, "gelu", impl)
  want = _torch_value_and_grads(a, b, g, "gelu")
  if dtype == jnp.float32:
    for x, y in zip(got, want):
      helpers.assert_close(x, y)
    return
  exact = _torch_value_and_grads(a, b, g, "gelu", dtype=torch.float64)
  for x, e, t in zip(got, exact, want):
    helpers.assert_within_low_precision_error(x, e, t)


@pytest.mark.parametrize("impl", helpers.CPU_IMPLEMENTATIONS)
def test_matches_fused_torch_twin(impl, pallas_mode):
  a, b, g = _inputs((1000,), jnp.float32, seed=5)
  got = _jax_value_and_grads(add_act, a, b, g, "tanh", impl)
  want = _torch_value_and_grads(a, b, g, "tanh", chain=ref.add_act_fused)
  for x, y in zip(got, want):
    helpers.assert_close(x, y)


@pytest.mark.parametrize("impl", helpers.CPU_IMPLEMENTATIONS)
def test_nan_and_inf_propagate_as_in_torch(impl, pallas_mode):
  a = jnp.array([jnp.nan, jnp.inf, -jnp.inf, 1.0, -1.0, jnp.nan, 0.0])
  b = jnp.array([0.0, 0.0, 0.0, jnp.inf, jnp.nan, -jnp.inf, -jnp.inf])
  for act in ("relu", "silu", "tanh", "sigmoid", "gelu_tanh", "identity"):
    got = add_act(a, b, act, implementation=impl)
    want = ref.add_act_unfused(helpers.to_torch(a), helpers.to_torch(b), act)
    np.testing.assert_array_equal(np.isnan(helpers.to_numpy(got)),
                                  np.isnan(helpers.to_numpy(want)), err_msg=act)
    finite = ~np.isnan(helpers.to_numpy(want))
    np.testing.assert_allclose(helpers.to_numpy(got)[finite], helpers.to_numpy(want)[finite],
                               err_msg=act)
  # The one documented difference: gelu(+inf) is +inf (its limit) where torch's CPU kernel gives
  # NaN; NaN and gelu(-inf) are NaN in both.
  got = helpers.to_numpy(add_act(a, b, "gelu", implementation=impl))
  assert np.isnan(got[[0, 2, 4, 5, 6]]).all()
  assert got[1] == np.inf and got[3] == np.inf


def test_jit_and_remat_compose(pallas_mode):
  a, b, g = _inputs((300,), jnp.float32, seed=6)
  loss = lambda a, b: jnp.sum(add_act(a, b, "gelu", implementation="pallas") * g)  # noqa: E731
  grads = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1)))(a, b)
  want = _torch_value_and_grads(a, b, g, "gelu")
  helpers.assert_close(grads[0], want[1])
  helpers.assert_close(grads[1], want[2])


# Memory and traffic ------------------------------------------------------------------------------


def test_fusion_moves_three_fifths_of_the_unfused_bytes(pallas_mode):
  a, b, _ = _inputs((10_000,), jnp.float32)
  fused = bytes_moved(lambda a, b: add_act(a, b, "relu", implementation="pallas"), a, b)
  unfused = bytes_moved(lambda a, b: add_act_unfused(a, b, "relu", implementation="pallas"), a, b)
  assert fused == 3 * a.nbytes
  assert unfused == 5 * a.nbytes


def test_fused_backward_keeps_only_the_inputs():
  a, b, _ = _inputs((10_000,), jnp.float32)
  assert residual_bytes(lambda a, b: jnp.sum(add_act(a, b, "gelu")), a, b) == 0
  # The unfused chain keeps c = a + b for fn's backward.
  assert residual_bytes(lambda a, b: jnp.sum(add_act_unfused(a, b, "gelu")), a, b) == a.nbytes


# Lowering for GPUs -------------------------------------------------------------------------------


# gelu in float32 and bfloat16 is the op table's case (test_op_lowering.py).
LOWERING = [(act, dtype) for act in NAMED for dtype in (jnp.float32, jnp.bfloat16, jnp.float16)
            if not (act == "gelu" and dtype != jnp.float16)]


@pytest.mark.parametrize("act,dtype", LOWERING,
                         ids=lambda v: v if isinstance(v, str) else jnp.dtype(v).name)
def test_pallas_kernels_lower_for_cuda(act, dtype):
  a, b, _ = _inputs((5, 123, 123), dtype)
  step = jax.value_and_grad(
      lambda a, b: jnp.sum(add_act(a, b, act, implementation="pallas").astype(jnp.float32) ** 2),
      argnums=(0, 1))
  names = helpers.triton_kernel_names(helpers.lower_for_gpu(step, a, b))
  assert sorted(names) == ["add_act_bwd", "add_act_fwd"]


def test_unfused_pallas_kernels_lower_for_cuda():
  a, b, _ = _inputs((1000,), jnp.float32)
  step = jax.value_and_grad(
      lambda a, b: jnp.sum(add_act_unfused(a, b, "gelu", implementation="pallas") ** 2),
      argnums=(0, 1))
  names = helpers.triton_kernel_names(helpers.lower_for_gpu(step, a, b))
  assert sorted(names) == ["act_bwd", "act_fwd", "add"]


def test_remat_runs_each_kernel_once():
  """Under jit(value_and_grad(remat(f))) the forward kernel is not launched a second time: the
  backward kernel needs only the inputs, not a recomputed forward."""
  a, b, w = _inputs((1000,), jnp.float32)
  loss = lambda a, b: jnp.sum(add_act(a, b, "silu", implementation="pallas") * w)  # noqa: E731
  step = jax.value_and_grad(jax.checkpoint(loss), argnums=(0, 1))
  names = helpers.triton_kernel_names(helpers.lower_for_gpu(step, a, b))
  assert sorted(names) == ["add_act_bwd", "add_act_fwd"]


# Bad input ---------------------------------------------------------------------------------------


def test_errors_name_the_argument():
  """The errors the op table's BAD list (tests/cases/elementwise.py) has no entry for."""
  a = jnp.ones((4, 5))
  with pytest.raises(TypeError, match=r"b must have a floating dtype.*bool"):
    add_act(a, jnp.ones((4, 5), bool))
  with pytest.raises(ValueError, match=r"implementation must be None or one of.*'cuda'"):
    add_act(a, a, implementation="cuda")


@pytest.mark.skipif(helpers.ON_GPU, reason="checks the CPU error")
def test_kernels_need_a_gpu_or_interpret_mode():
  a = jnp.ones((8,))
  with pytest.raises(jaxfuse.ImplementationUnavailableError, match=r"Available here: \['xla'\]"):
    add_act(a, a, implementation="pallas")
  with pytest.raises(jaxfuse.ImplementationUnavailableError, match="Triton kernels need a GPU"):
    add_act(a, a, implementation="triton")
  assert jnp.array_equal(add_act(a, a), add_act(a, a, implementation="xla"))


@pytest.mark.skipif(not jaxfuse.ops.dispatch.runs_natively("triton"),
                    reason="needs a GPU and jax-triton")
@pytest.mark.parametrize("act", ["relu", "gelu", "gelu_tanh", "silu", "tanh"])
def test_triton_implementation_matches_torch(act):
  a, b, g = _inputs((5, 123, 123), jnp.float32, seed=7)
  got = _jax_value_and_grads(add_act, a, b, g, act, "triton")
  want = _torch_value_and_grads(a, b, g, act)
  for x, y in zip(got, want):
    helpers.assert_close(x, y)
