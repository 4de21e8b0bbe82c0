"""The Pallas attention kernels: interpret-mode runs against torch at small shapes, lowering for
CUDA (Triton) of every kernel forward and backward, the remat kernel count, tile sizes and the
autotuner. The tests shared with the XLA path are in test_attention.py."""

import itertools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from jaxfuse.kernels.pallas import flash_attention as kernels
from jaxfuse.ops import attention
from jaxfuse.ops import flash_attention as fa
from tests import helpers
from tests.attention_common import assert_matches_torch, inputs, jax_step, torch_step


# Grouped heads at a head dim not a power of 2, over several query and key tiles with a tail, full
# and causal, are the op table's cases "", "causal" (d=24) and "causal q<kv" (d=40)
# (tests/cases/attention.py), against torch in every dtype.
PALLAS_CASES = [
    ((2, 1, 1, 2, 2, 64), True),
]


def _case_id(shape, causal):
  return "b{}_tq{}_tk{}_h{}/{}_d{}".format(*shape) + ("-causal" if causal else "-full")


@pytest.mark.parametrize("shape, causal", PALLAS_CASES,
                         ids=[_case_id(s, c) for s, c in PALLAS_CASES])
def test_pallas_fp32_matches_torch(shape, causal, pallas_mode):
  q, k, v, g = inputs(*shape, seed=1)
  got = jax_step(q, k, v, g, "pallas", causal=causal)
  assert_matches_torch(got, torch_step(q, k, v, g, causal=causal), f"{shape} causal={causal}")


# Lowering for GPUs -----------------------------------------------------------------------------

KERNELS = ["attention_bwd_dkdv", "attention_bwd_dq", "attention_fwd_res"]


# Small head dims in float32 and bfloat16 are the op table's case "causal" (test_op_lowering.py).
@pytest.mark.parametrize("dtype, d", [(jnp.float32, 128), (jnp.float32, 256), (jnp.bfloat16, 256),
                                      (jnp.float16, 128)],
                         ids=lambda x: jnp.dtype(x).name if not isinstance(x, int) else f"d{x}")
def test_pallas_kernels_lower_for_cuda(dtype, d):
  q, k, v, _ = inputs(2, 77, 100, 4, 2, d, dtype=dtype)
  step = jax.value_and_grad(
      lambda q, k, v: jnp.sum(attention(q, k, v, causal=True, implementation="pallas")
                              .astype(jnp.float32) ** 2), argnums=(0, 1, 2))
  assert sorted(helpers.triton_kernel_names(helpers.lower_for_gpu(step, q, k, v))) == KERNELS


def test_pallas_kernels_lower_for_cuda_with_every_mask():
  q, k, v, _ = inputs(2, 77, 100, 4, 2, 64, dtype=jnp.bfloat16)
  seg = (jnp.zeros((2, 77), jnp.int32), jnp.zeros((2, 100), jnp.int32))
  lengths = jnp.array([50, 100], jnp.int32)
  bias = jnp.zeros((1, 4, 77, 100), jnp.float32)

  def loss(q, k, v, bias):
    o = attention(q, k, v, causal=True, segment_ids=seg, kv_lengths=lengths, bias=bias,
                  implementation="pallas")
    return jnp.sum(o.astype(jnp.float32))

  step = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))
  names = sorted(helpers.triton_kernel_names(helpers.lower_for_gpu(step, q, k, v, bias)))
  assert names == ["attention_bwd_dbias"] + KERNELS


