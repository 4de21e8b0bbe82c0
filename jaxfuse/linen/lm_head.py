"""``LMHead``: the output projection and its loss, fused, for Flax Linen."""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxfuse.blocks import lm_head
from jaxfuse.blocks.torch_names import lm_head_torch_params

Array = jax.Array


class LMHead(nn.Module):
  """The language-model head: ``logits = h @ weight.T + bias`` and their cross-entropy, fused.

  ``head(h, labels)`` returns the loss of :func:`jaxfuse.ops.linear_cross_entropy` (the
  ``[tokens, V]`` logits never exist beyond a chunk). With ``deterministic=True`` (eval), or
  without labels, it returns float32 logits of ``h``: pass a small slice (e.g. ``h[:, -1:]``).

  The weight is ``[V, D]`` (``"kernel"``, the layout of ``nn.Embed``'s ``"embedding"``). To tie
  it to an input embedding, pass that table as ``weight=`` at call time, e.g.
  ``LMHead(V)(h, labels, weight=self.embed.embedding)`` inside the parent module: the head then
  creates no kernel.

  Attributes:
    vocab_size: V.
    use_bias: add a ``[V]`` bias (created by the head, also when tied).
    dtype: computation dtype; default: the weight's. param_dtype: of the created parameters.
    kernel_init, bias_init: initializers.
    ignore_index, reduction, label_smoothing, z_loss, logit_softcap, chunk_size,
    grad_in_forward, implementation: passed to :func:`jaxfuse.ops.linear_cross_entropy`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxfuse.linen import LMHead
    >>> head = LMHead(vocab_size=1000)
    >>> h = jax.random.normal(jax.random.key(0), (2, 8, 16))
    >>> labels = jnp.zeros((2, 8), jnp.int32)
    >>> params = head.init(jax.random.key(1), h, labels)
    >>> head.apply(params, h, labels).shape, head.apply(params, h[:, -1:]).shape
    ((), (2, 1, 1000))
  """

  vocab_size: int
  use_bias: bool = False
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Callable = nn.initializers.normal(0.02)
  bias_init: Callable = nn.initializers.zeros_init()
  ignore_index: int = -100
  reduction: str = "mean"
  label_smoothing: float = 0.0
  z_loss: float = 0.0
  logit_softcap: float | None = None
  chunk_size: int | None = None
  grad_in_forward: bool = False
  implementation: str | None = None

  @nn.compact
  def __call__(self, h: Array, labels: Array | None = None, *, weight: Array | None = None,
               deterministic: bool = False):
    if weight is None:
      weight = self.param("kernel", self.kernel_init, (self.vocab_size, h.shape[-1]),
                          self.param_dtype)
    elif tuple(weight.shape) != (self.vocab_size, h.shape[-1]):
      raise ValueError(f"LMHead: weight must have shape (vocab_size, D) = "
                       f"({self.vocab_size}, {h.shape[-1]}), got {tuple(weight.shape)}")
    bias = (self.param("bias", self.bias_init, (self.vocab_size,), self.param_dtype)
            if self.use_bias else None)
    if labels is None or deterministic:
      return lm_head.logits(h, weight, bias, dtype=self.dtype)
    return lm_head.loss(
        h, weight, labels, bias, dtype=self.dtype, ignore_index=self.ignore_index,
        reduction=self.reduction, label_smoothing=self.label_smoothing, z_loss=self.z_loss,
        logit_softcap=self.logit_softcap, chunk_size=self.chunk_size,
        grad_in_forward=self.grad_in_forward, implementation=self.implementation)

  @property
  def TORCH_PARAMS(self) -> dict:  # noqa: N802 (the name every module's map has)
    """``kernel`` as ``weight`` (``[V, D]``, torch ``nn.Linear(D, V)``'s layout) and, with
    ``use_bias``, ``bias``. A head called with ``weight=`` (tied) has no kernel: leave the
    ``("kernel",)`` entry out, and pass the rest as ``mapping=`` to :mod:`jaxfuse.interop`."""
    return lm_head_torch_params(True, self.use_bias)
