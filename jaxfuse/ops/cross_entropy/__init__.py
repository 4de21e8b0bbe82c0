"""The ops on the LM head, without the [tokens, vocab] logits: fused linear cross-entropy
(:mod:`.op`) and per-token log-probabilities (:mod:`.log_probs`), on the same kernels; their
XLA formulas (:mod:`.xla`) and their partitioning over tokens and vocabulary slices
(:mod:`.sharded`); distillation losses between a student's and a teacher's heads
(:mod:`.distillation`)."""

from jaxfuse.ops.cross_entropy.distillation import (LINEAR_DISTILLATION_LOSS,
                                                    linear_distillation_loss,
                                                    linear_distillation_loss_reference,
                                                    linear_topk_distillation_loss,
                                                    topk_distillation_loss)
from jaxfuse.ops.cross_entropy.log_probs import (LINEAR_LOG_PROBS, linear_log_probs,
                                                 linear_log_probs_reference)
from jaxfuse.ops.cross_entropy.op import (LINEAR_CROSS_ENTROPY, linear_cross_entropy,
                                          linear_cross_entropy_reference, linear_logits)

__all__ = ["LINEAR_CROSS_ENTROPY", "LINEAR_DISTILLATION_LOSS", "LINEAR_LOG_PROBS",
           "linear_cross_entropy", "linear_cross_entropy_reference", "linear_distillation_loss",
           "linear_distillation_loss_reference", "linear_log_probs", "linear_log_probs_reference",
           "linear_logits", "linear_topk_distillation_loss", "topk_distillation_loss"]
