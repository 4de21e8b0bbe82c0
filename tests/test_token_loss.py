"""``linear_token_loss``: a sum of functions of each token's log-probability on the LM head, its
gradients computed in the forward, against the same loss on the full logits (float32 and
bfloat16; bias, soft-cap, temperature, ignored targets), its residuals, the compiled step's
largest arrays, second-order gradients and the GRPO terms it carries."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfuse.metrics import residuals
from jaxfuse.ops import linear_log_probs_reference
from jaxfuse.ops.cross_entropy.token_loss import linear_token_loss
from jaxfuse.posttrain import losses
from tests import helpers


def _inputs(n=45, d=24, v=301, seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  h = jnp.asarray(rng.standard_normal((n, d)), dtype)
  w = jnp.asarray(0.3 * rng.standard_normal((v, d)), dtype)
  b = jnp.asarray(0.1 * rng.standard_normal(v), dtype)
  y = rng.integers(0, v, n)
  y[::5] = -100
  args = (jnp.asarray(rng.standard_normal(n), jnp.float32),
          jnp.asarray(rng.uniform(0.5, 1.5, n), jnp.float32))
  return h, w, b, jnp.asarray(y, jnp.int32), args


def _weighted(logp, a, c):
  """A nonlinear elementwise loss of the log-probabilities."""
  return c * (jnp.exp(logp) * a - 0.5 * logp ** 2)


def _reference(h, w, b, y, fn, *args, **options):
  logp = linear_log_probs_reference(h, w, y, bias=b, **options)
  return jnp.sum(jnp.where(y != -100, fn(logp, *args), 0.0))


@pytest.mark.parametrize("options", [{}, {"temperature": 0.7, "logit_softcap": 3.0}])
def test_matches_the_full_logits_loss_and_its_gradients(options):
  h, w, b, y, args = _inputs()
  got, grads = jax.jit(jax.value_and_grad(
      lambda h, w, b: linear_token_loss(h, w, y, _weighted, *args, bias=b, chunk_size=16,
                                        **options), argnums=(0, 1, 2)))(h, w, b)
  want, want_grads = jax.value_and_grad(
      lambda h, w, b: _reference(h, w, b, y, _weighted, *args, **options),
      argnums=(0, 1, 2))(h, w, b)
  helpers.assert_close(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  for g, r in zip(grads, want_grads):
    helpers.assert_close(np.asarray(g), np.asarray(r), rtol=1e-4,
                         atol=1e-5 * float(jnp.max(jnp.abs(r))))


def test_bfloat16_and_the_per_token_outputs():
  h, w, b, y, args = _inputs(dtype=jnp.bfloat16)
  loss, (logp, entropy) = linear_token_loss(h, w, y, _weighted, *args, bias=b, return_aux=True)
  want_logp, want_entropy = linear_log_probs_reference(h, w, y, bias=b, return_entropy=True)
  helpers.assert_close(np.asarray(logp), np.asarray(want_logp), rtol=1e-4, atol=1e-4)
  helpers.assert_close(np.asarray(entropy), np.asarray(want_entropy), rtol=1e-4, atol=1e-4)
  grads = jax.grad(lambda h, w: linear_token_loss(h, w, y, _weighted, *args), (0, 1))(h, w)
  assert [g.dtype for g in grads] == [jnp.bfloat16, jnp.bfloat16]
  assert bool(jnp.all(jnp.isfinite(loss)))


def test_keeps_the_gradients_and_makes_no_tokens_by_vocabulary_array():
  n, v = 384, 1536
  h, w, b, y, args = _inputs(n=n, d=40, v=v)
  loss = lambda h, w: linear_token_loss(h, w, y, _weighted, *args, chunk_size=32)  # noqa: E731
  kept = sorted(r.shape for r in residuals(loss, h, w) if r.shape)
  assert kept == [(n, 40), (v, 40)]
  text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(h, w).compile().as_text()
  shapes = {tuple(int(x) for x in m.split(",")) for m in re.findall(r"f32\[(\d+(?:,\d+)*)\]",
                                                                      text)}
  assert (32, v) in shapes
  assert not [s for s in shapes if n in s and v in s]
  frozen = [r.shape for r in residuals(lambda h: loss(h, w), h) if r.shape]
  assert frozen == [(n, 40)]


def test_second_order_gradients():
  h, w, b, y, args = _inputs(n=20, v=50, seed=3)
  tangent = jnp.asarray(np.random.default_rng(1).standard_normal(h.shape), jnp.float32)

  def hvp(f):
    return jax.jvp(jax.grad(f), (h,), (tangent,))[1]

  got = hvp(lambda h: linear_token_loss(h, w, y, _weighted, *args, bias=b, chunk_size=8))
  want = hvp(lambda h: _reference(h, w, b, y, _weighted, *args))
  helpers.assert_close(np.asarray(got), np.asarray(want), rtol=1e-4,
                       atol=1e-5 * float(jnp.max(jnp.abs(want))))


@pytest.mark.parametrize("terms", [
    losses.GRPOTerms(loss_type="dapo", epsilon_high=0.28),
    losses.GRPOTerms(loss_type="grpo", beta=0.04, delta=1.4),
    losses.GRPOTerms(loss_type="cispo", epsilon_high=1.2),
    losses.GRPOTerms(loss_type="sapo", beta=0.1, use_bias_correction_kl=True)])
def test_grpo_terms_through_the_fused_op_equal_grpo_loss(terms):
  """A token-separable GRPO loss as weighted per-token terms equals :func:`grpo_loss` on the
  full logits' log-probabilities, loss and gradients."""
  rng = np.random.default_rng(4)
  b_, t_ = 4, 12
  h, w, b, _, _ = _inputs(n=b_ * t_, v=97, seed=5)
  y = jnp.asarray(np.where(rng.random(b_ * t_) < 0.8, rng.integers(0, 97, b_ * t_), -100),
                  jnp.int32)
  mask = (y != -100).astype(jnp.float32).reshape(b_, t_)
  adv = jnp.asarray(rng.standard_normal(b_), jnp.float32)
  base = linear_log_probs_reference(h, w, y).reshape(b_, t_)
  old = base + jnp.asarray(0.3 * rng.standard_normal((b_, t_)), jnp.float32)
  ref = base + jnp.asarray(0.3 * rng.standard_normal((b_, t_)), jnp.float32)
  weights = losses.grpo_token_weights(mask, terms.loss_type)

  def fn(logp, a, wt, o, r):
    return wt * terms.terms(logp, o, a, r if terms.beta else None)[0]

  def fused(h, w):
    return linear_token_loss(h, w, y, fn, jnp.repeat(adv, t_), weights.reshape(-1),
                             old.reshape(-1), ref.reshape(-1), chunk_size=8)

  def plain(h, w):
    logp = linear_log_probs_reference(h, w, y).reshape(b_, t_)
    return losses.grpo_loss(logp, old, adv, mask, ref_logps=ref, beta=terms.beta,
                            loss_type=terms.loss_type, epsilon=terms.epsilon_low,
                            epsilon_high=terms.epsilon_high, delta=terms.delta,
                            use_bias_correction_kl=terms.use_bias_correction_kl)[0]

  (got, g), (want, r) = (jax.value_and_grad(f, (0, 1))(h, w) for f in (fused, plain))
  helpers.assert_close(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)
  for x, z in zip(g, r):
    helpers.assert_close(np.asarray(x), np.asarray(z), rtol=1e-4,
                         atol=1e-5 * float(jnp.max(jnp.abs(z))))


def test_errors_name_the_argument():
  h, w, b, y, args = _inputs()
  with pytest.raises(ValueError, match=r"token_args\[1\] must have the targets' shape"):
    linear_token_loss(h, w, y, _weighted, args[0], args[1][:3])
  with pytest.raises(TypeError, match="token_loss must be a function"):
    linear_token_loss(h, w, y, 3.0)
  with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
    linear_token_loss(h, w, y, _weighted, *args, temperature=0.0)
  with pytest.raises(TypeError, match="targets must have an integer dtype"):
    linear_token_loss(h, w, y.astype(jnp.float32), _weighted, *args)
