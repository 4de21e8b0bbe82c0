"""Torch twins of the seed's recomputation layer and SimpleNN, in its three memory layouts."""

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint


class RecomputationLayer(torch.autograd.Function):
  """input @ weight.T + bias; saves only (input, weight, bias) and recomputes in backward."""

  @staticmethod
  def forward(ctx, input, weight, bias):
    ctx.save_for_backward(input, weight, bias)
    return input.mm(weight.t()) + bias

  @staticmethod
  def backward(ctx, grad_output):
    input, weight, bias = ctx.saved_tensors
    with torch.enable_grad():
      input = input.detach().requires_grad_()
      weight = weight.detach().requires_grad_()
      bias = bias.detach().requires_grad_()
      recomputed = input.mm(weight.t()) + bias
      grads = torch.autograd.grad(recomputed, (input, weight, bias), grad_output)
    return grads


class SimpleNN(nn.Module):
  """The seed's model; ``recompute`` picks None (plain), "fc1" (the seed) or "block"
  (torch.utils.checkpoint around fc1, relu and fc2)."""

  def __init__(self, input_size, hidden_size, output_size, recompute="fc1"):
    super().__init__()
    self.recompute = recompute
    self.fc1_weight = nn.Parameter(torch.randn(hidden_size, input_size))
    self.fc1_bias = nn.Parameter(torch.randn(hidden_size))
    self.fc2 = nn.Linear(hidden_size, output_size)

  def _block(self, x):
    return self.fc2(torch.relu(F.linear(x, self.fc1_weight, self.fc1_bias)))

  def forward(self, x):
    if self.recompute == "fc1":
      x = RecomputationLayer.apply(x, self.fc1_weight, self.fc1_bias)
      return self.fc2(torch.relu(x))
    if self.recompute == "block":
      return torch.utils.checkpoint.checkpoint(self._block, x, use_reentrant=False)
    return self._block(x)
