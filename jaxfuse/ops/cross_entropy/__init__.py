"""Fused linear cross-entropy (:mod:`.op`), its XLA formulas (:mod:`.xla`) and its partitioning
over tokens and vocabulary slices (:mod:`.sharded`)."""

from jaxfuse.ops.cross_entropy.op import (LINEAR_CROSS_ENTROPY, linear_cross_entropy,
                                          linear_cross_entropy_reference, linear_logits)

__all__ = ["LINEAR_CROSS_ENTROPY", "linear_cross_entropy", "linear_cross_entropy_reference",
           "linear_logits"]
