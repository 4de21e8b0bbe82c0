"""linear_cross_entropy against torch: F.cross_entropy(h @ W.T + b, labels), z-loss, soft-cap."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxfuse
from jaxfuse.metrics import bytes_moved, residual_bytes
from jaxfuse.ops import linear_cross_entropy, linear_cross_entropy_reference
from jaxfuse.testing.torch_ref import cross_entropy as ref
from tests import helpers

IGNORE = -100


def _inputs(lead, d, v, dtype=jnp.float32, seed=0, ignored=0.2, scale=1.0):
  # Drawn by numpy: jax.random compiles its samplers anew for every shape.
  rng = np.random.default_rng(seed)
  h, w, b = (rng.standard_normal(shape, dtype=np.float32) for shape in ((*lead, d), (v, d), (v,)))
  h, w, b = helpers.to_jax(dtype, h, scale * w / np.float32(np.sqrt(d)), 0.1 * b)
  y = rng.integers(0, v, lead)
  y = jnp.asarray(np.where(rng.random(lead) < ignored, IGNORE, y).astype(np.int32))
  g = jnp.asarray(rng.standard_normal(lead, dtype=np.float32))  # cotangent for reduction="none"
  return h, w, b, y, g


def _jax_run(h, w, b, y, g, *, impl, reduction="mean", use_bias=True, **opts):
  """The loss and its gradients in one jitted program (the labels stay concrete: checked)."""
  def run(h, w, b, g):
    def loss_fn(h, w, b):
      loss = linear_cross_entropy(h, w, y, bias=b if use_bias else None, reduction=reduction,
                                  implementation=impl, **opts)
      return jnp.sum(loss * g) if reduction == "none" else loss

    loss, grads = jax.value_and_grad(loss_fn, argnums=(0, 1, 2))(h, w, b)
    if reduction == "none":
      loss = linear_cross_entropy(h, w, y, bias=b if use_bias else None, reduction="none",
                                  implementation=impl, **opts)
    return (loss, *grads[:3 if use_bias else 2])

  return jax.jit(run, compiler_options=helpers.FAST_COMPILE)(h, w, b, g)


def _torch_run(h, w, b, y, g, *, dtype=None, reduction="mean", use_bias=True, **opts):
  th, tw, tb = (helpers.to_torch(x, dtype, requires_grad=True) for x in (h, w, b))
  ty = torch.from_numpy(np.array(y)).long()
  loss = ref.linear_cross_entropy(th, tw, ty, tb if use_bias else None, reduction=reduction,
                                  **opts)
  out = loss * helpers.to_torch(g, loss.dtype) if reduction == "none" else loss
  out.sum().backward()
  return (loss, th.grad, tw.grad) + ((tb.grad,) if use_bias else ())


NAMES = ("loss", "grad h", "grad weight", "grad bias")

OPTIONS = {
    "plain": {},
    "zloss": {"z_loss": 1e-3},
    "softcap": {"logit_softcap": 2.0},
    "all": {"label_smoothing": 0.2, "z_loss": 1e-2, "logit_softcap": 3.0},
}


# The op table's cases (tests/cases/cross_entropy.py) check the plain mean and label smoothing
# with a z-loss summed against torch in every dtype; these are the other combinations.
FP32_CASES = [("plain", "none"), ("zloss", "none"), ("softcap", "mean"), ("all", "mean"),
              ("all", "sum"), ("all", "none")]


@pytest.mark.parametrize("impl", helpers.CPU_IMPLEMENTATIONS)
@pytest.mark.parametrize("option,reduction", FP32_CASES, ids=lambda x: x)
def test_fp32_matches_torch(impl, option, reduction, pallas_mode):
  """V = 1000 is not a multiple of any vocabulary tile; 3 x 37 tokens not of any token block."""
  h, w, b, y, g = _inputs((3, 37), 48, 1000, seed=1, scale=3.0)
  opts = OPTIONS[option]
  got = _jax_run(h, w, b, y, g, impl=impl, reduction=reduction, chunk_size=32, **opts)
  want = _torch_run(h, w, b, y, g, reduction=reduction, **opts)
  for x, t, what in zip(got, want, NAMES):
    helpers.assert_close(x, t, what=f"{option} {reduction} {what}")


@pytest.mark.parametrize("impl", helpers.CPU_IMPLEMENTATIONS)
def test_gpt2_vocabulary_without_bias(impl, pallas_mode):
  """V = 50257 at a small N and D, no bias."""
  h, w, b, y, g = _inputs((13,), 16, 50257, seed=2, scale=4.0)
  got = _jax_run(h, w, b, y, g, impl=impl, use_bias=False)
  want = _torch_run(h, w, b, y, g, use_bias=False)
  for x, t, what in zip(got, want, NAMES):
    helpers.assert_close(x, t, what=what)


@pytest.mark.parametrize("chunk_size,reduction", [(1, "mean"), (16, "sum"), (100, "mean")])
def test_grad_in_forward_matches_torch(chunk_size, reduction):
  h, w, b, y, g = _inputs((2, 21), 24, 333, seed=3, scale=3.0)
  opts = OPTIONS["all"]
  got = _jax_run(h, w, b, y, g, impl="xla", reduction=reduction, chunk_size=chunk_size,
                 grad_in_forward=True, **opts)
  want = _torch_run(h, w, b, y, g, reduction=reduction, **opts)
  for x, t, what in zip(got, want, NAMES):
    helpers.assert_close(x, t, what=f"chunk {chunk_size} {what}")


def test_grad_in_forward_keeps_only_the_gradients_of_differentiated_inputs():
  """A frozen head (only h differentiated, as in a LoRA run) keeps no weight gradient, a frozen
  h no h gradient; the gradients taken are those of the full differentiation."""
  h, w, b, y, _ = _inputs((48,), 16, 200, seed=6)
  loss = functools.partial(linear_cross_entropy, labels=y, grad_in_forward=True)
  full = jax.grad(lambda h, w, b: loss(h, w, bias=b), argnums=(0, 1, 2))(h, w, b)
  only_h = residual_bytes(lambda h: loss(h, w, bias=b), h)
  only_w = residual_bytes(lambda w: loss(h, w, bias=b), w)
  assert h.nbytes <= only_h < h.nbytes + 1024          # dh (and a few scalars), no dw, no db
  assert w.nbytes <= only_w < w.nbytes + 1024
  everything = residual_bytes(lambda h, w, b: loss(h, w, bias=b), h, w, b)
  assert everything >= h.nbytes + w.nbytes + b.nbytes
  np.testing.assert_array_equal(jax.grad(lambda h: loss(h, w, bias=b))(h), full[0])
  np.testing.assert_array_equal(jax.grad(lambda w: loss(h, w, bias=b))(w), full[1])
  np.testing.assert_array_equal(jax.grad(lambda b: loss(h, w, bias=b))(b), full[2])


@pytest.mark.parametrize("chunk_size", [1, 7])  # the default (None): the op table's case ""
def test_any_chunk_size(chunk_size):
  h, w, b, y, g = _inputs((50,), 32, 129, seed=4)
  got = _jax_run(h, w, b, y, g, impl="xla", chunk_size=chunk_size)
  want = _torch_run(h, w, b, y, g)
  for x, t, what in zip(got, want, NAMES):
    helpers.assert_close(x, t, what=what)


@pytest.mark.parametrize("impl", helpers.CPU_IMPLEMENTATIONS)
@pytest.mark.parametrize("mode", ["recompute", "grad_in_forward"])
def test_all_labels_ignored_match_torch(impl, mode, pallas_mode):
  """Mean over no labels is NaN with zero gradients, as in torch; sum is 0."""
  if mode == "grad_in_forward" and impl != "xla":
    pytest.skip("grad_in_forward is an XLA mode")
  h, w, b, _, g = _inputs((9,), 16, 100, seed=5)
  y = jnp.full((9,), IGNORE)
  opts = {"grad_in_forward": mode == "grad_in_forward", "label_smoothing": 0.1, "z_loss": 1e-3}
  for reduction in ("mean", "sum"):
    got = _jax_run(h, w, b, y, g, impl=impl, reduction=reduction, **opts)
    want = _torch_run(h, w, b, y, g, reduction=reduction, label_smoothing=0.1)
    assert np.isnan(helpers.to_numpy(want[0])) == (reduction == "mean")
    np.testing.assert_array_equal(np.isnan(helpers.to_numpy(got[0])),
                                  np.isnan(helpers.to_numpy(want[0])))
    for x, t, what in zip(got[1:], want[1:], NAMES[1:]):
      helpers.assert_close(x, t, rtol=0, atol=0, what=f"{reduction} {what}")


@pytest.mark.parametrize("impl", helpers.CPU_IMPLEMENTATIONS)
def test_lse_and_accuracy(impl, pallas_mode):
  """The returned logsumexp matches torch's and carries a gradient; accuracy is the argmax's."""
  h, w, b, y, g = _inputs((2, 45), 40, 500, seed=7, scale=3.0)
  y = y.at[0, :5].set(jnp.argmax(h[0, :5] @ w.T + b, axis=-1))  # some hits

  def loss_fn(h, w, b):
    loss, aux = linear_cross_entropy(h, w, y, bias=b, return_lse=True, return_accuracy=True,
                                     logit_softcap=5.0, implementation=impl)
    return loss + 0.1 * jnp.sum(aux["lse"] * g), aux

  (_, aux), grads = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1, 2), has_aux=True),
                            compiler_options=helpers.FAST_COMPILE)(h, w, b)
  th, tw, tb = (helpers.to_torch(x, requires_grad=True) for x in (h, w, b))
  ty = torch.from_numpy(np.array(y)).long()
  logits = 5.0 * torch.tanh((th @ tw.T + tb) / 5.0)
  lse = torch.logsumexp(logits, -1)
  total = torch.nn.functional.cross_entropy(logits.reshape(-1, 500), ty.reshape(-1))
  (total + 0.1 * (lse * helpers.to_torch(g)).sum()).backward()
  helpers.assert_close(aux["lse"], lse)
  for x, t, what in zip(grads, (th.grad, tw.grad, tb.grad), NAMES[1:]):
    helpers.assert_close(x, t, what=what)
  valid = ty != IGNORE
  hits = (logits.argmax(-1) == ty) & valid
  want_accuracy = hits.sum().item() / valid.sum().item()
  assert want_accuracy > 0
  helpers.assert_close(aux["accuracy"], want_accuracy)
  per_token = jax.jit(lambda h, w, b: linear_cross_entropy(
      h, w, y, bias=b, reduction="none", return_accuracy=True, logit_softcap=5.0,
      implementation=impl)[1]["accuracy"], compiler_options=helpers.FAST_COMPILE)(h, w, b)
  np.testing.assert_array_equal(np.asarray(per_token), hits.numpy().astype(np.float32))


def test_matches_the_full_logits_reference():
  h, w, b, y, _ = _inputs((4, 31), 32, 777, seed=8, scale=3.0)
  opts = OPTIONS["all"]

  @functools.partial(jax.jit, static_argnames="reduction", compiler_options=helpers.FAST_COMPILE)
  def both(h, w, b, reduction):
    return (linear_cross_entropy(h, w, y, bias=b, reduction=reduction, **opts),
            linear_cross_entropy_reference(h, w, y, bias=b, reduction=reduction, **opts))

  for reduction in ("mean", "sum", "none"):
    got, want = both(h, w, b, reduction=reduction)
    helpers.assert_close(got, want, what=reduction)


def test_jit_and_remat_compose(pallas_mode):
  h, w, b, y, g = _inputs((40,), 24, 300, seed=9)
  loss = lambda h, w, b: linear_cross_entropy(h, w, y, bias=b, implementation="pallas")  # noqa
  grads = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2)))(h, w, b)
  want = _torch_run(h, w, b, y, g)
  for x, t in zip(grads, want[1:]):
    helpers.assert_close(x, t)


# Labels out of range ---------------------------------------------------------------------------


def test_out_of_range_labels_raise_when_concrete():
  h, w, b, _, _ = _inputs((6,), 8, 50)
  for bad in (50, -1, 1000):
    y = jnp.array([0, 1, bad, 3, IGNORE, 5])
    with pytest.raises(ValueError, match=rf"labels must be in \[0, 50\).*e\.g\. {bad}"):
      linear_cross_entropy(h, w, y)


NAN_MODES = [(impl, reduction, False) for impl in helpers.CPU_IMPLEMENTATIONS
             for reduction in ("none", "mean", "sum")]
NAN_MODES += [("xla", "mean", True), ("xla", "sum", True)]


@pytest.mark.parametrize("impl,reduction,grad_in_forward", NAN_MODES, ids=str)
def test_out_of_range_labels_give_nan_loss_and_gradients_under_jit(impl, reduction,
                                                                   grad_in_forward, pallas_mode):
  """Labels past V or negative (other than ignore_index) cannot be checked under jit: their
  tokens' losses are NaN, and so are their rows of dh and all of dweight and dbias, which sum
  over the tokens; the other rows of dh stay finite."""
  h, w, b, _, g = _inputs((7,), 8, 50)
  y = jnp.array([0, 1, 50, 3, IGNORE, 5, -1])
  bad = [False, False, True, False, False, False, True]

  def loss_fn(h, w, b, y):
    loss = linear_cross_entropy(h, w, y, bias=b, reduction=reduction, implementation=impl,
                                grad_in_forward=grad_in_forward, chunk_size=4)
    return jnp.sum(loss * g) if reduction == "none" else loss

  @jax.jit
  def run(h, w, b, y):
    per_token = linear_cross_entropy(h, w, y, bias=b, reduction="none", implementation=impl)
    return per_token, jax.value_and_grad(loss_fn, argnums=(0, 1, 2))(h, w, b, y)

  per_token, (loss, (dh, dw, db)) = run(h, w, b, y)
  assert np.isnan(np.asarray(per_token)).tolist() == bad
  assert np.isnan(float(loss))
  assert np.isnan(np.asarray(dh)).any(axis=1).tolist() == bad
  assert np.isnan(np.asarray(dh)[bad]).all()
  assert np.isnan(np.asarray(dw)).all() and np.isnan(np.asarray(db)).all()


@pytest.mark.parametrize("grad_in_forward", [False, True])
def test_empty_vocabulary_is_refused(grad_in_forward):
  h, w, _, _, _ = _inputs((4,), 8, 10, ignored=0)
  y = jnp.full((4,), IGNORE)
  message = (r"linear_cross_entropy: the vocabulary \(weight.shape\[0\], V\) must be at least 1, "
             r"got weight of shape \(0, 8\)")
  with pytest.raises(ValueError, match=message):
    linear_cross_entropy(h, w[:0], y, grad_in_forward=grad_in_forward)
  with pytest.raises(ValueError, match=message):
    jax.jit(lambda h, w: linear_cross_entropy(h, w, y))(h, w[:0])


# Memory and traffic ----------------------------------------------------------------------------


def test_backward_keeps_only_the_logsumexp():
  n, d, v = 64, 32, 1000
  h, w, b, y, _ = _inputs((n,), d, v)
  fused = residual_bytes(lambda h, w, b: linear_cross_entropy(h, w, y, bias=b), h, w, b)
  # 4 bytes a token, and the mean's scalar count.
  assert 4 * n <= fused <= 4 * n + 8
  full = residual_bytes(lambda h, w, b: linear_cross_entropy_reference(h, w, y, bias=b), h, w, b)
  assert full >= 4 * n * v
  # Gradients in the forward keep dh, dweight and dbias instead.
  liger = residual_bytes(lambda h, w, b: linear_cross_entropy(h, w, y, bias=b,
                                                              grad_in_forward=True), h, w, b)
  grads = h.nbytes + w.nbytes + b.nbytes
  assert grads <= liger <= grads + 8


def test_pallas_bytes_moved_are_reported(pallas_mode):
  h, w, b, y, _ = _inputs((64,), 32, 1000)
  moved = bytes_moved(jax.grad(lambda h, w: linear_cross_entropy(h, w, y,
                                                                 implementation="pallas")), h, w)
  # At least: the forward and the backward each stream the weight once.
  assert moved >= 2 * w.nbytes


# Lowering for GPUs -----------------------------------------------------------------------------


# The plain call in float32 and bfloat16 is the op table's case (test_op_lowering.py).
@pytest.mark.parametrize("option,dtype", [("plain", jnp.float16), ("all", jnp.float32),
                                          ("all", jnp.bfloat16), ("all", jnp.float16)],
                         ids=lambda v: v if isinstance(v, str) else jnp.dtype(v).name)
def test_pallas_kernels_lower_for_cuda(option, dtype):
  h, w, b, y, _ = _inputs((3, 37), 48, 1000, dtype=dtype)
  step = jax.value_and_grad(
      lambda h, w, b: linear_cross_entropy(h, w, y, bias=b, implementation="pallas",
                                           chunk_size=64, **OPTIONS[option]),
      argnums=(0, 1, 2))
  names = helpers.triton_kernel_names(helpers.lower_for_gpu(step, h, w, b))
  assert sorted(names) == ["linear_xent_bwd_logit_grad", "linear_xent_fwd"]


def test_gpt2_vocabulary_lowers_without_bias():
  h, w, _, y, _ = _inputs((100,), 64, 50257)
  step = jax.grad(lambda h, w: linear_cross_entropy(h, w, y, implementation="pallas"),
                  argnums=(0, 1))
  names = helpers.triton_kernel_names(helpers.lower_for_gpu(step, h, w))
  assert sorted(names) == ["linear_xent_bwd_logit_grad", "linear_xent_fwd"]


def test_remat_runs_each_kernel_once():
  """Without remat each kernel runs once. Under jit(value_and_grad(remat(f))) the backward
  kernel still runs once; the forward kernel runs a second time only because remat drops its
  4-byte-a-token logsumexp, which the backward needs (saving it by name avoids that)."""
  h, w, b, y, _ = _inputs((64,), 32, 1000)
  loss = lambda h, w: linear_cross_entropy(h, w, y, implementation="pallas")  # noqa: E731
  plain = jax.value_and_grad(loss, argnums=(0, 1))
  names = helpers.triton_kernel_names(helpers.lower_for_gpu(plain, h, w))
  assert sorted(names) == ["linear_xent_bwd_logit_grad", "linear_xent_fwd"]
  remat = jax.value_and_grad(jax.checkpoint(loss), argnums=(0, 1))
  names = helpers.triton_kernel_names(helpers.lower_for_gpu(remat, h, w))
  assert sorted(names) == ["linear_xent_bwd_logit_grad", "linear_xent_fwd", "linear_xent_fwd"]


# Bad input -------------------------------------------------------------------------------------


def test_errors_name_the_argument():
  """The errors the op table's BAD list (tests/cases/cross_entropy.py) has no entry for."""
  h, w, _, y, _ = _inputs((4,), 8, 10, ignored=0)
  with pytest.raises(TypeError, match=r"h must have a floating dtype.*int32"):
    linear_cross_entropy(h.astype(jnp.int32), w, y)
  with pytest.raises(ValueError, match=r"implementation must be None or one of.*'cuda'"):
    linear_cross_entropy(h, w, y, implementation="cuda")


@pytest.mark.skipif(helpers.ON_GPU, reason="checks the CPU error")
def test_kernels_need_a_gpu_or_interpret_mode():
  h, w, _, y, _ = _inputs((4,), 8, 10, ignored=0)
  with pytest.raises(jaxfuse.ImplementationUnavailableError, match=r"Available here: \['xla'\]"):
    linear_cross_entropy(h, w, y, implementation="pallas")
  with pytest.raises(jaxfuse.ImplementationUnavailableError, match=r"Triton kernels need a GPU"):
    linear_cross_entropy(h, w, y, implementation="triton")
