"""Second-order gradients against torch's double backward: Hessian-vector products by reverse
over reverse and by forward over reverse, on the XLA and the Pallas implementation.

(The normalization and cross-entropy ops have theirs in test_second_order_norm_xent.py.)
"""

import jax
import jax.numpy as jnp
import pytest
import torch
import torch.nn.attention
import torch.nn.functional as F

import jaxfuse
from jaxfuse import ops
from jaxfuse.testing.torch_ref import attention as attention_ref
from jaxfuse.testing.torch_ref import elementwise as elementwise_ref
from jaxfuse.testing.torch_ref import mlp as mlp_ref
from tests import helpers


def _normal(shape, seed, scale=1.0):
  return helpers.normal(seed, shape, scale=scale)


def _math_attention(q, k, v):
  """torch's SDPA on its math backend, the one with a double backward."""
  with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
    return attention_ref.attention(q, k, v, causal=True)


def _case(name):
  """``(jax fn(impl), torch fn, args)`` of one op at a small odd shape."""
  x, y = _normal((7, 13), 0, 2.0), _normal((7, 13), 1)
  bias = _normal((13,), 2)
  if name == "add_act":
    return (lambda i: lambda a, b: ops.add_act(a, b, "gelu", implementation=i),
            lambda a, b: elementwise_ref.add_act_unfused(a, b, "gelu"), (x, y))
  if name == "add_act_unfused":
    return (lambda i: lambda a, b: ops.add_act_unfused(a, b, "silu", implementation=i),
            lambda a, b: elementwise_ref.add_act_unfused(a, b, "silu"), (x, y))
  if name == "bias_act":
    return (lambda i: lambda x, b: ops.bias_act(x, b, "gelu_tanh", implementation=i),
            lambda x, b: mlp_ref.bias_act(x, b, "gelu_tanh"), (x, bias))
  if name == "glu":
    return (lambda i: lambda a, b: ops.glu(a, b, "silu", implementation=i),
            lambda a, b: mlp_ref.glu(a, b, "silu"), (x, y))
  if name == "glu_packed":
    packed = jnp.concatenate([x, y], axis=-1)
    return (lambda i: lambda x: ops.glu(x, "gelu", implementation=i),
            lambda x: mlp_ref.glu_packed(x, "gelu"), (packed,))
  if name == "softmax":
    return (lambda i: lambda x: ops.softmax(x, scale=0.7, implementation=i),
            lambda x: mlp_ref.softmax(x, scale=0.7), (x,))
  if name == "recompute_linear":
    w = _normal((5, 13), 3, 0.3)
    return (lambda i: lambda x, w, b: ops.recompute_linear(x, w, b, implementation=i),
            F.linear, (x, w, _normal((5,), 4)))
  if name == "attention":
    q, k, v = _normal((2, 11, 4, 8), 5), _normal((2, 9, 2, 8), 6), _normal((2, 9, 2, 8), 7)
    return (lambda i: lambda q, k, v: ops.attention(q, k, v, causal=True, implementation=i),
            _math_attention, (q, k, v))
  raise ValueError(name)


# ops whose second derivative is not identically zero in the directions tested; relu's is zero
# almost everywhere, and recompute_linear's Hessian has only its cross terms.
OPS = ["add_act", "add_act_unfused", "bias_act", "glu", "glu_packed", "softmax",
       "recompute_linear", "attention"]


@pytest.mark.parametrize("impl", helpers.CPU_IMPLEMENTATIONS)
@pytest.mark.parametrize("name", OPS)
def test_hessian_vector_products_match_torch_double_backward(name, impl, pallas_mode):
  jax_fn, torch_fn, args = _case(name)
  out = jax.eval_shape(jax_fn("xla"), *args)
  w = _normal(out.shape, 10)
  vs = tuple(_normal(a.shape, 20 + i) for i, a in enumerate(args))
  reverse, forward = helpers.jax_hessian_vector_products(jax_fn(impl), args, w, vs)
  want = helpers.torch_hessian_vector_products(torch_fn, args, w, vs)
  helpers.assert_second_order_close(reverse, want, what=f"{name} reverse over reverse")
  helpers.assert_second_order_close(forward, want, what=f"{name} forward over reverse")


def test_relu_and_dense_second_order_match_torch():
  x, w = _normal((6, 5), 0), _normal((5, 3), 1)
  g = _normal((6, 3), 2)
  vs = (_normal((6, 5), 3), _normal((5, 3), 4))
  fn = lambda x, k: ops.relu(ops.dense(x, k)) ** 2  # noqa: E731
  reverse, forward = helpers.jax_hessian_vector_products(fn, (x, w), g, vs)
  want = helpers.torch_hessian_vector_products(lambda x, k: F.relu(x @ k) ** 2, (x, w), g, vs)
  helpers.assert_second_order_close(reverse, want, what="reverse")
  helpers.assert_second_order_close(forward, want, what="forward")


def test_forward_mode_on_an_op_is_refused_by_jax():
  """custom_vjp ops take reverse mode (any order) but not forward mode on the op itself."""
  x = jnp.ones(3)
  with pytest.raises(TypeError, match="forward-mode"):
    jax.jvp(lambda x: ops.add_act(x, x, "silu"), (x,), (x,))


def test_pallas_kernels_take_the_derivative_of_their_twin():
  """In a step that needs the gradient and a Hessian-vector product (Sophia-style), the Pallas
  kernels compute the first order and their own derivative is the XLA twin's: the lowered GPU
  module still launches both kernels, and the values match the XLA implementation's."""
  a, b = _normal((64,), 0), _normal((64,), 1)

  def grad_and_hvp(impl):
    def step(a, b):
      grad = jax.grad(lambda a: jnp.sum(ops.add_act(a, b, "gelu", implementation=impl) ** 2))
      return grad(a), jax.grad(lambda a: jnp.vdot(grad(a), b))(a)
    return step

  names = helpers.triton_kernel_names(helpers.lower_for_gpu(grad_and_hvp("pallas"), a, b))
  assert sorted(names) == ["add_act_bwd", "add_act_fwd", "add_act_fwd"]
  with jaxfuse.pallas_interpret():
    got = jax.jit(grad_and_hvp("pallas"))(a, b)
  for x, y in zip(got, jax.jit(grad_and_hvp("xla"))(a, b)):
    helpers.assert_close(x, y)
