"""Post-training on per-token log-probabilities, computed from the LM head without its logits
(:func:`jaxfuse.ops.linear_log_probs`):

- :mod:`.losses`: DPO (every TRL loss type), CPO/SimPO/AlphaPO, ORPO and KTO as pure functions
  of per-token log-probabilities and masks, as TRL 1.16 computes them;
- :mod:`.data`: preference records (and KTO's) as rows of one pair each;
- :mod:`.objectives`: what ``python -m jaxfuse.train --objective`` minimises, as objects the
  training loop calls (SFT, DPO, CPO, ORPO, KTO, distillation).
"""

# One job a module; data flows down this list (a module imports only those below it):
#   objectives  loss(model, batch) -> (loss, metrics) of each --objective
#   data        preference and KTO records as rows of a pair each
#   losses      the losses of per-token log-probabilities

from jaxfuse.posttrain import data, losses, objectives
from jaxfuse.posttrain.losses import (CPO_LOSS_TYPES, DPO_LOSS_TYPES, F_DIVERGENCES, KTO_LOSS_TYPES,
                                      cpo_loss, dpo_loss, kto_loss, orpo_loss, sequence_logps)

__all__ = ["CPO_LOSS_TYPES", "DPO_LOSS_TYPES", "F_DIVERGENCES", "KTO_LOSS_TYPES", "cpo_loss",
           "data", "dpo_loss", "kto_loss", "losses", "objectives", "orpo_loss", "sequence_logps"]
