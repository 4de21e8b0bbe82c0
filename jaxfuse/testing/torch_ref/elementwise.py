"""Torch twins of the seed's elementwise chain: unfused (add, then fn) and fused fn(a + b)."""

import torch
import torch.nn.functional as F

ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "squared_relu": lambda x: torch.square(F.relu(x)),
    "identity": lambda x: x,
}


def add_act_unfused(a, b, act="relu"):
  """Two kernels, as the seed's addKernel then funcKernel: c = a + b is materialized."""
  c = a + b
  return ACTIVATIONS[act](c)


class FusedAddAct(torch.autograd.Function):
  """fn(a + b) that saves only its inputs and recomputes a + b in the backward."""

  @staticmethod
  def forward(ctx, a, b, act):
    ctx.save_for_backward(a, b)
    ctx.act = act
    with torch.no_grad():
      return ACTIVATIONS[act](a + b)

  @staticmethod
  def backward(ctx, grad_out):
    a, b = ctx.saved_tensors
    with torch.enable_grad():
      c = (a.detach() + b.detach()).requires_grad_()
      out = ACTIVATIONS[ctx.act](c)
      (grad_c,) = torch.autograd.grad(out, c, grad_out)
    return grad_c, grad_c, None


def add_act_fused(a, b, act="relu"):
  return FusedAddAct.apply(a, b, act)
