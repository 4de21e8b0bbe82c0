"""Packed rows: a row holding several documents (positions restarting, segment ids, no target
across a boundary) gives the loss and gradients of its documents run one at a time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxfuse.models import Decoder, DecoderConfig
from jaxfuse.models.decoder import IGNORE_INDEX, next_token_targets

LLAMA = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=64)
# Gemma 2's options: sandwich norms, 1 + w scales, alternating sliding windows, soft-caps.
GEMMA2 = dict(LLAMA, norm_placement="sandwich", norm_scale_offset=1.0, embed_scale=True,
              activation="gelu_tanh", sliding_window=4, layer_types=("sliding_attention", "full_attention"),
              attn_logit_softcap=50.0, final_logit_softcap=30.0, head_dim=16)
QWEN3 = dict(LLAMA, qk_norm="head")

LENGTHS = (5, 9, 4)   # three documents in a row of 20: two padding tokens


def packed_row(docs, seq):
  """``(tokens, targets, positions, segment_ids)`` ``[1, seq]``: ``docs`` one after another."""
  tokens, targets = np.zeros(seq, np.int32), np.full(seq, IGNORE_INDEX, np.int32)
  positions, segments = np.zeros(seq, np.int32), np.zeros(seq, np.int32)
  start = 0
  for i, doc in enumerate(docs):
    end = start + len(doc)
    tokens[start:end], segments[start:end] = doc, i + 1
    positions[start:end] = np.arange(len(doc))
    targets[start:end - 1] = doc[1:]
    start = end
  return tuple(jnp.asarray(a[None]) for a in (tokens, targets, positions, segments))


def summed_loss(model, tokens, targets, *rest):
  """The loss summed over the valid targets (the model's mean times their count)."""
  return model(tokens, targets, *rest) * jnp.sum(targets != IGNORE_INDEX)


def relative_error(a, b):
  return float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))


@pytest.mark.parametrize("family, fused, scan", [
    ("llama", True, False), ("llama", False, False), ("gemma2", True, True),
    ("gemma2", False, False), ("qwen3", True, False)])
def test_packed_row_equals_documents_one_at_a_time(family, fused, scan):
  options = {"llama": LLAMA, "gemma2": GEMMA2, "qwen3": QWEN3}[family]
  cfg = DecoderConfig(**options, dtype=jnp.float32)
  model = Decoder(cfg, fused=fused, scan_layers=scan, remat="block" if scan else None,
                  rngs=nnx.Rngs(0))
  rng = np.random.default_rng(1)
  docs = [rng.integers(0, cfg.vocab_size, n).astype(np.int32) for n in LENGTHS]
  row = packed_row(docs, 20)

  value_and_grad = nnx.jit(nnx.value_and_grad(summed_loss))
  packed_loss, packed_grads = value_and_grad(model, *row)
  loss, grads = 0.0, None
  for doc in docs:
    tokens = jnp.asarray(doc[None])
    value, g = value_and_grad(model, tokens, next_token_targets(tokens))
    loss += value
    grads = g if grads is None else jax.tree.map(jnp.add, grads, g)

  np.testing.assert_allclose(float(packed_loss), float(loss), rtol=2e-6)
  errors = jax.tree.leaves(jax.tree.map(relative_error, packed_grads, grads))
  assert len(errors) == len(jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert max(errors) < 2e-5


def test_segments_keep_documents_apart():
  """Changing one document changes no other document's logits in the row."""
  cfg = DecoderConfig(**LLAMA, dtype=jnp.float32)
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(2)
  docs = [rng.integers(0, cfg.vocab_size, n).astype(np.int32) for n in LENGTHS]
  tokens, _, positions, segments = packed_row(docs, 20)
  changed = tokens.at[0, :LENGTHS[0]].set((tokens[0, :LENGTHS[0]] + 1) % cfg.vocab_size)
  before = model.logits(tokens, positions, segments)
  after = model.logits(changed, positions, segments)
  assert not np.allclose(before[0, :LENGTHS[0]], after[0, :LENGTHS[0]])
  np.testing.assert_array_equal(before[0, LENGTHS[0]:], after[0, LENGTHS[0]:])

