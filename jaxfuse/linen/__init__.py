"""Flax Linen modules over jaxfuse's ops: thin, they hold parameters and call the fused ops."""

from jaxfuse.linen.normalization import LayerNorm, RMSNorm

__all__ = ["LayerNorm", "RMSNorm"]
