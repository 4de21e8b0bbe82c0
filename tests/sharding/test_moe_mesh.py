"""Expert parallelism on 8 simulated devices: a Mixture-of-Experts decoder (with a shared expert,
as Qwen2-MoE's) whose experts are split over the ``expert`` mesh axis (alone with data parallelism, and with FSDP and tensor
parallelism) gives the single-device loss and gradients, holds ``1 / split`` of the experts per
device, and sends its tokens to the experts by all-to-all, never by gathering them; the
training CLI on such a mesh gives the single-device losses."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxfuse import parallel, train
from jaxfuse.ops import dispatch
from jaxfuse.parallel import experts
from jaxfuse.metrics.collectives import collectives
from jaxfuse.models import Decoder, DecoderConfig, next_token_targets
from tests import helpers

# No two shapes alike: the rows of a device (32), its pairs (64), d_model and the widths.
B, T, D, V, E, K, F = 8, 16, 24, 64, 8, 2, 40


@functools.cache
def _model():
  cfg = DecoderConfig(vocab_size=V, d_model=D, num_layers=2, num_heads=4, num_kv_heads=2,
                      mlp_dim=F, num_experts=E, experts_per_token=K, router_aux_loss_coef=0.5,
                      router_z_loss_coef=0.01, shared_expert_mlp_dim=F // 2)
  return nnx.split(Decoder(cfg, implementation="xla", rngs=nnx.Rngs(0)), nnx.Param, ...)


def _batch():
  tokens = jax.random.randint(jax.random.key(1), (B, T), 0, V)
  return tokens, next_token_targets(tokens)


def _loss(params, tokens, targets):
  graphdef, _, rest = _model()
  return nnx.merge(graphdef, params, rest)(tokens, targets)


@functools.cache
def _single():
  return jax.jit(jax.value_and_grad(_loss))(_model()[1], *_batch())


def _expert_kernels(tree):
  return [x for path, x in jax.tree_util.tree_leaves_with_path(tree)
          if "experts" in jax.tree_util.keystr(path)]


def _split_shapes(tree) -> set[tuple[int, ...]]:
  """Every shape a parameter of ``tree`` has with any of its axes halved (what an all-gather
  over one or two mesh axes of 2 devices makes of its shards)."""
  out = set()
  for x in jax.tree.leaves(tree):
    for halved in itertools.product((1, 2), repeat=x.ndim):
      out.add(tuple(n // h for n, h in zip(x.shape, halved)))
  return out


def _placed(mesh_text):
  """The mesh and the step's arguments on it: the parameters as the rules place them, the
  batch split over its batch axes."""
  mesh = parallel.make_mesh(mesh_text)
  tokens, targets = _batch()
  with jax.set_mesh(mesh):
    params = parallel.place(_model()[1], mesh)
    rows = NamedSharding(mesh, parallel.logical_spec(("batch", "seq"), mesh, tokens.shape))
    return mesh, (params, jax.device_put(tokens, rows), jax.device_put(targets, rows))


# (mesh, how many devices split each expert kernel: expert x fsdp x tensor)
MESHES = [("expert=4,data=2", 4), ("expert=2,fsdp=2,tensor=2", 8)]


@pytest.mark.parametrize("mesh_text,split", MESHES, ids=[m for m, _ in MESHES])
def test_expert_parallel_decoder_equals_one_device(mesh_text, split):
  mesh, args = _placed(mesh_text)
  params = args[0]
  with jax.set_mesh(mesh):
    out = (NamedSharding(mesh, P()), jax.tree.map(lambda x: x.sharding, params))
    step = jax.jit(jax.value_and_grad(_loss), out_shardings=out).lower(*args).compile()
    value, grads = step(*args)
  want_value, want_grads = _single()
  helpers.assert_close(value, want_value, rtol=1e-5, atol=0)
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
    helpers.assert_close(g, w, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(w))))

  # Each device holds 1 / split of every expert kernel, and of their gradients.
  kernels = _expert_kernels(params)
  assert len(kernels) == 3 * 2   # gate, up, down in 2 layers
  for x in kernels + _expert_kernels(grads):
    assert {s.data.nbytes for s in x.addressable_shards} == {x.nbytes // split}

  # The tokens reach the experts by all-to-all, and the MoE layers gather weights only (the
  # experts' and the router's d_model and width splits under fsdp and tensor); no whole
  # activation is gathered anywhere. (Under tensor parallelism attention and the LM head gather
  # the residual stream's sequence, and the vocab-parallel embedding its rows' features: those
  # are the dense decoder's, tests/sharding/test_decoder_mesh.py.)
  text = step.as_text()
  found = collectives(text)
  pairs = B * T // 8 * K   # a device's token-expert pairs: one block of them per destination
  assert any(c.kind == "all-to-all" and c.shape[-2:] == (pairs, D) for c in found)
  gathers = [(c.shape, "moe_expert_parallel" in line) for line in text.splitlines()
             for c in collectives(line) if c.kind == "all-gather"]
  in_moe = {shape for shape, moe_scope in gathers if moe_scope}
  assert in_moe <= _split_shapes(params), in_moe
  assert bool(in_moe) == ("tensor" in mesh_text)   # no fsdp or tensor split: nothing to gather
  assert not {shape for shape, _ in gathers} & {(B, T, D), (B * T, D)}


# The training CLI ------------------------------------------------------------------------------

TINY = ["--steps", "3", "--batch", "8", "--seq", "16", "--warmup", "1", "--eval-every", "3",
        "--eval-batches", "1", "--save-every", "3", "--sample-tokens", "0"]


def test_training_a_mixtral_on_an_expert_mesh_gives_the_single_device_losses(tmp_path):
  pytest.importorskip("transformers")
  from jaxfuse.testing.checkpoints import write_tiny_checkpoint

  checkpoint = write_tiny_checkpoint(tmp_path / "mixtral", family="mixtral",
                                     output_router_logits=True, router_aux_loss_coef=0.5)
  runs = {}
  for mesh in (None, "expert=2,data=2,fsdp=2"):
    extra = [] if mesh is None else ["--mesh", mesh]
    cfg = train.parse_args([*TINY, "--init-from", str(checkpoint), *extra,
                            "--out", str(tmp_path / (mesh or "single"))])
    runs[mesh] = train.train(cfg, log=lambda *_: None)
  single, sharded = runs[None]["history"], runs["expert=2,data=2,fsdp=2"]["history"]
  assert sharded["step"] == single["step"] == [1, 2, 3]
  helpers.assert_close(np.asarray(sharded["loss"]), np.asarray(single["loss"]), rtol=1e-5,
                       atol=0)
  helpers.assert_close(np.asarray(sharded["val_loss"]), np.asarray(single["val_loss"]),
                       rtol=1e-5, atol=0)


# The ragged exchange ---------------------------------------------------------------------------


def _expert_parallel_step(mesh_text):
  """The mesh, the placed arguments and a fresh (untraced) jitted step."""
  return (*_placed(mesh_text), jax.jit(jax.value_and_grad(_loss)))


def test_ragged_exchange_equals_one_device(monkeypatch):
  """The ragged exchange of GPUs and TPUs, its offsets and sizes as they compute them, with
  the exchange itself built from all-gathers (XLA:CPU has no ragged all-to-all)."""
  monkeypatch.setattr(experts, "EMULATE_RAGGED", True)
  mesh, args, step = _expert_parallel_step("expert=4,data=2")
  with jax.set_mesh(mesh):
    value, grads = step(*args)
  want_value, want_grads = _single()
  helpers.assert_close(value, want_value, rtol=1e-5, atol=0)
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
    helpers.assert_close(g, w, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(w))))


def _stablehlo_all_to_all_types(text: str) -> list[str]:
  """The result types of the padded all-to-alls of a lowered (StableHLO) program."""
  return [line.rsplit("->", 1)[-1].strip() for line in text.splitlines()
          if '"stablehlo.all_to_all"' in line]


def test_gpus_exchange_by_ragged_all_to_all_forward_and_backward():
  """Lowered for CUDA, the step sends the rows by ``ragged_all_to_all`` both ways, forward and
  backward (in each of the 2 MoE layers: out and back, and the transposes of both), and by no
  padded all-to-all of rows; lowered for CPUs, the same step has no ragged exchange and its
  rows travel in padded ``[P, C, d]`` blocks."""
  rows_block = f"x{B * T // 8 * K}x{D}xf32>"   # [P, C, d]: C a device's pairs
  texts = {}
  for platform in ("gpu", "cpu"):
    mesh, args, step = _expert_parallel_step("expert=4,data=2")   # traced afresh
    with jax.set_mesh(mesh), dispatch.target_platform(platform):
      texts[platform] = step.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  gpu, cpu = texts["gpu"], texts["cpu"]
  assert gpu.count("@ragged_all_to_all") == 2 * 4, gpu.count("@ragged_all_to_all")
  assert not [t for t in _stablehlo_all_to_all_types(gpu) if t.endswith(rows_block)]
  assert "@ragged_all_to_all" not in cpu
  assert [t for t in _stablehlo_all_to_all_types(cpu) if t.endswith(rows_block)]
