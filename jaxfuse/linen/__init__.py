"""Flax Linen modules over jaxfuse ops, with the same parameter names as their NNX twins."""

from jaxfuse.linen.lm_head import LMHead
from jaxfuse.linen.linear import RecomputeLinear
from jaxfuse.linen.simple_nn import SimpleNN

__all__ = ["LMHead", "RecomputeLinear", "SimpleNN"]
