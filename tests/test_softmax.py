"""softmax against torch's F.softmax: forward and gradient, masks, stability, kernels, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxfuse
from jaxfuse.kernels.pallas import softmax as kernels
from jaxfuse.metrics import bytes_moved, residual_bytes
from jaxfuse.ops import softmax, softmax_reference
from jaxfuse.testing.torch_ref import mlp as ref
from tests import helpers

SIZES = [64, 768, 1000, 4097, 8192]


def _inputs(shape, dtype, seed=0, spread=3.0):
  x, g = helpers.numpy_normals(seed, shape, shape)
  return helpers.to_jax(dtype, spread * x, g)


def _jax(x, g, impl, mask=None, **kw):
  @jax.jit
  def run(x, g, mask):
    y, vjp = jax.vjp(lambda x: softmax(x, mask=mask, implementation=impl, **kw), x)
    return y, vjp(g)[0]
  return run(x, g, mask)


def _torch(x, g, dtype=None, mask=None, **kw):
  tx = helpers.to_torch(x, dtype, requires_grad=True)
  tmask = None if mask is None else torch.from_numpy(np.array(mask))
  y = ref.softmax(tx, mask=tmask, **kw)
  y.backward(helpers.to_torch(g, dtype))
  return y, tx.grad


@pytest.mark.parametrize("impl", helpers.CPU_IMPLEMENTATIONS)
@pytest.mark.parametrize("n", SIZES)
def test_fp32_matches_torch(impl, n, pallas_mode):
  x, g = _inputs((3, n), jnp.float32, seed=n)
  for got, want, what in zip(_jax(x, g, impl), _torch(x, g), ("out", "grad")):
    helpers.assert_close(got, want, what=f"n={n} {what}")


@pytest.mark.parametrize("impl", helpers.CPU_IMPLEMENTATIONS)
@pytest.mark.parametrize("n", [1000, 4097])
def test_values_around_1e4_are_stable(impl, n, pallas_mode):
  """Logits near 1e4 (exp overflows without the max shift): same result as torch, no NaN."""
  x, g = _inputs((5, n), jnp.float32, seed=1, spread=30.0)
  x = x + 1e4
  got = _jax(x, g, impl)
  want = _torch(x, g)
  for a, b in zip(got, want):
    assert np.isfinite(helpers.to_numpy(a)).all()
    helpers.assert_close(a, b)


@pytest.mark.parametrize("impl", helpers.CPU_IMPLEMENTATIONS)
def test_axis_scale_and_odd_shapes(impl, pallas_mode):
  x, g = _inputs((5, 123, 7), jnp.float32, seed=4)
  for axis in (0, 1, -1):
    got = _jax(x, g, impl, axis=axis, scale=0.125)
    want = _torch(x, g, axis=axis, scale=0.125)
    for a, b in zip(got, want):
      helpers.assert_close(a, b, what=f"axis={axis}")


@pytest.mark.parametrize("impl", helpers.CPU_IMPLEMENTATIONS)
def test_mask_broadcasts_and_empty_rows_are_zero(impl, pallas_mode):
  """A (T, T) causal mask over (B, T, T) scores; rows with no kept entry give 0 and grad 0
  (torch gives NaN there)."""
  x, g = _inputs((3, 37, 37), jnp.float32, seed=5)
  causal = jnp.tril(jnp.ones((37, 37), bool))
  mask = causal.at[4].set(False)  # row 4 keeps nothing
  y, dx = _jax(x, g, impl, mask=mask, scale=0.5)
  ty, tdx = _torch(x, g, mask=jnp.broadcast_to(mask, x.shape), scale=0.5)
  keep_row = np.ones(37, bool)
  keep_row[4] = False
  helpers.assert_close(y[:, keep_row], ty[:, keep_row])
  helpers.assert_close(dx[:, keep_row], tdx[:, keep_row])
  assert np.isnan(helpers.to_numpy(ty[:, 4])).all()
  assert (helpers.to_numpy(y[:, 4]) == 0).all() and (helpers.to_numpy(dx[:, 4]) == 0).all()
  assert (helpers.to_numpy(y)[:, ~np.asarray(causal)] == 0).all()


@pytest.mark.parametrize("impl", helpers.CPU_IMPLEMENTATIONS)
def test_long_rows_walk_chunks(impl, pallas_mode):
  """Rows longer than one kernel chunk (16384) take the two-pass online path."""
  x, g = _inputs((2, 20000), jnp.float32, seed=6)
  mask = jnp.asarray(np.random.default_rng(7).random(x.shape) < 0.9)
  for a, b in zip(_jax(x, g, impl, mask=mask), _torch(x, g, mask=mask)):
    helpers.assert_close(a, b)


def test_chunked_kernel_with_small_blocks():
  """The kernels' multi-chunk loop and row tails, at GPU-like block sizes (interpret mode)."""
  x, g = _inputs((5, 1000), jnp.float32, seed=8)
  mask = jnp.asarray(np.random.default_rng(9).random(x.shape) < 0.8).at[2].set(False)
  kw = dict(scale=0.7, interpret=True, max_chunk=256, block_rows=2)

  @jax.jit
  def run(x, mask, g):
    y = kernels.softmax_forward(x, mask, **kw)
    return y, kernels.softmax_backward(y, g, **kw)

  y, dx = run(x, mask, g)
  want, vjp = jax.vjp(lambda x: softmax_reference(x, scale=0.7, mask=mask), x)
  helpers.assert_close(y, want)
  helpers.assert_close(dx, vjp(g)[0])


