"""A decoder's blocks unrolled (``layers[i]``) or stacked on a leading layer axis (what
``scan_layers=True`` holds): the parameters converted between the two layouts.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from flax import nnx
  >>> from jaxfuse.models import Decoder, DecoderConfig
  >>> cfg = DecoderConfig(vocab_size=32, d_model=16, num_layers=3, num_heads=2, mlp_dim=32)
  >>> plain = Decoder(cfg, rngs=nnx.Rngs(0))
  >>> scanned = plain.with_layers(scan_layers=True)
  >>> scanned.layers.mlp.up_proj.kernel.shape      # [layers, d_model, mlp_dim]
  (3, 16, 32)
  >>> tokens = jnp.zeros((1, 5), jnp.int32)
  >>> bool(jnp.allclose(plain.logits(tokens), scanned.logits(tokens), atol=1e-6))
  True
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def stack_layers(state: nnx.State, num_layers: int) -> dict:
  """The state of an unrolled :class:`jaxfuse.models.Decoder` (``nnx.state(model)``) as a pure
  dict with its blocks' parameters stacked, as ``Decoder(..., scan_layers=True)`` holds them
  (load it with ``nnx.replace_by_pure_dict``; :meth:`jaxfuse.models.Decoder.with_layers` does it
  all)."""
  pure = nnx.to_pure_dict(state)
  layers = [pure["layers"][i] for i in range(num_layers)]
  pure["layers"] = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *layers)
  return pure


def unstack_layers(state: nnx.State, num_layers: int) -> dict:
  """The inverse of :func:`stack_layers`: per-block parameters ``layers[i]`` from stacked ones,
  as a pure dict for ``nnx.update`` of an unrolled :class:`jaxfuse.models.Decoder`."""
  pure = nnx.to_pure_dict(state)
  stackd = pure["layers"]
  pure["layers"] = {i: jax.tree_util.tree_map(lambda x, i=i: x[i], stackd)
                    for i in range(num_layers)}
  return pure


def convert_layers(model: nnx.Module, other: nnx.Module, num_layers: int,
                   scan_layers: bool) -> nnx.Module:
  """``other`` (an abstract model of the other layout, e.g. from ``nnx.eval_shape``) with
  ``model``'s parameters, stacked (``scan_layers``) or unstacked."""
  convert = stack_layers if scan_layers else unstack_layers
  state = nnx.state(other)
  nnx.replace_by_pure_dict(state, convert(nnx.state(model), num_layers))
  nnx.update(other, state)
  return other
