"""Moving parameters between PyTorch state dicts and jaxfuse modules.

Each module that has a PyTorch twin declares ``TORCH_PARAMS``: its parameter paths mapped to
``(state_dict key, transposed)``. Linear weights in torch layout (``[out, in]``) load as they
are; flax ``Linear``/``Dense`` kernels (``[in, out]``) are transposed on the way in and out.
torch is not imported here: a state dict may hold torch tensors or numpy arrays.

Example:
  >>> import numpy as np
  >>> from flax import nnx
  >>> from jaxfuse import interop
  >>> from jaxfuse.nnx import SimpleNN
  >>> model = SimpleNN(3, 5, 2, rngs=nnx.Rngs(0))
  >>> state = interop.torch_state_dict(model)          # numpy arrays, torch names and layouts
  >>> sorted(state), state["fc2.weight"].shape
  (['fc1_bias', 'fc1_weight', 'fc2.bias', 'fc2.weight'], (2, 5))
  >>> interop.load_torch_state_dict(model, state)      # and back
"""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np


def _mapping(module) -> dict:
  mapping = getattr(module, "TORCH_PARAMS", None)
  if mapping is None:
    raise TypeError(f"{type(module).__name__} declares no TORCH_PARAMS mapping")
  return mapping


def to_numpy(value) -> np.ndarray:
  """A numpy array from a torch tensor (any device, bfloat16 through float32) or an array."""
  if hasattr(value, "detach"):
    value = value.detach().cpu()
    if str(value.dtype) == "torch.bfloat16":
      value = value.float()
    return value.numpy()
  return np.asarray(value)


def _check_keys(state_dict: Mapping, mapping: dict, strict: bool):
  wanted = {key for key, _ in mapping.values()}
  missing = sorted(wanted - set(state_dict))
  unexpected = sorted(set(state_dict) - wanted)
  if missing or (strict and unexpected):
    raise ValueError(f"state_dict: missing keys {missing}, unexpected keys {unexpected}")


def _torch_value(state_dict, key, transposed, expected_shape, dtype):
  value = to_numpy(state_dict[key])
  value = value.T if transposed else value
  if tuple(value.shape) != tuple(expected_shape):
    raise ValueError(f"state_dict[{key!r}]: expected shape "
                     f"{tuple(expected_shape[::-1]) if transposed else tuple(expected_shape)}, "
                     f"got {tuple(to_numpy(state_dict[key]).shape)}")
  return jnp.asarray(value, dtype=dtype)


# NNX ---------------------------------------------------------------------------------------------


def _param(module, path):
  node = module
  for name in path:
    node = getattr(node, name)
  return node


def load_torch_state_dict(module, state_dict: Mapping, *, strict: bool = True) -> None:
  """Copies a torch ``state_dict`` into an NNX module's parameters, in place.

  Raises:
    ValueError: a key is missing (or, with ``strict``, unexpected), or a shape does not match.
  """
  mapping = _mapping(module)
  _check_keys(state_dict, mapping, strict)
  for path, (key, transposed) in mapping.items():
    param = _param(module, path)
    param[...] = _torch_value(state_dict, key, transposed, param[...].shape, param[...].dtype)


def torch_state_dict(module, *, as_torch: bool = False) -> dict:
  """An NNX module's parameters under torch names and layouts (numpy, or torch tensors)."""
  out = {}
  for path, (key, transposed) in _mapping(module).items():
    value = np.asarray(_param(module, path)[...])
    out[key] = value.T.copy() if transposed else value
  return _maybe_torch(out, as_torch)


# Linen -------------------------------------------------------------------------------------------


def linen_params_from_torch(module, variables: Mapping, state_dict: Mapping, *,
                            strict: bool = True) -> dict:
  """Linen ``variables`` (as from ``module.init``) with their params replaced from torch."""
  mapping = _mapping(module)
  _check_keys(state_dict, mapping, strict)
  params = _unfreeze(variables["params"])
  for path, (key, transposed) in mapping.items():
    *parents, leaf = path
    node = params
    for name in parents:
      node = node[name]
    node[leaf] = _torch_value(state_dict, key, transposed, node[leaf].shape, node[leaf].dtype)
  return {**variables, "params": params}


def linen_params_to_torch(module, variables: Mapping, *, as_torch: bool = False) -> dict:
  """Linen params under torch names and layouts."""
  out = {}
  for path, (key, transposed) in _mapping(module).items():
    node = variables["params"]
    for name in path:
      node = node[name]
    value = np.asarray(node)
    out[key] = value.T.copy() if transposed else value
  return _maybe_torch(out, as_torch)


def _unfreeze(tree):
  if isinstance(tree, Mapping):
    return {k: _unfreeze(v) for k, v in tree.items()}
  return tree


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
