"""The distillation losses beyond the op table (tests/cases/distillation.py): TRL's own
generalized JSD and Liger-Kernel's fused JSD as twins, the compiled programs holding no
[tokens, vocab] array, what the backward keeps, the teacher's missing gradient, jit/vmap/remat,
and the top-k forward KL."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxfuse.metrics import residual_bytes, residuals
from jaxfuse.ops import (linear_distillation_loss, linear_distillation_loss_reference,
                         linear_topk_distillation_loss, names, topk_distillation_loss)
from jaxfuse.testing.torch_ref import distillation as torch_ref
from tests import helpers

IGNORE = -100
REDUCTIONS = ("batchmean", "sum", "mean", "none")


def _inputs(n, ds, dt, v, *, seed=0, dtype=jnp.float32):
  """A student and a teacher head over the same tokens, labels with a masked tail and a few
  masked tokens inside (a prompt and padding)."""
  rng = np.random.default_rng(seed)
  normal = lambda shape, scale=1.0: jnp.asarray(  # noqa: E731
      rng.standard_normal(shape) * scale, dtype)
  hs, ws, bs = normal((n, ds)), normal((v, ds), 0.3), normal((v,), 0.1)
  ht, wt, bt = normal((n, dt)), normal((v, dt), 0.3), normal((v,), 0.1)
  y = rng.integers(0, v, n)
  y[-6:] = IGNORE
  y[2::7] = IGNORE
  return hs, ws, bs, ht, wt, bt, jnp.asarray(y, jnp.int32)


def _torch64(*xs, grad=False):
  return tuple(torch.tensor(np.asarray(x), dtype=torch.float64, requires_grad=grad) for x in xs)


def _assert_close(got, want):
  want = np.asarray(want)
  helpers.assert_close(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def _trl_jsd():
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")   # trl.experimental warns on import
    from trl.experimental.gkd.gkd_trainer import GKDTrainer
  return GKDTrainer.generalized_jsd_loss


# TRL's generalized JSD ------------------------------------------------------------------------


# grad_in_forward needs a scalar loss.
_MODES = [(r, g) for r in REDUCTIONS for g in (False, True) if not (g and r == "none")]


@pytest.mark.parametrize("reduction,grad_in_forward", _MODES)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0, 0.3])
def test_matches_trl_generalized_jsd_loss(beta, temperature, reduction, grad_in_forward):
  """``GKDTrainer.generalized_jsd_loss`` of the installed TRL, in float64 on the full logits of
  both heads (the teacher's without gradient), with the labels TRL takes: the loss and the
  gradients of the student's h, weight and bias, with the gradients computed in the backward
  and in the forward."""
  n, v = 37, 300
  hs, ws, bs, ht, wt, bt, y = _inputs(n, 24, 40, v)
  weights = np.random.default_rng(1).standard_normal(n)   # a cotangent for "none"

  def ours(hs, ws, bs):
    out = linear_distillation_loss(hs, ws, ht, wt, labels=y, beta=beta, temperature=temperature,
                                   student_bias=bs, teacher_bias=bt, reduction=reduction,
                                   chunk_size=16, grad_in_forward=grad_in_forward)
    return (jnp.sum(out * weights) if reduction == "none" else out), out

  (_, out), grads = jax.jit(jax.value_and_grad(ours, argnums=(0, 1, 2), has_aux=True))(
      hs, ws, bs)

  th, tw, tb = _torch64(hs, ws, bs, grad=True)
  tht, twt, tbt = _torch64(ht, wt, bt)
  ty = torch.tensor(np.asarray(y)).long()
  jsd = _trl_jsd()(th @ tw.T + tb, tht @ twt.T + tbt, labels=ty, beta=beta,
                   temperature=temperature, reduction=reduction)
  if reduction == "none":   # TRL: the per-word terms of the tokens that count, [count, V]
    valid = (ty != IGNORE).numpy()
    assert jsd.shape == (valid.sum(), v)
    per_token = jsd.sum(-1)
    _assert_close(np.asarray(out)[valid], per_token.detach().numpy())
    np.testing.assert_array_equal(np.asarray(out)[~valid], 0.0)
    (per_token * torch.tensor(weights[valid])).sum().backward()
  else:
    _assert_close(out, jsd.detach().numpy())
    jsd.backward()
  for got, want in zip(grads, (th, tw, tb)):
    _assert_close(got, want.grad.numpy())


@pytest.mark.parametrize("grad_in_forward", [False, True])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_matches_liger_fused_linear_jsd(beta, grad_in_forward):
  """Liger-Kernel's ``LigerFusedLinearJSDLoss`` (torch, chunked, gradients in the forward),
  whose ``beta`` is TRL's (0: forward KL, 1: reverse KL): with no hard loss it is the
  ``"batchmean"`` JSD."""
  liger = pytest.importorskip("liger_kernel.chunked_loss")
  n, v = 37, 300
  hs, ws, bs, ht, wt, bt, y = _inputs(n, 24, 40, v, seed=3)
  loss, grads = jax.value_and_grad(
      lambda hs, ws, bs: linear_distillation_loss(
          hs, ws, ht, wt, labels=y, beta=beta, temperature=2.0, student_bias=bs,
          teacher_bias=bt, chunk_size=16, grad_in_forward=grad_in_forward),
      argnums=(0, 1, 2))(hs, ws, bs)

  th, tw, tb = _torch64(hs, ws, bs, grad=True)
  tht, twt, tbt = _torch64(ht, wt, bt)
  module = liger.LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=beta,
                                         temperature=2.0, compiled=False, chunk_size=16)
  want = module(th, tw, tht, twt, torch.tensor(np.asarray(y)).long(), tb, tbt)
  want.backward()
  _assert_close(loss, want.detach().numpy())
  for got, t in zip(grads, (th, tw, tb)):
    _assert_close(got, t.grad.numpy())


def test_matches_the_reference_with_soft_caps_a_mask_and_batch_axes():
  hs, ws, bs, ht, wt, bt, y = _inputs(39, 16, 20, 257, seed=4)
  mask = (y != IGNORE).reshape(3, 13)
  hs3, ht3 = hs.reshape(3, 13, 16), ht.reshape(3, 13, 20)
  options = dict(beta=0.7, temperature=1.3, student_logit_softcap=2.0,
                 teacher_logit_softcap=4.0, reduction="none")

  def run(f, hs3, ws, bs):
    out = f(hs3, ws, ht3, wt, mask, student_bias=bs, teacher_bias=bt, **options)
    return jnp.sum(jnp.sin(out)), out

  (_, got), grads = jax.jit(jax.value_and_grad(
      lambda *a: run(lambda *b, **k: linear_distillation_loss(*b, chunk_size=5, **k), *a),
      argnums=(0, 1, 2), has_aux=True))(hs3, ws, bs)
  (_, want), want_grads = jax.value_and_grad(
      lambda *a: run(linear_distillation_loss_reference, *a), argnums=(0, 1, 2),
      has_aux=True)(hs3, ws, bs)
  assert got.shape == (3, 13)
  _assert_close(got, want)
  for g, w in zip(grads, want_grads):
    _assert_close(g, w)


def test_the_teacher_gets_no_gradient():
  hs, ws, bs, ht, wt, bt, y = _inputs(20, 8, 12, 50)
  grads = jax.grad(lambda ht, wt, bt: linear_distillation_loss(
      hs, ws, ht, wt, labels=y, student_bias=bs, teacher_bias=bt), argnums=(0, 1, 2))(ht, wt, bt)
  for g in grads:
    np.testing.assert_array_equal(g, 0.0)
  ref = jax.grad(lambda wt: linear_distillation_loss_reference(hs, ws, ht, wt, labels=y))(wt)
  np.testing.assert_array_equal(ref, 0.0)


def test_with_no_token_counted():
  """``"batchmean"`` divides by at least 1 (0, TRL's clamp); ``"mean"`` is NaN as torch's mean
  of nothing, both with zero gradients."""
  hs, ws, _, ht, wt, _, y = _inputs(10, 8, 8, 30)
  nothing = jnp.full_like(y, IGNORE)
  for reduction, want in (("batchmean", 0.0), ("sum", 0.0), ("mean", np.nan)):
    loss, grad = jax.value_and_grad(lambda hs: linear_distillation_loss(
        hs, ws, ht, wt, labels=nothing, reduction=reduction))(hs)
    np.testing.assert_array_equal(loss, want)
    np.testing.assert_array_equal(grad, 0.0)


def test_one_head_against_itself_has_no_divergence():
  hs, ws, bs, _, _, _, y = _inputs(16, 8, 8, 40)
  for beta in (0.0, 0.4, 1.0):
    loss = linear_distillation_loss(hs, ws, hs, ws, labels=y, beta=beta, student_bias=bs,
                                    teacher_bias=bs, reduction="none")
    np.testing.assert_allclose(loss, 0.0, atol=1e-6)


def test_errors_name_the_argument():
  hs, ws, _, ht, wt, _, y = _inputs(8, 8, 6, 20)
  with pytest.raises(ValueError, match="a teacher whose vocabulary differs from the student's"):
    linear_distillation_loss(hs, ws, ht, wt[:19], labels=y)
  with pytest.raises(ValueError, match=r"beta must be a number in \[0, 1\].*got -0\.1"):
    linear_distillation_loss(hs, ws, ht, wt, labels=y, beta=-0.1)
  with pytest.raises(ValueError, match=r"temperature must be a finite number > 0, got inf"):
    linear_distillation_loss(hs, ws, ht, wt, labels=y, temperature=float("inf"))
  with pytest.raises(ValueError, match=r"h_teacher must have the tokens' shape"):
    linear_distillation_loss(hs, ws, ht[:7], wt, labels=y)
  with pytest.raises(ValueError, match=r"implementation='pallas' is not provided"):
    linear_distillation_loss(hs, ws, ht, wt, labels=y, implementation="pallas")


# Memory: no [tokens, vocab] array, a few bytes a token kept ----------------------------------


def _hlo_shapes(compiled_text: str) -> set[tuple[int, ...]]:
  return {tuple(int(x) for x in dims.split(",") if x)
          for dims in re.findall(r"\[([\d,]*)\]", compiled_text)}


def _compiled_step(f, *args):
  return jax.jit(jax.value_and_grad(f, argnums=tuple(range(len(args))))).lower(
      *args).compile().as_text()


@pytest.mark.parametrize("op", ["linear_distillation_loss", "grad_in_forward",
                                "linear_topk_distillation_loss"])
def test_no_tokens_by_vocabulary_array_in_the_compiled_step(op):
  """The compiled forward and backward hold at most a chunk of logits: no array has both the
  tokens' and the vocabulary's extent (N = 384 tokens, V = 1536 words, chunks of 32, hidden
  sizes 40 and 56, k = 12)."""
  n, v = 384, 1536
  hs, ws, bs, ht, wt, bt, y = _inputs(n, 40, 56, v)
  if op != "linear_topk_distillation_loss":
    f = lambda hs, ws, bs: linear_distillation_loss(  # noqa: E731
        hs, ws, ht, wt, labels=y, beta=0.3, temperature=0.8, student_bias=bs, teacher_bias=bt,
        student_logit_softcap=30.0, chunk_size=32, grad_in_forward=op == "grad_in_forward")
  else:
    ids = jnp.asarray(np.random.default_rng(5).integers(0, v, (n, 12)), jnp.int32)
    f = lambda hs, ws, bs: linear_topk_distillation_loss(  # noqa: E731
        hs, ws, ids, -jnp.arange(12.0) * jnp.ones((n, 1)), labels=y, temperature=0.8,
        student_bias=bs, chunk_size=32)
  shapes = _hlo_shapes(_compiled_step(f, hs, ws, bs))
  assert (32, v) in shapes or (v, 32) in shapes   # the chunk's logits: the check sees shapes
  big = [s for s in shapes if n in s and v in s]
  assert not big, big
  # The full-logits reference does make one: the check can fail.
  full = _compiled_step(lambda hs: linear_distillation_loss_reference(hs, ws, ht, wt, labels=y),
                        hs)
  assert any(n in s and v in s for s in _hlo_shapes(full))


def test_the_backward_keeps_the_inputs_and_two_logsumexps_a_token():
  n, v = 64, 1000
  hs, ws, bs, ht, wt, bt, y = _inputs(n, 32, 24, v)
  kept = residuals(lambda hs, ws, bs: linear_distillation_loss(
      hs, ws, ht, wt, labels=y, student_bias=bs, teacher_bias=bt, reduction="none"), hs, ws, bs)
  assert sorted((r.shape, str(r.dtype)) for r in kept) == [((n,), "float32")] * 2
  scalar = residual_bytes(lambda hs, ws, bs: linear_distillation_loss(
      hs, ws, ht, wt, labels=y, student_bias=bs, teacher_bias=bt), hs, ws, bs)
  assert 8 * n <= scalar <= 8 * n + 16   # and the reduction's scalars
  ids = jnp.asarray(np.random.default_rng(5).integers(0, v, (n, 8)), jnp.int32)
  topk = residual_bytes(lambda hs, ws: linear_topk_distillation_loss(
      hs, ws, ids, jnp.zeros((n, 8)), labels=y, reduction="none"), hs, ws)
  assert topk == 4 * n   # the student's logsumexp
  full = residual_bytes(lambda hs, ws, bs: linear_distillation_loss_reference(
      hs, ws, ht, wt, labels=y, student_bias=bs, teacher_bias=bt), hs, ws, bs)
  assert full >= 4 * n * v


def test_grad_in_forward_keeps_the_gradients_of_what_is_differentiated():
  """With the gradients computed in the forward, the backward keeps them (the student's h,
  weight and bias sizes) and nothing else; a frozen head keeps no weight gradient and its
  product is not in the compiled step."""
  n, v = 64, 1000
  hs, ws, bs, ht, wt, bt, y = _inputs(n, 32, 24, v)
  loss = lambda hs, ws, bs: linear_distillation_loss(  # noqa: E731
      hs, ws, ht, wt, labels=y, student_bias=bs, teacher_bias=bt, grad_in_forward=True)
  kept = sorted((r.shape, str(r.dtype)) for r in residuals(loss, hs, ws, bs) if r.shape)
  assert kept == sorted([((n, 32), "float32"), ((v, 32), "float32"), ((v,), "float32")])
  frozen = [r.shape for r in residuals(lambda hs: loss(hs, ws, bs), hs) if r.shape]
  assert frozen == [(n, 32)]
  # dw's product, [V, Ds], is dropped with it (and is there when the head is differentiated).
  product = re.compile(rf"= f32\[{v},32\]\S* dot\(")
  for argnums, present in (((0,), False), ((0, 1), True)):
    text = jax.jit(jax.grad(loss, argnums=argnums)).lower(hs, ws, bs).compile().as_text()
    assert bool(product.search(text)) == present
  with pytest.raises(ValueError, match="grad_in_forward=True needs a scalar loss"):
    linear_distillation_loss(hs, ws, ht, wt, reduction="none", grad_in_forward=True)


def test_grad_in_forward_second_order_and_transformations():
  """Hessian-vector products, vmap and remat with the gradients in the forward equal the
  recomputing backward's."""
  hs, ws, bs, ht, wt, bt, y = _inputs(30, 12, 20, 90, seed=7)
  tangent = jnp.asarray(np.random.default_rng(2).standard_normal(hs.shape), jnp.float32)

  def hvp(gif):
    grad = jax.grad(lambda x: linear_distillation_loss(
        x, ws, ht, wt, labels=y, beta=0.4, student_bias=bs, teacher_bias=bt, chunk_size=8,
        grad_in_forward=gif))
    return jax.jvp(grad, (hs,), (tangent,))[1]

  _assert_close(hvp(True), hvp(False))
  batched = lambda gif: jax.jit(jax.vmap(jax.grad(jax.checkpoint(  # noqa: E731
      lambda x, t: linear_distillation_loss(x, ws, t, wt, grad_in_forward=gif)))))(
          hs.reshape(3, 10, 12), ht.reshape(3, 10, 20))
  _assert_close(batched(True), batched(False))


def test_a_policy_keeps_exactly_the_named_logsumexps():
  hs, ws, _, ht, wt, _, y = _inputs(48, 16, 8, 100)

  def kept(*keep):
    region = jax.checkpoint(lambda hs, ws: jnp.sum(jnp.sin(linear_distillation_loss(
        hs, ws, ht, wt, labels=y, reduction="none"))),
        policy=jax.checkpoint_policies.save_only_these_names(*keep))
    return [(r.shape, str(r.dtype)) for r in residuals(region, hs, ws)]

  assert kept() == []
  assert kept(names.DISTILL_STUDENT_LSE) == [((48,), "float32")]
  assert kept(names.DISTILL_STUDENT_LSE, names.DISTILL_TEACHER_LSE) == [((48,), "float32")] * 2


# Transformations ------------------------------------------------------------------------------


def test_jit_vmap_and_remat_compose():
  """vmap over a batch of sequences (the heads shared), under jit and jax.checkpoint: the same
  sums and gradients as one call over the flattened tokens."""
  hs, ws, bs, ht, wt, bt, y = _inputs(60, 16, 12, 200)
  hs3, ht3, y3 = hs.reshape(3, 20, 16), ht.reshape(3, 20, 12), y.reshape(3, 20)
  options = dict(beta=0.4, temperature=0.9, reduction="sum", chunk_size=8)

  def flat(hs, ws, bs):
    return linear_distillation_loss(hs, ws, ht, wt, labels=y, student_bias=bs, teacher_bias=bt,
                                    **options)

  def mapped(hs3, ws, bs):
    return jnp.sum(jax.vmap(lambda h, t, labels: linear_distillation_loss(
        h, ws, t, wt, labels=labels, student_bias=bs, teacher_bias=bt, **options))(
            hs3, ht3, y3))

  want, want_grads = jax.value_and_grad(flat, argnums=(0, 1, 2))(hs, ws, bs)
  got, grads = jax.jit(jax.value_and_grad(jax.checkpoint(mapped), argnums=(0, 1, 2)))(
      hs3, ws, bs)
  helpers.assert_close(got, want, rtol=1e-5, atol=1e-5)
  helpers.assert_close(grads[0].reshape(want_grads[0].shape), want_grads[0], rtol=1e-5,
                       atol=1e-6)
  for g, w in zip(grads[1:], want_grads[1:]):
    helpers.assert_close(g, w, rtol=1e-5, atol=1e-6)


# Top-k distillation ---------------------------------------------------------------------------


def _topk_inputs(n, d, v, k, seed=6):
  hs, ws, bs, _, _, _, y = _inputs(n, d, 4, v, seed=seed)
  rng = np.random.default_rng(seed)
  ids = np.stack([rng.choice(v, k, replace=False) for _ in range(n)])
  logps = np.sort(rng.standard_normal((n, k)), axis=-1)[:, ::-1] - 3.0
  return hs, ws, bs, jnp.asarray(ids, jnp.int32), jnp.asarray(logps.copy(), jnp.float32), y


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_topk_matches_its_torch_twin(reduction):
  n, v, k = 37, 300, 7
  hs, ws, bs, ids, logps, y = _topk_inputs(n, 24, v, k)
  mask = y != IGNORE
  weights = np.random.default_rng(2).standard_normal(n)

  def ours(hs, ws, bs):
    out = linear_topk_distillation_loss(hs, ws, ids, logps, mask, student_bias=bs,
                                        temperature=1.5, student_logit_softcap=4.0,
                                        reduction=reduction, chunk_size=16)
    return (jnp.sum(out * weights) if reduction == "none" else out), out

  (_, out), grads = jax.jit(jax.value_and_grad(ours, argnums=(0, 1, 2), has_aux=True))(
      hs, ws, bs)
  th, tw, tb = _torch64(hs, ws, bs, grad=True)
  want = torch_ref.linear_topk_distillation_loss(
      th, tw, torch.tensor(np.asarray(ids)), *_torch64(logps), torch.tensor(np.asarray(mask)),
      tb, temperature=1.5, student_logit_softcap=4.0, reduction=reduction)
  _assert_close(out, want.detach().numpy())
  (want * torch.tensor(weights) if reduction == "none" else want).sum().backward()
  for got, t in zip(grads, (th, tw, tb)):
    _assert_close(got, t.grad.numpy())


def test_topk_over_the_whole_vocabulary_is_the_forward_kl():
  """With k = V and the teacher's full log-probabilities, renormalising changes nothing: the
  top-k loss is ``linear_distillation_loss`` at ``beta = 0``."""
  n, v = 21, 40
  hs, ws, bs, ht, wt, bt, y = _inputs(n, 8, 6, v, seed=7)
  teacher = jax.nn.log_softmax(ht @ wt.T + bt, axis=-1)
  ids = jnp.broadcast_to(jnp.arange(v), (n, v))
  loss, grad = jax.value_and_grad(lambda hs: linear_topk_distillation_loss(
      hs, ws, ids, teacher * 2.0, labels=y, student_bias=bs, temperature=2.0))(hs)
  # The teacher's log-probabilities times 2 at temperature 2 are the teacher at 1; the student
  # at temperature 2 is the head halved at 1.
  want, want_grad = jax.value_and_grad(lambda hs: linear_distillation_loss(
      hs, ws / 2.0, ht, wt, labels=y, beta=0.0, student_bias=bs / 2.0, teacher_bias=bt))(hs)
  helpers.assert_close(loss, want, rtol=1e-5, atol=1e-6)
  helpers.assert_close(grad, want_grad, rtol=1e-5, atol=1e-6)
  plain, plain_grad = jax.value_and_grad(lambda hs: linear_topk_distillation_loss(
      hs, ws, ids, teacher, labels=y, student_bias=bs))(hs)
  want, want_grad = jax.value_and_grad(lambda hs: linear_distillation_loss(
      hs, ws, ht, wt, labels=y, beta=0.0, student_bias=bs, teacher_bias=bt))(hs)
  helpers.assert_close(plain, want, rtol=1e-5, atol=1e-6)
  helpers.assert_close(plain_grad, want_grad, rtol=1e-5, atol=1e-6)


def test_topk_on_log_probabilities_treats_minus_inf_as_absent():
  student = jnp.log(jnp.array([[0.5, 0.2, 0.1], [0.3, 0.3, 0.1]]))
  teacher = jnp.array([[-1.0, -2.0, -jnp.inf], [-jnp.inf, -jnp.inf, -jnp.inf]])
  loss, grad = jax.value_and_grad(topk_distillation_loss)(
      student, teacher, jnp.array([True, False]), reduction="sum")
  q = np.exp([-1.0, -2.0]) / np.exp([-1.0, -2.0]).sum()
  np.testing.assert_allclose(loss, np.sum(q * (np.log(q) - np.log([0.5, 0.2]))), rtol=1e-6)
  np.testing.assert_allclose(grad, [[-q[0], -q[1], 0.0], [0.0, 0.0, 0.0]], rtol=1e-6)


def test_topk_ids_out_of_range():
  """Concrete ids of counted tokens are checked (a masked token's are not read); traced ones
  out of range give NaN, and NaN gradients."""
  hs, ws, _, ids, logps, y = _topk_inputs(12, 8, 50, 3)
  y = y.at[:2].set(IGNORE)
  masked_out = ids.at[0, 1].set(50)   # a masked token: fine
  assert np.isfinite(float(linear_topk_distillation_loss(hs, ws, masked_out, logps, labels=y)))
  bad = ids.at[5, 2].set(-1)
  with pytest.raises(ValueError, match=r"teacher_topk_ids must be in \[0, 50\)"):
    linear_topk_distillation_loss(hs, ws, bad, logps, labels=y)
  value, grad = jax.jit(jax.value_and_grad(lambda hs, ids: linear_topk_distillation_loss(
      hs, ws, ids, logps, labels=y)))(hs, bad)
  assert np.isnan(float(value)) and np.isnan(np.asarray(grad)).any()


def test_topk_errors_name_the_argument():
  hs, ws, _, ids, logps, y = _topk_inputs(12, 8, 50, 3)
  with pytest.raises(ValueError, match=r"teacher_topk_ids must have shape h_student"):
    linear_topk_distillation_loss(hs, ws, ids[:5], logps, labels=y)
  with pytest.raises(ValueError, match=r"teacher_topk_logps must have teacher_topk_ids' shape"):
    linear_topk_distillation_loss(hs, ws, ids, logps[:, :2], labels=y)
  with pytest.raises(TypeError, match=r"teacher_topk_ids must have an integer dtype"):
    linear_topk_distillation_loss(hs, ws, logps, logps, labels=y)
  with pytest.raises(ValueError, match=r"^topk_distillation_loss: student_topk_logps, "
                                       r"teacher_topk_logps must have the same shape"):
    topk_distillation_loss(logps, logps[:, :2])
