"""The names jaxfuse gives the values a backward pass could keep (``checkpoint_name``).

A recomputation policy (:mod:`jaxfuse.remat`) chooses among these names what a recomputed
region keeps, what it offloads to host memory and what it recomputes. The ops tag their own
residuals inside their custom_vjp forward rules, so a policy reaches values that no caller
sees (an attention's log-sum-exp, a norm's per-row statistics); the modules tag the matmul
outputs around them. Outside a ``jax.checkpoint`` region a name changes nothing.

===============  ====================================================  ==========================
name             value                                                 tagged by
===============  ====================================================  ==========================
``block.input``  the residual stream entering a decoder block          ``jaxfuse.models``
``norm.input``   the rows a norm reads (``x + residual`` for ``add_*``)  the norm ops
``norm.mean``    float32 per-row mean (LayerNorm)                      the norm ops
``norm.rstd``    float32 per-row ``1 / sqrt(var + eps)``               the norm ops
``norm.out``     the normalized, scaled output                         the norm ops
``attn.q``       queries as attention reads them (after rotary)        :func:`~jaxfuse.ops.attention`
``attn.k``       keys (after rotary)                                   :func:`~jaxfuse.ops.attention`
``attn.v``       values                                                :func:`~jaxfuse.ops.attention`
``attn.out``     the attention output, before the output projection    :func:`~jaxfuse.ops.attention`
``attn.lse``     float32 per-row log-sum-exp of the scores             :func:`~jaxfuse.ops.attention`
``attn.proj``    the output projection's output                        the attention modules
``mlp.gate``     the gate projection (gated MLPs)                      :mod:`jaxfuse.remat.mlp`
``mlp.up``       the up projection (gated MLPs)                        :mod:`jaxfuse.remat.mlp`
``mlp.pre``      the up projection before bias and activation          :mod:`jaxfuse.remat.mlp`
``mlp.hidden``   the hidden activation, the down projection's input    :mod:`jaxfuse.remat.mlp`
``mlp.down``     the down projection's output                          :mod:`jaxfuse.remat.mlp`
``lora.xa``      a LoRA adapter's ``x @ lora_a``, ``[..., rank]``      :mod:`jaxfuse.ops.lora`
``moe.router``   a MoE layer's router logits ``[tokens, experts]``     :mod:`jaxfuse.blocks.moe`
``moe.routing``  its top-k weights and the token-expert pairs' order   :mod:`jaxfuse.blocks.moe`
``moe.routed``   the rows sent to the experts, sorted by expert        :mod:`jaxfuse.blocks.moe`
``moe.gate``     the experts' gate projections (grouped)               :mod:`jaxfuse.blocks.moe`
``moe.up``       the experts' up projections (grouped)                 :mod:`jaxfuse.blocks.moe`
``moe.hidden``   the experts' hidden activations (unfused)             :mod:`jaxfuse.blocks.moe`
``moe.down``     the experts' outputs, before they are combined        :mod:`jaxfuse.blocks.moe`
``logp.lse``     float32 per-token logsumexp of the LM head's logits   :func:`~jaxfuse.ops.linear_log_probs`
``logp.mean_logit``  float32 per-token mean logit under the softmax    :func:`~jaxfuse.ops.linear_log_probs`
``distill.student_lse``  float32 per-token logsumexp of a student's logits  the distillation losses
``distill.teacher_lse``  float32 per-token logsumexp of a teacher's logits  the distillation losses
===============  ====================================================  ==========================

The fused MoE layer computes the experts' whole MLP as one op
(:func:`~jaxfuse.ops.grouped_mlp`), which keeps its inputs and the products its ``keep`` names
(``moe.gate``, ``moe.up``; none by default) and recomputes the others once in its backward. A
policy over the fused layer chooses among what the op keeps: naming ``moe.gate`` keeps nothing
more unless the op was asked to keep it (``DecoderConfig.expert_keep``), and dropping a kept
product runs the op's forward again. ``moe.hidden`` is a value of the unfused layer only.

Example:
  >>> from jaxfuse.ops import names
  >>> names.ATTN_LSE, names.ALL[:3]
  ('attn.lse', ('block.input', 'norm.input', 'norm.mean'))
"""

from __future__ import annotations

BLOCK_INPUT = "block.input"
NORM_INPUT = "norm.input"
NORM_MEAN = "norm.mean"
NORM_RSTD = "norm.rstd"
NORM_OUT = "norm.out"
ATTN_Q = "attn.q"
ATTN_K = "attn.k"
ATTN_V = "attn.v"
ATTN_OUT = "attn.out"
ATTN_LSE = "attn.lse"
ATTN_PROJ = "attn.proj"
MLP_GATE = "mlp.gate"
MLP_UP = "mlp.up"
MLP_PRE = "mlp.pre"
MLP_HIDDEN = "mlp.hidden"
MLP_DOWN = "mlp.down"
LORA_XA = "lora.xa"
MOE_ROUTER = "moe.router"
MOE_ROUTING = "moe.routing"
MOE_ROUTED = "moe.routed"
MOE_GATE = "moe.gate"
MOE_UP = "moe.up"
MOE_HIDDEN = "moe.hidden"
# The experts' products that the fused layer's op may keep (its ``keep``), by their short names.
MOE_PRODUCTS = {"gate": MOE_GATE, "up": MOE_UP}
MOE_DOWN = "moe.down"
LOGP_LSE = "logp.lse"
LOGP_MEAN_LOGIT = "logp.mean_logit"
DISTILL_STUDENT_LSE = "distill.student_lse"
DISTILL_TEACHER_LSE = "distill.teacher_lse"

ALL = (BLOCK_INPUT, NORM_INPUT, NORM_MEAN, NORM_RSTD, NORM_OUT, ATTN_Q, ATTN_K, ATTN_V,
       ATTN_OUT, ATTN_LSE, ATTN_PROJ, MLP_GATE, MLP_UP, MLP_PRE, MLP_HIDDEN, MLP_DOWN, LORA_XA,
       MOE_ROUTER, MOE_ROUTING, MOE_ROUTED, MOE_GATE, MOE_UP, MOE_HIDDEN, MOE_DOWN, LOGP_LSE,
       LOGP_MEAN_LOGIT, DISTILL_STUDENT_LSE, DISTILL_TEACHER_LSE)


def moe_products(keep, what: str = "keep") -> tuple[str, ...]:
  """``keep`` (a name of :data:`MOE_PRODUCTS` or several) as a tuple in that table's order;
  a ``ValueError`` naming ``what`` for anything else.

  Example:
    >>> moe_products(("up", "gate"))
    ('gate', 'up')
  """
  given = (keep,) if isinstance(keep, str) else tuple(keep)
  if len(set(given)) != len(given) or not set(given) <= set(MOE_PRODUCTS):
    raise ValueError(f"{what} takes distinct names among {tuple(MOE_PRODUCTS)}, got {keep!r}")
  return tuple(name for name in MOE_PRODUCTS if name in given)
