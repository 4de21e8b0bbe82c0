"""Fused per-token log-probabilities on the LM head: ``log p(token)`` and the entropy, without the
[tokens, vocab] logits.

``linear_log_probs(h, weight, tokens)`` is ``log_softmax(softcap(h @ weight.T + bias) /
temperature)[token]`` per token, optionally with the entropy of that distribution, computed as
:func:`~jaxfuse.ops.linear_cross_entropy` computes its loss (the same kernels): chunk by chunk
over the tokens, walking the vocabulary in tiles with an online logsumexp, so that no more than
one chunk of logits exists in the forward and in the backward. What preference optimisation,
distillation and RL need of a policy (and of its reference model) is these per-token values;
their losses are functions of them.

- forward: per token, the logsumexp, the token's logit and (for the entropy) the logits' mean
  under the softmax ``E_p[z]``; ``log p = z_token - lse``, ``H = lse - E_p[z]``.
- backward: keeps the inputs and those 4 (8 with the entropy) bytes a token, tagged
  ``logp.lse`` and ``logp.mean_logit`` (:mod:`jaxfuse.ops.names`); recomputes each chunk's
  logits and multiplies their gradient, ``g * (onehot - p) - g_H * p * (z - E_p[z])``, into
  ``dh``, ``dweight`` and ``dbias``.
- temperature and soft-capping as TRL applies them: the logits are soft-capped by the model
  (``cap * tanh(z / cap)``), then divided by the temperature.
- vocab-parallel over a mesh as :func:`~jaxfuse.ops.linear_cross_entropy` is: each device walks
  its slice of the vocabulary; only ``[tokens]`` vectors cross devices.

Derivatives: reverse mode to any order, as :func:`~jaxfuse.ops.linear_cross_entropy`'s.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxfuse.ops import base, checks, names, partitioning
from jaxfuse.ops.cross_entropy import op as ce
from jaxfuse.ops.cross_entropy import xla

LINEAR_LOG_PROBS = base.Op("linear_log_probs", "cross_entropy")

__all__ = ["LINEAR_LOG_PROBS", "linear_log_probs", "linear_log_probs_reference"]


# The reference --------------------------------------------------------------------------------


def linear_log_probs_reference(h, weight, tokens, *, bias=None, temperature=1.0,
                               logit_softcap=None, ignore_index=-100, return_entropy=False):
  """Plain-jnp :func:`linear_log_probs` with the full logits (float32 results).

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxfuse.ops import linear_log_probs_reference
    >>> h, w = jnp.ones((2, 4)), jnp.eye(3, 4)
    >>> linear_log_probs_reference(h, w, jnp.array([0, 2]))   # log(1/3) each
    Array([-1.0986123, -1.0986123], dtype=float32)
  """
  logits = xla.linear_logits(h, weight, bias)
  if logit_softcap is not None:
    logits = logit_softcap * jnp.tanh(logits / logit_softcap)
  logp_all = jax.nn.log_softmax(logits / temperature, axis=-1)
  valid = tokens != ignore_index
  safe = jnp.where(valid, tokens, 0)
  logp = jnp.where(valid, jnp.take_along_axis(logp_all, safe[..., None], axis=-1)[..., 0], 0.0)
  if not return_entropy:
    return logp
  entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
  return logp, jnp.where(valid, entropy, 0.0)


# Checks and config ----------------------------------------------------------------------------


def _config(h, weight, tokens, bias, *, temperature, logit_softcap, ignore_index, return_entropy,
            chunk_size, implementation) -> ce._Config:
  op = LINEAR_LOG_PROBS.name
  ce.check_head(op, h, weight, tokens, bias, logit_softcap, chunk_size, labels_name="tokens")
  if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
      or not math.isfinite(temperature) or not temperature > 0:
    raise ValueError(f"{op}: temperature must be a finite number > 0, got {temperature!r}")
  n, vocab = math.prod(tokens.shape), weight.shape[0]
  return LINEAR_LOG_PROBS.config(
      implementation, ce._Config, facts={"grad_in_forward": False}, vocab=vocab,
      ignore_index=int(ignore_index), label_smoothing=0.0, z_loss=0.0,
      softcap=None if logit_softcap is None else float(logit_softcap),
      chunk=ce.chunk_tokens(n, vocab, chunk_size), accuracy=False, has_bias=bias is not None,
      scale=None if temperature == 1 else 1.0 / float(temperature),
      entropy=bool(return_entropy))


# The op ---------------------------------------------------------------------------------------


def linear_log_probs(h: jax.Array, weight: jax.Array, tokens: jax.Array, *,
                     bias: jax.Array | None = None, temperature: float = 1.0,
                     logit_softcap: float | None = None, ignore_index: int = -100,
                     return_entropy: bool = False, chunk_size: int | None = None,
                     implementation: str | None = None):
  """Per-token ``log p(token)`` under ``softmax(softcap(h @ weight.T + bias) / temperature)``,
  one chunk of logits at a time; optionally the distribution's entropy.

  Matches TRL's ``selective_log_softmax(logits / temperature, tokens)`` and
  ``entropy_from_logits`` on the full logits (``jaxfuse.testing.torch_ref.cross_entropy``).

  Args:
    h: hidden states ``[..., D]``, float32, bfloat16 or float16.
    weight: the output embedding ``[V, D]``, h's dtype; ``V >= 1``.
    tokens: integer tokens of shape ``h.shape[:-1]``, in ``[0, V)`` or ``ignore_index``.
    bias: optional ``[V]`` bias, h's dtype.
    temperature: the logits (after the soft-cap) are divided by it (> 0).
    logit_softcap: if set, logits become ``cap * tanh(logits / cap)`` first (Gemma 2).
    ignore_index: tokens with this value (padding, prompts) get 0 and no gradient: the
      segment and padding mask.
    return_entropy: also return each token's entropy ``-sum_v p_v log p_v`` (0 where ignored).
    chunk_size: tokens per chunk (default: about 2**25 / V); the logits of one chunk are the
      most that exists at a time.
    implementation: ``None`` (the fastest here), ``"pallas"``, ``"triton"`` or ``"xla"``.

  Returns:
    The float32 log-probabilities, ``tokens.shape``; with ``return_entropy``, ``(log_probs,
    entropy)``. A token outside ``[0, V)`` that is not ``ignore_index`` (possible only under
    ``jit``: concrete tokens are checked) gets NaN, and so do the gradients.

  Raises:
    ValueError: bad shapes, options, or concrete tokens outside ``[0, V)``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxfuse.ops import linear_log_probs
    >>> h = jax.random.normal(jax.random.key(0), (2, 8, 16))
    >>> w = jax.random.normal(jax.random.key(1), (1000, 16)) * 0.1
    >>> y = jax.random.randint(jax.random.key(2), (2, 8), 0, 1000)
    >>> logp, entropy = linear_log_probs(h, w, y, temperature=0.7, return_entropy=True)
    >>> logp.shape, bool((logp < 0).all()), bool((entropy <= jnp.log(1000.0)).all())
    ((2, 8), True, True)
  """
  tokens = checks.as_array(tokens)
  cfg = _config(h, weight, tokens, bias, temperature=temperature, logit_softcap=logit_softcap,
                ignore_index=ignore_index, return_entropy=return_entropy, chunk_size=chunk_size,
                implementation=implementation)
  ce.check_label_range(tokens, cfg.vocab, ignore_index, LINEAR_LOG_PROBS.name, "tokens")
  n = math.prod(tokens.shape)
  h2, tokens1 = h.reshape(n, h.shape[-1]), tokens.reshape(n).astype(jnp.int32)
  with jax.named_scope(f"jaxfuse.linear_log_probs[{cfg.impl}]"):
    logp, entropy = _log_probs(h2, weight, bias, tokens1, cfg)
  logp = logp.reshape(tokens.shape)
  return (logp, entropy.reshape(tokens.shape)) if return_entropy else logp


# Forward and backward -------------------------------------------------------------------------


def _per_token(tokens, lse, target, mean_logit, cfg):
  valid = tokens != cfg.ignore_index
  in_range = (tokens >= 0) & (tokens < cfg.vocab)
  logp = jnp.where(valid, jnp.where(in_range, target - lse, jnp.nan), 0.0)
  entropy = jnp.where(valid, lse - mean_logit, 0.0) if cfg.entropy else jnp.zeros_like(lse)
  return logp, entropy


def _coefficients(tokens, mean_logit, g_logp, g_entropy, cfg):
  """The per-token factors of the logit gradient ``p * (a + c * z) - b * onehot(token)``:
  ``d log p / dz = onehot - p`` and ``dH / dz = -p * (z - E_p[z])``."""
  valid = tokens != cfg.ignore_index
  g = jnp.where(valid, g_logp, 0.0)
  a, b = -g, -g
  c = jnp.zeros_like(g)
  if cfg.entropy:
    gh = jnp.where(valid, g_entropy, 0.0)
    a, c = a + gh * mean_logit, -gh
  out_of_range = valid & ((tokens < 0) | (tokens >= cfg.vocab))
  return jnp.where(out_of_range, jnp.nan, a), b, c


# The custom VJP -------------------------------------------------------------------------------


@partitioning.matching_vma
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _log_probs(h, weight, bias, tokens, cfg):
  return _log_probs_fwd(h, weight, bias, tokens, cfg)[0]


def _log_probs_fwd(h, weight, bias, tokens, cfg):
  lse, target, mean_logit, _ = ce.token_stats(h, weight, bias, tokens, cfg)
  lse = checkpoint_name(lse, names.LOGP_LSE)
  mean_logit = checkpoint_name(mean_logit, names.LOGP_MEAN_LOGIT) if cfg.entropy else None
  out = _per_token(tokens, lse, target, mean_logit, cfg)
  # Residuals: the inputs, and per token the logsumexp (and the softmax's mean logit, for the
  # entropy's gradient). Logits are recomputed chunk by chunk.
  return out, (h, weight, bias, tokens, lse, mean_logit)


def _log_probs_bwd(cfg, residuals, cotangents):
  h, weight, bias, tokens, lse, mean_logit = residuals
  g_logp, g_entropy = cotangents
  a, b, c = _coefficients(tokens, mean_logit, g_logp, g_entropy, cfg)
  dh, dw, db = ce.head_backward(h, weight, bias, tokens, lse, a, b, c, cfg)
  return dh, dw, db, None


# Plain defvjp: optimize_remat=True breaks reverse over reverse.
_log_probs.defvjp(_log_probs_fwd, _log_probs_bwd)

