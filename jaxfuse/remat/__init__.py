"""Recomputation tools: named residuals, policies and recipes, ``remat`` for functions and
modules, layer stacks with √L segments, and a planner that chooses what to recompute within a
memory budget."""

from jax.ad_checkpoint import checkpoint_name

from jaxfuse.ops import names
from jaxfuse.remat.layers import apply_layers, segment_size, stacked
from jaxfuse.remat.planner import (DEFAULT_CHOICES, NAMED_CHOICES, BudgetError, ChoiceCost, Plan,
                                   Profile, choice_policy, layer_policies, plan, profile)
from jaxfuse.remat.policies import (POLICIES, PRESETS, RECIPES, freeze_policy, policy_table,
                                    resolve_policy)
from jaxfuse.remat.recompute import Remat, recompute, remat

__all__ = [
    "DEFAULT_CHOICES", "NAMED_CHOICES", "POLICIES", "PRESETS", "RECIPES", "BudgetError",
    "ChoiceCost", "Plan", "Profile", "Remat", "apply_layers", "checkpoint_name",
    "choice_policy", "freeze_policy", "layer_policies", "names", "plan", "policy_table",
    "profile", "recompute", "remat", "resolve_policy", "segment_size", "stacked",
]
