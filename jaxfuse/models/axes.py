"""The decoder's logical axes: where its parameters and activations live on a mesh.

:data:`PARAM_AXES` names the axes of each parameter (by the end of its path; see
:func:`jaxfuse.parallel.annotate`): Megatron's tensor parallelism (q/k/v, gate and up split by
their outputs, o and down by their inputs, the vocabulary split in the embedding and head) and
FSDP over ``d_model``. Norm scales are replicated. A MoE layer's stacked expert kernels carry
an ``expert`` axis first (split over the ``expert`` mesh axis: expert parallelism, see
:mod:`jaxfuse.parallel.experts`), then the axes of a gated MLP's kernels; its router
``[d_model, E]`` is split by ``d_model``. The
activation axes below are what :func:`jaxfuse.parallel.constrain` is given between the ops;
:data:`jaxfuse.parallel.RULES` maps both onto the mesh.

Example:
  >>> from jaxfuse.models.axes import PARAM_AXES
  >>> PARAM_AXES[r"o_proj\\.kernel"], PARAM_AXES[r"(gate|up)_proj\\.bias"]
  (('heads', 'embed'), ('mlp',))
"""

from __future__ import annotations


def _linear(path: str, inputs: str, outputs: str) -> dict[str, tuple[str, ...]]:
  """A ``Linear`` layer's kernel ``[in, out]`` and bias ``[out]``."""
  return {rf"{path}\.kernel": (inputs, outputs), rf"{path}\.bias": (outputs,)}


PARAM_AXES: dict[str, tuple[str, ...]] = {
    r"embed_tokens\.embedding": ("vocab", "embed"),
    **_linear("q_proj", "embed", "heads"),
    **_linear("[kv]_proj", "embed", "kv_heads"),
    **_linear("o_proj", "heads", "embed"),
    **_linear("(gate|up)_proj", "embed", "mlp"),
    **_linear("down_proj", "mlp", "embed"),
    r"router\.kernel": ("embed", None),
    r"shared_expert_gate\.kernel": ("embed", None),
    r"experts\.(gate|up)_proj": ("expert", "embed", "mlp"),
    r"experts\.down_proj": ("expert", "mlp", "embed"),
    r"lm_head\.kernel": ("vocab", "embed"),   # [V, D], the embedding's layout
    r"lm_head\.bias": ("vocab",),
    r"scale": ("norm",),
}

# The residual stream, which sequence parallelism splits over the sequence between the blocks'
# projections.
STREAM = ("batch", "residual_seq", "act_embed")
# Attention's query heads and key/value heads, split by tensor parallelism.
HEADS = ("batch", "seq", "act_heads", None)
KV_HEADS = ("batch", "seq", "act_kv_heads", None)
# The final hidden states, whole over the sequence.
FULL_SEQ = ("batch", "seq", "act_embed")
