"""Differentiable ops. Each has a plain-jnp reference, kernel implementations and a custom_vjp
that chooses what the backward keeps; ``implementation=None | "pallas" | "triton" | "xla"``."""

from jaxfuse.ops import activations
from jaxfuse.ops.elementwise import add_act, add_act_reference, add_act_unfused
from jaxfuse.ops.flash_attention import attention, attention_reference, dot_product_attention
from jaxfuse.ops.rotary import rotary_embedding
from jaxfuse.ops.dispatch import (IMPLEMENTATIONS, ImplementationUnavailableError, can_run,
                                  pallas_interpret)

__all__ = [
    "IMPLEMENTATIONS",
    "ImplementationUnavailableError",
    "activations",
    "add_act",
    "add_act_reference",
    "add_act_unfused",
    "attention",
    "attention_reference",
    "can_run",
    "dot_product_attention",
    "pallas_interpret",
    "rotary_embedding",
]
