"""Named recomputation policies: what a recomputed region may keep for the backward pass."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax

Policy = Callable[..., bool]

POLICIES: dict[str, Policy] = {
    # Keep nothing but the region's inputs; recompute everything else.
    "nothing": jax.checkpoint_policies.nothing_saveable,
    # Keep every matmul output; recompute only the cheap elementwise work.
    "dots": jax.checkpoint_policies.dots_saveable,
    # Keep matmul outputs that have no batch dimension (weights-only products).
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # Keep everything (no recomputation): for comparisons.
    "everything": jax.checkpoint_policies.everything_saveable,
}


def resolve_policy(policy: str | Sequence[str] | Policy | None) -> Policy:
  """Turns ``policy`` into a ``jax.checkpoint`` policy.

  ``None`` and ``"nothing"`` keep only the inputs; another string names an entry of
  :data:`POLICIES`; a list or tuple of strings keeps exactly the values tagged with those names
  by :func:`jax.ad_checkpoint.checkpoint_name`; a callable is used as it is.
  """
  if policy is None:
    return POLICIES["nothing"]
  if callable(policy):
    return policy
  if isinstance(policy, str):
    if policy not in POLICIES:
      raise ValueError(f"policy must be None, a callable, a list of checkpoint names or one "
                       f"of {sorted(POLICIES)}, got {policy!r}")
    return POLICIES[policy]
  if isinstance(policy, (list, tuple)) and all(isinstance(n, str) for n in policy):
    return jax.checkpoint_policies.save_only_these_names(*policy)
  raise TypeError(f"policy must be None, a string, a list of names or a callable, got "
                  f"{type(policy).__name__}")
