"""Flax NNX modules over jaxfuse ops: thin, they hold parameters and call pure-array ops."""

from jaxfuse.nnx.attention import MultiHeadAttention, SelfAttention
from jaxfuse.nnx.linear import RecomputeLinear
from jaxfuse.nnx.lm_head import LMHead
from jaxfuse.nnx.mlp import MLP, GatedMLP
from jaxfuse.nnx.normalization import LayerNorm, RMSNorm
from jaxfuse.nnx.patching import Change, fuse
from jaxfuse.nnx.simple_nn import SimpleNN

__all__ = ["Change", "GatedMLP", "LMHead", "LayerNorm", "MLP", "MultiHeadAttention", "RMSNorm",
           "RecomputeLinear", "SelfAttention", "SimpleNN", "fuse"]
