"""Flax NNX modules over jaxfuse's fused ops."""

from jaxfuse.nnx.attention import MultiHeadAttention, SelfAttention

__all__ = [
    "MultiHeadAttention",
    "SelfAttention",
]
