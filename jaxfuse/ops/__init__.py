"""Differentiable ops. Each has a plain-jnp reference, kernel implementations and a custom_vjp
that chooses what the backward keeps; ``implementation=None | "pallas" | "triton" | "xla"``,
and ``"cpu"`` for the ops with CPU kernels."""

from jaxfuse.ops import activations, names
from jaxfuse.ops.bias_activation import bias_act, bias_act_reference
from jaxfuse.ops.cross_entropy import (linear_cross_entropy, linear_cross_entropy_reference,
                                       linear_distillation_loss,
                                       linear_distillation_loss_reference, linear_log_probs,
                                       linear_log_probs_reference, linear_logits,
                                       linear_topk_distillation_loss, topk_distillation_loss)
from jaxfuse.ops.dispatch import (IMPLEMENTATIONS, ImplementationUnavailableError, can_run,
                                  pallas_interpret)
from jaxfuse.ops.elementwise import add_act, add_act_reference, add_act_unfused, relu
from jaxfuse.ops.flash_attention import attention, attention_reference, dot_product_attention
from jaxfuse.ops.gated_linear import glu, glu_reference
from jaxfuse.ops.grouped_glu import grouped_glu, grouped_glu_reference
from jaxfuse.ops.grouped_matmul import grouped_matmul, grouped_matmul_reference
from jaxfuse.ops.grouped_mlp import grouped_mlp, grouped_mlp_reference
from jaxfuse.ops.linear import dense, dense_reference, linear_reference, recompute_linear
from jaxfuse.ops.lora import lora_dense, lora_dense_reference
from jaxfuse.ops.normalization import (add_layer_norm, add_layer_norm_reference, add_rms_norm,
                                       add_rms_norm_reference, add_rms_norm_unfused, layer_norm,
                                       layer_norm_reference, rms_norm, rms_norm_reference)
from jaxfuse.ops.qk_norm_rope import qk_norm_rope, qk_norm_rope_reference
from jaxfuse.ops.rotary import rotary_embedding
from jaxfuse.ops.softmax_ops import softmax, softmax_reference

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
    "attention",
    "attention_reference",
    "bias_act",
    "bias_act_reference",
    "can_run",
    "dense",
    "dense_reference",
    "dot_product_attention",
    "glu",
    "glu_reference",
    "grouped_glu",
    "grouped_glu_reference",
    "grouped_matmul",
    "grouped_matmul_reference",
    "grouped_mlp",
    "grouped_mlp_reference",
    "layer_norm",
    "layer_norm_reference",
    "linear_cross_entropy",
    "linear_cross_entropy_reference",
    "linear_distillation_loss",
    "linear_distillation_loss_reference",
    "linear_log_probs",
    "linear_log_probs_reference",
    "linear_logits",
    "linear_reference",
    "linear_topk_distillation_loss",
    "lora_dense",
    "lora_dense_reference",
    "names",
    "pallas_interpret",
    "qk_norm_rope",
    "qk_norm_rope_reference",
    "recompute_linear",
    "relu",
    "rms_norm",
    "rms_norm_reference",
    "rotary_embedding",
    "softmax",
    "softmax_reference",
    "topk_distillation_loss",
]
