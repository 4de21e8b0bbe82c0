"""Parameter maps between PyTorch state dicts and jaxfuse modules (NNX and Linen).

A module's ``TORCH_PARAMS`` maps each parameter path to an entry ``(key, transposed)`` or
``(key, transposed, flatten)`` (:class:`TorchParam`). The torch tensor of a parameter is the
parameter with the axes ``flatten = (start_dim, end_dim)`` merged into one (``torch.flatten``'s
convention, both ends included), then transposed if ``transposed``. The maps themselves are
built in :mod:`jaxfuse.blocks.torch_names`; this module moves the values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class TorchParam(NamedTuple):
  """Where a parameter lives in a torch state dict, and its layout there.

  Attributes:
    key: the state-dict key, e.g. ``"q_proj.weight"``.
    transposed: the torch tensor is the (flattened) parameter transposed: a flax kernel
      ``[in, out]`` is a torch ``nn.Linear`` weight ``[out, in]``; of a stack of kernels
      ``[E, in, out]`` (a MoE layer's experts), each is transposed: ``[E, out, in]``.
    flatten: ``(start_dim, end_dim)``: these axes of the parameter (both included) are one axis
      of the torch tensor, e.g. ``(1, 2)`` for a ``LinearGeneral`` kernel ``[in, heads, head_dim]``
      whose torch weight is ``[heads * head_dim, in]``. ``None``: no axes are merged.

  Example:
    >>> import numpy as np
    >>> from jaxfuse.interop import TorchParam
    >>> entry = TorchParam("q_proj.weight", True, (1, 2))
    >>> entry.torch_shape((16, 4, 8))   # a [in, heads, head_dim] kernel
    (32, 16)
    >>> entry.to_torch(np.zeros((16, 4, 8))).shape
    (32, 16)
  """

  key: str
  transposed: bool = False
  flatten: tuple[int, int] | None = None

  def _flattened(self, shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` with the ``flatten`` axes merged (before any transpose)."""
    shape = tuple(shape)
    if self.flatten is not None:
      start, end = (axis + len(shape) if axis < 0 else axis for axis in self.flatten)
      if not 0 <= start <= end < len(shape):
        raise ValueError(f"{self.key!r}: cannot flatten axes {self.flatten} of a parameter of "
                         f"shape {shape}")
      shape = shape[:start] + (math.prod(shape[start:end + 1]),) + shape[end + 1:]
    if self.transposed and len(shape) not in (2, 3):
      raise ValueError(f"{self.key!r}: a transposed entry needs a 2-D tensor or a stack of "
                       f"them (after flattening), got shape {shape}")
    return shape

  def torch_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The torch tensor's shape for a parameter of ``shape``."""
    flat = self._flattened(shape)
    return flat[:-2] + flat[-2:][::-1] if self.transposed else flat

  def to_torch(self, value) -> np.ndarray:
    """The torch layout (a contiguous numpy array) of a parameter's value."""
    value = np.asarray(value)
    value = value.reshape(self._flattened(value.shape))
    return np.ascontiguousarray(np.swapaxes(value, -1, -2) if self.transposed else value)

  def from_torch(self, value, shape: tuple[int, ...]) -> np.ndarray:
    """The parameter of ``shape`` from its torch tensor; raises if the tensor's shape is not
    :meth:`torch_shape` (naming the key)."""
    value = to_numpy(value)
    expected = self.torch_shape(shape)
    if tuple(value.shape) != expected:
      raise ValueError(f"state_dict[{self.key!r}]: expected shape {expected}, got "
                       f"{tuple(value.shape)}")
    return (np.swapaxes(value, -1, -2) if self.transposed else value).reshape(shape)


def entries(mapping: Mapping) -> dict[tuple, TorchParam]:
  """A ``TORCH_PARAMS`` map with every entry as a :class:`TorchParam`."""
  out = {}
  for path, entry in mapping.items():
    path = (path,) if isinstance(path, str) else tuple(path)
    out[path] = entry if isinstance(entry, TorchParam) else TorchParam(*entry)
  return out


def torch_params(module) -> dict[tuple, TorchParam]:
  """The parameter map of a jaxfuse module: its ``TORCH_PARAMS`` (for a
  :class:`jaxfuse.models.Decoder`, the Hugging Face map of its config).

  Raises:
    TypeError: the module declares no map.
  """
  mapping = getattr(module, "TORCH_PARAMS", None)
  if mapping is None:
    from jaxfuse.interop import _hf  # the models layer, only when asked for

    mapping = _hf.decoder_params_or_none(module)
  if mapping is None:
    raise TypeError(f"{type(module).__name__} declares no TORCH_PARAMS mapping")
  return entries(mapping)


def to_numpy(value) -> np.ndarray:
  """A numpy array from a torch tensor (any device, bfloat16 through float32) or an array."""
  if hasattr(value, "detach"):
    value = value.detach().cpu()
    if str(value.dtype) == "torch.bfloat16":
      value = value.float()
    return value.numpy()
  return np.asarray(value)


def check_keys(state_dict: Mapping, mapping: Mapping[tuple, TorchParam], strict: bool) -> None:
  """Raises ``ValueError`` naming the missing keys (and, with ``strict``, the unexpected ones)."""
  wanted = {entry.key for entry in mapping.values()}
  missing = sorted(wanted - set(state_dict))
  unexpected = sorted(set(state_dict) - wanted)
  if missing or (strict and unexpected):
    raise ValueError(f"state_dict: missing keys {missing}, unexpected keys {unexpected}")


def _maybe_torch(arrays: dict, as_torch: bool) -> dict:
  if not as_torch:
    return arrays
  import torch

  out = {}
  for key, value in arrays.items():
    if value.dtype == jnp.bfloat16:  # numpy has no bfloat16 that torch reads
      out[key] = torch.from_numpy(np.array(value, dtype=np.float32)).to(torch.bfloat16)
    else:
      out[key] = torch.from_numpy(np.array(value))
  return out


# NNX ---------------------------------------------------------------------------------------------


def _param(module, path):
  node = module
  for name in path:
    node = node[name] if isinstance(name, int) else getattr(node, name, None)
    if node is None:
      raise ValueError(f"{type(module).__name__} has no parameter {'.'.join(map(str, path))}")
  return node


def _set(param, value: np.ndarray) -> None:
  """Replaces a variable's value, keeping its dtype (and sharding, if it has one)."""
  old = param.get_value()
  new = jnp.asarray(value, dtype=old.dtype)
  sharding = getattr(old, "sharding", None)
  if isinstance(old, jax.Array) and sharding is not None:
    new = jax.device_put(new, sharding)
  param.set_value(new)


def load_torch_state_dict(module, state_dict: Mapping, *, strict: bool = True,
                          mapping: Mapping | None = None) -> None:
  """Copies a torch ``state_dict`` into an NNX module's parameters, in place.

  Args:
    module: an NNX module with a ``TORCH_PARAMS`` map.
    state_dict: torch tensors or arrays under torch names.
    strict: refuse keys the map does not name.
    mapping: the map to use instead of the module's.

  Raises:
    ValueError: a key is missing (or, with ``strict``, unexpected), or a shape does not match;
      the message names the key.
  """
  mapping = torch_params(module) if mapping is None else entries(mapping)
  check_keys(state_dict, mapping, strict)
  for path, entry in mapping.items():
    param = _param(module, path)
    _set(param, entry.from_torch(state_dict[entry.key], param.get_value().shape))


def torch_state_dict(module, *, as_torch: bool = False, mapping: Mapping | None = None) -> dict:
  """An NNX module's parameters under torch names and layouts (numpy, or torch tensors)."""
  mapping = torch_params(module) if mapping is None else entries(mapping)
  out = {entry.key: entry.to_torch(_param(module, path).get_value())
         for path, entry in mapping.items()}
  return _maybe_torch(out, as_torch)


# Linen -------------------------------------------------------------------------------------------


def _linen_leaf(params, path):
  node = params
  for name in path:
    if not isinstance(node, Mapping) or name not in node:
      raise ValueError(f"the variables have no parameter {'/'.join(map(str, path))}")
    node = node[name]
  return node


def _unfreeze(tree):
  if isinstance(tree, Mapping):
    return {k: _unfreeze(v) for k, v in tree.items()}
  return tree


def linen_params_from_torch(module, variables: Mapping, state_dict: Mapping, *,
                            strict: bool = True, mapping: Mapping | None = None) -> dict:
  """Linen ``variables`` (as from ``module.init``) with their params replaced from torch.

  Arguments and errors as :func:`load_torch_state_dict`.
  """
  mapping = torch_params(module) if mapping is None else entries(mapping)
  check_keys(state_dict, mapping, strict)
  params = _unfreeze(variables.get("params", {}))
  for path, entry in mapping.items():
    *parents, leaf = path
    _linen_leaf(params, path)
    node = params
    for name in parents:
      node = node[name]
    value = entry.from_torch(state_dict[entry.key], np.shape(node[leaf]))
    node[leaf] = jnp.asarray(value, dtype=node[leaf].dtype)
  return {**variables, "params": params}


def linen_params_to_torch(module, variables: Mapping, *, as_torch: bool = False,
                          mapping: Mapping | None = None) -> dict:
  """Linen params under torch names and layouts."""
  mapping = torch_params(module) if mapping is None else entries(mapping)
  out = {entry.key: entry.to_torch(_linen_leaf(variables.get("params", {}), path))
         for path, entry in mapping.items()}
  return _maybe_torch(out, as_torch)
