"""glu (SwiGLU, GEGLU, ReGLU) against torch's ``act(a) * b``: both forms, both gradients,
kernels, errors."""

import re

import jax
import jax.numpy as jnp
import pytest
import torch

import jaxfuse
from jaxfuse.metrics import bytes_moved, residual_bytes
from jaxfuse.ops import activations, glu, glu_reference
from tests import helpers
from jaxfuse.testing.torch_ref import mlp as ref

SIZES = [64, 768, 1000, 4097, 8192]


_inputs = helpers.random_pair


def _jax(a, b, g, act, impl):
  return helpers.jax_value_and_grads(lambda a, b: glu(a, b, act, implementation=impl), (a, b), g)


def _jax_packed(x, g, act, impl):
  @jax.jit
  def run(x, g):
    y, vjp = jax.vjp(lambda x: glu(x, act, implementation=impl), x)
    return y, vjp(g)[0]
  return run(x, g)


def _torch(a, b, g, act, dtype=None):
  return helpers.torch_value_and_grads(lambda a, b: ref.glu(a, b, act), (a, b), g, dtype)


@pytest.mark.parametrize("impl", helpers.CPU_IMPLEMENTATIONS)
@pytest.mark.parametrize("n", SIZES)
def test_packed_form_and_feature_sizes(impl, n, pallas_mode):
  """glu(x, act) on x = [a | b] matches torch on the two halves; dx = [da | db]."""
  a, b, g = _inputs((3, n), jnp.float32, seed=n)
  y, dx = _jax_packed(jnp.concatenate([a, b], axis=-1), g, "silu", impl)
  ty, da, db = _torch(a, b, g, "silu")
  helpers.assert_close(y, ty)
  helpers.assert_close(dx, torch.cat([da, db], dim=-1))


@pytest.mark.parametrize("impl", helpers.CPU_IMPLEMENTATIONS)
def test_user_function(impl, pallas_mode):
  fn = lambda a: jnp.sin(a) * a  # noqa: E731
  a, b, g = _inputs((7, 33), jnp.float32, seed=3)
  y, da, db = _jax(a, b, g, fn, impl)
  helpers.assert_close(y, jnp.sin(a) * a * b)
  helpers.assert_close(da, g * b * (jnp.cos(a) * a + jnp.sin(a)))
  helpers.assert_close(db, g * jnp.sin(a) * a)


def test_kernels_with_small_tiles():
  """The kernels at GPU-like tile sizes (interpret mode): tails in both dimensions."""
  from jaxfuse.kernels.pallas import gated_linear as kernels

  a, b, g = _inputs((13, 300), jnp.float32, seed=4)
  fn = activations.silu
  kw = dict(interpret=True, block_rows=4, block_cols=128)

  @jax.jit
  def run(a, b, g):
    x = jnp.concatenate([a, b], axis=-1)
    return (kernels.glu_forward(a, b, fn, **kw), kernels.glu_backward(a, b, g, fn, **kw),
            kernels.glu_forward(x, None, fn, **kw), kernels.glu_backward(x, None, g, fn, **kw))

  y, (da, db), y_packed, dx = run(a, b, g)
  want, vjp = jax.vjp(lambda a, b: fn(a) * b, a, b)
  want_da, want_db = vjp(g)
  for got, expected in ((y, want), (da, want_da), (db, want_db), (y_packed, want),
                        (dx, jnp.concatenate([want_da, want_db], axis=-1))):
    helpers.assert_close(got, expected)


def test_reference_takes_both_forms():
  a, b, _ = _inputs((4, 6), jnp.float32)
  packed = jnp.concatenate([a, b], axis=-1)
  got = jax.jit(lambda packed, a, b: (glu_reference(packed, "gelu"), glu_reference(a, b, "gelu"),
                                      glu(packed), glu(a, b, "silu")))(packed, a, b)
  helpers.assert_close(got[0], got[1], rtol=0, atol=0)
  helpers.assert_close(got[2], got[3], rtol=0, atol=0)


