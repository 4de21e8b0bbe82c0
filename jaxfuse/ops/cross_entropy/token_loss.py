"""A loss that sums a function of each token's log-probability, on the LM head, its gradients
computed in the forward: one pass over each chunk of logits, and no ``[tokens, V]`` array.

``linear_token_loss(h, weight, targets, token_loss, *token_args)`` is
``sum_t token_loss(log p_t, *args_t)`` over the targets that count, ``log p_t`` being
``log_softmax(softcap(h @ weight.T + bias) / temperature)[target_t]``. A policy-gradient loss
whose terms each depend on their own token's log-probability (GRPO's token-level losses, their
KL to a reference) is of this form; its derivative with respect to ``log p_t`` is then known as
soon as the token's chunk of logits is, so the forward walks the chunks once and multiplies each
chunk's logit gradient, ``g_t * (onehot - p)``, into ``dh``, ``dweight`` and ``dbias`` right
away (as Liger-Kernel's fused losses do): three ``N x D x V`` products in all, where the
log-probabilities op followed by the loss takes four (its backward makes the logits again).

- backward: keeps those gradients (``h``'s and the head's sizes) and scales them by the loss's
  cotangent; the ``token_args`` (advantages, old and reference log-probabilities, weights) are
  constants and get zeros.
- ``token_loss`` must act elementwise on ``[chunk]`` arrays (token ``t``'s loss from token
  ``t``'s values only); it is differentiated by JAX, so ``jax.lax.stop_gradient`` inside it
  works as in any loss. It is a static argument: pass the same function object across calls,
  or each call compiles anew.
- ``return_aux``: also the per-token log-probabilities and entropies (for metrics; no
  gradient flows through them).

Implementations: XLA only; no partitioning rule of its own (over a mesh XLA partitions its jnp).
Derivatives: reverse mode to second order through the forward's jnp; forward mode raises, as
for every ``jax.custom_vjp`` function.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from jaxfuse.ops import base, checks, partitioning
from jaxfuse.ops.cross_entropy import op as ce
from jaxfuse.ops.cross_entropy import xla

_LINEAR_TOKEN_LOSS = base.Op("linear_token_loss", None, register=False)

__all__ = ["linear_token_loss"]


@dataclasses.dataclass(frozen=True)
class _Config(base.Config):
  """Static settings (the fields :func:`xla.chunk_logits` and its gradient read)."""

  vocab: int
  softcap: float | None
  scale: float | None
  chunk: int
  ignore_index: int
  token_loss: Callable
  entropy: bool = False
  label_smoothing: float = 0.0
  accuracy: bool = False


def linear_token_loss(h: jax.Array, weight: jax.Array, targets: jax.Array,
                      token_loss: Callable[..., jax.Array], *token_args: jax.Array,
                      bias: jax.Array | None = None, temperature: float = 1.0,
                      logit_softcap: float | None = None, ignore_index: int = -100,
                      chunk_size: int | None = None, return_aux: bool = False,
                      implementation: str | None = None):
  """``sum_t token_loss(log p_t, *args_t)`` over the targets that count, from the LM head
  without its logits, the gradients computed in the forward (see the module docstring).

  Args:
    h: hidden states ``[..., D]``, float32, bfloat16 or float16.
    weight: the output embedding ``[V, D]``, h's dtype.
    targets: integer ``h.shape[:-1]``: the token scored at each position; ``ignore_index``
      where none (no loss, no gradient).
    token_loss: ``fn(logp [chunk], *args [chunk]) -> [chunk]`` float32 losses, elementwise.
    *token_args: float arrays of ``targets``' shape passed to ``token_loss`` chunk by chunk.
    bias: optional ``[V]`` bias, h's dtype.
    temperature: divides the (soft-capped) logits (> 0).
    logit_softcap: if set, the logits become ``cap * tanh(logits / cap)`` first.
    ignore_index: the target of the positions that do not count.
    chunk_size: tokens per chunk (default: about ``2**25 / V``).
    return_aux: also return ``(logp, entropy)`` per token (0 where nothing counts), without
      gradient.
    implementation: ``None`` or ``"xla"``.

  Returns:
    The float32 sum, or ``(sum, (logp, entropy))`` with ``return_aux``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxfuse.ops import linear_log_probs_reference
    >>> from jaxfuse.ops.cross_entropy.token_loss import linear_token_loss
    >>> h, w = jnp.ones((3, 4)), jnp.eye(5, 4)
    >>> y = jnp.array([0, 1, -100])
    >>> nll = lambda logp, weight: -weight * logp          # a weighted cross-entropy
    >>> loss, dh = jax.value_and_grad(linear_token_loss)(h, w, y, nll, jnp.ones(3))
    >>> logp = linear_log_probs_reference(h, w, y)          # 0 where the target is ignored
    >>> bool(jnp.isclose(loss, -logp.sum())), dh.shape
    (True, (3, 4))
  """
  op = _LINEAR_TOKEN_LOSS.name
  targets = checks.as_array(targets)
  ce.check_head(op, h, weight, targets, bias, logit_softcap, chunk_size, labels_name="targets")
  if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
      or not math.isfinite(temperature) or not temperature > 0:
    raise ValueError(f"{op}: temperature must be a finite number > 0, got {temperature!r}")
  if not callable(token_loss):
    raise TypeError(f"{op}: token_loss must be a function of the log-probabilities, got "
                    f"{type(token_loss).__name__}")
  lead = targets.shape
  args = []
  for i, a in enumerate(token_args):
    a = checks.as_array(a)
    if tuple(a.shape) != tuple(lead):
      raise ValueError(f"{op}: token_args[{i}] must have the targets' shape {tuple(lead)}, got "
                       f"{tuple(a.shape)}")
    args.append(a.reshape(-1).astype(jnp.float32))
  n, vocab = math.prod(lead), weight.shape[0]
  cfg = _LINEAR_TOKEN_LOSS.config(
      implementation, _Config, vocab=vocab,
      softcap=None if logit_softcap is None else float(logit_softcap),
      scale=None if temperature == 1 else 1.0 / float(temperature),
      chunk=ce.chunk_tokens(n, vocab, chunk_size), ignore_index=int(ignore_index),
      token_loss=token_loss)
  with jax.named_scope(f"jaxfuse.linear_token_loss[{cfg.impl}]"):
    total, logp, entropy = _token_loss(h.reshape(n, h.shape[-1]), weight, bias,
                                       targets.reshape(n), tuple(args), cfg)
  if not return_aux:
    return total
  return total, (lax.stop_gradient(logp).reshape(lead), lax.stop_gradient(entropy).reshape(lead))


def _forward_with_grads(h, weight, bias, targets, args, cfg):
  """The loss, per-token log-probabilities and entropies, and ``(dh, dweight, dbias)``."""
  n, d = h.shape
  cd = jnp.float32
  w_mm = weight.astype(cd)

  def step(carry, xs):
    total, dw, db = carry
    hc, yc, ac = xs
    z = xla.chunk_logits(hc, weight, bias, cfg)
    lse, target, _, _ = xla.stats_from_logits(z, yc, cfg)
    valid = yc != cfg.ignore_index
    logp = jnp.where(valid, target - lse, 0.0)
    losses, pullback = jax.vjp(lambda lp: cfg.token_loss(lp, *ac).astype(cd), logp)
    (g,) = pullback(jnp.ones_like(losses))
    g = jnp.where(valid, g, 0.0)
    # d(sum g log p)/dz = g * (onehot - p): p * a - b * onehot with a = b = -g.
    dz = xla.logit_grad_from_logits(z, yc, lse, -g, -g, jnp.zeros_like(g), cfg)
    dhc = jnp.dot(dz, w_mm, precision=xla.HIGHEST, preferred_element_type=cd)
    dw = dw + lax.dot_general(dz, hc.astype(cd), (((0,), (0,)), ((), ())),
                              precision=xla.HIGHEST, preferred_element_type=cd)
    if bias is not None:
      db = db + jnp.sum(dz, axis=0)
    p = jnp.exp(z - lse[:, None])
    entropy = jnp.where(valid, lse - jnp.sum(p * z, axis=-1), 0.0)
    total = total + jnp.sum(jnp.where(valid, losses, 0.0))
    return (total, dw, db), (dhc.astype(h.dtype), logp, entropy)

  xs = (xla.chunked(h, cfg), xla.chunked(targets, cfg, cfg.ignore_index),
        tuple(xla.chunked(a, cfg) for a in args))
  init = (jnp.zeros((), cd), jnp.zeros(weight.shape, cd),
          jnp.zeros((cfg.vocab,) if bias is not None else (), cd))
  init = partitioning.vary_like(init, h, weight, bias, targets, *args)
  (total, dw, db), (dh, logp, entropy) = lax.scan(step, init, xs)
  dh = dh.reshape(-1, d)[:n]
  logp, entropy = logp.reshape(-1)[:n], entropy.reshape(-1)[:n]
  grads = (dh, dw.astype(weight.dtype), None if bias is None else db.astype(bias.dtype))
  return (total, logp, entropy), grads


@partitioning.matching_vma
@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _token_loss(h, weight, bias, targets, args, cfg):
  return _forward_with_grads(h, weight, bias, targets, args, cfg)[0]


def _fwd(h, weight, bias, targets, args, cfg):
  value = lambda x: None if x is None else x.value  # noqa: E731
  out, grads = _forward_with_grads(value(h), value(weight), value(bias), value(targets),
                                   tuple(value(a) for a in args), cfg)
  # Residuals: the gradients of the differentiated inputs (a frozen head keeps none, and XLA
  # drops its product); the backward scales them by the loss's cotangent.
  return out, tuple(g if x is not None and x.perturbed else None
                    for g, x in zip(grads, (h, weight, bias)))


def _bwd(cfg, residuals, cotangents):
  g = cotangents[0]   # the per-token outputs carry no gradient (stop_gradient by the caller)
  if isinstance(g, SymbolicZero):
    return None, None, None, None, None
  scale = lambda x: None if x is None else (x * g).astype(x.dtype)  # noqa: E731
  return (*(scale(x) for x in residuals), None, None)


# Plain defvjp (optimize_remat=True breaks reverse over reverse), with symbolic zeros.
_token_loss.defvjp(_fwd, _bwd, symbolic_zeros=True)
