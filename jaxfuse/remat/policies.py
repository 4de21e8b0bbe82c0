"""Recomputation policies: what a recomputed region keeps, offloads or recomputes.

A policy is given in one of five forms, all turned into a ``jax.checkpoint`` policy by
:func:`resolve_policy`:

- a preset of :data:`PRESETS`: ``"nothing"``, ``"everything"``, ``"dots"``, ``"dots_no_batch"``;
- a recipe of :data:`RECIPES`, named as MaxText names its ``remat_policy`` choices (``"full"``,
  ``"minimal"``, ``"save_qkv_proj"``, ..., ``"minimal_offloaded"``), written over jaxfuse's
  residual names (:mod:`jaxfuse.ops.names`);
- a list of names: keep exactly the values tagged with them;
- a table ``{name: "remat" | "device" | "offload"}``: keep on the device, move to host memory
  (``jax.checkpoint_policies.save_and_offload_only_these_names``) or recompute; names not in it
  are recomputed;
- a ``jax.checkpoint`` policy (a callable), used as it is.

Example:
  >>> from jaxfuse.remat import RECIPES, policy_table
  >>> sorted(policy_table("save_qkv_proj").items())
  [('attn.k', 'device'), ('attn.q', 'device'), ('attn.v', 'device')]
  >>> policy_table({"mlp.hidden": "offload"})
  {'mlp.hidden': 'offload'}
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import jax

from jaxfuse.ops import names as n

Policy = Callable[..., bool]
PolicySpec = str | Sequence[str] | Mapping[str, str] | Policy | None

PRESETS: dict[str, Policy] = {
    # Keep nothing but the region's inputs; recompute everything else.
    "nothing": jax.checkpoint_policies.nothing_saveable,
    # Keep every matmul output; recompute only the cheap elementwise work.
    "dots": jax.checkpoint_policies.dots_saveable,
    # Keep matmul outputs that have no batch dimension (weights-only products).
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # Keep everything (no recomputation): for comparisons.
    "everything": jax.checkpoint_policies.everything_saveable,
}
# Kept for callers of the first version of this module.
POLICIES = PRESETS

_QKV = (n.ATTN_Q, n.ATTN_K, n.ATTN_V)
_CONTEXT = (n.ATTN_OUT, n.ATTN_LSE)   # MaxText's "context": our op needs its lse with it
_MLP_IN = (n.MLP_GATE, n.MLP_UP, n.MLP_PRE)   # MaxText's "mlpwi", "mlpwi_0", "mlpwi_1"
_MINIMAL = _QKV + (n.ATTN_PROJ,) + _MLP_IN + (n.MLP_DOWN,)

# MaxText's recipes (its ``remat_policy`` values), over our names: query/key/value_proj are
# attn.q/k/v, context is attn.out with attn.lse, out_proj is attn.proj, mlpwi is the MLP's input
# projections, mlpwo is mlp.down. Each maps a name to "device" or "offload"; the rest is
# recomputed.
RECIPES: dict[str, dict[str, str]] = {
    "full": {},
    "minimal": dict.fromkeys(_MINIMAL, "device"),
    "minimal_with_context": dict.fromkeys(_MINIMAL + _CONTEXT, "device"),
    "save_dot_with_context_except_mlp": dict.fromkeys(_QKV + _CONTEXT + (n.ATTN_PROJ,),
                                                      "device"),
    "save_dot_except_mlpwi": dict.fromkeys(_QKV + (n.ATTN_PROJ, n.MLP_DOWN), "device"),
    "save_dot_except_mlp": dict.fromkeys(_QKV + (n.ATTN_PROJ,), "device"),
    "save_qkv_proj": dict.fromkeys(_QKV, "device"),
    "save_out_proj": {n.ATTN_PROJ: "device"},
    "qkv_proj_offloaded": dict.fromkeys(_QKV, "offload"),
    "minimal_offloaded": dict.fromkeys(_MINIMAL, "offload"),
}

CHOICES = ("remat", "device", "offload")
# Where offloaded values go, and from where (jax's memory kinds).
OFFLOAD_SRC, OFFLOAD_DST = "device", "pinned_host"


def _is_pairs(policy) -> bool:
  return isinstance(policy, tuple) and all(isinstance(x, tuple) and len(x) == 2
                                           for x in policy) and len(policy) > 0


def freeze_policy(policy: PolicySpec):
  """``policy`` in a hashable form (a table becomes sorted ``(name, choice)`` pairs, a list of
  names a tuple), so that modules can keep it as a static attribute."""
  if isinstance(policy, Mapping):
    policy_table(policy)   # checks it
    return tuple(sorted(policy.items()))
  if isinstance(policy, list):
    return tuple(policy)
  return policy


def policy_table(policy: str | Sequence[str] | Mapping[str, str]) -> dict[str, str]:
  """``{name: "device" | "offload"}``: what a recipe, a list of names or a table keeps (the
  names recomputed are left out). Presets and callables have no table: they decide by
  primitive, not by name."""
  if isinstance(policy, str):
    if policy not in RECIPES:
      raise ValueError(f"policy_table: {policy!r} is not a recipe; recipes: {sorted(RECIPES)}")
    return dict(RECIPES[policy])
  if _is_pairs(policy):
    policy = dict(policy)
  if isinstance(policy, Mapping):
    bad = {k: v for k, v in policy.items() if v not in CHOICES or not isinstance(k, str)}
    if bad:
      raise ValueError(f"policy table: each name maps to one of {CHOICES}, got {bad}")
    return {k: v for k, v in policy.items() if v != "remat"}
  if isinstance(policy, (list, tuple, frozenset, set)) and all(isinstance(x, str)
                                                              for x in policy):
    return dict.fromkeys(policy, "device")
  raise TypeError(f"policy_table: expected a recipe name, a list of names or a table, got "
                  f"{type(policy).__name__}")


def _from_table(table: Mapping[str, str]) -> Policy:
  device = sorted(k for k, v in table.items() if v == "device")
  offload = sorted(k for k, v in table.items() if v == "offload")
  if not offload:
    return jax.checkpoint_policies.save_only_these_names(*device)
  return jax.checkpoint_policies.save_and_offload_only_these_names(
      names_which_can_be_saved=device, names_which_can_be_offloaded=offload,
      offload_src=OFFLOAD_SRC, offload_dst=OFFLOAD_DST)


def resolve_policy(policy: PolicySpec) -> Policy:
  """Turns ``policy`` (any form in the module docstring) into a ``jax.checkpoint`` policy;
  ``None`` means ``"nothing"``.

  Example:
    >>> import jax
    >>> from jaxfuse.remat import resolve_policy
    >>> resolve_policy("dots") is jax.checkpoint_policies.dots_saveable
    True
  """
  if policy is None:
    return PRESETS["nothing"]
  if isinstance(policy, str):
    if policy in PRESETS:
      return PRESETS[policy]
    if policy in RECIPES:
      return _from_table(RECIPES[policy])
    raise ValueError(f"policy must be None, a callable, a list of checkpoint names, a table or "
                     f"one of {sorted(PRESETS) + sorted(RECIPES)}, got {policy!r}")
  if isinstance(policy, Mapping) or _is_pairs(policy) or (
      isinstance(policy, (list, tuple)) and all(isinstance(x, str) for x in policy)):
    return _from_table(policy_table(policy))
  if callable(policy):
    return policy
  raise TypeError(f"policy must be None, a string, a list of names, a table or a callable, got "
                  f"{type(policy).__name__}")
