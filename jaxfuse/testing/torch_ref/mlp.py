"""Torch twins of the activation family: softmax, bias + activation, gated units and MLP blocks."""

import torch.nn.functional as F
from torch import nn

from jaxfuse.testing.torch_ref.elementwise import ACTIVATIONS


def softmax(x, axis=-1, scale=1.0, mask=None):
  """``F.softmax(scale * x)``, with ``mask`` (True = keep) as a ``-inf`` fill. A row with no kept
  entry is NaN in torch; jaxfuse gives zeros, so callers compare such rows separately."""
  z = x * scale if scale != 1.0 else x
  if mask is not None:
    z = z.masked_fill(~mask, float("-inf"))
  return F.softmax(z, dim=axis)


def bias_act(x, bias, act):
  return ACTIVATIONS[act](x + bias)


def glu(a, b, act):
  return ACTIVATIONS[act](a) * b


def glu_packed(x, act):
  a, b = x.chunk(2, dim=-1)
  return glu(a, b, act)


class LlamaMLP(nn.Module):
  """LLaMA's MLP as in Hugging Face transformers: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

  def __init__(self, hidden_size, intermediate_size, act="silu", bias=False, dtype=None):
    super().__init__()
    self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, dtype=dtype)
    self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, dtype=dtype)
    self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias, dtype=dtype)
    self.act_fn = ACTIVATIONS[act]

  def forward(self, x):
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class MLP(nn.Module):
  """The transformer MLP: ``fc2(act(fc1(x)))``."""

  def __init__(self, in_features, hidden_features, act="gelu", bias=True, dtype=None):
    super().__init__()
    self.fc1 = nn.Linear(in_features, hidden_features, dtype=dtype)
    self.fc2 = nn.Linear(hidden_features, in_features, bias=bias, dtype=dtype)
    self.act_fn = ACTIVATIONS[act]

  def forward(self, x):
    return self.fc2(self.act_fn(self.fc1(x)))
