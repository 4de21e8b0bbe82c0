"""Flax NNX modules over jaxfuse's fused ops."""

from jaxfuse.nnx.mlp import MLP, GatedMLP

__all__ = [
    "GatedMLP",
    "MLP",
]
