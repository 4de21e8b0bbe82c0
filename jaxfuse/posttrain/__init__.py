"""Post-training on per-token log-probabilities, computed from the LM head without its logits
(:func:`jaxfuse.ops.linear_log_probs`):

- :mod:`.losses`: DPO (every TRL loss type), CPO/SimPO/AlphaPO, ORPO and KTO as pure functions
  of per-token log-probabilities and masks, as TRL 1.16 computes them;
- :mod:`.data`: preference records (and KTO's) as rows of one pair each;
- :mod:`.objectives`: what ``python -m jaxfuse.train --objective`` minimises, as objects the
  training loop calls (SFT, DPO, CPO, ORPO, KTO, distillation);
- :mod:`.rollouts`: GRPO's rollouts, several sampled completions of each prompt with the KV
  cache (prompts of different lengths in one batch) and their log-probabilities;
- :mod:`.rewards`: GRPO's reward functions of completions, their weighted sum and the group
  advantages, as TRL 1.16 computes them.
"""

# One job a module; data flows down this list (a module imports only those below it):
#   objectives  loss(model, batch) -> (loss, metrics) of each --objective
#   data        preference and KTO records as rows of a pair each
#   losses      the losses of per-token log-probabilities
#   rollouts    sampled completions with the KV cache (imports the models only)
#   rewards     rewards of completions and their group advantages (imports none of the above)

from jaxfuse.posttrain import data, losses, objectives, rewards, rollouts
from jaxfuse.posttrain.losses import (CPO_LOSS_TYPES, DPO_LOSS_TYPES, F_DIVERGENCES,
                                      GRPO_LOSS_TYPES, KTO_LOSS_TYPES, cpo_loss, dpo_loss,
                                      grpo_loss, kto_loss, orpo_loss, sequence_logps)
from jaxfuse.posttrain.rollouts import Rollouts, rollout, truncate_at_stop_strings
from jaxfuse.posttrain.rewards import (RewardError, exact_match, format_reward, group_advantages,
                                       length_penalty, load_reward, score)

__all__ = ["CPO_LOSS_TYPES", "DPO_LOSS_TYPES", "F_DIVERGENCES", "GRPO_LOSS_TYPES",
           "KTO_LOSS_TYPES", "cpo_loss", "data", "dpo_loss", "exact_match", "format_reward",
           "group_advantages", "grpo_loss", "kto_loss", "length_penalty", "load_reward", "losses",
           "objectives", "orpo_loss", "RewardError", "rewards", "rollout", "Rollouts", "rollouts",
           "score", "sequence_logps", "truncate_at_stop_strings"]
