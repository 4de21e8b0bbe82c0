"""Whole models composed from jaxfuse modules: a LLaMA-family decoder and its configuration, and
a residual MLP stack."""

from jaxfuse.models.config import DecoderConfig, UnsupportedConfigError
from jaxfuse.models.decoder import (IGNORE_INDEX, Attention, Block, Decoder, MLP, generate,
                                    next_token_targets)
from jaxfuse.models.mlp_stack import MLPBlock, MLPStack

__all__ = ["IGNORE_INDEX", "Attention", "Block", "Decoder", "DecoderConfig", "MLP", "MLPBlock",
           "MLPStack", "UnsupportedConfigError", "generate", "next_token_targets"]
