"""Torch twin of the grouped matmul of Mixture-of-Experts layers: a loop over the experts."""

import torch


def grouped_matmul(lhs, rhs, group_sizes):
  """``lhs`` ``[M, K]`` (rows sorted by group) times ``rhs[g]`` ``[K, N]`` for each group's rows,
  one expert at a time; rows past ``sum(group_sizes)`` give zeros."""
  sizes = [int(s) for s in torch.as_tensor(group_sizes).tolist()]
  pieces, start = [], 0
  for expert, size in enumerate(sizes):
    if size:
      pieces.append(lhs[start:start + size] @ rhs[expert])
    start += size
  # The rows past the groups: zeros, as an empty product (which keeps the graph connected
  # when no row is in a group).
  pieces.append(lhs[start:, :0] @ rhs[0, :0])
  return torch.cat(pieces, dim=0)
