"""Differentiable ops. Each has a plain-jnp reference, kernel implementations and a custom_vjp
that chooses what the backward keeps; ``implementation=None | "pallas" | "triton" | "xla"``."""

from jaxfuse.ops import activations
from jaxfuse.ops.elementwise import add_act, add_act_reference, add_act_unfused
from jaxfuse.ops.dispatch import (IMPLEMENTATIONS, ImplementationUnavailableError, can_run,
                                  pallas_interpret)
from jaxfuse.ops.normalization import (add_layer_norm, add_layer_norm_reference, add_rms_norm,
                                       add_rms_norm_reference, add_rms_norm_unfused, layer_norm, layer_norm_reference,
                                       rms_norm, rms_norm_reference)

__all__ = [
    "IMPLEMENTATIONS",
    "ImplementationUnavailableError",
    "activations",
    "add_act",
    "add_act_reference",
    "add_act_unfused",
    "add_layer_norm",
    "add_layer_norm_reference",
    "add_rms_norm",
    "add_rms_norm_reference",
    "add_rms_norm_unfused",
    "can_run",
    "layer_norm",
    "layer_norm_reference",
    "pallas_interpret",
    "rms_norm",
    "rms_norm_reference",
]
