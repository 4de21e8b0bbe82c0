"""Edge cases of the ops: empty arrays, bad names, missing optional dependencies. Each gets the
right answer or an error that names the op and the argument.

(linear_cross_entropy's and the normalizations' edge cases are in their own test files.)
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfuse import metrics, ops


def test_a_bad_activation_name_names_the_op():
  """Packed glu's (the other calls are the op table's BAD entries, tests/cases/*.py)."""
  with pytest.raises(ValueError, match=r"^glu: activation must be a callable or one of .*got "
                     r"'geluu'"):
    ops.glu(jnp.ones(4), "geluu")


@pytest.mark.parametrize("shape,axis", [((4, 0), -1), ((0, 5), -1), ((4, 0), 0), ((0,), 0)])
def test_softmax_of_an_empty_array(shape, axis):
  x = jnp.ones(shape)
  y, grad = jax.value_and_grad(lambda x: ops.softmax(x, axis=axis).sum())(x)
  assert float(y) == 0.0 and grad.shape == shape
  assert ops.softmax(x, axis=axis).shape == shape


@pytest.mark.parametrize("shape", [(0, 5, 2, 8), (2, 0, 2, 8), (2, 5, 2, 0)])
def test_attention_with_an_empty_axis_and_its_gradient(shape):
  q = jnp.ones(shape)
  kv = jnp.ones((shape[0], 3, 2, shape[3]))
  o = ops.attention(q, kv, kv, causal=True)
  assert o.shape == shape and not np.any(np.asarray(o))
  grads = jax.grad(lambda q, k, v: ops.attention(q, k, v).sum(), argnums=(0, 1, 2))(q, kv, kv)
  assert [g.shape for g in grads] == [q.shape, kv.shape, kv.shape]
  assert all(not np.any(np.asarray(g)) for g in grads)


def test_torch_residual_bytes_without_torch_says_what_to_install(monkeypatch):
  monkeypatch.setitem(sys.modules, "torch", None)   # makes `import torch` raise ImportError
  with pytest.raises(ImportError, match=r"needs PyTorch.*jaxfuse\[test\]"):
    metrics.torch_residual_bytes(lambda: None)


def test_gpu_order_moves_to_triton_where_pallas_triton_is_deprecated(monkeypatch):
  from jaxfuse.ops import base, dispatch

  kernels_first = base.Op("k", "elementwise", base.KERNEL_GPU_ORDER, register=False)
  no_triton = base.Op("n", "elementwise", base.KERNEL_GPU_ORDER, kinds=("pallas",),
                      register=False)
  elementwise = base.Op("e", "elementwise", base.ELEMENTWISE_GPU_ORDER, register=False)
  monkeypatch.setattr(dispatch, "pallas_triton_current", lambda: True)
  assert kernels_first.preference["gpu"] == ("pallas", "triton", "xla")
  assert elementwise.preference["gpu"] == ("xla", "pallas", "triton")
  monkeypatch.setattr(dispatch, "pallas_triton_current", lambda: False)
  assert kernels_first.preference["gpu"] == ("triton", "xla")
  assert no_triton.preference["gpu"] == ("xla",)
  assert elementwise.preference["gpu"] == ("xla", "triton")
  assert kernels_first.preference["cpu"] == ("xla",)


@pytest.mark.parametrize("version,current", [("0.10.2", True), ("0.11.0", False),
                                             ("0.11.2", False), ("1.0.0", False)])
def test_pallas_triton_is_current_before_jax_0_11(monkeypatch, version, current):
  from jaxfuse.ops import dispatch

  monkeypatch.setattr(jax, "__version__", version)
  assert dispatch.pallas_triton_current.__wrapped__() is current
