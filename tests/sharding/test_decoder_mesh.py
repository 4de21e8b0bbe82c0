"""The decoder trained on a mesh of 8 simulated devices: every strategy of jaxfuse.parallel
gives the single-device loss and gradients, gathers no whole activation, and runs the
collectives its analysis says, per layer."""

from __future__ import annotations

import functools
from collections import Counter

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxfuse import parallel
from jaxfuse.metrics import per_device_residual_bytes, residual_bytes
from jaxfuse.metrics.collectives import collectives
from jaxfuse.models import Decoder, DecoderConfig, next_token_targets
from tests import helpers

B, T, D, H, HD, MLP, V = 8, 32, 64, 8, 8, 320, 384   # no two shapes alike (B*T != MLP)


def _config(layers=2, kv_heads=H):
  return DecoderConfig(vocab_size=V, d_model=D, num_layers=layers, num_heads=H,
                       num_kv_heads=kv_heads, mlp_dim=MLP)


def _batch(batch=B, seq=T):
  tokens = jax.random.randint(jax.random.key(1), (batch, seq), 0, V)
  return tokens, next_token_targets(tokens)


@functools.cache
def _model(layers=2, kv_heads=H):
  return nnx.split(Decoder(_config(layers, kv_heads), implementation="xla", rngs=nnx.Rngs(0)),
                   nnx.Param, ...)


def _loss_fn(layers, kv_heads):
  graphdef, _, rest = _model(layers, kv_heads)
  return lambda params, tokens, targets: nnx.merge(graphdef, params, rest)(tokens, targets)


def _placed(mesh, params, tokens, targets):
  batch = NamedSharding(mesh, parallel.logical_spec(("batch", "seq"), mesh, tokens.shape))
  return parallel.place(params, mesh), jax.device_put(tokens, batch), jax.device_put(targets,
                                                                                     batch)


def _compiled(mesh_text, *, layers=2, kv_heads=H, grad=True, batch=B, seq=T):
  """``(step, args)``: the decoder's loss (and gradients, laid out as the parameters) compiled
  for ``mesh_text``, with its arguments placed there."""
  mesh = parallel.make_mesh(mesh_text)
  loss = _loss_fn(layers, kv_heads)
  f = jax.value_and_grad(loss) if grad else loss
  with jax.set_mesh(mesh):
    args = _placed(mesh, _model(layers, kv_heads)[1], *_batch(batch, seq))
    out = NamedSharding(mesh, P())
    if grad:
      out = (out, jax.tree.map(lambda x: x.sharding, args[0]))
    return jax.jit(f, out_shardings=out).lower(*args).compile(), args


@functools.cache
def _single(kv_heads=H, batch=B, seq=T):
  loss = _loss_fn(2, kv_heads)
  return jax.jit(jax.value_and_grad(loss))(_model(2, kv_heads)[1], *_batch(batch, seq))


STRATEGIES = [
    # (mesh, kv_heads, batch): every axis alone, and products of them.
    ("data=8", H, B),
    ("fsdp=8", H, B),
    ("tensor=8", H, B),
    ("context=8", H, 1),
    ("data=2,fsdp=2,tensor=2", H, B),
    ("data=2,context=2,tensor=2", 2, B),   # grouped queries, two heads of k/v a device
]


@pytest.mark.parametrize("mesh_text,kv_heads,batch", STRATEGIES)
def test_strategy_equals_one_device(mesh_text, kv_heads, batch):
  step, args = _compiled(mesh_text, kv_heads=kv_heads, batch=batch)
  value, grads = step(*args)
  want_value, want_grads = _single(kv_heads, batch)
  helpers.assert_close(value, want_value, rtol=1e-5, atol=0)
  flat, want_flat = jax.tree.leaves(grads), jax.tree.leaves(want_grads)
  assert len(flat) == len(want_flat)
  for g, w in zip(flat, want_flat):
    helpers.assert_close(g, w, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(w))))
  # The gradients are laid out as the parameters: split where the parameters are.
  for g, p in zip(flat, jax.tree.leaves(args[0])):
    assert g.sharding.is_equivalent_to(p.sharding, g.ndim)

  # No whole activation is gathered: not the residual stream [B, T, D] (except for Megatron's
  # sequence-parallel gathers when the tensor axis spans every device; counted below), nor
  # the heads [B, T, H, hd] or the logits [B*T, V].
  whole = {(batch, T, H, HD), (batch, T, kv_heads, HD), (batch * T, V), (batch, T, V)}
  if mesh_text != "tensor=8":
    whole |= {(batch, T, D), (batch * T, D)}
  gathered = [c.shape for c in collectives(step.as_text())
              if c.kind in ("all-gather", "all-to-all") and c.shape in whole]
  assert not gathered, gathered


