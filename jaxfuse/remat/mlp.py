"""MLP blocks with the hidden activation recomputed in the backward pass.

The computations are :mod:`jaxfuse.blocks.mlp`'s; this module chooses what their backward keeps.
The Flax modules in :mod:`jaxfuse.nnx` and :mod:`jaxfuse.linen` hold the parameters and call
:func:`mlp_block`. Each block is wrapped in :func:`jaxfuse.recompute` with one of three choices
(``recompute=``):

- ``"activation"`` (the default): the projections' outputs (``gate`` and ``up``, or the
  pre-activation), which the fused op needs anyway; the hidden activation ``act(gate) * up``
  (``act(z + bias)``), which the down projection's weight gradient needs, is recomputed from them
  by the fused forward kernel.
- ``"block"``: only the block's input; the projections are recomputed too (two or one extra
  matmuls in the backward).
- ``None``: no recomputation: the fused op keeps its inputs, and the hidden activation is kept for
  the down projection.

Projections with a LoRA adapter (``adapters=``) keep, besides, their ``x @ lora_a``
(``lora.xa``, ``[..., rank]``) under ``"activation"`` and ``None``, and recompute it under
``"block"``; the adapters' outputs are part of the projections' (``mlp.gate``, ``mlp.up``, ...).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import jax

from jaxfuse.blocks import mlp as blocks
from jaxfuse.blocks.linear import Adapter
from jaxfuse.ops import names
from jaxfuse.remat.recompute import recompute as _recompute

RECOMPUTE = ("activation", "block", None)
# What recompute="activation" keeps of each kind of block: the projections' outputs, and the
# LoRA adapters' x @ lora_a ([..., rank]: small, and kept rather than recomputed from x).
ACTIVATION_KEEPS = {blocks.GATED: [names.MLP_GATE, names.MLP_UP, names.LORA_XA],
                    blocks.PLAIN: [names.MLP_PRE, names.LORA_XA]}


def check_recompute(recompute: str | None, owner: str | None = None) -> None:
  """Raises ``ValueError`` (starting with ``owner``, when given) unless ``recompute`` is one of
  :data:`RECOMPUTE`."""
  if recompute not in RECOMPUTE:
    prefix = f"{owner}: " if owner else ""
    raise ValueError(f"{prefix}recompute must be one of {RECOMPUTE}, got {recompute!r}")


def mlp_block(kind: str, x: jax.Array, params: Mapping[str, tuple], *,
              recompute: str | None = "activation",
              adapters: Mapping[str, Adapter | None] | None = None, **settings) -> jax.Array:
  """The ``kind`` of block (:data:`jaxfuse.blocks.mlp.KINDS`) of ``x`` with ``params``
  ``{projection: (kernel, bias)}`` and LoRA ``adapters`` ``{projection: Adapter}`` (None or
  absent: none), keeping what ``recompute`` says.

  ``settings``: ``activation``, ``precision`` and ``implementation``, as
  :func:`jaxfuse.blocks.mlp.gated_mlp` and :func:`jaxfuse.blocks.mlp.mlp` take them.
  """
  check_recompute(recompute)
  adapters = blocks.check_adapters(kind, adapters, "mlp_block")
  block: Callable = functools.partial(blocks.BLOCKS[kind], **settings)
  if recompute is not None:
    keep = ACTIVATION_KEEPS[kind] if recompute == "activation" else "nothing"
    block = _recompute(block, policy=keep)
  if adapters:   # a pytree argument: the arrays traced, each scale static
    return block(x, *blocks.arguments(kind, params), adapters=adapters)
  return block(x, *blocks.arguments(kind, params))


def gated_mlp(x: jax.Array, gate_kernel: jax.Array, up_kernel: jax.Array,
              down_kernel: jax.Array, *, gate_bias: jax.Array | None = None,
              up_bias: jax.Array | None = None, down_bias: jax.Array | None = None,
              activation: str | Callable = "silu", recompute: str | None = "activation",
              precision=jax.lax.Precision.HIGHEST, implementation: str | None = None,
              adapters: Mapping[str, Adapter] | None = None) -> jax.Array:
  """``(act(x @ gate_kernel) * (x @ up_kernel)) @ down_kernel``, the LLaMA MLP (SwiGLU), keeping
  what ``recompute`` says (see the module docstring); the other arguments (LoRA ``adapters``
  included) are :func:`jaxfuse.blocks.mlp.gated_mlp`'s.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxfuse.remat.mlp import gated_mlp
    >>> x, wg, wu, wd = (jnp.ones(s) for s in ((4, 8), (8, 16), (8, 16), (16, 8)))
    >>> gated_mlp(x, wg, wu, wd).shape
    (4, 8)
  """
  params = {"gate_proj": (gate_kernel, gate_bias), "up_proj": (up_kernel, up_bias),
            "down_proj": (down_kernel, down_bias)}
  return mlp_block(blocks.GATED, x, params, recompute=recompute, adapters=adapters,
                   activation=activation, precision=precision, implementation=implementation)


def mlp(x: jax.Array, up_kernel: jax.Array, up_bias: jax.Array, down_kernel: jax.Array,
        down_bias: jax.Array | None = None, *, activation: str | Callable = "gelu",
        recompute: str | None = "activation", precision=jax.lax.Precision.HIGHEST,
        implementation: str | None = None,
        adapters: Mapping[str, Adapter] | None = None) -> jax.Array:
  """``act(x @ up_kernel + up_bias) @ down_kernel + down_bias``, the bias and activation fused
  by :func:`jaxfuse.ops.bias_act`, keeping what ``recompute`` says (see the module docstring);
  the other arguments (LoRA ``adapters`` included) are :func:`jaxfuse.blocks.mlp.mlp`'s.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxfuse.remat.mlp import mlp
    >>> x, w1, b1, w2 = jnp.ones((4, 8)), jnp.ones((8, 16)), jnp.zeros(16), jnp.ones((16, 8))
    >>> mlp(x, w1, b1, w2).shape
    (4, 8)
  """
  params = {"up_proj": (up_kernel, up_bias), "down_proj": (down_kernel, down_bias)}
  return mlp_block(blocks.PLAIN, x, params, recompute=recompute, adapters=adapters,
                   activation=activation, precision=precision, implementation=implementation)
