"""Flax Linen modules over jaxfuse's fused ops."""

from jaxfuse.linen.mlp import MLP, GatedMLP

__all__ = [
    "GatedMLP",
    "MLP",
]
