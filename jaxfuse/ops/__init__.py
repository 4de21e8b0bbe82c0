"""Differentiable ops. Each has a plain-jnp reference, kernel implementations and a custom_vjp
that chooses what the backward keeps; ``implementation=None | "pallas" | "triton" | "xla"``."""

from jaxfuse.ops import activations
from jaxfuse.ops.cross_entropy import linear_cross_entropy, linear_cross_entropy_reference
from jaxfuse.ops.elementwise import add_act, add_act_reference, add_act_unfused, relu
from jaxfuse.ops.linear import linear_reference, recompute_linear
from jaxfuse.ops.dispatch import (IMPLEMENTATIONS, ImplementationUnavailableError, can_run,
                                  pallas_interpret)

__all__ = [
    "IMPLEMENTATIONS",
    "ImplementationUnavailableError",
    "activations",
    "add_act",
    "add_act_reference",
    "add_act_unfused",
    "can_run",
    "linear_cross_entropy",
    "linear_cross_entropy_reference",
    "linear_reference",
    "pallas_interpret",
    "recompute_linear",
    "relu",
]
