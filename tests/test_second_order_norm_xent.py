"""Second-order gradients of the normalizations and of linear_cross_entropy against torch's
double backward: Hessian-vector products by reverse over reverse (``grad`` of ``<grad L, v>``)
and by forward over reverse (``jvp`` of ``grad L``), on the XLA and the Pallas implementation.

``L = sum(w * f(args)**2)``: squaring the op's output makes the cotangent that enters the op's
backward depend on the inputs, so the second derivative goes through the backward's dependence
on its cotangent as well as on the inputs and the parameters (with ``sum(w * f)`` the cotangent
would be the constant ``w``, and a bias, which enters the output linearly, would have a zero
row in the Hessian).

Tolerance: float32 against torch in float64, each Hessian-vector product (one per argument:
inputs and parameters) within ``1e-5`` of its largest entry (``helpers.assert_second_order_close``):
the fp32 rule's ``rtol`` of about 1e-5, relative to the magnitude because a Hessian-vector
product sums products of first and second derivatives over every element. The errors measured
at these shapes are 1e-7 to 7e-7 of the largest entry.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxfuse import ops
from jaxfuse.testing.torch_ref import cross_entropy as xent_ref
from jaxfuse.testing.torch_ref import normalization as norm_ref
from tests import helpers

RTOL = 1e-5


def _normal(shape, seed, scale=1.0, loc=0.0):
  return helpers.to_jax(jnp.float32, loc + scale * helpers.numpy_normals(seed, shape)[0])[0]


def _assert_hvps_match_torch(jax_fn, torch_fn, args, what):
  out = jax.eval_shape(jax_fn, *args)
  w = _normal(out.shape, 10)
  vs = tuple(_normal(a.shape, 20 + i) for i, a in enumerate(args))
  reverse, forward = helpers.jax_hessian_vector_products(jax_fn, args, w, vs)
  want = helpers.torch_hessian_vector_products(torch_fn, args, w, vs)
  assert any(t is not None and float(t.abs().max()) > 0 for t in want)
  helpers.assert_second_order_close(reverse, want, rtol=RTOL, what=f"{what} reverse over reverse")
  helpers.assert_second_order_close(forward, want, rtol=RTOL, what=f"{what} forward over reverse")


# Normalization ----------------------------------------------------------------------------------


def _norm_case(name):
  """``(jax fn(impl), torch fn, args)``: outputs squared (the add variants' two concatenated),
  rows of 7 features with a mean of 0.5, so that the centering matters."""
  x, r = _normal((2, 3, 7), 0, 2.0, 0.5), _normal((2, 3, 7), 1)
  scale, bias = _normal((7,), 2, 0.3, 1.0), _normal((7,), 3, 0.3)
  if name == "layer_norm":
    return (lambda i: lambda x, s, b: ops.layer_norm(x, s, b, implementation=i) ** 2,
            lambda x, s, b: norm_ref.layer_norm(x, s, b) ** 2, (x, scale, bias))
  if name == "rms_norm":
    return (lambda i: lambda x, s: ops.rms_norm(x, s, implementation=i) ** 2,
            lambda x, s: norm_ref.rms_norm(x, s) ** 2, (x, scale))
  if name == "layer_norm_plain":  # neither scale nor bias
    return (lambda i: lambda x: ops.layer_norm(x, implementation=i) ** 2,
            lambda x: norm_ref.layer_norm(x) ** 2, (x,))
  if name == "add_layer_norm":
    return (lambda i: lambda x, r, s, b: jnp.concatenate(
                ops.add_layer_norm(x, r, s, b, implementation=i), -1) ** 2,
            lambda x, r, s, b: torch.cat(norm_ref.add_layer_norm(x, r, s, b), -1) ** 2,
            (x, r, scale, bias))
  if name in ("add_rms_norm", "add_rms_norm_unfused"):
    op = getattr(ops, name)
    return (lambda i: lambda x, r, s: jnp.concatenate(op(x, r, s, implementation=i), -1) ** 2,
            lambda x, r, s: torch.cat(norm_ref.add_rms_norm(x, r, s), -1) ** 2, (x, r, scale))
  raise ValueError(name)


NORMS = ["layer_norm", "rms_norm", "layer_norm_plain", "add_layer_norm", "add_rms_norm",
         "add_rms_norm_unfused"]


@pytest.mark.parametrize("impl", helpers.CPU_IMPLEMENTATIONS)
@pytest.mark.parametrize("name", NORMS)
def test_normalization_hessian_vector_products_match_torch(name, impl, pallas_mode):
  jax_fn, torch_fn, args = _norm_case(name)
  _assert_hvps_match_torch(jax_fn(impl), torch_fn, args, f"{name} {impl}")


# Linear cross-entropy ---------------------------------------------------------------------------

IGNORE = -100
OPTIONS = {
    "plain": {},
    "all": {"label_smoothing": 0.2, "z_loss": 0.01, "logit_softcap": 2.0},
}
# (option, reduction, with bias, grad_in_forward, implementation); grad_in_forward is XLA's.
XENT_CASES = [(*case, impl)
              for case in [("plain", "mean", True, False), ("all", "sum", True, False),
                           ("all", "none", False, False)]
              for impl in helpers.CPU_IMPLEMENTATIONS]
XENT_CASES += [("all", "mean", True, True, "xla"), ("plain", "sum", False, True, "xla")]


def _xent_inputs():
  """11 tokens (two ignored), D = 6, V = 13: no size a multiple of a tile; chunks of 4 tokens."""
  h, w, b = _normal((11, 6), 0), _normal((13, 6), 1, 0.7), _normal((13,), 2, 0.3)
  y = jnp.asarray(np.random.default_rng(3).integers(0, 13, (11,)), jnp.int32)
  y = y.at[2].set(IGNORE).at[7].set(IGNORE)
  return h, w, b, y


@pytest.mark.parametrize("option,reduction,use_bias,grad_in_forward,impl", XENT_CASES, ids=str)
def test_linear_cross_entropy_hessian_vector_products_match_torch(
    option, reduction, use_bias, grad_in_forward, impl, pallas_mode):
  """Reductions, ignore_index, label smoothing, z-loss and soft-cap, with and without a bias.
  grad_in_forward=True differentiates the forward pass that made the gradients."""
  h, w, b, y = _xent_inputs()
  ty = torch.from_numpy(np.array(y)).long()
  opts = OPTIONS[option]

  def jax_fn(h, w, *b):
    return ops.linear_cross_entropy(h, w, y, bias=b[0] if b else None, reduction=reduction,
                                    chunk_size=4, grad_in_forward=grad_in_forward,
                                    implementation=impl, **opts) ** 2

  def torch_fn(h, w, *b):
    return xent_ref.linear_cross_entropy(h, w, ty, b[0] if b else None, reduction=reduction,
                                         **opts) ** 2

  args = (h, w, b) if use_bias else (h, w)
  _assert_hvps_match_torch(jax_fn, torch_fn, args, f"{option} {reduction} {impl}")


@pytest.mark.parametrize("impl", helpers.CPU_IMPLEMENTATIONS)
def test_linear_cross_entropy_lse_second_order_matches_torch(impl, pallas_mode):
  """The returned logsumexp's gradient (a second cotangent into the backward) differentiates
  too."""
  h, w, b, y = _xent_inputs()
  ty = torch.from_numpy(np.array(y)).long()

  def jax_fn(h, w, b):
    loss, aux = ops.linear_cross_entropy(h, w, y, bias=b, reduction="none", return_lse=True,
                                         logit_softcap=3.0, implementation=impl, chunk_size=4)
    return loss * aux["lse"]

  def torch_fn(h, w, b):
    logits = 3.0 * torch.tanh((h @ w.T + b) / 3.0)
    loss = torch.nn.functional.cross_entropy(logits, ty, ignore_index=IGNORE, reduction="none")
    return loss * torch.logsumexp(logits, -1)

  _assert_hvps_match_torch(jax_fn, torch_fn, (h, w, b), f"lse {impl}")


# Forward mode on the ops themselves -------------------------------------------------------------


@pytest.mark.parametrize("name", ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm",
                                  "add_rms_norm_unfused", "linear_cross_entropy"])
def test_forward_mode_on_the_op_is_refused_by_jax(name):
  """custom_vjp ops take reverse mode (any order) but not forward mode on the op itself."""
  x = _normal((3, 4), 0)
  if name == "linear_cross_entropy":
    fn = lambda x: ops.linear_cross_entropy(x, x, jnp.arange(3))  # noqa: E731
  elif name.startswith("add_"):
    fn = lambda x: getattr(ops, name)(x, x)  # noqa: E731
  else:
    fn = getattr(ops, name)
  with pytest.raises(TypeError, match="forward-mode"):
    jax.jvp(fn, (x,), (x,))
