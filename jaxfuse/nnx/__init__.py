"""Flax NNX modules over jaxfuse's ops: thin, they hold parameters and call the fused ops."""

from jaxfuse.nnx.normalization import LayerNorm, RMSNorm

__all__ = ["LayerNorm", "RMSNorm"]
