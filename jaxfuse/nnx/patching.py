"""``fuse(model)``: put jaxfuse's fused ops into an existing Flax NNX model, in place.

Liger-Kernel patches a Hugging Face model with one call; this is the same for Flax. It walks
the model's graph and

- replaces every ``nnx.RMSNorm`` and ``nnx.LayerNorm`` by its jaxfuse twin, which takes over the
  same parameter variables (so an optimizer built before keeps working) and computes the same
  function with a fused kernel whose backward keeps only the input and per-row statistics;
- sets ``attention_fn`` of every ``nnx.MultiHeadAttention`` to
  :func:`jaxfuse.ops.dot_product_attention`, whose backward recomputes the scores instead of
  keeping the ``[q_len, kv_len]`` probabilities.

Modules with options the fused ops do not cover (normalization over other axes, attention
dropout, sowing the attention weights) are left as they are, and the report says why.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> import jaxfuse.nnx
  >>> class Block(nnx.Module):
  ...   def __init__(self, rngs):
  ...     self.norm = nnx.RMSNorm(16, rngs=rngs)
  ...     self.attn = nnx.MultiHeadAttention(2, 16, decode=False, rngs=rngs)
  ...   def __call__(self, x):
  ...     return self.attn(self.norm(x), is_causal=True)
  >>> block = Block(nnx.Rngs(0))
  >>> report = jaxfuse.nnx.fuse(block)
  >>> [(r.path, r.action) for r in report]
  [('attn', 'attention_fn'), ('norm', 'replaced')]
  >>> block(jnp.ones((1, 5, 16))).shape
  (1, 5, 16)
"""

from __future__ import annotations

import dataclasses

from flax import nnx

from jaxfuse.nnx import normalization as jnorm
from jaxfuse.ops import dot_product_attention


@dataclasses.dataclass(frozen=True)
class Change:
  """One module ``fuse`` looked at: its path, what it did and why."""

  path: str
  module: str
  action: str   # "replaced", "attention_fn" or "kept"
  detail: str = ""


def _path_name(path) -> str:
  return ".".join(str(p) for p in path) or "<root>"


def _norm_twin(module):
  """The jaxfuse twin of an ``nnx.RMSNorm`` / ``nnx.LayerNorm`` on the same variables, or the
  reason there is none."""
  for name in ("reduction_axes", "feature_axes"):
    axes = getattr(module, name)
    listed = axes if isinstance(axes, (tuple, list)) else (axes,)
    if len(listed) != 1 or listed[0] != -1:
      return None, f"{name}={axes!r}: the fused ops normalize over the last axis only"
  if module.axis_name is not None:
    return None, f"axis_name={module.axis_name!r}: statistics across devices"
  common = dict(epsilon=module.epsilon, dtype=module.dtype, param_dtype=module.param_dtype,
                use_scale=module.use_scale, rngs=nnx.Rngs(0))
  if isinstance(module, nnx.LayerNorm):
    twin = jnorm.LayerNorm(module.num_features, use_bias=module.use_bias, **common)
    twin.bias = module.bias
  else:
    twin = jnorm.RMSNorm(module.num_features, **common)
  twin.scale = module.scale
  return twin, ""


def _set(parent, key, value):
  if isinstance(key, str):
    setattr(parent, key, value)
  else:
    parent[key] = value


def fuse(model: nnx.Module) -> list[Change]:
  """Puts jaxfuse's ops into ``model`` in place; returns what it changed (see the module doc).

  Args:
    model: any ``flax.nnx`` module.

  Returns:
    One :class:`Change` per normalization or attention module found, sorted by path.
  """
  found = [(tuple(path), node) for path, node in nnx.iter_graph(model)
           if isinstance(node, (nnx.RMSNorm, nnx.LayerNorm, nnx.MultiHeadAttention))]
  by_path = dict(nnx.iter_graph(model))
  report = []
  for path, node in found:
    name = _path_name(path)
    kind = type(node).__name__
    if isinstance(node, nnx.MultiHeadAttention):
      if node.dropout_rate:
        report.append(Change(name, kind, "kept", f"dropout_rate={node.dropout_rate}: attention "
                             f"dropout needs the attention weights"))
        continue
      node.attention_fn = dot_product_attention
      report.append(Change(name, kind, "attention_fn", "jaxfuse.ops.dot_product_attention"))
      continue
    if not path:
      report.append(Change(name, kind, "kept", "the model itself is the norm"))
      continue
    twin, why = _norm_twin(node)
    if twin is None:
      report.append(Change(name, kind, "kept", why))
      continue
    _set(by_path[path[:-1]], path[-1], twin)
    report.append(Change(name, kind, "replaced", f"jaxfuse.nnx.{kind}"))
  return sorted(report, key=lambda c: c.path)
