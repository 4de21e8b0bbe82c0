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
- :mod:`.simple_nn`: the seed's model;
- :mod:`.torch_names`: the ``TORCH_PARAMS`` maps of all of them.

Layers: this package imports :mod:`jaxfuse.ops` and :mod:`jaxfuse.parallel`; it is imported by
:mod:`jaxfuse.remat` (which may wrap its computations), :mod:`jaxfuse.nnx`,
:mod:`jaxfuse.linen`, :mod:`jaxfuse.models` and :mod:`jaxfuse.interop`, never the other way.
"""

from jaxfuse.blocks import attention, linear, lm_head, mlp, normalization, simple_nn, torch_names

__all__ = ["attention", "linear", "lm_head", "mlp", "normalization", "simple_nn", "torch_names"]
