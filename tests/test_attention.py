"""jaxfuse.ops.attention against torch's scaled_dot_product_attention: output, dq, dk, dv (and
dbias) across lengths, heads, masks and dtypes, memory, and bad input. The Pallas kernels run in
interpret mode at small shapes here; their lowering for GPUs is in test_attention_pallas.py."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxfuse.metrics import residual_bytes, torch_residual_bytes
from jaxfuse.ops import attention, attention_reference
from tests import helpers
from tests.attention_common import (FAST_COMPILE, assert_matches_torch, inputs, jax_step,
                                    torch_step)


# Float32 against torch, across lengths, heads and masks ----------------------------------------

# (batch, q_len, kv_len, q_heads, kv_heads, head_dim). XLA runs every length; Pallas runs in
# interpret mode on CPU, so it takes the small ones. GQA at 77 tokens, full and causal, is the op
# table's cases "" and "causal" (tests/cases/attention.py), in every dtype on both paths.
# The XLA path runs strips at these lengths; "tiles" runs its tile loops (longer sequences').
XLA_CASES = [
    ((2, 1, 1, 2, 2, 64), True, "strips"),
    ((1, 1000, 1000, 2, 1, 64), False, "strips"),   # MQA, not a multiple of any tile
    ((1, 1000, 1000, 2, 1, 64), True, "strips"),
    ((1, 1000, 1000, 2, 1, 64), True, "tiles"),
    ((1, 1024, 1024, 2, 2, 32), True, "tiles"),     # 512-wide XLA tiles
    ((1, 700, 600, 2, 1, 64), True, "tiles"),       # 128-wide XLA tiles, q longer than kv
    ((1, 700, 600, 2, 1, 64), True, "strips"),
]


def _case_id(shape, causal, path):
  return ("b{}_tq{}_tk{}_h{}/{}_d{}".format(*shape) + ("-causal" if causal else "-full")
          + f"-{path}")


@pytest.mark.parametrize("shape, causal, path", XLA_CASES, ids=[_case_id(*c) for c in XLA_CASES])
def test_xla_fp32_matches_torch(shape, causal, path, monkeypatch):
  from jaxfuse.ops.flash_attention import xla

  if path == "tiles":
    monkeypatch.setattr(xla, "XLA_STRIP_MAX_SCORES", 0)
  q, k, v, g = inputs(*shape)
  got = jax_step(q, k, v, g, "xla", causal=causal)
  assert_matches_torch(got, torch_step(q, k, v, g, causal=causal), f"{shape} causal={causal}")


# Causal with fewer queries than keys is the op table's case "causal q<kv".
LENGTH_CASES = [("xla", (130, 77), False), ("xla", (130, 77), True), ("xla", (77, 130), False),
                ("pallas", (130, 77), False),
                *((impl, lengths, causal) for impl in helpers.CPU_KERNELS
                  for lengths, causal in (((130, 77), True), ((77, 130), False)))]


@pytest.mark.parametrize("impl, lengths, causal", LENGTH_CASES,
                         ids=[f"{i}-q{a}-kv{b}-{'causal' if c else 'full'}"
                              for i, (a, b), c in LENGTH_CASES])
def test_q_and_kv_lengths_differ(impl, lengths, causal, pallas_mode):
  q, k, v, g = inputs(1, lengths[0], lengths[1], 2, 1, 32, seed=2)
  got = jax_step(q, k, v, g, impl, causal=causal)
  assert_matches_torch(got, torch_step(q, k, v, g, causal=causal), f"{lengths}")


def test_xla_strips_vmap_units_in_batches_with_a_remainder(monkeypatch):
  """Five (batch, kv head) units computed two (forward) and three (backward) at a time: the
  last batch holds the rest."""
  from jaxfuse.ops.flash_attention import xla

  q, k, v, g = inputs(5, 40, 40, 2, 1, 16, seed=13)
  per_unit = xla.strip_height(40, 40, 2) * 2 * 40
  monkeypatch.setattr(xla, "XLA_STRIP_BATCH_SCORES", 2 * per_unit)
  monkeypatch.setattr(xla, "XLA_STRIP_BACKWARD_BATCH_SCORES", 3 * per_unit)
  got = jax_step(q, k, v, g, "xla", causal=True)
  assert_matches_torch(got, torch_step(q, k, v, g, causal=True), "5 units")


def test_xla_strips_backward_one_unit_at_a_time_in_its_length_window(monkeypatch):
  """The lengths of ``XLA_STRIP_BACKWARD_ONE_UNIT`` run the backward one unit at a time (a
  loop without vmap); outside it every unit goes in one batch. Both match torch."""
  from jaxfuse.ops.flash_attention import xla

  q, k, v, g = inputs(3, 40, 40, 2, 1, 16, seed=14)
  want = torch_step(q, k, v, g, causal=True)

  # Loop lengths of the forward (one batch of the 3 units) and the backward.
  for window, loops in (((30, 50), ["1", "3"]), ((50, 60), ["1", "1"])):
    monkeypatch.setattr(xla, "XLA_STRIP_BACKWARD_ONE_UNIT", window)

    def grads(q, k, v):   # a new function each time: traces are cached by function
      f = lambda q, k, v: attention(q, k, v, causal=True, implementation="xla")
      return jax.vjp(f, q, k, v)[1](g)

    assert re.findall(r"length=(\d+)", str(jax.make_jaxpr(grads)(q, k, v))) == loops, window
    assert_matches_torch(jax_step(q, k, v, g, "xla", causal=True), want, f"window {window}")


@pytest.mark.parametrize("impl, d", [("xla", 256), ("pallas", 256),
                                     *((i, d) for i in helpers.CPU_KERNELS for d in (80, 256))])
def test_head_dim_range(impl, d, pallas_mode):
  q, k, v, g = inputs(1, 50, 50, 2, 2, d, seed=3)
  scale = 1.5 / d**0.5
  got = jax_step(q, k, v, g, impl, causal=True, scale=scale)
  assert_matches_torch(got, torch_step(q, k, v, g, causal=True, scale=scale), f"d={d}")


@pytest.mark.parametrize("impl, causal", [("xla", False), ("xla", True), ("xla-tiles", True),
                                          ("pallas", True),
                                          *((i, c) for i in helpers.CPU_KERNELS
                                            for c in (False, True))])
def test_padding_segments_and_fully_masked_rows(impl, causal, pallas_mode, monkeypatch):
  """kv_lengths (one full row, one padded, one empty) and segment ids (sorted, with queries
  whose segment has no key): the output and gradients match torch; rows that see no key give
  zeros, keys past kv_lengths get zero gradients, and nothing is NaN. ("xla-tiles": the XLA
  path's tile loops, which it runs for longer sequences.)"""
  if impl == "xla-tiles":
    from jaxfuse.ops.flash_attention import xla

    monkeypatch.setattr(xla, "XLA_STRIP_MAX_SCORES", 0)
    impl = "xla"
  t = 77 if impl == "pallas" else 300
  q, k, v, g = inputs(3, t, t, 2, 1, 32, seed=4)
  kv_lengths = jnp.array([t, t // 3, 0], jnp.int32)
  rng = np.random.default_rng(4)
  kv_seg = np.sort(rng.integers(0, 4, (3, t)), axis=1).astype(np.int32)
  q_seg = kv_seg.copy()
  q_seg[0, :5] = 9                    # no key has segment 9
  seg = (jnp.asarray(q_seg), jnp.asarray(kv_seg))
  kw = dict(causal=causal, kv_lengths=kv_lengths, segment_ids=seg)
  got = jax_step(q, k, v, g, impl, **kw)
  assert_matches_torch(got, torch_step(q, k, v, g, **kw), "masks")
  out, dq, dk, dv = (helpers.to_numpy(x) for x in got)
  for x in (out, dq):
    assert (x[2] == 0).all() and (x[0, :5] == 0).all()
  assert (dk[1, t // 3:] == 0).all() and (dv[1, t // 3:] == 0).all()
  assert (dk[2] == 0).all() and (dv[2] == 0).all()


@pytest.mark.parametrize("impl, bias_shape", [
    ("xla", (2, 4, 60, 70)), ("xla", (1, 1, 60, 70)), ("xla", (2, 1, 1, 70)),
    ("pallas", (2, 4, 60, 70))], ids=str)
def test_bias_and_its_gradient(impl, bias_shape, pallas_mode):
  q, k, v, g = inputs(2, 60, 70, 4, 2, 32, seed=7)
  rng = np.random.default_rng(8)
  bias = rng.standard_normal(bias_shape, dtype=np.float32)
  # -inf entries mask too; with a batch axis, some query rows are masked out entirely.
  bias = jnp.asarray(np.where(rng.random(bias_shape) < 0.2, -np.inf, bias).astype(np.float32))
  if bias_shape[0] == 2:
    bias = bias.at[1, :, :].set(-jnp.inf) if bias_shape[2] == 1 else bias.at[1, :, 5].set(-jnp.inf)
  got = jax_step(q, k, v, g, impl, bias=bias, causal=True)
  want = torch_step(q, k, v, g, bias=bias, causal=True)
  assert got[4].shape == bias.shape
  assert_matches_torch(got, want, f"bias {bias_shape}")


# Composition -----------------------------------------------------------------------------------


def test_jit_vmap_and_remat_compose():
  q, k, v, g = inputs(3, 50, 50, 2, 2, 32, seed=11)

  def loss(q, k, v):
    return jnp.sum(attention(q, k, v, causal=True) * g)

  grads = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2)),
                  compiler_options=FAST_COMPILE)(q, k, v)
  want = torch_step(q, k, v, g, causal=True)
  for x, y in zip(grads, want[1:]):
    helpers.assert_close(x, y)
  per_example = jax.vmap(lambda q, k, v: attention(q[None], k[None], v[None], causal=True)[0])
  helpers.assert_close(jax.jit(per_example, compiler_options=FAST_COMPILE)(q, k, v), want[0])


def test_reference_matches_torch():
  q, k, v, g = inputs(2, 33, 45, 4, 2, 16, seed=12)
  seg = (jnp.arange(33)[None].repeat(2, 0) // 10, jnp.arange(45)[None].repeat(2, 0) // 14)
  kw = dict(causal=True, segment_ids=seg, kv_lengths=jnp.array([45, 20]))
  def value_and_grads(q, k, v, g):
    out, vjp = jax.vjp(lambda q, k, v: attention_reference(q, k, v, **kw), q, k, v)
    return (out, *vjp(g))

  got = jax.jit(value_and_grads, compiler_options=FAST_COMPILE)(q, k, v, g)
  assert_matches_torch(got, torch_step(q, k, v, g, **kw), "reference")


# Memory ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", helpers.TABLE_IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_backward_keeps_only_output_and_logsumexp(impl, dtype, pallas_mode):
  b, t, h, d = 1, 256, 4, 64
  q, k, v, _ = inputs(b, t, t, h, h, d, dtype=dtype)
  f = lambda q, k, v: jnp.sum(attention(q, k, v, causal=True, implementation=impl))  # noqa: E731
  kept = residual_bytes(f, q, k, v)
  assert kept == q.nbytes + b * h * t * 4   # o, and one float32 per query row and head
  naive = residual_bytes(lambda q, k, v: jnp.sum(attention_reference(q, k, v, causal=True)),
                         q, k, v)
  assert naive >= t / (d + 1) * kept        # the unfused softmax keeps [t, t] per head


def test_residuals_at_most_torch_sdpa():
  b, t, h, d = 1, 512, 4, 64
  q, k, v, _ = inputs(b, t, t, h, h, d)
  ours = residual_bytes(lambda q, k, v: jnp.sum(attention(q, k, v, causal=True)), q, k, v)
  tq, tk, tv = (helpers.to_torch(x).transpose(1, 2).contiguous().requires_grad_()
                for x in (q, k, v))
  theirs = torch_residual_bytes(
      lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True).sum(),
      exclude=[tq, tk, tv])
  assert 0 < ours <= 1.25 * theirs


# Bad input -------------------------------------------------------------------------------------


def test_errors_name_the_argument():
  """The errors the op table's BAD list (tests/cases/attention.py) has no entry for."""
  q = jnp.ones((2, 8, 4, 16))
  kv = jnp.ones((2, 8, 2, 16))
  with pytest.raises(TypeError, match=r"segment_ids must be an integer array, got float32"):
    attention(q, kv, kv, segment_ids=jnp.zeros((2, 8)))
  with pytest.raises(ValueError, match=r"segment_ids as one array needs q and k of one length"):
    attention(q, kv[:, :5], kv[:, :5], segment_ids=jnp.zeros((2, 8), jnp.int32))
  with pytest.raises(ValueError, match=r"kv_lengths must have shape \(2,\), got \(3,\)"):
    attention(q, kv, kv, kv_lengths=jnp.array([1, 2, 3]))
  with pytest.raises(ValueError, match=r"bias must have rank 4"):
    attention(q, kv, kv, bias=jnp.zeros((8, 8)))
  with pytest.raises(ValueError, match=r"implementation must be None or one of.*'cuda'"):
    attention(q, kv, kv, implementation="cuda")
  if not helpers.ON_GPU:
    with pytest.raises(RuntimeError, match=r"attention: implementation='triton' cannot run"):
      attention(q, kv, kv, implementation="triton")


def test_empty_sequences():
  q, k, v, _ = inputs(1, 5, 0, 2, 2, 16)
  assert jnp.array_equal(attention(q, k, v), jnp.zeros_like(q))


def test_xla_strips_up_to_2048_positions_and_at_most_32_of_them():
  from jaxfuse.ops.flash_attention.xla import XLA_STRIP_MAX_LENGTH, strip_height

  assert XLA_STRIP_MAX_LENGTH == 2048
  assert strip_height(77, 77) == 77                 # one strip covers a short sequence
  assert strip_height(1024, 1024) == 128
  assert strip_height(1024, 1024, groups=4) == 32   # 128 rows: 32 positions x 4 query heads
  assert strip_height(2048, 2048) == 256            # taller strips beyond 1024 positions
  assert strip_height(2048, 2048, groups=8) == 64   # at most 32 strips
  assert strip_height(1, 2048) == 256               # decoding: one strip of queries
  assert strip_height(2049, 2049) is None           # the tile loops beyond
  assert strip_height(1, 4096) is None


def test_xla_tiles_grow_only_where_padding_stays_small():
  from jaxfuse.ops.flash_attention import XLA_BLOCK, XLA_LONG_BLOCK, xla_block_size

  assert xla_block_size(77, 77) == 77                       # one tile covers a short sequence
  assert xla_block_size(1, 4096) == XLA_BLOCK               # decoding: no 512-row query tile
  assert xla_block_size(2048, 2048) == XLA_LONG_BLOCK
  assert xla_block_size(1000, 1000) == XLA_LONG_BLOCK       # 1024 either way
  assert xla_block_size(700, 600) == XLA_BLOCK              # 512 would pad 600 to 1024
