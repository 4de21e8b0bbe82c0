"""The PyTorch counterpart of residual bytes: what autograd saves for the backward pass.

Built on ``torch.autograd.graph.saved_tensors_hooks``; torch is imported only when used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


def _storage_key(t):
  return (t.untyped_storage().data_ptr(), t.device.type)


def _torch():
  try:
    import torch
  except ImportError as e:
    raise ImportError("jaxfuse.metrics.torch_residual_bytes needs PyTorch, which jaxfuse does "
                      "not install by default: pip install 'jaxfuse[test]'") from e
  return torch


def torch_saved_tensors(fn: Callable[[], object], exclude: Iterable = ()) -> list[tuple]:
  """Runs ``fn()`` and lists the tensors autograd saves: ``(shape, dtype, bytes)`` each.

  Tensors sharing storage with ``exclude`` (the inputs and parameters) are left out, and each
  storage counts once, however many nodes save it; a saved view counts its storage's bytes.

  Raises:
    ImportError: torch is not installed (it comes with the ``test`` extra).
  """
  torch = _torch()

  excluded = {_storage_key(t) for t in exclude if isinstance(t, torch.Tensor)}
  seen: dict = {}

  def pack(t):
    key = _storage_key(t)
    if key not in excluded and key not in seen:
      seen[key] = (tuple(t.shape), str(t.dtype).replace("torch.", ""),
                   t.untyped_storage().nbytes())
    return t

  with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
    fn()
  return list(seen.values())


def torch_residual_bytes(fn: Callable[[], object], exclude: Iterable = ()) -> int:
  """Bytes autograd keeps for the backward of ``fn()``, beyond the tensors in ``exclude``.

  Example:
    >>> import torch
    >>> from jaxfuse.metrics import torch_residual_bytes
    >>> x = torch.ones(1024, requires_grad=True)
    >>> torch_residual_bytes(lambda: torch.sin(x).sum(), exclude=[x])  # sin saves x only
    0
  """
  return sum(nbytes for _, _, nbytes in torch_saved_tensors(fn, exclude))
