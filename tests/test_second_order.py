"""Second-order gradients against torch's double backward, for every case of the op tables
(``tests/cases``) that has a second derivative: Hessian-vector products by reverse over
reverse (``grad`` of ``<grad L, v>``) and by forward over reverse (``jvp`` of ``grad L``), on
the XLA implementation, and on Pallas for each op's first case.

``L = sum(w * f(args)**2)`` over the op's outputs: squaring makes the cotangent that enters the
op's backward depend on the inputs, so the second derivative goes through the backward's
dependence on its cotangent as well as on the inputs and the parameters (with ``sum(w * f)``
the cotangent would be the constant ``w``, and a bias, which enters the output linearly, would
have a zero row in the Hessian).

Tolerance: float32 against torch in float64, each Hessian-vector product (one per
differentiated argument) within ``1e-5`` of its largest entry
(``helpers.assert_second_order_close``): a Hessian-vector product sums products of first and
second derivatives over every element, so its rounding is relative to its magnitude.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxfuse
from jaxfuse import ops
from tests import cases, helpers

# Each op's first case on XLA and Pallas, its other cases on XLA: the kernels' own derivative
# is their XLA twin's (jaxfuse.ops.base.kernel_call), which the options do not change.
FIRST = {c.op: c for c in reversed(cases.CASES) if c.second_order}
PARAMS = [pytest.param(c, impl, id=f"{c.id}-{impl}") for c in cases.CASES if c.second_order
          for impl in helpers.TABLE_IMPLEMENTATIONS
          if c.runs_on(impl) and (impl == "xla" or FIRST[c.op] is c)]


def _squared(outs):
  return [o.astype(jnp.float32) ** 2 if hasattr(o, "astype") else o ** 2 for o in outs]


def _normal(shape, seed):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32))


@pytest.mark.parametrize("case,impl", PARAMS)
def test_hessian_vector_products_match_torch_double_backward(case, impl, pallas_mode):
  args = case.inputs(case.small)
  f, diff = case.bind(args, impl)
  outs = jax.eval_shape(lambda *d: cases.outputs(f(*d)), *diff)
  ws = [_normal(o.shape, 10 + i) for i, o in enumerate(outs)]
  vs = [_normal(a.shape, 20 + i) for i, a in enumerate(diff)]

  def loss(*d):
    return sum(jnp.sum(o * w) for o, w in zip(_squared(cases.outputs(f(*d))), ws))

  argnums = tuple(range(len(diff)))
  grad = jax.grad(loss, argnums=argnums)
  directional = lambda *d: sum(jnp.vdot(g, v) for g, v in zip(grad(*d), vs))  # noqa: E731
  reverse = jax.jit(jax.grad(directional, argnums=argnums),
                    compiler_options=helpers.FAST_COMPILE)(*diff)
  forward = jax.jit(lambda d, v: jax.jvp(grad, d, v)[1],
                    compiler_options=helpers.FAST_COMPILE)(diff, tuple(vs))

  twin = case.second_order_twin or case.twin
  ints = dict(case.ints)
  targs = [torch.from_numpy(np.array(a)).long() if i in ints
           else helpers.to_torch(a, torch.float64, requires_grad=i in case.diff_args)
           for i, a in enumerate(args)]
  t_diff = [targs[i] for i in case.diff_args]
  t_loss = sum((o ** 2 * helpers.to_torch(w, torch.float64)).sum()
               for o, w in zip(cases.outputs(twin(*targs)), ws))
  grads = torch.autograd.grad(t_loss, t_diff, create_graph=True, allow_unused=True)
  t_dir = sum((g * helpers.to_torch(v, torch.float64)).sum() for g, v in zip(grads, vs)
              if g is not None)
  want = torch.autograd.grad(t_dir, t_diff, allow_unused=True)
  assert any(t is not None and float(t.abs().max()) > 0 for t in want), case.id
  helpers.assert_second_order_close(reverse, want, what=f"{case.id} {impl} reverse over reverse")
  helpers.assert_second_order_close(forward, want, what=f"{case.id} {impl} forward over reverse")


@pytest.mark.parametrize("impl", helpers.CPU_IMPLEMENTATIONS)
def test_the_returned_logsumexp_differentiates_twice(impl, pallas_mode):
  """linear_cross_entropy's logsumexp output (a second cotangent into its backward)."""
  rng = np.random.default_rng(3)
  h, w, b = _normal((11, 6), 0), 0.7 * _normal((13, 6), 1), 0.3 * _normal((13,), 2)
  y = jnp.asarray(rng.integers(0, 13, (11,)), jnp.int32).at[2].set(-100)
  ty = torch.from_numpy(np.array(y)).long()

  def jax_fn(h, w, b):
    loss, aux = ops.linear_cross_entropy(h, w, y, bias=b, reduction="none", return_lse=True,
                                         logit_softcap=3.0, implementation=impl, chunk_size=4)
    return loss * aux["lse"]

  def torch_fn(h, w, b):
    logits = 3.0 * torch.tanh((h @ w.T + b) / 3.0)
    loss = torch.nn.functional.cross_entropy(logits, ty, ignore_index=-100, reduction="none")
    return loss * torch.logsumexp(logits, -1)

  g, vs = _normal((11,), 10), (_normal((11, 6), 20), _normal((13, 6), 21), _normal((13,), 22))
  reverse, forward = helpers.jax_hessian_vector_products(jax_fn, (h, w, b), g, vs)
  want = helpers.torch_hessian_vector_products(torch_fn, (h, w, b), g, vs)
  helpers.assert_second_order_close(reverse, want, what="reverse")
  helpers.assert_second_order_close(forward, want, what="forward")


def test_relu_and_dense_second_order_match_torch():
  x, w = _normal((6, 5), 0), _normal((5, 3), 1)
  g = _normal((6, 3), 2)
  vs = (_normal((6, 5), 3), _normal((5, 3), 4))
  fn = lambda x, k: ops.relu(ops.dense(x, k)) ** 2  # noqa: E731
  reverse, forward = helpers.jax_hessian_vector_products(fn, (x, w), g, vs)
  want = helpers.torch_hessian_vector_products(
      lambda x, k: torch.nn.functional.relu(x @ k) ** 2, (x, w), g, vs)
  helpers.assert_second_order_close(reverse, want, what="reverse")
  helpers.assert_second_order_close(forward, want, what="forward")


@pytest.mark.parametrize("op", sorted({c.op for c in cases.CASES}))
def test_forward_mode_on_an_op_is_refused_by_jax(op):
  """custom_vjp ops take reverse mode (any order) but not forward mode on the op itself."""
  case = next(c for c in cases.CASES if c.op == op)
  if op in ("rotary_embedding",):
    pytest.skip("plain jnp: forward mode works")
  f, diff = case.bind(case.inputs(case.small))
  with pytest.raises(TypeError, match="forward-mode"):
    jax.jvp(f, diff, diff)


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
