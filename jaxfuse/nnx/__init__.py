"""Flax NNX modules over jaxfuse ops: thin, they hold parameters and call pure-array ops."""

from jaxfuse.nnx.attention import MultiHeadAttention, SelfAttention
from jaxfuse.nnx.linear import RecomputeLinear
from jaxfuse.nnx.lm_head import LMHead
from jaxfuse.nnx.lora import adapter_of, apply_lora, merge_lora, save_peft_adapter
from jaxfuse.nnx.mlp import MLP, GatedMLP
from jaxfuse.nnx.normalization import LayerNorm, RMSNorm
from jaxfuse.nnx.patching import Change, fuse
from jaxfuse.nnx.simple_nn import SimpleNN

__all__ = ["Change", "GatedMLP", "LMHead", "LayerNorm", "MLP", "MultiHeadAttention", "RMSNorm",
           "RecomputeLinear", "SelfAttention", "SimpleNN", "adapter_of", "apply_lora", "fuse",
           "merge_lora", "save_peft_adapter"]
