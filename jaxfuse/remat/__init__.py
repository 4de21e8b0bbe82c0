"""Recomputation tools: ``recompute`` and its policies."""

from jax.ad_checkpoint import checkpoint_name

from jaxfuse.remat.policies import POLICIES, resolve_policy
from jaxfuse.remat.recompute import recompute

__all__ = ["POLICIES", "checkpoint_name", "recompute", "resolve_policy"]
