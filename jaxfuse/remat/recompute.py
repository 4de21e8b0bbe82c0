"""``remat`` (and ``recompute``): save less for the backward pass, recompute the rest there."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
from flax import linen, nnx

from jaxfuse.remat.policies import PolicySpec, freeze_policy, resolve_policy


def _argnums(static_argnums: int | Sequence[int]) -> tuple[int, ...]:
  return (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)


def _single_policy(policy):
  """A :class:`~jaxfuse.remat.Plan` gives one policy when it chose one for every layer."""
  from jaxfuse.remat.planner import Plan

  if isinstance(policy, Plan):
    return policy.single_policy()
  return policy


def recompute(fn: Callable | None = None, *, policy: PolicySpec = None,
              prevent_cse: bool = True, static_argnums: int | tuple[int, ...] = ()):
  """Makes ``fn`` keep only its inputs (or what ``policy`` names) for the backward pass.

  Everything else ``fn`` computes is recomputed in the backward pass. Built on
  ``jax.checkpoint``; with ``prevent_cse=True`` (the default) the recomputation is fenced off so
  that XLA on GPUs cannot merge it back into the forward pass. (XLA:CPU drops such fences:
  measure CPU savings with :func:`jaxfuse.metrics.residual_bytes`.)

  Args:
    fn: the function to recompute; when omitted, returns a decorator.
    policy: any form :func:`jaxfuse.remat.resolve_policy` takes (``None``: keep the inputs
      only), or a :class:`~jaxfuse.remat.Plan` that chose one policy for every layer.
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
  wrapped = jax.checkpoint(fn, policy=resolve_policy(_single_policy(policy)),
                           prevent_cse=prevent_cse, static_argnums=static_argnums)
  return functools.wraps(fn)(wrapped)


class Remat(nnx.Module):
  """An NNX module whose calls recompute in the backward pass; made by :func:`remat`."""

  def __init__(self, module: nnx.Module, policy: PolicySpec, static_argnums: tuple[int, ...],
               prevent_cse: bool):
    self.module = module
    self.policy = freeze_policy(policy)
    self.static_argnums = static_argnums
    self.prevent_cse = prevent_cse

  def __call__(self, *args, **kwargs):
    def call(module, *args):
      return module(*args, **kwargs)

    checkpointed = nnx.remat(call, policy=resolve_policy(self.policy),
                             prevent_cse=self.prevent_cse,
                             static_argnums=tuple(i + 1 for i in self.static_argnums))
    return checkpointed(self.module, *args)


def remat(target, *, policy: PolicySpec = None, static_argnums: int | Sequence[int] = (),
          prevent_cse: bool = True):
  """Recomputation for a function, an NNX module or a Linen module, under one ``policy``.

  Args:
    target: a function; an ``nnx.Module`` instance (returns a :class:`Remat` module that calls
      it, sharing its variables); a ``linen.Module`` class (returns the lifted class, as
      ``nn.remat``) or instance (returns a copy of it built from the lifted class).
    policy: what the backward keeps: any form :func:`jaxfuse.remat.resolve_policy` takes
      (``None`` keeps only the inputs), or a :class:`~jaxfuse.remat.Plan` with one policy for
      every layer.
    static_argnums: positional arguments of the call (not counting ``self``) that are Python
      values, not arrays.
    prevent_cse: keep XLA from merging the recomputation into the forward pass.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxfuse.remat import remat
    >>> from jaxfuse.metrics import residual_bytes
    >>> layer = nnx.Sequential(nnx.Linear(8, 32, rngs=nnx.Rngs(0)), jnp.tanh,
    ...                        nnx.Linear(32, 8, rngs=nnx.Rngs(1)))
    >>> loss = lambda m, x: jnp.sum(m(x))
    >>> x = jnp.ones((4, 8))
    >>> residual_bytes(loss, layer, x), residual_bytes(loss, remat(layer, policy="dots"), x)
    (1024, 512)
  """
  policy = _single_policy(policy)
  argnums = _argnums(static_argnums)
  if isinstance(target, nnx.Module):
    return Remat(target, policy, argnums, prevent_cse)
  if isinstance(target, type) and issubclass(target, linen.Module):
    return linen.remat(target, policy=resolve_policy(policy), prevent_cse=prevent_cse,
                       static_argnums=tuple(i + 1 for i in argnums))
  if isinstance(target, linen.Module):
    lifted = remat(type(target), policy=policy, static_argnums=argnums,
                   prevent_cse=prevent_cse)
    fields = {f.name: getattr(target, f.name) for f in dataclasses.fields(target)
              if f.init and f.name not in ("parent", "name")}
    return lifted(**fields)
  if callable(target):
    return recompute(target, policy=policy, prevent_cse=prevent_cse, static_argnums=argnums)
  raise TypeError(f"remat: expected a function, an nnx.Module or a linen.Module, got "
                  f"{type(target).__name__}")
