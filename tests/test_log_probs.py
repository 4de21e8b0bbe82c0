"""linear_log_probs beyond the op table (tests/cases/cross_entropy.py): TRL's own functions as
the twin, the compiled programs holding no [tokens, vocab] array, what the backward keeps,
jit/vmap/remat, and the kernels lowering for CUDA."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxfuse.metrics import residual_bytes
from jaxfuse.ops import (dispatch, linear_cross_entropy, linear_log_probs,
                         linear_log_probs_reference)
from tests import helpers

IGNORE = -100


def _inputs(n, d, v, *, dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  h = jnp.asarray(rng.standard_normal((n, d)), dtype)
  w = jnp.asarray(rng.standard_normal((v, d)) * 0.2, dtype)
  b = jnp.asarray(rng.standard_normal((v,)) * 0.1, dtype)
  y = rng.integers(0, v, n)
  y[::7] = IGNORE
  return h, w, b, jnp.asarray(y, jnp.int32)


@pytest.mark.parametrize("impl", helpers.CPU_IMPLEMENTATIONS)
@pytest.mark.parametrize("temperature,softcap", [(1.0, None), (0.6, None), (1.4, 4.0)])
def test_matches_trl_selective_log_softmax_and_entropy(impl, temperature, softcap, pallas_mode):
  """TRL's ``selective_log_softmax`` and ``entropy_from_logits`` (the installed TRL's code, in
  float64 on the full logits), values and the gradients of h, the weight and the bias."""
  from trl.trainer.utils import entropy_from_logits, selective_log_softmax

  h, w, b, y = _inputs(45, 24, 300)
  rng = np.random.default_rng(1)
  g_logp, g_entropy = rng.standard_normal(45), rng.standard_normal(45)

  def ours(h, w, b):
    logp, entropy = linear_log_probs(h, w, y, bias=b, temperature=temperature,
                                     logit_softcap=softcap, return_entropy=True, chunk_size=16,
                                     implementation=impl)
    return jnp.sum(logp * g_logp) + jnp.sum(entropy * g_entropy), (logp, entropy)

  (_, (logp, entropy)), grads = jax.value_and_grad(ours, argnums=(0, 1, 2), has_aux=True)(h, w, b)

  th, tw, tb = (torch.tensor(np.asarray(x), dtype=torch.float64, requires_grad=True)
                for x in (h, w, b))
  logits = th @ tw.T + tb
  if softcap is not None:
    logits = softcap * torch.tanh(logits / softcap)
  ty = torch.tensor(np.asarray(y))
  valid = ty != IGNORE
  t_logp = selective_log_softmax(logits, torch.where(valid, ty, 0), temperature=temperature)
  t_logp = t_logp * valid
  t_entropy = entropy_from_logits(logits / temperature) * valid
  (torch.sum(t_logp * torch.tensor(g_logp)) + torch.sum(t_entropy * torch.tensor(g_entropy))
   ).backward()
  np.testing.assert_allclose(logp, t_logp.detach().numpy(), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(entropy, t_entropy.detach().numpy(), rtol=1e-5, atol=1e-5)
  for got, want in zip(grads, (th, tw, tb)):
    want = want.grad.numpy()
    helpers.assert_close(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def _hlo_shapes(compiled_text: str) -> set[tuple[int, ...]]:
  return {tuple(int(x) for x in dims.split(",") if x)
          for dims in re.findall(r"\[([\d,]*)\]", compiled_text)}


@pytest.mark.parametrize("op", ["linear_log_probs", "linear_cross_entropy"])
def test_no_tokens_by_vocabulary_array_in_the_compiled_step(op):
  """The compiled forward and backward hold at most a chunk of logits: no array has both the
  tokens' and the vocabulary's extent (N = 384 tokens, V = 1536 words, chunks of 32)."""
  n, v = 384, 1536
  h, w, b, y = _inputs(n, 40, v)
  if op == "linear_log_probs":
    f = lambda h, w, b: jnp.sum(jnp.stack(linear_log_probs(  # noqa: E731
        h, w, y, bias=b, return_entropy=True, temperature=0.8, chunk_size=32,
        implementation="xla")))
  else:
    f = lambda h, w, b: linear_cross_entropy(h, w, y, bias=b, chunk_size=32,  # noqa: E731
                                             implementation="xla")
  text = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2))).lower(h, w, b).compile().as_text()
  shapes = _hlo_shapes(text)
  assert (32, v) in shapes or (v, 32) in shapes   # the chunk's logits: the check sees shapes
  big = [s for s in shapes if n in s and v in s]
  assert not big, big
  # The full-logits reference does make one: the check can fail.
  full = jax.jit(jax.grad(lambda h: jnp.sum(linear_log_probs_reference(h, w, y)))).lower(
      h).compile().as_text()
  assert any(n in s and v in s for s in _hlo_shapes(full))


def test_the_backward_keeps_the_inputs_and_a_few_bytes_a_token():
  n, v = 64, 1000
  h, w, b, y = _inputs(n, 32, v)
  plain = residual_bytes(lambda h, w, b: linear_log_probs(h, w, y, bias=b), h, w, b)
  assert plain == 4 * n   # the logsumexp
  both = residual_bytes(lambda h, w, b: jnp.stack(linear_log_probs(
      h, w, y, bias=b, return_entropy=True)), h, w, b)
  assert both == 8 * n    # and the softmax's mean logit
  full = residual_bytes(lambda h, w, b: linear_log_probs_reference(h, w, y, bias=b), h, w, b)
  assert full >= 4 * n * v


def test_jit_vmap_and_remat_compose(pallas_mode):
  """vmap over a batch of sequences (the weight shared), under jit and jax.checkpoint: the
  same values and gradients as one call over the flattened tokens."""
  h, w, b, y = _inputs(60, 16, 200)
  h3, y3 = h.reshape(3, 20, 16), y.reshape(3, 20)

  def flat(h, w):
    return jnp.sum(jnp.stack(linear_log_probs(h, w, y, return_entropy=True, temperature=0.9)))

  def mapped(h3, w):
    per = jax.vmap(lambda hs, ys: jnp.stack(linear_log_probs(
        hs, w, ys, return_entropy=True, temperature=0.9)))(h3, y3)
    return jnp.sum(per)

  want, (gh, gw) = jax.value_and_grad(flat, argnums=(0, 1))(h, w)
  got, (gh3, gw3) = jax.jit(jax.value_and_grad(jax.checkpoint(mapped), argnums=(0, 1)))(h3, w)
  helpers.assert_close(got, want, rtol=1e-5, atol=1e-5)
  helpers.assert_close(gh3.reshape(gh.shape), gh, rtol=1e-5, atol=1e-6)
  helpers.assert_close(gw3, gw, rtol=1e-5, atol=1e-6)


def test_tokens_out_of_range_under_jit_give_nan():
  """Traced tokens cannot be checked: one outside the vocabulary gets NaN, and so do the
  gradients (concrete ones raise: the op table's bad cases)."""
  h, w, _, y = _inputs(8, 8, 10)
  y = y.at[2].set(10)
  value, grad = jax.jit(jax.value_and_grad(
      lambda h, y: jnp.sum(linear_log_probs(h, w, y))))(h, y)
  assert np.isnan(float(value)) and np.isnan(np.asarray(grad)).any()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pallas_kernels_with_entropy_and_temperature_lower_for_cuda(dtype):
  h, w, b, y = _inputs(37, 48, 1000, dtype=dtype)
  step = jax.value_and_grad(lambda h, w, b: jnp.sum(jnp.stack(linear_log_probs(
      h, w, y, bias=b, temperature=0.7, logit_softcap=30.0, return_entropy=True,
      implementation="pallas"))), argnums=(0, 1, 2))
  with dispatch.target_platform("gpu"):
    lowered = jax.jit(step).trace(h, w, b).lower(lowering_platforms=("cuda",))
  assert "linear_xent_fwd" in lowered.as_text() and "linear_xent_bwd_logit_grad" in \
      lowered.as_text()
