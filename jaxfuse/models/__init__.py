"""Whole models composed from jaxfuse modules: a LLaMA-family decoder and its configuration."""

from jaxfuse.models.config import DecoderConfig, UnsupportedConfigError
from jaxfuse.models.decoder import (IGNORE_INDEX, Attention, Block, Decoder, MLP, generate,
                                    next_token_targets)

__all__ = ["IGNORE_INDEX", "Attention", "Block", "Decoder", "DecoderConfig", "MLP",
           "UnsupportedConfigError", "generate", "next_token_targets"]
