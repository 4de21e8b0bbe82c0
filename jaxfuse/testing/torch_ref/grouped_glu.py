"""Torch twin of the grouped gated linear unit of Mixture-of-Experts layers: a loop over the
experts."""

import torch

from jaxfuse.testing.torch_ref.elementwise import ACTIVATIONS
from jaxfuse.testing.torch_ref.grouped_matmul import grouped_matmul


def grouped_glu(lhs, gate, up, group_sizes, act="silu"):
  """``act(lhs_e @ gate[e]) * (lhs_e @ up[e])`` for each expert's rows of ``lhs`` ``[M, K]``
  (sorted by expert), one expert at a time; rows past ``sum(group_sizes)`` give zeros."""
  sizes = [int(s) for s in torch.as_tensor(group_sizes).tolist()]
  fn = ACTIVATIONS[act]
  pieces, start = [], 0
  for expert, size in enumerate(sizes):
    if size:
      rows = lhs[start:start + size]
      pieces.append(fn(rows @ gate[expert]) * (rows @ up[expert]))
    start += size
  # The rows past the groups: zeros, as an empty product (which keeps the graph connected
  # when no row is in a group).
  pieces.append(lhs[start:, :0] @ gate[0, :0] + lhs[start:, :0] @ up[0, :0])
  return torch.cat(pieces, dim=0)


def grouped_mlp(lhs, gate, up, down, group_sizes, act="silu"):
  """The experts' gated MLP: :func:`grouped_glu`, then each expert's rows times ``down[e]``
  ``[F, N]``, one expert at a time; rows past ``sum(group_sizes)`` give zeros."""
  return grouped_matmul(grouped_glu(lhs, gate, up, group_sizes, act), down, group_sizes)
