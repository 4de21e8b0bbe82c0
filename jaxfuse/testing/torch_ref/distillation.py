"""Torch twins of the distillation losses on two LM heads: TRL's own generalized JSD
(``GKDTrainer.generalized_jsd_loss``, TRL 1.16) on the full logits of both heads, and the
top-k forward KL written out."""

import warnings

import torch


def _logits(h, weight, bias, softcap):
  logits = h @ weight.T
  if bias is not None:
    logits = logits + bias
  if softcap is not None:
    logits = softcap * torch.tanh(logits / softcap)
  return logits


def _trl_labels(mask, labels, ignore_index, shape):
  """TRL's ``labels`` (-100 where a token does not count) from a mask or labels."""
  if mask is None and labels is None:
    return None
  counts = mask if mask is not None else labels != ignore_index
  return torch.where(counts.reshape(shape), 0, -100)


def linear_distillation_loss(h_student, w_student, h_teacher, w_teacher, mask=None,
                             student_bias=None, teacher_bias=None, *, labels=None,
                             ignore_index=-100, beta=0.5, temperature=1.0,
                             student_logit_softcap=None, teacher_logit_softcap=None,
                             reduction="batchmean"):
  """TRL's ``generalized_jsd_loss`` of the two heads' ``[tokens, V]`` logits (the teacher's
  under ``no_grad``); ``"none"`` is TRL's per-word terms summed over the vocabulary, per token,
  0 where a token does not count."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")   # trl.experimental warns on import
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

  lead = h_student.shape[:-1]
  student = _logits(h_student, w_student, student_bias, student_logit_softcap)
  with torch.no_grad():
    teacher = _logits(h_teacher, w_teacher, teacher_bias, teacher_logit_softcap)
  vocab = student.shape[-1]
  n = student.numel() // vocab
  trl_labels = _trl_labels(mask, labels, ignore_index, (n,))
  out = GKDTrainer.generalized_jsd_loss(student.reshape(n, vocab), teacher.reshape(n, vocab),
                                        labels=trl_labels, beta=beta, temperature=temperature,
                                        reduction=reduction)
  if reduction != "none":
    return out
  per_token = out.sum(-1)
  if trl_labels is None:
    return per_token.reshape(lead)
  full = torch.zeros(n, dtype=per_token.dtype)
  full = full.masked_scatter(trl_labels != -100, per_token)
  return full.reshape(lead)


def linear_topk_distillation_loss(h_student, w_student, teacher_topk_ids, teacher_topk_logps,
                                  mask=None, student_bias=None, *, temperature=1.0,
                                  student_logit_softcap=None, reduction="batchmean"):
  """The forward KL from the teacher's top-k log-probabilities renormalised over the k to the
  student's full-softmax log-probabilities at those ids, on the student's full logits."""
  logits = _logits(h_student, w_student, student_bias, student_logit_softcap) / temperature
  student = torch.gather(torch.log_softmax(logits, -1), -1, teacher_topk_ids.long())
  log_q = torch.log_softmax(teacher_topk_logps.detach() / temperature, -1)
  per_token = (log_q.exp() * (log_q - student)).sum(-1)
  counts = torch.ones_like(per_token, dtype=torch.bool) if mask is None else mask
  per_token = torch.where(counts, per_token, torch.zeros_like(per_token))
  if reduction == "none":
    return per_token
  total = per_token.sum()
  if reduction == "sum":
    return total
  count = counts.sum()
  if reduction == "batchmean":
    return total / count.clamp_min(1)
  return total / (count * teacher_topk_ids.shape[-1])
