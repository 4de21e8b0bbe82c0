"""Whole models composed from jaxfuse blocks: a LLaMA-family decoder and its configuration, and
a residual MLP stack.

- :mod:`.decoder`: the decoder (:class:`Decoder`) and its loss targets;
- :mod:`.decoder_block`: one block (:class:`Block`) and its pieces (:class:`Attention`,
  :class:`MLP`, the norms);
- :mod:`.axes`: the logical axes of the parameters and activations (mesh placement);
- :mod:`.decoding`: the KV cache and :func:`generate`;
- :mod:`.stacking`: blocks unrolled or stacked for a scan;
- :mod:`.config`: :class:`DecoderConfig` and Hugging Face configs;
- :mod:`.mlp_stack`: :class:`MLPStack`.
"""

from jaxfuse.models.config import DecoderConfig, UnsupportedConfigError
from jaxfuse.models.decoder import IGNORE_INDEX, Decoder, next_token_targets
from jaxfuse.models.decoder_block import MLP, Attention, Block
from jaxfuse.models.decoding import generate
from jaxfuse.models.mlp_stack import MLPBlock, MLPStack

__all__ = ["IGNORE_INDEX", "Attention", "Block", "Decoder", "DecoderConfig", "MLP", "MLPBlock",
           "MLPStack", "UnsupportedConfigError", "generate", "next_token_targets"]
