"""Torch twin of the fused linear cross-entropy: full logits, then F.cross_entropy.

z-loss and logit soft-capping are written out in torch: the soft-cap is ``cap * tanh(x / cap)``
applied to the logits, and the z-loss adds ``z_loss * logsumexp(logits)**2`` per token, reduced
like the loss (a mean over the tokens that are not ignored for ``"mean"``).
"""

import torch
import torch.nn.functional as F


def linear_cross_entropy(h, weight, labels, bias=None, *, ignore_index=-100, reduction="mean",
                         label_smoothing=0.0, z_loss=0.0, logit_softcap=None):
  logits = h @ weight.T
  if bias is not None:
    logits = logits + bias
  if logit_softcap is not None:
    logits = logit_softcap * torch.tanh(logits / logit_softcap)
  flat = logits.reshape(-1, logits.shape[-1])
  target = labels.reshape(-1)
  loss = F.cross_entropy(flat, target, ignore_index=ignore_index, reduction=reduction,
                         label_smoothing=label_smoothing)
  if z_loss:
    valid = target != ignore_index
    z = z_loss * torch.logsumexp(flat, dim=-1) ** 2 * valid
    if reduction == "none":
      loss = loss + z
    elif reduction == "sum":
      loss = loss + z.sum()
    else:
      loss = loss + z.sum() / valid.sum()
  if reduction == "none":
    loss = loss.reshape(labels.shape)
  return loss


def linear_log_probs(h, weight, tokens, bias=None, *, temperature=1.0, logit_softcap=None,
                     ignore_index=-100, return_entropy=False):
  """TRL's per-token log-probabilities (``selective_log_softmax(logits / temperature, tokens)``)
  and entropies (``entropy_from_logits``) on the full logits, 0 where ``tokens`` is
  ``ignore_index``."""
  logits = h @ weight.T
  if bias is not None:
    logits = logits + bias
  if logit_softcap is not None:
    logits = logit_softcap * torch.tanh(logits / logit_softcap)
  logp_all = torch.log_softmax(logits / temperature, dim=-1)
  valid = tokens != ignore_index
  safe = torch.where(valid, tokens, torch.zeros_like(tokens)).long()
  logp = torch.gather(logp_all, -1, safe.unsqueeze(-1)).squeeze(-1) * valid
  if not return_entropy:
    return logp
  entropy = -(torch.exp(logp_all) * logp_all).sum(-1) * valid
  return logp, entropy