def _nbytes(params) -> int:
  """The parameters' bytes on one device (the largest shard of each)."""
  return sum(max(s.data.nbytes for s in x.addressable_shards) for x in jax.tree.leaves(params))


def test_strategies_split_what_they_promise():
  """Per device, against one device: data, tensor and context parallelism split the
  residuals, FSDP and tensor parallelism the parameters (within 1.25/8: what stays whole is
  the loss's gradients kept from the forward, ``dW`` under data parallelism and ``dh`` under
  tensor parallelism)."""
  def bytes_of(mesh_text, batch, seq):
    if mesh_text is None:   # one device
      args = (_model()[1], *_batch(batch, seq))
      return residual_bytes(_loss_fn(2, H), *args), _nbytes(args[0])
    mesh = parallel.make_mesh(mesh_text)
    with jax.set_mesh(mesh):
      args = _placed(mesh, _model()[1], *_batch(batch, seq))
      residual = per_device_residual_bytes(_loss_fn(2, H), *args)
    return residual, _nbytes(args[0])

  # One long sequence for context parallelism: dW (V x d_model, whole on every device) stays
  # under 2% of the residuals, as in a model of real size.
  for batch, seq, strategies in ((B, 2 * T, ("data=8", "fsdp=8", "tensor=8")),
                                 (1, 16 * T, ("context=8",))):
    single_residual, single_params = bytes_of(None, batch, seq)
    for mesh_text in strategies:
      residual, params = bytes_of(mesh_text, batch, seq)
      if mesh_text != "fsdp=8":
        assert residual <= 1.25 / 8 * single_residual, (mesh_text, residual, single_residual)
      if mesh_text in ("fsdp=8", "tensor=8"):
        assert params <= 1.25 / 8 * single_params, (mesh_text, params, single_params)
      else:
        assert params == single_params


def _per_layer(mesh_text, *, grad, batch=B, **kinds):
  """The collectives (kind, per-device shape) one more layer adds to the compiled program."""
  one, _ = _compiled(mesh_text, layers=1, grad=grad, batch=batch)
  two, _ = _compiled(mesh_text, layers=2, grad=grad, batch=batch)
  count = lambda step: Counter((c.kind, c.shape) for c in collectives(step.as_text()))  # noqa
  c1, c2 = count(one), count(two)
  assert not c1 - c2, f"a layer more removed collectives: {c1 - c2}"
  return c2 - c1


def _reduce_scatters(added, shape):
  """Reduce-scatters of ``shape`` (XLA:CPU writes those it partitions itself as an all-reduce
  of the whole array followed by a slice)."""
  return added.pop(("reduce-scatter", shape), 0) + added.pop(("all-reduce", (B, T, D)), 0)


