"""Moving parameters between PyTorch / Hugging Face state dicts and jaxfuse modules.

**Torch state dicts.** Each module with a PyTorch twin declares ``TORCH_PARAMS``: its parameter
paths mapped to entries ``(key, transposed)`` or ``(key, transposed, flatten)``
(:class:`TorchParam`). The torch tensor of a parameter is the parameter with the axes
``flatten = (start_dim, end_dim)`` merged into one (as ``torch.flatten``), then transposed if
``transposed``. Linear weights in torch layout (``[out, in]``) load as they are; flax
``Linear``/``Dense`` kernels (``[in, out]``) are transposed; an attention ``LinearGeneral``
kernel ``[in, heads, head_dim]`` is flattened over ``(1, 2)`` and transposed into a torch
``q_proj.weight`` ``[heads * head_dim, in]``. Axes rather than shapes, so that one entry serves
every size, also for Linen modules that learn their input size from the input. Maps that depend
on a module's options (biases, scales, a tied head) are properties. torch is not imported: a
state dict may hold torch tensors or numpy arrays.

**Hugging Face checkpoints.** :func:`load_hf_state_dict`, :func:`hf_state_dict`,
:func:`from_pretrained` and :func:`save_pretrained` move a :class:`jaxfuse.models.Decoder` to
and from ``transformers``' ``LlamaForCausalLM``, ``MistralForCausalLM`` and
``Qwen2ForCausalLM`` (state dicts, ``save_pretrained`` directories, live models).

Supported Hugging Face config fields (:meth:`jaxfuse.models.DecoderConfig.from_hf`):

- ``model_type``: ``llama``, ``mistral`` or ``qwen2``;
- sizes: ``vocab_size``, ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
  ``num_attention_heads``, ``num_key_value_heads`` (grouped-query attention), ``head_dim``;
- ``hidden_act``: ``"silu"`` only (SwiGLU); ``rms_norm_eps``;
- ``rope_parameters`` / ``rope_theta``: the default rotary embedding only (``rope_scaling`` and
  other rope types are refused); ``max_position_embeddings`` (the KV cache's length);
- ``tie_word_embeddings``; ``attention_bias`` (LLaMA: all four attention projections; Qwen2
  always has q/k/v biases); ``mlp_bias``;
- ``sliding_window`` (Mistral); Qwen2's ``use_sliding_window`` must be false;
  ``max_window_layers`` and ``layer_types`` only with full attention in every layer;
- ``attention_dropout`` must be 0, ``pretraining_tp`` 1; ``initializer_range`` is kept.

Fields that do not change the computation (``dtype``, ``architectures``, token ids,
``use_cache``, ...) are ignored; any other field whose value differs from the model type's
default raises :class:`jaxfuse.models.UnsupportedConfigError` naming it.

Example:
  >>> import numpy as np
  >>> from flax import nnx
  >>> from jaxfuse import interop
  >>> from jaxfuse.nnx import SimpleNN
  >>> model = SimpleNN(3, 5, 2, rngs=nnx.Rngs(0))
  >>> state = interop.torch_state_dict(model)          # numpy arrays, torch names and layouts
  >>> sorted(state), state["fc2.weight"].shape
  (['fc1_bias', 'fc1_weight', 'fc2.bias', 'fc2.weight'], (2, 5))
  >>> interop.load_torch_state_dict(model, state)      # and back
"""

from jaxfuse.interop._hf import (from_pretrained, hf_param_map, hf_state_dict,
                                 load_hf_state_dict, read_checkpoint, read_safetensors,
                                 save_pretrained)
from jaxfuse.interop._torch_maps import (TorchParam, linen_params_from_torch,
                                         linen_params_to_torch, load_torch_state_dict, to_numpy,
                                         torch_params, torch_state_dict)

__all__ = [
    "TorchParam",
    "from_pretrained",
    "hf_param_map",
    "hf_state_dict",
    "linen_params_from_torch",
    "linen_params_to_torch",
    "load_hf_state_dict",
    "load_torch_state_dict",
    "read_checkpoint",
    "read_safetensors",
    "save_pretrained",
    "to_numpy",
    "torch_params",
    "torch_state_dict",
]
