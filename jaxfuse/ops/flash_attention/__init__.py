"""Fused attention: the op (:mod:`.op`), its reference (:mod:`.reference`), the XLA algorithm
(:mod:`.xla`), the Pallas kernels' tile sizes and autotuning (:mod:`.tuning`) and the argument
checks they share (:mod:`.arguments`). The kernels themselves are in
:mod:`jaxfuse.kernels.pallas.flash_attention`."""

from jaxfuse.kernels.pallas.flash_attention import BlockSizes
from jaxfuse.ops.flash_attention.op import ATTENTION, attention, dot_product_attention
from jaxfuse.ops.flash_attention.reference import attention_reference
from jaxfuse.ops.flash_attention.tuning import (autotune, block_sizes_for, clear_autotune_cache,
                                                default_candidates, heuristic_block_sizes)
from jaxfuse.ops.flash_attention.xla import XLA_BLOCK, XLA_LONG_BLOCK, xla_block_size

__all__ = [
    "ATTENTION",
    "BlockSizes",
    "XLA_BLOCK",
    "XLA_LONG_BLOCK",
    "attention",
    "attention_reference",
    "autotune",
    "block_sizes_for",
    "clear_autotune_cache",
    "default_candidates",
    "dot_product_attention",
    "heuristic_block_sizes",
    "xla_block_size",
]
