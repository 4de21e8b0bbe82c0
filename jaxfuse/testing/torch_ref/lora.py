"""Torch twin of LoRA (:func:`jaxfuse.ops.lora_dense`), as peft's ``lora.Linear`` computes it."""

import torch.nn.functional as F


def lora_dense(x, kernel, lora_a, lora_b, bias=None, *, scale):
  """``base(x) + lora_B(lora_A(x)) * scaling`` (peft's forward without dropout) in Flax's
  layouts: ``kernel`` ``[in, out]``, ``lora_a`` ``[in, rank]``, ``lora_b`` ``[rank, out]``."""
  return F.linear(x, kernel.T, bias) + (x @ lora_a @ lora_b) * scale
