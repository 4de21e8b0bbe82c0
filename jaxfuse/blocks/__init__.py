"""The pieces the Flax front-ends (:mod:`jaxfuse.nnx`, :mod:`jaxfuse.linen`) and the models
(:mod:`jaxfuse.models`) share, written once: pure functions over arrays and parameters, and
the torch names of those parameters. No module classes: the front-ends hold the parameters.

- :mod:`.attention`: rotary embedding of the heads and attention over them, the argument
  checks of a multi-head attention layer, a decoder's causal attention;
- :mod:`.mlp`: the gated and plain MLPs' parameter layouts and computations (what
  :mod:`jaxfuse.remat.mlp` recomputes);
- :mod:`.normalization`: LayerNorm and RMSNorm, alone or after a residual add;
- :mod:`.lm_head`: the language-model head's loss and logits;
- :mod:`.linear`: the recomputed linear layer and a decoder's projections;
- :mod:`.rope`: rotary position embeddings as Hugging Face transformers computes them (every
  ``rope_type`` of the Llama 3, Qwen3, Gemma 2/3, Phi-3 and OLMo 2 families);
- :mod:`.simple_nn`: the seed's model;
- :mod:`.torch_names`: the ``TORCH_PARAMS`` maps of all of them.

Layers: this package imports :mod:`jaxfuse.ops` and :mod:`jaxfuse.parallel`; it is imported by
:mod:`jaxfuse.remat` (which may wrap its computations), :mod:`jaxfuse.nnx`,
:mod:`jaxfuse.linen`, :mod:`jaxfuse.models` and :mod:`jaxfuse.interop`, never the other way.
"""

from jaxfuse.blocks import (attention, linear, lm_head, mlp, normalization, rope, simple_nn,
                            torch_names)

__all__ = ["attention", "linear", "lm_head", "mlp", "normalization", "rope", "simple_nn",
           "torch_names"]
