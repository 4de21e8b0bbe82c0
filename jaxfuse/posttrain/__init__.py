"""Post-training on per-token log-probabilities: preference losses (:mod:`.losses`), computed
from the LM head without its logits (:func:`jaxfuse.ops.linear_log_probs`)."""

from jaxfuse.posttrain import losses
from jaxfuse.posttrain.losses import DPO_LOSS_TYPES, F_DIVERGENCES, dpo_loss, sequence_logps

__all__ = ["DPO_LOSS_TYPES", "F_DIVERGENCES", "dpo_loss", "losses", "sequence_logps"]
