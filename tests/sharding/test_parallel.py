"""jaxfuse.parallel on 8 simulated devices: the mesh and its rules, ring attention against
attention on one device (values and gradients), the vocab-parallel embedding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxfuse import ops, parallel
from jaxfuse.metrics.collectives import collectives
from tests import helpers


def _normal(shape, seed):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


# The mesh and the rules --------------------------------------------------------------------------


def test_parse_mesh():
  assert parallel.parse_mesh("data=2, fsdp=2,tensor=2") == {"data": 2, "fsdp": 2, "tensor": 2}
  assert parallel.parse_mesh("") == {}
  for bad in ("data", "data=0", "batch=2", "data=2,data=4", "tensor=x"):
    with pytest.raises(ValueError, match="--mesh"):
      parallel.parse_mesh(bad)


def test_make_mesh_counts_devices():
  mesh = parallel.make_mesh("data=2,tensor=4")
  assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "expert": 1, "context": 1,
                              "tensor": 4}
  with pytest.raises(ValueError, match="needs 4 devices, there are 8"):
    parallel.make_mesh("data=4")
  with pytest.raises(ValueError, match="unknown mesh axes"):
    parallel.make_mesh({"model": 8})


def test_logical_spec_keeps_only_splits_the_mesh_allows():
  mesh = parallel.make_mesh("data=2,fsdp=2,tensor=2")
  # batch -> (data, fsdp); a size-1 axis (context) is dropped.
  assert parallel.logical_spec(("batch", "seq", "act_heads"), mesh) == P(("data", "fsdp"), None,
                                                                         "tensor")
  # An axis that does not divide the dimension is dropped, innermost first.
  assert parallel.logical_spec(("batch",), mesh, shape=(6,)) == P("data")
  # A mesh axis serves one dimension only.
  assert parallel.logical_spec(("heads", "mlp"), mesh) == P("tensor", None)
  with parallel.axis_rules((("batch", "tensor"),)):
    assert parallel.logical_spec(("batch",), mesh) == P("tensor")


def test_constrain_and_mesh_size_follow_the_mesh_in_context():
  x = jnp.ones((8, 16))
  assert parallel.constrain(x, "batch", None) is x   # no mesh: x itself
  assert parallel.mesh_size("batch") == 1
  mesh = parallel.make_mesh("data=2,fsdp=2,tensor=2")
  with jax.set_mesh(mesh):
    assert parallel.mesh_size("batch") == 4
    y = jax.jit(lambda x: parallel.constrain(x * 2, "batch", "act_mlp"))(x)
  assert y.sharding.spec == P(("data", "fsdp"), "tensor")
  with pytest.raises(ValueError, match="3 axes"), jax.set_mesh(mesh):
    parallel.constrain(x, "batch", None, None)


def test_annotate_and_place_split_parameters_by_their_axes():
  layer = parallel.annotate(nnx.Linear(16, 32, rngs=nnx.Rngs(0)),
                            {r"kernel": ("embed", "mlp"), r"bias": ("mlp",)})
  with pytest.raises(ValueError, match="do not match"):
    parallel.annotate(nnx.Linear(16, 32, rngs=nnx.Rngs(0)), {r"kernel": ("layers", "embed", "mlp")})
  mesh = parallel.make_mesh("fsdp=2,tensor=4")
  state = parallel.place(nnx.state(layer), mesh)
  assert state["kernel"][...].sharding.spec == P("fsdp", "tensor")
  assert state["kernel"][...].addressable_shards[0].data.shape == (8, 8)
  assert state["bias"][...].sharding.spec == P("tensor")
  np.testing.assert_array_equal(np.asarray(state["kernel"][...]), np.asarray(layer.kernel[...]))


# Ring attention --------------------------------------------------------------------------------


def test_zigzag_order():
  order = parallel.zigzag_order(16, 4)   # 8 chunks of 2; device i holds chunks i and 7 - i
  assert sorted(order.tolist()) == list(range(16))
  assert order.reshape(4, 4).tolist() == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11],
                                          [6, 7, 8, 9]]
  with pytest.raises(ValueError):
    parallel.zigzag_order(12, 4)


def _ring_case(mesh_shape, *, heads, kv_heads, causal, batch=2, seq=32, hd=8):
  q = _normal((batch, seq, heads, hd), 0)
  k, v = _normal((batch, seq, kv_heads, hd), 1), _normal((batch, seq, kv_heads, hd), 2)
  do = _normal((batch, seq, heads, hd), 3)

  def loss(attend, q, k, v):
    return jnp.sum(attend(q, k, v) * do_order)

  mesh = parallel.make_mesh(mesh_shape)
  parts = dict(mesh.shape)["context"]
  order = parallel.zigzag_order(seq, parts) if causal else np.random.default_rng(4).permutation(seq)
  do_order = do[:, order]
  want = jax.value_and_grad(lambda *a: loss(lambda q, k, v: ops.attention(
      q, k, v, causal=causal)[:, order], *a), argnums=(0, 1, 2))(q, k, v)
  with jax.set_mesh(mesh):
    spec = parallel.logical_spec(("batch", "seq", "act_kv_heads", None), mesh, k.shape)
    args = [jax.device_put(x[:, order], NamedSharding(mesh, spec)) for x in (q, k, v)]
    ring = jax.jit(jax.value_and_grad(lambda *a: loss(lambda q, k, v: (
        parallel.context_parallel_attention(q, k, v, causal=causal)), *a), argnums=(0, 1, 2)))
    got = ring(*args)
    text = ring.lower(*args).compile().as_text()
  helpers.assert_close(got[0], want[0], rtol=1e-5, atol=1e-4)
  inverse = np.argsort(order)
  for g, w in zip(got[1], want[1]):
    helpers.assert_close(g[:, inverse], w, rtol=1e-5, atol=1e-5)
  return text, spec


@pytest.mark.parametrize("mesh_shape,heads,kv_heads,causal", [
    ("context=8", 2, 2, True),
    ("context=8", 4, 2, True),              # grouped queries
    ("context=8", 2, 1, False),
    ("data=2,context=4", 2, 2, True),
    ("context=2,tensor=4", 4, 4, True),     # heads split too
])
def test_ring_attention_equals_attention(mesh_shape, heads, kv_heads, causal):
  text, spec = _ring_case(mesh_shape, heads=heads, kv_heads=kv_heads, causal=causal)
  kinds = {c.kind for c in collectives(text)}
  # Key/value blocks travel by collective-permute; nothing of the sequence is gathered.
  assert "collective-permute" in kinds
  assert "all-gather" not in kinds and "all-to-all" not in kinds, kinds
  assert spec[1] == "context"


def test_ring_attention_errors():
  mesh = parallel.make_mesh("context=8")
  q = jnp.ones((1, 24, 2, 8))   # blocks of 3: not two zig-zag chunks
  with jax.set_mesh(mesh), pytest.raises(ValueError, match="even block length"):
    parallel.context_parallel_attention(q, q, q, causal=True)


def test_context_parallel_attention_without_a_split_is_attention():
  q, k, v = (_normal((1, 16, 2, 8), s) for s in range(3))
  helpers.assert_close(parallel.context_parallel_attention(q, k, v),
                       ops.attention(q, k, v, causal=True), rtol=1e-6, atol=1e-6)


# The vocab-parallel embedding ------------------------------------------------------------------


@pytest.mark.parametrize("mesh_shape", ["tensor=8", "data=2,fsdp=2,tensor=2"])
def test_vocab_parallel_embedding(mesh_shape):
  vocab, d, batch, seq = 64, 16, 4, 16
  table = _normal((vocab, d), 0)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, vocab, (batch, seq)), jnp.int32)
  weights = _normal((batch, seq, d), 2)

  def loss(table, tokens):
    return jnp.sum(jnp.sin(parallel.embed(table, tokens)) * weights)

  want = jax.value_and_grad(loss)(table, tokens)
  mesh = parallel.make_mesh(mesh_shape)
  with jax.set_mesh(mesh):
    table_s = jax.device_put(table, NamedSharding(mesh, parallel.logical_spec(
        ("vocab", "embed"), mesh)))
    tokens_s = jax.device_put(tokens, NamedSharding(mesh, parallel.logical_spec(
        ("batch", "seq"), mesh)))
    f = jax.jit(jax.value_and_grad(loss))
    got = f(table_s, tokens_s)
    found = collectives(f.lower(table_s, tokens_s).compile().as_text())
    out = jax.jit(parallel.embed)(table_s, tokens_s)
  helpers.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
  helpers.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
  # Sequence parallel: the lookup arrives split over the sequence by the tensor axis.
  assert out.sharding.spec[1] == "tensor"
  # The table is never gathered over the vocabulary.
  assert not any(c.kind == "all-gather" and c.shape and c.shape[0] == vocab for c in found)
  with pytest.raises(TypeError, match="integers"):
    parallel.embed(table, tokens.astype(jnp.float32))
