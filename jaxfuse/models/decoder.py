"""A LLaMA-family decoder language model (LLaMA, Mistral, Qwen2) built from jaxfuse parts.

``Decoder(cfg, rngs=...)`` is a stack of pre-norm blocks: RMSNorm, attention (grouped-query,
rotary, causal, optionally a sliding window), RMSNorm, a SwiGLU MLP; then a final RMSNorm and
the LM head. ``fused`` chooses how it computes, never what parameters it has:

- ``fused=True``: the residual add and the next RMSNorm are one op (:func:`add_rms_norm`); the
  attention is :func:`jaxfuse.ops.attention` (saves its output and log-sum-exp, never the
  scores); the MLP is :class:`jaxfuse.nnx.GatedMLP` (recomputes its hidden activation); the head
  is :class:`jaxfuse.nnx.LMHead` (the fused linear cross-entropy: no ``[tokens, V]`` logits).
- ``fused=False``: the same model from plain flax/jax parts: ``nnx.RMSNorm``,
  ``jax.nn.dot_product_attention``, a SwiGLU of ``nnx.Linear`` calls, full logits and
  ``optax.softmax_cross_entropy_with_integer_labels``. It is the baseline every figure is
  measured against; :func:`nnx.state` of one loads into the other.

With ``num_experts`` in the config (Mixtral, Qwen2-MoE, Qwen3-MoE) each block's MLP is a Mixture of
Experts (:class:`jaxfuse.models.decoder_block.MoE`, over :mod:`jaxfuse.blocks.moe`): the blocks
pass their routing statistics along with the residual stream, and the loss adds the
load-balancing loss (and a router z-loss) as the config says (:meth:`Decoder.router_loss`).

The parameter tree follows Hugging Face's names (``layers[i].self_attn.q_proj``,
``mlp.gate_proj``, ``input_layernorm``, ...), so :mod:`jaxfuse.interop` maps it one to one.

This module holds the model; its block and the block's pieces are in
:mod:`jaxfuse.models.decoder_block`, the logical axes of its parameters and activations in
:mod:`jaxfuse.models.axes`, decoding with a KV cache in :mod:`jaxfuse.models.decoding`, and the
conversion between unrolled and stacked blocks in :mod:`jaxfuse.models.stacking`.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from flax import nnx
  >>> from jaxfuse.models import Decoder, DecoderConfig
  >>> cfg = DecoderConfig(vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
  ...                     mlp_dim=128)
  >>> model = Decoder(cfg, rngs=nnx.Rngs(0))
  >>> tokens = jnp.zeros((2, 16), jnp.int32)
  >>> model(tokens, next_token_targets(tokens)).shape   # the mean loss
  ()
  >>> model.logits(tokens).shape
  (2, 16, 256)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxfuse import nnx as jnnx
from jaxfuse import parallel
from jaxfuse.blocks import moe as moe_blocks
from jaxfuse.models import decoding, stacking
from jaxfuse.models.axes import FULL_SEQ, PARAM_AXES, STREAM
from jaxfuse.models.config import DecoderConfig
from jaxfuse.models.decoder_block import MLP, Attention, Block, make_norm
from jaxfuse.models.decoding import generate
from jaxfuse.models.stacking import stack_layers, unstack_layers
from jaxfuse.remat.layers import LayerStack, stacked

IGNORE_INDEX = -100


def next_token_targets(tokens: jax.Array, ignore_index: int = IGNORE_INDEX) -> jax.Array:
  """``targets[:, t] = tokens[:, t + 1]``, with ``ignore_index`` at the last position: the
  language-model targets (Hugging Face's ``labels=input_ids`` shifts them the same way)."""
  pad = jnp.full(tokens.shape[:-1] + (1,), ignore_index, tokens.dtype)
  return jnp.concatenate([tokens[..., 1:], pad], axis=-1)


class Decoder(LayerStack, nnx.Module):
  """A decoder-only language model; see the module docstring.

  Args:
    cfg: the :class:`DecoderConfig`.
    fused: jaxfuse's fused ops (True) or plain flax/jax parts (False), on the same parameters.
    remat: what each block's backward keeps. ``None``: no recomputation beyond the ops' own
      (the fused MLP recomputes its hidden activation); ``"block"``: only the block's input
      (the same as ``"nothing"``); any policy :func:`jaxfuse.remat.resolve_policy` takes (a
      preset, a MaxText recipe, a list of names, a ``{name: "remat" | "device" | "offload"}``
      table), applied to every block; or a :class:`jaxfuse.remat.Plan`, one policy per block.
      Under a policy the blocks' ops keep nothing of their own accord: the policy decides, by
      the names of :mod:`jaxfuse.ops.names`; and the blocks pass one array between them (the
      residual stream, its last add not fused with the next RMSNorm), so that a block that
      keeps only its input keeps one array, not two.
    segments: ``None``, ``"sqrt"`` or a number of blocks: checkpoint segments of about
      √L blocks (each keeps only its input; Chen et al. 2016), see
      :mod:`jaxfuse.remat.layers`.
    scan_layers: stack the blocks' parameters on a leading layer axis (``nnx.vmap`` to create
      them) and run them as a ``jax.lax.scan``: the traced program, and so the compile time,
      stays the same size as the layers grow. :func:`stack_layers` and
      :func:`unstack_layers` convert the parameters between the two layouts.
    grad_in_forward: the fused head computes its gradients with the loss (three
      ``tokens x d_model x V`` matmuls, as the plain loss, and keeps ``dW`` and ``dh``), or, with
      False, recomputes the logits in the backward (four matmuls, keeps 4 bytes a token); see
      :func:`jaxfuse.ops.linear_cross_entropy`. A training step needs the gradient right after
      the loss, so the default is the faster one.
    implementation: passed to every jaxfuse op (None: the fastest here).
    rngs: for the initializers.
  """

  def __init__(self, cfg: DecoderConfig, *, fused: bool = True, remat=None,
               segments: str | int | None = None, scan_layers: bool = False,
               grad_in_forward: bool = True, implementation: str | None = None,
               rngs: nnx.Rngs):
    self.cfg = cfg
    self.fused = fused
    self.scan_layers = scan_layers
    self.grad_in_forward = grad_in_forward
    self.implementation = implementation
    self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype,
                                  param_dtype=cfg.param_dtype, rngs=rngs,
                                  embedding_init=nnx.initializers.normal(cfg.initializer_range))

    def block(rngs):
      return Block(cfg, fused=fused, implementation=implementation, rngs=rngs)

    if scan_layers:
      self.layers = stacked(block, cfg.num_layers, rngs)
    else:
      self.layers = nnx.List([block(rngs) for _ in range(cfg.num_layers)])
    self.norm = make_norm(cfg, fused, implementation, rngs)
    self.lm_head = jnnx.LMHead(
        cfg.d_model, cfg.vocab_size, tie_to=self.embed_tokens if cfg.tie_embeddings else None,
        dtype=cfg.dtype, param_dtype=cfg.param_dtype, ignore_index=IGNORE_INDEX,
        logit_softcap=cfg.final_logit_softcap,
        kernel_init=nnx.initializers.normal(cfg.initializer_range),
        grad_in_forward=grad_in_forward, implementation=implementation, rngs=rngs)
    self.set_remat(remat, segments)
    parallel.annotate(self, PARAM_AXES)

  # Recomputation ------------------------------------------------------------------------------

  def with_layers(self, scan_layers: bool) -> Decoder:
    """This model with its blocks unrolled (``False``) or stacked for a scan (``True``), its
    parameters copied (:func:`stack_layers`, :func:`unstack_layers`)."""
    if scan_layers == self.scan_layers:
      return self
    other = nnx.eval_shape(lambda: Decoder(
        self.cfg, fused=self.fused, remat=self.remat, segments=self.segments,
        scan_layers=scan_layers, grad_in_forward=self.grad_in_forward,
        implementation=self.implementation, rngs=nnx.Rngs(0)))
    return stacking.convert_layers(self, other, self.cfg.num_layers, scan_layers)

  def block_carry(self, tokens: jax.Array) -> Any:
    """What the first block receives for ``tokens`` (the input of :meth:`Block.step`): when
    fused and no block is recomputed, ``(pending, stream)``, so that each residual add is fused
    with the RMSNorm after it across the blocks' boundary; otherwise the embedded tokens, the
    one array a recomputed block keeps. With MoE blocks, ``{"h": that, "stats": ...}``: the
    routing statistics ride along (:func:`jaxfuse.blocks.moe.router_stats`)."""
    h = parallel.constrain(self.embed(tokens), *STREAM)
    carry = (jnp.zeros_like(h), h) if self._pending_carry else h
    if self.cfg.moe:
      return {"h": carry, "stats": moe_blocks.empty_stats(self.cfg.num_experts)}
    return carry

  def embed(self, tokens: jax.Array) -> jax.Array:
    """The embedded tokens (times ``sqrt(d_model)`` in their dtype where the family scales
    them, as Gemma does): vocab-parallel where the mesh splits the vocabulary."""
    if parallel.mesh_size("vocab") == 1:
      h = self.embed_tokens(tokens)
    else:
      table = self.embed_tokens.embedding[...]
      h = parallel.embed(table.astype(self.cfg.dtype or table.dtype), tokens, STREAM)
    pad = self.cfg.pad_token_id
    if pad is not None:   # no gradient into the padding row from the lookup, as torch
      h = jnp.where((tokens == pad)[..., None], jax.lax.stop_gradient(h), h)
    if self.cfg.embed_scale:
      h = h * jnp.asarray(self.cfg.d_model ** 0.5, h.dtype)
    return h

  @property
  def _pending_carry(self) -> bool:
    return (self.fused and self.segments is None and Block.fuses_across(self.cfg)
            and all(p is None for p in self.layer_policies))

  def remat_block(self, batch) -> tuple:
    """``(step, carry)`` for :func:`jaxfuse.remat.profile`: ``carry = step(self.layer(i),
    carry)`` runs block ``i``; ``batch`` is ``(tokens, ...)`` or the tokens."""
    tokens = batch[0] if isinstance(batch, (tuple, list)) else batch
    positions = jnp.arange(tokens.shape[-1])
    return ((lambda block, carry, index=0: block.step(carry, positions, None, index)),
            self.block_carry(tokens))

  # Training -----------------------------------------------------------------------------------

  @staticmethod
  def sequence_order(length: int):
    """The order the blocks see a sequence of ``length`` in: None (as given) unless the mesh
    in context splits the sequence (context parallelism), then the zig-zag order of
    :func:`jaxfuse.parallel.zigzag_order`, which balances the causal ring attention."""
    parts = parallel.mesh_size("seq")
    return None if parts == 1 else parallel.zigzag_order(length, parts)

  def _hidden(self, tokens, positions, segment_ids):
    """The final hidden states in the blocks' order, with the order the blocks saw them in and
    the routing statistics of the MoE blocks (None without)."""
    if positions is None:
      positions = jnp.arange(tokens.shape[-1])
    order = self.sequence_order(tokens.shape[-1])
    if order is not None:
      tokens, positions = tokens[..., order], positions[..., order]
      if segment_ids is not None:
        segment_ids = segment_ids[..., order]
    carry = self.apply_blocks(self.block_carry(tokens), positions, segment_ids)
    stats = None
    if isinstance(carry, dict):
      carry, stats = carry["h"], carry["stats"]
    if isinstance(carry, tuple):
      h = self.norm.add(*carry)[0]
    else:
      h = self.norm(carry)
    return parallel.constrain(h, *FULL_SEQ), order, stats

  def hidden(self, tokens: jax.Array, positions: jax.Array | None = None,
             segment_ids: jax.Array | None = None) -> jax.Array:
    """The final normalized hidden states ``[batch, seq, d_model]``."""
    h, order, _ = self._hidden(tokens, positions, segment_ids)
    return h if order is None else h[:, np.argsort(order)]

  def router_stats(self, tokens: jax.Array, positions: jax.Array | None = None,
                   segment_ids: jax.Array | None = None) -> dict:
    """The routing statistics of every MoE block together (padding, segment id 0, left out):
    ``counts`` and ``probs`` per expert, ``rows``, ``z``, and the token-expert pairs
    ``dropped`` by the capacity (:func:`jaxfuse.blocks.moe.router_stats`)."""
    if not self.cfg.moe:
      raise ValueError("router_stats: the model has no Mixture-of-Experts blocks")
    return self._hidden(tokens, positions, segment_ids)[2]

  def router_loss(self, stats: dict) -> jax.Array:
    """What the routing adds to the loss: ``router_aux_loss_coef`` times the load-balancing
    loss plus ``router_z_loss_coef`` times the z-loss of the summed statistics ``stats``."""
    cfg = self.cfg
    loss = jnp.zeros((), jnp.float32)
    if cfg.router_aux_loss_coef:
      loss += cfg.router_aux_loss_coef * moe_blocks.load_balancing_loss(stats)
    if cfg.router_z_loss_coef:
      loss += cfg.router_z_loss_coef * moe_blocks.router_z_loss(stats)
    return loss

  def __call__(self, tokens: jax.Array, targets: jax.Array,
               positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None,
               total_targets: jax.Array | None = None) -> jax.Array:
    """The mean cross-entropy of ``targets`` (``IGNORE_INDEX`` where none; see
    :func:`next_token_targets`) given ``tokens``, over the batch's valid targets.

    ``total_targets``: divide the summed token losses by this count instead of the batch's own
    (the valid targets of a whole step, when this batch is one of its micro-batches: the
    micro-batches' losses then add up to the step's mean, each token weighted ``1 /
    total_targets`` as in one pass over the step).

    Packed rows (several documents in one row): ``positions`` ``[batch, seq]`` restart at each
    document, ``segment_ids`` ``[batch, seq]`` keep attention inside each document, and the
    targets hold ``IGNORE_INDEX`` at each document's last token (see :mod:`jaxfuse.data`).

    With MoE blocks, :meth:`router_loss` is added (as ``transformers`` adds
    ``router_aux_loss_coef`` times the load-balancing loss with ``output_router_logits``)."""
    h, order, stats = self._hidden(tokens, positions, segment_ids)
    loss = self._token_loss(h, targets, order, total_targets)
    if stats is None:
      return loss
    router = self.router_loss(stats)
    if total_targets is not None:   # this batch's share of the step
      router = router * jnp.sum(targets != IGNORE_INDEX) / total_targets
    return loss + router

  def _token_loss(self, h, targets, order, total_targets=None):
    """The mean cross-entropy of the final hidden states ``h`` (in the blocks' ``order``), or
    their summed cross-entropy over ``total_targets``."""
    if order is not None:
      # The targets in the blocks' order, and the tokens sequence-major: the sequence is split
      # over the mesh, so that flattening [seq, batch] into the loss's rows moves no data.
      targets = targets[..., order]
      h, targets = jnp.swapaxes(h, 0, 1), jnp.swapaxes(targets, 0, 1)
    if self.fused:
      if total_targets is None:
        return self.lm_head.loss(h, targets)
      return self.lm_head.loss(h, targets, reduction="sum") / total_targets
    logits = self.logits_from_hidden(h)
    valid = targets != IGNORE_INDEX
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(valid, targets, 0))
    count = jnp.sum(valid) if total_targets is None else total_targets
    return jnp.sum(jnp.where(valid, losses, 0.0)) / count

  def token_log_probs(self, tokens: jax.Array, targets: jax.Array,
                      positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
                      *, temperature: float = 1.0, return_entropy: bool = False):
    """Float32 ``log p(target)`` ``[batch, seq]`` of each target given the tokens before it (0
    where the target is ``IGNORE_INDEX``), from the fused head without the ``[tokens, V]``
    logits (:func:`jaxfuse.ops.linear_log_probs`; plain logits without ``fused``): what
    preference, distillation and RL losses need of a policy. ``temperature`` divides the
    (soft-capped) logits; ``return_entropy`` also returns each position's entropy.

    With MoE blocks, the routing's loss is not part of these (see :meth:`router_loss`)."""
    h, order, _ = self._hidden(tokens, positions, segment_ids)
    if order is not None:
      targets = targets[..., order]
    if self.fused:
      out = self.lm_head.log_probs(h, targets, temperature=temperature,
                                   return_entropy=return_entropy)
    else:
      logits = self.logits_from_hidden(h) / temperature
      logp_all = jax.nn.log_softmax(logits, axis=-1)
      valid = targets != IGNORE_INDEX
      safe = jnp.where(valid, targets, 0)
      logp = jnp.where(valid, jnp.take_along_axis(logp_all, safe[..., None], -1)[..., 0], 0.0)
      entropy = jnp.where(valid, -jnp.sum(jnp.exp(logp_all) * logp_all, -1), 0.0)
      out = (logp, entropy) if return_entropy else logp
    if order is None:
      return out
    inverse = np.argsort(order)
    return jax.tree.map(lambda x: x[:, inverse], out)

  def logits_from_hidden(self, h: jax.Array) -> jax.Array:
    """Float32 logits of normalized hidden states (materialized: use on few positions),
    soft-capped where the family caps them."""
    logits = self.lm_head.logits(h)
    cap = self.cfg.final_logit_softcap
    return logits if cap is None else cap * jnp.tanh(logits / cap)

  def logits(self, tokens: jax.Array, positions: jax.Array | None = None,
             segment_ids: jax.Array | None = None) -> jax.Array:
    """Float32 logits ``[batch, seq, V]`` of every position (materialized)."""
    return self.logits_from_hidden(self.hidden(tokens, positions, segment_ids))

  # Decoding with a KV cache (jaxfuse.models.decoding) ---------------------------------------

  def init_cache(self, batch: int, max_len: int | None = None, dtype: Any = None) -> dict:
    """An empty KV cache for ``batch`` sequences of up to ``max_len`` tokens (default
    ``cfg.max_seq_len``): per layer, keys and values ``[batch, max_len, kv_heads, head_dim]``."""
    return decoding.init_cache(self.cfg, batch, max_len, dtype)

  def decode(self, tokens: jax.Array, cache: dict,
             lengths: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """Feeds ``tokens [batch, t]`` after the cached ones; returns the float32 logits of the last
    of them ``[batch, V]`` and the updated cache. The prefix is never recomputed: each call
    computes keys and values for its own tokens only. ``lengths [batch]``: right-padded rows
    of that many real tokens, each then with its own length in the cache (see
    :func:`jaxfuse.models.decoding.decode`)."""
    return decoding.decode(self, tokens, cache, lengths)


__all__ = ["IGNORE_INDEX", "PARAM_AXES", "Attention", "Block", "Decoder", "MLP", "generate",
           "next_token_targets", "stack_layers", "unstack_layers"]
