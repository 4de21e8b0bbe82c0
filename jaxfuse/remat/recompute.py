"""``recompute``: save less for the backward pass, recompute the rest there."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax

from jaxfuse.remat.policies import Policy, resolve_policy


def recompute(fn: Callable | None = None, *, policy: str | Sequence[str] | Policy | None = None,
              prevent_cse: bool = True, static_argnums: int | tuple[int, ...] = ()):
  """Makes ``fn`` keep only its inputs (or what ``policy`` names) for the backward pass.

  Everything else ``fn`` computes is recomputed in the backward pass. Built on
  ``jax.checkpoint``; with ``prevent_cse=True`` (the default) the recomputation is fenced off so
  that XLA on GPUs cannot merge it back into the forward pass. (XLA:CPU drops such fences:
  measure CPU savings with :func:`jaxfuse.metrics.residual_bytes`.)

  Args:
    fn: the function to recompute; when omitted, returns a decorator.
    policy: ``None`` or ``"nothing"`` (keep the inputs only), ``"dots"``, ``"dots_no_batch"``,
      a list of names given to values with ``jax.ad_checkpoint.checkpoint_name``, or a
      ``jax.checkpoint`` policy.
    prevent_cse: keep XLA from merging recomputation into the forward pass.
    static_argnums: arguments that are Python values, not arrays.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxfuse import recompute
    >>> from jaxfuse.metrics import residual_bytes
    >>> mlp = lambda x: jnp.sum(jnp.tanh(jnp.tanh(x)))
    >>> residual_bytes(mlp, jnp.ones(256)), residual_bytes(recompute(mlp), jnp.ones(256))
    (4096, 0)
  """
  if fn is None:
    return functools.partial(recompute, policy=policy, prevent_cse=prevent_cse,
                             static_argnums=static_argnums)
  wrapped = jax.checkpoint(fn, policy=resolve_policy(policy), prevent_cse=prevent_cse,
                           static_argnums=static_argnums)
  return functools.wraps(fn)(wrapped)
