"""Where each block's parameters live in a PyTorch state dict: the ``TORCH_PARAMS`` maps.

A map takes a parameter's path to ``(key, transposed)`` or ``(key, transposed, flatten)``:
the torch tensor is the parameter with the axes ``flatten = (start_dim, end_dim)`` merged, then
transposed if ``transposed`` (see :class:`jaxfuse.interop.TorchParam`, which reads these
entries). The NNX and Linen modules build their maps here, so that one parameter has one
torch name whichever front-end holds it; :func:`jaxfuse.interop.hf_param_map` builds a whole
decoder's from the same pieces.

Example:
  >>> from jaxfuse.blocks import torch_names
  >>> params = torch_names.linear_torch_params({"up_proj": True})
  >>> params[("up_proj", "kernel")], params[("up_proj", "bias")]   # a kernel is transposed
  (('up_proj.weight', True), ('up_proj.bias', False))
  >>> torch_names.prefixed(torch_names.norm_torch_params(True, False), ("norm",), "model.norm.")
  {('norm', 'scale'): ('model.norm.weight', False)}
"""

from __future__ import annotations

from collections.abc import Mapping


def same_layout(names: Mapping[str, str | None]) -> dict:
  """Parameters stored as torch stores them: ``{param: torch_key}`` (a ``None`` key: the module
  has no such parameter) to untransposed entries."""
  return {(param,): (key, False) for param, key in names.items() if key is not None}


def linear_torch_params(projections: Mapping[str, bool]) -> dict:
  """flax ``Linear`` / ``Dense`` projections ``{name: has_bias}`` as torch ``nn.Linear``
  submodules of those names: ``name.weight`` (the ``[in, out]`` kernel, transposed) and
  ``name.bias``."""
  params = {}
  for name, has_bias in projections.items():
    params[(name, "kernel")] = (f"{name}.weight", True)
    if has_bias:
      params[(name, "bias")] = (f"{name}.bias", False)
  return params


def attention_torch_params(use_bias: bool, normalize_qk: bool) -> dict:
  """An attention module's parameters as separate ``q_proj``, ``k_proj``, ``v_proj`` and
  ``o_proj`` ``nn.Linear`` weights ``[out, in]`` (Hugging Face's names).

  The ``LinearGeneral`` kernels ``[in, heads, head_dim]`` are flattened over their last two axes
  and transposed; ``out``'s ``[heads, head_dim, out]`` over its first two; the q/k/v biases
  ``[heads, head_dim]`` are flattened. ``query_ln`` and ``key_ln`` (``normalize_qk``) are
  ``q_norm.weight`` and ``k_norm.weight``: a ``torch.nn.LayerNorm(head_dim, bias=False)``
  applied per head.
  """
  params = {}
  for name, key in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
    params[(name, "kernel")] = (f"{key}.weight", True, (1, 2))
    if use_bias:
      params[(name, "bias")] = (f"{key}.bias", False, (0, 1))
  params[("out", "kernel")] = ("o_proj.weight", True, (0, 1))
  if use_bias:
    params[("out", "bias")] = ("o_proj.bias", False)
  if normalize_qk:
    params[("query_ln", "scale")] = ("q_norm.weight", False)
    params[("key_ln", "scale")] = ("k_norm.weight", False)
  return params


def norm_torch_params(use_scale: bool, use_bias: bool) -> dict:
  """A norm's ``scale`` and ``bias`` as ``torch.nn.LayerNorm`` / ``RMSNorm`` name them:
  ``weight`` and ``bias``."""
  return same_layout({"scale": "weight" if use_scale else None,
                      "bias": "bias" if use_bias else None})


def lm_head_torch_params(has_kernel: bool, use_bias: bool) -> dict:
  """An LM head's ``kernel`` (``[V, D]``, torch ``nn.Linear(D, V)``'s layout; none when tied to
  the embedding, which owns it) and ``bias``."""
  return same_layout({"kernel": "weight" if has_kernel else None,
                      "bias": "bias" if use_bias else None})


def recompute_linear_torch_params(use_bias: bool) -> dict:
  """:class:`jaxfuse.nnx.RecomputeLinear`'s ``weight`` and ``bias``: torch's names and layout."""
  return same_layout({"weight": "weight", "bias": "bias" if use_bias else None})


# The seed's model: fc1 is a RecomputeLinear (torch's own parameters ``fc1_weight``,
# ``fc1_bias``), fc2 an ordinary ``nn.Linear``.
SIMPLE_NN_TORCH_PARAMS = {
    ("fc1", "weight"): ("fc1_weight", False),
    ("fc1", "bias"): ("fc1_bias", False),
    ("fc2", "kernel"): ("fc2.weight", True),
    ("fc2", "bias"): ("fc2.bias", False),
}


def prefixed(mapping: Mapping, path: tuple, key_prefix: str) -> dict:
  """``mapping`` of a submodule at ``path`` whose torch keys start with ``key_prefix``."""
  return {tuple(path) + tuple(p): (key_prefix + entry[0], *entry[1:])
          for p, entry in mapping.items()}