def test_jit_vmap_and_grad_compose(pallas_mode):
  x, g = _inputs((4, 3, 100), jnp.float32, seed=10)
  f = jax.jit(jax.vmap(lambda x: softmax(x, implementation="pallas")))
  helpers.assert_close(f(x), _torch(x, g)[0])
  grad = jax.jit(jax.grad(lambda x: jnp.sum(softmax(x, implementation="pallas") * g)))(x)
  helpers.assert_close(grad, _torch(x, g)[1])


# Memory and traffic ------------------------------------------------------------------------------


def test_the_output_is_the_only_residual():
  x, g = _inputs((64, 1000), jnp.float32)
  loss = lambda x: jnp.sum(softmax(x) * g)  # noqa: E731
  assert residual_bytes(loss, x) == x.nbytes
  mask = jnp.ones(x.shape, bool)
  assert residual_bytes(lambda x: jnp.sum(softmax(x, mask=mask) * g), x) == x.nbytes


def test_one_read_and_one_write_per_pass(pallas_mode):
  x, g = _inputs((64, 1000), jnp.float32)
  fwd = bytes_moved(lambda x: softmax(x, implementation="pallas"), x)
  both = bytes_moved(jax.grad(lambda x: jnp.sum(softmax(x, implementation="pallas") * g)), x)
  assert fwd == 2 * x.nbytes  # read x, write y
  assert both - fwd == 3 * x.nbytes  # read y and g, write dx


# Lowering for GPUs -------------------------------------------------------------------------------


# One unmasked chunk in float32 and bfloat16 is the op table's case (test_op_lowering.py).
@pytest.mark.parametrize("dtype, n, masked", [
    (jnp.float32, 1000, True), (jnp.float32, 20000, False), (jnp.float32, 20000, True),
    (jnp.bfloat16, 1000, True), (jnp.float16, 4097, False)], ids=str)
def test_pallas_kernels_lower_for_cuda(dtype, n, masked):
  x, _ = _inputs((5, n), dtype)
  mask = jnp.ones((5, n), bool) if masked else None
  step = jax.value_and_grad(lambda x: jnp.sum(
      softmax(x, mask=mask, scale=0.5, implementation="pallas").astype(jnp.float32) ** 2))
  names = helpers.triton_kernel_names(helpers.lower_for_gpu(step, x))
  assert sorted(names) == ["softmax_bwd", "softmax_fwd"]


def test_remat_kernel_count():
  """Under jit(value_and_grad(checkpoint(f))) the backward kernel runs once, and the forward
  kernel runs twice: once for the value and once in the backward to recompute the output, which
  is softmax's one residual and which checkpoint asks not to keep. Without checkpoint it runs once.
  """
  x, w = _inputs((37, 1000), jnp.float32)
  loss = lambda x: jnp.sum(softmax(x, implementation="pallas") * w)  # noqa: E731
  plain = helpers.triton_kernel_names(helpers.lower_for_gpu(jax.value_and_grad(loss), x))
  assert sorted(plain) == ["softmax_bwd", "softmax_fwd"]
  remat = helpers.triton_kernel_names(
      helpers.lower_for_gpu(jax.value_and_grad(jax.checkpoint(loss)), x))
  assert sorted(remat) == ["softmax_bwd", "softmax_fwd", "softmax_fwd"]


# Bad input ---------------------------------------------------------------------------------------


def test_errors_name_the_argument():
  """The error the op table's BAD list (tests/cases/softmax.py) has no entry for."""
  with pytest.raises(ValueError, match=r"softmax: implementation must be None or one of"):
    softmax(jnp.ones((4, 5)), implementation="cuda")


@pytest.mark.skipif(helpers.ON_GPU, reason="checks the CPU error")
def test_pallas_needs_a_gpu_or_interpret_mode():
  with pytest.raises(jaxfuse.ImplementationUnavailableError, match=r"Available here: \['xla'\]"):
    softmax(jnp.ones((2, 3)), implementation="pallas")
  with pytest.raises(jaxfuse.ImplementationUnavailableError, match="Triton kernels need a GPU"):
    softmax(jnp.ones((2, 3)), implementation="triton")
