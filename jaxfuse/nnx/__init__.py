"""Flax NNX modules over jaxfuse ops: thin, they hold parameters and call pure-array ops."""

from jaxfuse.nnx.lm_head import LMHead
from jaxfuse.nnx.linear import RecomputeLinear
from jaxfuse.nnx.simple_nn import SimpleNN

__all__ = ["LMHead", "RecomputeLinear", "SimpleNN"]
