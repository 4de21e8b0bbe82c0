"""Flax Linen modules over jaxfuse's fused ops."""

from jaxfuse.linen.attention import MultiHeadAttention, MultiHeadDotProductAttention, SelfAttention

__all__ = [
    "MultiHeadAttention",
    "MultiHeadDotProductAttention",
    "SelfAttention",
]
