"""recompute_linear against the seed's torch RecomputationLayer: forward and all gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfuse.metrics import bytes_moved, residual_bytes
from jaxfuse.ops import recompute_linear
from jaxfuse.ops.dispatch import ImplementationUnavailableError
from jaxfuse.testing.torch_ref.seed import RecomputationLayer
from tests import helpers

# Odd sizes, (5, 37, 123) -> 67 with and without a bias, are the op table's cases
# (tests/cases/linear.py), against F.linear in every dtype.
SHAPES = [((64, 32), 48), ((1, 3), 1)]


def _inputs(x_shape, out, dtype, seed=0):
  x, w, b, g = helpers.numpy_normals(seed, x_shape, (out, x_shape[-1]), (out,),
                                     (*x_shape[:-1], out))
  return helpers.to_jax(dtype, x, w / np.float32(x_shape[-1] ** 0.5), b, g)


def _jax(x, w, b, g, impl):
  out, vjp = jax.vjp(lambda x, w, b: recompute_linear(x, w, b, implementation=impl), x, w, b)
  return (out, *vjp(g))


def _torch(x, w, b, g, dtype=None):
  tx, tw, tb = (helpers.to_torch(a, dtype, requires_grad=True) for a in (x, w, b))
  out = RecomputationLayer.apply(tx.reshape(-1, tx.shape[-1]), tw, tb)
  out = out.reshape(*tx.shape[:-1], tw.shape[0])
  out.backward(helpers.to_torch(g, dtype))
  return out, tx.grad, tw.grad, tb.grad


@pytest.mark.parametrize("impl", helpers.CPU_IMPLEMENTATIONS)
@pytest.mark.parametrize("x_shape,out", SHAPES, ids=str)
def test_fp32_matches_seed_layer(impl, x_shape, out, pallas_mode):
  x, w, b, g = _inputs(x_shape, out, jnp.float32)
  for got, want, what in zip(_jax(x, w, b, g, impl), _torch(x, w, b, g),
                             ("out", "dx", "dweight", "dbias")):
    helpers.assert_close(got, want, what=what)


def test_keeps_only_its_inputs():
  x, w, b, _ = _inputs((64, 32), 48, jnp.float32)
  assert residual_bytes(lambda x, w, b: jnp.sum(jnp.sin(recompute_linear(x, w, b))), x, w, b) \
      == residual_bytes(lambda x, w, b: jnp.sum(jnp.sin(x @ w.T + b)), x, w, b)
  assert residual_bytes(lambda x, w, b: jnp.sum(recompute_linear(x, w, b) ** 2), x, w, b) \
      == 64 * 48 * 4  # only the square's input, which the layer itself does not keep


def test_pallas_bytes_moved_follow_the_tiles(pallas_mode):
  x, w, b, _ = _inputs((64, 32), 48, jnp.float32)
  moved = bytes_moved(lambda x, w, b: recompute_linear(x, w, b, implementation="pallas"), x, w, b)
  # One tile covers everything here: x, w, b read once, y written once.
  assert moved == x.nbytes + w.nbytes + b.nbytes + 64 * 48 * 4


def test_remat_runs_each_kernel_once():
  x, w, b, g = _inputs((40, 24), 16, jnp.float32)
  loss = lambda x, w, b: jnp.sum(recompute_linear(x, w, b, implementation="pallas") * g)  # noqa: E731
  step = jax.value_and_grad(jax.checkpoint(loss), argnums=(0, 1, 2))
  names = helpers.triton_kernel_names(helpers.lower_for_gpu(step, x, w, b))
  assert sorted(names) == ["linear_dbias", "linear_dweight", "linear_dx", "linear_fwd"]


def test_backward_recomputation_is_fenced_from_the_forward():
  """The backward starts from an optimization barrier over the saved inputs, which XLA on GPUs
  keeps: the recomputation cannot be CSE'd with the forward pass."""
  x, w, b, g = _inputs((8, 4), 3, jnp.float32)
  jaxpr = jax.make_jaxpr(jax.grad(lambda x, w, b: jnp.sum(recompute_linear(x, w, b) * g)))(x, w, b)
  assert "optimization_barrier" in str(jaxpr)


def test_errors_name_the_argument():
  """The errors the op table's BAD list (tests/cases/linear.py) has no entry for."""
  x, w, b, _ = _inputs((4, 5), 3, jnp.float32)
  with pytest.raises(TypeError, match=r"x must have a floating dtype.*int32"):
    recompute_linear(x.astype(jnp.int32), w, b)
  if not helpers.ON_GPU:
    with pytest.raises(ImplementationUnavailableError, match="Triton kernels need a GPU"):
      recompute_linear(x, w, b, implementation="triton")
