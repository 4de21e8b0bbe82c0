"""bias_act against torch (``F.gelu(x + b, approximate=...)``, ``F.silu``, relu, squared relu):
forward, input and bias gradients, kernels, errors."""

import jax
import jax.numpy as jnp
import pytest

import jaxfuse
from jaxfuse.kernels.pallas import bias_activation as kernels
from jaxfuse.metrics import bytes_moved, residual_bytes
from jaxfuse.ops import activations, bias_act
from tests import helpers
from jaxfuse.testing.torch_ref import mlp as ref

SIZES = [64, 768, 1000, 4097, 8192]


def _inputs(shape, dtype, seed=0):
  x, bias, g = helpers.numpy_normals(seed, shape, shape[-1:], shape)
  return helpers.to_jax(dtype, 2 * x, bias, g)


def _jax(x, bias, g, act, impl):
  return helpers.jax_value_and_grads(lambda x, b: bias_act(x, b, act, implementation=impl),
                                     (x, bias), g)


def _torch(x, bias, g, act, dtype=None):
  return helpers.torch_value_and_grads(lambda x, b: ref.bias_act(x, b, act), (x, bias), g, dtype)


@pytest.mark.parametrize("impl", helpers.CPU_IMPLEMENTATIONS)
@pytest.mark.parametrize("n", SIZES)
def test_feature_sizes(impl, n, pallas_mode):
  x, bias, g = _inputs((3, n), jnp.float32, seed=n)
  for got, want in zip(_jax(x, bias, g, "gelu", impl), _torch(x, bias, g, "gelu")):
    helpers.assert_close(got, want, what=f"n={n}")


def test_kernels_with_small_tiles_and_row_groups():
  """Both kernels at GPU-like tile sizes (interpret mode): tails in both dimensions, and the
  backward's bias partial sums over several row groups."""
  x, bias, g = _inputs((37, 300), jnp.float32, seed=3)
  fn = activations.gelu
  tiles = dict(interpret=True, block_rows=8, block_cols=128)
  run = jax.jit(lambda x, b, g: (kernels.bias_act_forward(x, b, fn, **tiles),
                                 kernels.bias_act_backward(x, b, g, fn, steps=2, **tiles)))
  y, (dx, dbias) = run(x, bias, g)
  want_y, vjp = jax.vjp(lambda x, b: fn(x + b), x, bias)
  want_dx, want_dbias = vjp(g)
  helpers.assert_close(y, want_y)
  helpers.assert_close(dx, want_dx)
  helpers.assert_close(dbias, want_dbias)
  assert kernels.backward_plan(37, 300, interpret=False, block_rows=8, block_cols=128,
                               steps=2)[3] == 3  # row groups of 16


# Memory and traffic ------------------------------------------------------------------------------


def test_only_the_inputs_are_kept():
  x, bias, g = _inputs((64, 1000), jnp.float32)
  assert residual_bytes(lambda x, b: jnp.sum(bias_act(x, b, "gelu") * g), x, bias) == 0
  # The unfused chain keeps x + b (and more) for the activation's backward.
  plain = lambda x, b: jnp.sum(activations.gelu(x + b) * g)  # noqa: E731
  assert residual_bytes(plain, x, bias) >= x.nbytes


def test_traffic_is_read_x_write_y(pallas_mode):
  x, bias, _ = _inputs((64, 1000), jnp.float32)
  moved = bytes_moved(lambda x, b: bias_act(x, b, "silu", implementation="pallas"), x, bias)
  assert 2 * x.nbytes <= moved <= 2 * x.nbytes + 64 * bias.nbytes


# Lowering for GPUs -------------------------------------------------------------------------------


# gelu in float32 and bfloat16 is the op table's case (test_op_lowering.py).
@pytest.mark.parametrize("act, dtype", [
    ("gelu_tanh", jnp.float32), ("squared_relu", jnp.float32), ("silu", jnp.bfloat16),
    ("relu", jnp.float16)], ids=str)
def test_pallas_kernels_lower_for_cuda(act, dtype):
  x, bias, _ = _inputs((5, 17, 1000), dtype)
  step = jax.value_and_grad(lambda x, b: jnp.sum(
      bias_act(x, b, act, implementation="pallas").astype(jnp.float32) ** 2), argnums=(0, 1))
  names = helpers.triton_kernel_names(helpers.lower_for_gpu(step, x, bias))
  assert sorted(names) == ["bias_act_bwd", "bias_act_fwd"]


def test_remat_runs_each_kernel_once():
  x, bias, w = _inputs((37, 4097), jnp.float32)
  loss = lambda x, b: jnp.sum(bias_act(x, b, "gelu", implementation="pallas") * w)  # noqa: E731
  step = jax.value_and_grad(jax.checkpoint(loss), argnums=(0, 1))
  names = helpers.triton_kernel_names(helpers.lower_for_gpu(step, x, bias))
  assert sorted(names) == ["bias_act_bwd", "bias_act_fwd"]


# Bad input ---------------------------------------------------------------------------------------


def test_errors_name_the_argument():
  """The errors the op table's BAD list (tests/cases/bias_activation.py) has no entry for."""
  x = jnp.ones((4, 5))
  with pytest.raises(TypeError, match=r"bias_act: x must have a floating dtype.*int32"):
    bias_act(jnp.ones((4, 5), jnp.int32), jnp.ones(5))
  with pytest.raises(ValueError, match=r"bias_act: implementation must be None or one of"):
    bias_act(x, jnp.ones(5), implementation="cuda")


@pytest.mark.skipif(helpers.ON_GPU, reason="checks the CPU error")
def test_pallas_needs_a_gpu_or_interpret_mode():
  with pytest.raises(jaxfuse.ImplementationUnavailableError, match=r"Available here: \['xla'\]"):
    bias_act(jnp.ones((2, 3)), jnp.ones(3), implementation="pallas")