@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "fwd+bwd"])
def test_tensor_parallel_collectives_per_layer(grad):
  """Megatron with sequence parallelism: per block, an all-gather of the sequence before the
  column-parallel projections (attention's q/k/v, the MLP's gate/up) and a reduce-scatter after
  the row-parallel ones (o, down), in the forward; in the backward, their transposes (two
  reduce-scatters, two all-gathers) and the two all-gathers again of the projections' inputs,
  which are kept split over the sequence. No weight is gathered."""
  added = _per_layer("tensor=8", grad=grad)
  gathers = added.pop(("all-gather", (B, T, D)), 0)
  scatters = _reduce_scatters(added, (B, T // 8, D))
  assert (gathers, scatters) == ((2 + 4, 2 + 2) if grad else (2, 2))
  assert not added, f"other collectives per layer: {added}"


def test_data_parallel_has_no_collectives_per_layer():
  assert not _per_layer("data=8", grad=True)


def test_fsdp_gathers_weights_not_activations_per_layer():
  added = _per_layer("fsdp=8", grad=True)
  weights = {(D, H * HD), (D, MLP), (MLP, D), (H * HD, D)}
  assert added and all(kind == "all-gather" and shape in weights for kind, shape in added)


def test_context_parallel_passes_key_value_blocks_per_layer():
  """The forward's ring: each of the other 7 blocks of k and of v arrives by one
  collective-permute; the backward sends the blocks around again, with their gradients."""
  block = (1, T // 8, H, HD)
  forward = _per_layer("context=8", grad=False, batch=1)
  assert forward == Counter({("collective-permute", block): 2 * 7})
  both = _per_layer("context=8", grad=True, batch=1)
  assert set(both) == {("collective-permute", block)}
  assert both[("collective-permute", block)] > 2 * 7


def test_sequence_order_and_hidden_states():
  """Under context parallelism the blocks see the sequence in zig-zag order; ``hidden``
  returns it in the given order."""
  graphdef, params, rest = _model()
  model = nnx.merge(graphdef, params, rest)
  tokens, _ = _batch(1)
  want = model.hidden(tokens)
  mesh = parallel.make_mesh("context=8")
  with jax.set_mesh(mesh):
    assert model.sequence_order(T).tolist() == parallel.zigzag_order(T, 8).tolist()
    got = jax.jit(lambda p, t: nnx.merge(graphdef, p, rest).hidden(t))(
        *_placed(mesh, params, tokens, tokens)[:2])
  assert model.sequence_order(T) is None
  helpers.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_context_parallel_needs_the_fused_decoder():
  model = Decoder(_config(1), fused=False, rngs=nnx.Rngs(0))
  tokens, targets = _batch(1)
  with jax.set_mesh(parallel.make_mesh("context=8")), pytest.raises(ValueError, match="fused"):
    model(tokens, targets)


# The families' options on a mesh ------------------------------------------------------------------

FAMILY_OPTIONS = {
    # Gemma 2: norms before and after each half with 1 + w, GeLU-tanh, query scale, both
    # soft-caps, scaled embeddings, alternating sliding-window and global layers.
    "gemma2": dict(norm_placement="sandwich", norm_scale_offset=1.0, activation="gelu_tanh",
                   query_scale=0.3, attn_logit_softcap=5.0, final_logit_softcap=3.0,
                   embed_scale=True, sliding_window=8,
                   layer_types=("sliding_attention", "full_attention"), model_type="gemma2"),
    # Qwen3: per-head q/k norms (the fused qk_norm_rope op, split with the heads), with and
    # without grouped queries.
    "qwen3": dict(qk_norm="head", model_type="qwen3"),
    "qwen3-gqa": dict(qk_norm="head", num_kv_heads=4, model_type="qwen3"),
    # OLMo 2: norms after each half, q/k norms over the whole projection (kept whole).
    "olmo2": dict(norm_placement="post", qk_norm="projection", model_type="olmo2"),
}
FAMILY_MESHES = [("gemma2", "data=2,fsdp=2,tensor=2"), ("qwen3-gqa", "data=2,fsdp=2,tensor=2"),
                 ("qwen3", "tensor=8"), ("olmo2", "data=4,fsdp=2")]


@pytest.mark.parametrize("family,mesh_text", FAMILY_MESHES,
                         ids=[f"{f}-{m}" for f, m in FAMILY_MESHES])
def test_family_options_on_a_mesh_equal_one_device(family, mesh_text):
  cfg = _config().replace(**FAMILY_OPTIONS[family])
  graphdef, params, rest = nnx.split(Decoder(cfg, implementation="xla", rngs=nnx.Rngs(0)),
                                     nnx.Param, ...)

  def loss(params, tokens, targets):
    return nnx.merge(graphdef, params, rest)(tokens, targets)

  want = jax.jit(jax.value_and_grad(loss))(params, *_batch())
  mesh = parallel.make_mesh(mesh_text)
  with jax.set_mesh(mesh):
    args = _placed(mesh, params, *_batch())
    got = jax.jit(jax.value_and_grad(loss))(*args)
  helpers.assert_close(got[0], want[0], rtol=1e-5, atol=0)
  for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
    helpers.assert_close(g, w, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(w))))