FEATURES = {  # name: (q_len, kv_len, attention's keyword arguments)
    "bottom_right": (77, 100, dict(causal="bottom_right")),
    "bottom_right-kv_lengths": (77, 100, dict(causal="bottom_right",
                                              kv_lengths=jnp.array([50, 100], jnp.int32))),
    "more_queries_than_keys": (100, 77, dict(causal="bottom_right")),
    "window": (77, 100, dict(causal=True, sliding_window=24)),
    "bottom_right-window-kv_lengths": (77, 100, dict(causal="bottom_right", sliding_window=33,
                                                     kv_lengths=jnp.array([3, 90], jnp.int32))),
    "softcap": (77, 100, dict(logit_softcap=30.0)),
    "everything": (77, 100, dict(causal="bottom_right", sliding_window=24, logit_softcap=30.0,
                                 kv_lengths=jnp.array([60, 100], jnp.int32),
                                 segment_ids=(jnp.zeros((2, 77), jnp.int32),
                                              jnp.zeros((2, 100), jnp.int32)))),
}


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("name", list(FEATURES))
def test_pallas_kernels_lower_for_cuda_with_the_features(name, with_bias):
  """Bottom-right alignment (per batch element with kv_lengths), sliding windows and soft-caps,
  alone and together, with grouped-query heads: every kernel lowers through Triton."""
  tq, tk, kw = FEATURES[name]
  q, k, v, _ = inputs(2, tq, tk, 4, 2, 64, dtype=jnp.bfloat16)
  bias = jnp.zeros((1, 4, tq, tk), jnp.float32) if with_bias else None

  def loss(q, k, v, bias):
    o = attention(q, k, v, bias=bias, implementation="pallas", **kw)
    return jnp.sum(o.astype(jnp.float32))

  step = jax.value_and_grad(loss, argnums=(0, 1, 2, 3) if with_bias else (0, 1, 2))
  names = sorted(helpers.triton_kernel_names(helpers.lower_for_gpu(step, q, k, v, bias)))
  assert names == ["attention_bwd_dbias"] * with_bias + KERNELS


def _spec(tq, tk, causal, window):
  return kernels._Spec(b=1, tq=tq, tk=tk, hq=1, hkv=1, d=16, scale=1.0, causal=causal,
                       window=window, softcap=None, has_kv_lengths=False, has_segments=False,
                       bias_shape=None, dtype="float32")


def _tile_ranges(ranges, n):
  return [tuple(int(x) for x in t)
          for t in zip(*(np.broadcast_to(np.asarray(x), (n,)) for x in ranges))]


