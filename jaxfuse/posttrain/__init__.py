"""Post-training on per-token log-probabilities: preference losses (:mod:`.losses`), computed
from the LM head without its logits (:func:`jaxfuse.ops.linear_log_probs`)."""

from jaxfuse.posttrain import losses
from jaxfuse.posttrain.losses import (CPO_LOSS_TYPES, DPO_LOSS_TYPES, F_DIVERGENCES, KTO_LOSS_TYPES,
                                      cpo_loss, dpo_loss, kto_loss, orpo_loss, sequence_logps)

__all__ = ["CPO_LOSS_TYPES", "DPO_LOSS_TYPES", "F_DIVERGENCES", "KTO_LOSS_TYPES", "cpo_loss",
           "dpo_loss", "kto_loss", "losses", "orpo_loss", "sequence_logps"]