# Memory and traffic ------------------------------------------------------------------------------


def test_only_the_inputs_are_kept():
  a, b, g = _inputs((64, 1000), jnp.float32)
  assert residual_bytes(lambda a, b: jnp.sum(glu(a, b, "gelu") * g), a, b) == 0
  x = jnp.concatenate([a, b], axis=-1)
  assert residual_bytes(lambda x: jnp.sum(glu(x, "silu") * g), x) == 0
  plain = lambda a, b: jnp.sum(activations.silu(a) * b * g)  # noqa: E731
  assert residual_bytes(plain, a, b) >= a.nbytes


def test_traffic_three_arrays_forward_five_backward(pallas_mode):
  a, b, g = _inputs((64, 1000), jnp.float32)
  x = jnp.concatenate([a, b], axis=-1)
  for args, f in (((a, b), lambda a, b: glu(a, b, implementation="pallas")),
                  ((x,), lambda x: glu(x, implementation="pallas"))):
    fwd = bytes_moved(f, *args)
    both = bytes_moved(jax.grad(lambda *p: jnp.sum(f(*p) * g), argnums=tuple(range(len(args)))),
                       *args)
    assert fwd == 3 * a.nbytes
    assert both - fwd == 5 * a.nbytes


# Lowering for GPUs -------------------------------------------------------------------------------


# silu in float32 and bfloat16, both forms, is the op table's case (test_op_lowering.py).
@pytest.mark.parametrize("act, dtype", [
    ("gelu", jnp.float32), ("gelu_tanh", jnp.bfloat16), ("relu", jnp.float16)], ids=str)
def test_pallas_kernels_lower_for_cuda(act, dtype):
  a, b, _ = _inputs((5, 17, 1000), dtype)
  step = jax.value_and_grad(lambda a, b: jnp.sum(
      glu(a, b, act, implementation="pallas").astype(jnp.float32) ** 2), argnums=(0, 1))
  assert sorted(helpers.triton_kernel_names(helpers.lower_for_gpu(step, a, b))) == [
      "glu_bwd", "glu_fwd"]
  x = jnp.concatenate([a, b], axis=-1)
  step = jax.value_and_grad(lambda x: jnp.sum(
      glu(x, act, implementation="pallas").astype(jnp.float32) ** 2))
  assert sorted(helpers.triton_kernel_names(helpers.lower_for_gpu(step, x))) == [
      "glu_bwd", "glu_fwd"]


def test_remat_runs_each_kernel_once():
  a, b, w = _inputs((37, 4097), jnp.float32)
  loss = lambda a, b: jnp.sum(glu(a, b, "silu", implementation="pallas") * w)  # noqa: E731
  step = jax.value_and_grad(jax.checkpoint(loss), argnums=(0, 1))
  names = helpers.triton_kernel_names(helpers.lower_for_gpu(step, a, b))
  assert sorted(names) == ["glu_bwd", "glu_fwd"]


# Bad input ---------------------------------------------------------------------------------------


def test_errors_name_the_argument():
  """The errors the op table's BAD list (tests/cases/gated_linear.py) has no entry for."""
  a = jnp.ones((4, 5))
  with pytest.raises(TypeError, match=r"glu: b must have a floating dtype.*int32"):
    glu(a, jnp.ones((4, 5), jnp.int32))
  with pytest.raises(ValueError, match=r"glu: implementation must be None or one of"):
    glu(a, a, implementation="cuda")


@pytest.mark.skipif(helpers.ON_GPU, reason="checks the CPU error")
def test_kernels_need_a_gpu_or_interpret_mode():
  a = jnp.ones((2, 4))
  here = re.escape(str([*helpers.CPU_KERNELS, "xla"]))
  with pytest.raises(jaxfuse.ImplementationUnavailableError, match=f"Available here: {here}"):
    glu(a, a, implementation="pallas")
  with pytest.raises(jaxfuse.ImplementationUnavailableError, match="Triton kernels need a GPU"):
    glu(a, a, implementation="triton")