@pytest.mark.parametrize("causal", ["top_left", "bottom_right"])
def test_kernels_visit_exactly_the_tiles_the_masks_reach(causal):
  """Per query tile, the forward and dq kernels visit exactly the key tiles holding a pair that
  the causal mask, the window and the key limit leave, and mask only those a mask edge crosses;
  per key tile, the dk/dv kernel does the same over query tiles. Query and key tiles differ in
  size; rows past q_len and keys past the key limit do not count."""
  for tq, tk, bq, bk, window, short in itertools.product(
      [1, 37, 64], [20, 53], [16, 32], [16, 32], [None, 1, 7, 16, 40], [0, 11]):
    limit = tk - short
    spec = _spec(tq, tk, causal, window)
    offset = limit - tq if causal == "bottom_right" else 0
    row, key = np.arange(tq)[:, None] + offset, np.arange(limit)[None, :]
    seen = (key <= row) & (True if window is None else key > row - window)
    nq, nk = -(-tq // bq), -(-tk // bk)
    what = dict(tq=tq, tk=tk, bq=bq, bk=bk, window=window, limit=limit)

    def expected(tile):
      return ([t for t, pairs in enumerate(tile) if pairs.any()],
              [t for t, pairs in enumerate(tile) if pairs.any() and pairs.all()])

    tiles = _tile_ranges(kernels._key_tiles(spec, np.arange(nq) * bq, bq, bk, limit, offset), nq)
    for i, (lo, a, b, hi) in enumerate(tiles):
      rows = seen[i * bq:(i + 1) * bq]
      visited, unmasked = expected([rows[:, j * bk:(j + 1) * bk] for j in range(nk)])
      assert list(range(lo, hi)) == visited and list(range(a, b)) == unmasked, (what, i)
    tiles = _tile_ranges(kernels._query_tiles(spec, np.arange(nk) * bk, bq, bk, limit, offset),
                         nk)
    for j, (lo, a, b, hi) in enumerate(tiles):
      cols = seen[:, j * bk:(j + 1) * bk]
      visited, unmasked = expected([cols[i * bq:(i + 1) * bq] for i in range(nq)])
      assert list(range(lo, hi)) == visited and list(range(a, b)) == unmasked, (what, j)


def test_remat_runs_each_kernel_once():
  """Under jit(value_and_grad(remat(f))): the primal pass runs the forward kernel once, the
  backward recomputes the residuals with it once more (what remat asks for), then runs each
  backward kernel once. The primal pass writes the log-sum-exp too (4 bytes a row and head,
  against o's 4 * head_dim): the op's custom_vjp has no separate primal rule under remat, which
  keeps second-order gradients working."""
  q, k, v, w = inputs(1, 100, 100, 2, 2, 64)
  loss = lambda q, k, v: jnp.sum(attention(q, k, v, causal=True, implementation="pallas") * w)  # noqa: E731
  step = jax.jit(jax.value_and_grad(jax.checkpoint(loss), argnums=(0, 1, 2)))
  names = sorted(helpers.triton_kernel_names(helpers.lower_for_gpu(step, q, k, v)))
  assert names == ["attention_bwd_dkdv", "attention_bwd_dq", "attention_fwd_res",
                   "attention_fwd_res"]


# Tile sizes ------------------------------------------------------------------------------------


def test_heuristic_table_covers_the_head_dims():
  for d in (32, 40, 64, 80, 96, 128, 160, 256):
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
      sizes = fa.heuristic_block_sizes(d, dtype)
      clipped = sizes.clipped(20, 5000)
      assert clipped.block_q == 32 and clipped.block_k == sizes.block_k
  with pytest.raises(ValueError, match="head dims up to 256"):
    fa.heuristic_block_sizes(512, jnp.float32)
  with pytest.raises(ValueError, match="block_k must be a power of 2"):
    fa.BlockSizes(block_k=48)


def test_autotune_picks_the_fastest_and_caches_it(tmp_path, monkeypatch, pallas_mode):
  fa.clear_autotune_cache()
  q, k, v, _ = inputs(1, 20, 20, 1, 1, 32)
  slow, fast = fa.BlockSizes(32, 32, 32, 32, 32, 32), fa.BlockSizes(16, 16, 16, 16, 16, 16)
  assert fa.block_sizes_for(q, k, causal=True) != fast
  calls = []

  def timer(fn):  # a fake clock: the candidate with 16-wide tiles "runs" faster
    calls.append(fn)
    fn()
    return 1.0 if len(calls) <= 2 else 0.5

  path = tmp_path / "tuning.json"
  best = fa.autotune(q, k, v, causal=True, candidates=[slow, fast], runs=2, timer=timer,
                     cache_path=str(path))
  assert best == fast and len(calls) == 4
  assert fa.block_sizes_for(q, k, causal=True) == fast
  assert fa.block_sizes_for(q, k, causal=False) != fast     # another signature
  fa.clear_autotune_cache()
  assert fa.block_sizes_for(q, k, causal=True) != fast
  monkeypatch.setenv("JAXFUSE_ATTENTION_TUNING", str(path))
  assert fa.block_sizes_for(q, k, causal=True) == fast      # read back from the file
  assert list(json.loads(path.read_text()).values()) == [fast.as_dict()]
  fa.clear_autotune_cache()


@pytest.mark.skipif(helpers.ON_GPU, reason="checks the CPU error")
def test_kernels_need_a_gpu_or_interpret_mode():
  x = jnp.ones((1, 8, 2, 16))
  here = re.escape(str([*helpers.CPU_KERNELS, "xla"]))
  with pytest.raises(jaxfuse.ImplementationUnavailableError, match=f"Available here: {here}"):
    attention(x, x, x, implementation="pallas")
  assert jnp.array_equal(attention(x, x, x), attention(x, x, x, implementation="xla"))
