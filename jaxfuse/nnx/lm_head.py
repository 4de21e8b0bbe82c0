"""``LMHead``: the output projection and its loss, fused, for Flax NNX."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfuse.blocks import lm_head
from jaxfuse.blocks.torch_names import lm_head_torch_params

Array = jax.Array


class LMHead(nnx.Module):
  """The language-model head: ``logits = h @ weight.T + bias`` and their cross-entropy, fused.

  In training (the default) ``head(h, labels)`` returns the loss of
  :func:`jaxfuse.ops.linear_cross_entropy`: the ``[tokens, V]`` logits are never held beyond a
  chunk. In eval mode (``model.eval()``), or when called without labels, it returns the logits
  of ``h`` in float32: pass a small slice (e.g. the last position, ``h[:, -1:]``), since these
  logits are materialized. :meth:`loss` returns the loss in either mode.

  The weight is ``[V, D]``, the layout of ``nnx.Embed.embedding``. To tie it to an input
  embedding, pass the ``nnx.Embed`` as ``tie_to``: the head then owns no weight and reads the
  embedding's (gradients reach the embedding's parameter).

  Args:
    in_features: D.
    vocab_size: V (ignored with ``tie_to``, which gives it).
    tie_to: an ``nnx.Embed`` whose ``[V, D]`` table is the weight.
    use_bias: add a ``[V]`` bias (owned by the head, also when tied).
    dtype: computation dtype (h and the weight are cast to it); default: the weight's.
    param_dtype: dtype of the parameters the head creates.
    kernel_init, bias_init: initializers.
    ignore_index, label_smoothing, z_loss, logit_softcap, chunk_size, grad_in_forward,
    implementation: passed to :func:`jaxfuse.ops.linear_cross_entropy`.
    rngs: ``nnx.Rngs`` for the parameters.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxfuse.nnx import LMHead
    >>> embed = nnx.Embed(1000, 16, rngs=nnx.Rngs(0))
    >>> head = LMHead(16, tie_to=embed, rngs=nnx.Rngs(1))
    >>> h = jax.random.normal(jax.random.key(0), (2, 8, 16))
    >>> labels = jnp.zeros((2, 8), jnp.int32)
    >>> head(h, labels).shape, head(h[:, -1:]).shape
    ((), (2, 1, 1000))
  """

  def __init__(self, in_features: int, vocab_size: int | None = None, *,
               tie_to: nnx.Embed | None = None, use_bias: bool = False, dtype: Any = None,
               param_dtype: Any = jnp.float32,
               kernel_init: nnx.Initializer = nnx.initializers.normal(0.02),
               bias_init: nnx.Initializer = nnx.initializers.zeros_init(),
               ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
               z_loss: float = 0.0, logit_softcap: float | None = None,
               chunk_size: int | None = None, grad_in_forward: bool = False,
               implementation: str | None = None, rngs: nnx.Rngs):
    if tie_to is not None:
      table = tie_to.embedding
      if table.shape[1] != in_features:
        raise ValueError(f"LMHead: tie_to's embedding has {table.shape[1]} features, "
                         f"in_features is {in_features}")
      if vocab_size is not None and vocab_size != table.shape[0]:
        raise ValueError(f"LMHead: vocab_size={vocab_size} but tie_to has {table.shape[0]} "
                         f"embeddings")
      vocab_size = table.shape[0]
      self.tied = tie_to
      self.kernel = None
    else:
      if vocab_size is None:
        raise ValueError("LMHead: give vocab_size, or tie_to an nnx.Embed")
      self.tied = None
      self.kernel = nnx.Param(kernel_init(rngs.params(), (vocab_size, in_features), param_dtype))
    self.bias = (nnx.Param(bias_init(rngs.params(), (vocab_size,), param_dtype))
                 if use_bias else None)
    self.in_features = in_features
    self.vocab_size = vocab_size
    self.dtype = dtype
    self.deterministic = False
    self.loss_options = dict(ignore_index=ignore_index, reduction=reduction,
                             label_smoothing=label_smoothing, z_loss=z_loss,
                             logit_softcap=logit_softcap, chunk_size=chunk_size,
                             grad_in_forward=grad_in_forward, implementation=implementation)

  @property
  def weight(self) -> Array:
    """The ``[V, D]`` weight: the head's own, or the tied embedding table."""
    return (self.tied.embedding if self.tied is not None else self.kernel)[...]

  @property
  def _bias(self) -> Array | None:
    return None if self.bias is None else self.bias[...]

  def loss(self, h: Array, labels: Array, **options):
    """The fused loss (in any mode); ``options`` override the constructor's loss options."""
    return lm_head.loss(h, self.weight, labels, self._bias, dtype=self.dtype,
                        **{**self.loss_options, **options})

  def log_probs(self, h: Array, tokens: Array, **options):
    """Per-token ``log p(token)`` of the fused head (:func:`jaxfuse.ops.linear_log_probs`), with
    this head's soft-cap, ignore index and implementation; ``options`` are that op's
    (``temperature``, ``return_entropy``, ...)."""
    own = {k: self.loss_options[k]
           for k in ("ignore_index", "logit_softcap", "chunk_size", "implementation")}
    return lm_head.log_probs(h, self.weight, tokens, self._bias, dtype=self.dtype,
                             **{**own, **options})

  def logits(self, h: Array) -> Array:
    """Float32 logits ``h @ weight.T + bias`` for a small slice of ``h``."""
    return lm_head.logits(h, self.weight, self._bias, dtype=self.dtype)

  def __call__(self, h: Array, labels: Array | None = None):
    if labels is None or self.deterministic:
      return self.logits(h)
    return self.loss(h, labels)

  @property
  def TORCH_PARAMS(self) -> dict:  # noqa: N802 (the name every module's map has)
    """``weight`` (``[V, D]``, as torch ``nn.Linear(D, V)`` has it; none when tied: the
    embedding owns it) and ``bias``.

    Example:
      >>> from flax import nnx
      >>> from jaxfuse.nnx import LMHead
      >>> LMHead(16, 100, rngs=nnx.Rngs(0)).TORCH_PARAMS
      {('kernel',): ('weight', False)}
      >>> LMHead(16, tie_to=nnx.Embed(100, 16, rngs=nnx.Rngs(0)), use_bias=True,
      ...        rngs=nnx.Rngs(0)).TORCH_PARAMS
      {('bias',): ('bias', False)}
    """
    return lm_head_torch_params(self.kernel is not None, self.bias is not None)
