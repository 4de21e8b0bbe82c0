"""Flax Linen modules over jaxfuse ops, with the same parameter names as their NNX twins."""

from jaxfuse.linen.attention import MultiHeadAttention, MultiHeadDotProductAttention, SelfAttention
from jaxfuse.linen.linear import RecomputeLinear
from jaxfuse.linen.lm_head import LMHead
from jaxfuse.linen.mlp import MLP, GatedMLP
from jaxfuse.linen.normalization import LayerNorm, RMSNorm
from jaxfuse.linen.simple_nn import SimpleNN

__all__ = ["GatedMLP", "LMHead", "LayerNorm", "MLP", "MultiHeadAttention",
           "MultiHeadDotProductAttention", "RMSNorm", "RecomputeLinear", "SelfAttention",
           "SimpleNN"]
