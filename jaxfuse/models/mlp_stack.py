"""A residual stack of pre-norm SwiGLU MLP blocks: the simplest deep model to recompute.

Each block is ``h + GatedMLP(RMSNorm(h))`` (:class:`jaxfuse.nnx.RMSNorm`,
:class:`jaxfuse.nnx.GatedMLP`); the model's loss is the mean squared error of the final
RMSNorm's output against a target. It takes the same recomputation settings as
:class:`jaxfuse.models.Decoder` (``remat``, ``segments``, ``scan_layers``, plans from
:func:`jaxfuse.remat.plan`), with the names ``norm.*`` and ``mlp.*`` of
:mod:`jaxfuse.ops.names`.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from flax import nnx
  >>> from jaxfuse.models import MLPStack
  >>> model = MLPStack(16, 48, num_layers=6, remat="nothing", segments="sqrt",
  ...                  scan_layers=True, rngs=nnx.Rngs(0))
  >>> x = jnp.ones((4, 16))
  >>> model(x, jnp.zeros((4, 16))).shape
  ()
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfuse import nnx as jnnx
from jaxfuse.ops import names
from jaxfuse.remat.layers import LayerStack, stacked


class MLPBlock(nnx.Module):
  """``h + mlp(norm(h))``."""

  def __init__(self, features: int, hidden: int, *, implementation: str | None,
               rngs: nnx.Rngs):
    self.norm = jnnx.RMSNorm(features, implementation=implementation, rngs=rngs)
    self.mlp = jnnx.GatedMLP(features, hidden, implementation=implementation, rngs=rngs)

  def step(self, h: jax.Array, index=0) -> jax.Array:
    h = jax.ad_checkpoint.checkpoint_name(h, names.BLOCK_INPUT)
    return h + self.mlp(self.norm(h))


class MLPStack(LayerStack, nnx.Module):
  """``num_layers`` :class:`MLPBlock` s and a final RMSNorm.

  Args:
    features: the residual stream's width.
    hidden: the MLP's hidden width.
    num_layers: blocks.
    remat, segments, scan_layers: as :class:`jaxfuse.models.Decoder` takes them.
    implementation: passed to the jaxfuse ops.
    rngs: for the initializers.
  """

  def __init__(self, features: int, hidden: int, *, num_layers: int, remat=None,
               segments: str | int | None = None, scan_layers: bool = False,
               implementation: str | None = None, rngs: nnx.Rngs):
    self.scan_layers = scan_layers

    def block(rngs):
      return MLPBlock(features, hidden, implementation=implementation, rngs=rngs)

    if scan_layers:
      self.layers = stacked(block, num_layers, rngs)
    else:
      self.layers = nnx.List([block(rngs) for _ in range(num_layers)])
    self.norm = jnnx.RMSNorm(features, implementation=implementation, rngs=rngs)
    self.set_remat(remat, segments)

  def hidden(self, x: jax.Array) -> jax.Array:
    return self.norm(self.apply_blocks(x))

  def __call__(self, x: jax.Array, target: jax.Array) -> jax.Array:
    """The mean squared error of the output against ``target``."""
    return jnp.mean(jnp.square(self.hidden(x) - target))

  def remat_block(self, batch) -> tuple:
    """``(step, carry)`` for :func:`jaxfuse.remat.profile`; ``batch`` is ``(x, target)``."""
    return (lambda block, h, index=0: block.step(h, index)), batch[0]


__all__ = ["MLPBlock", "MLPStack"]
