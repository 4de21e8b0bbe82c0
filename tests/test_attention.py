"""jaxfuse.ops.attention against torch's scaled_dot_product_attention: output, dq, dk, dv (and
dbias), masks, memory, GPU lowering and bad input."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxfuse
from jaxfuse.metrics import residual_bytes, torch_residual_bytes
from jaxfuse.ops import attention, attention_reference
from jaxfuse.ops import flash_attention as fa
from tests import helpers
from tests.torch_ref import attention as ref


def _inputs(b, tq, tk, hq, hkv, d, dtype=jnp.float32, seed=0):
  kq, kk, kv, kg = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(kq, (b, tq, hq, d)).astype(dtype)
  k = jax.random.normal(kk, (b, tk, hkv, d)).astype(dtype)
  v = jax.random.normal(kv, (b, tk, hkv, d)).astype(dtype)
  g = jax.random.normal(kg, (b, tq, hq, d)).astype(dtype)
  return q, k, v, g


# The tests compile many small programs and run each once: skip LLVM's optimizations.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _jax(q, k, v, g, impl, bias=None, **kw):
  """Output and gradients (dq, dk, dv, and dbias with a bias) in one jitted program."""
  def value_and_grads(q, k, v, g, *bias):
    f = lambda q, k, v, *b: attention(q, k, v, implementation=impl,  # noqa: E731
                                      bias=b[0] if b else None, **kw)
    out, vjp = jax.vjp(f, q, k, v, *bias)
    return (out, *vjp(g))

  step = jax.jit(value_and_grads, compiler_options=FAST_COMPILE)
  return step(q, k, v, g, *(() if bias is None else (bias,)))


def _to_torch_kw(kw):
  out = dict(kw)
  if "segment_ids" in kw:
    seg = kw["segment_ids"]
    out["segment_ids"] = (tuple(torch.from_numpy(np.asarray(s)) for s in seg)
                          if isinstance(seg, tuple) else torch.from_numpy(np.asarray(seg)))
  if "kv_lengths" in kw:
    out["kv_lengths"] = torch.from_numpy(np.asarray(kw["kv_lengths"]))
  return out


def _torch(q, k, v, g, dtype=None, bias=None, **kw):
  tensors = [helpers.to_torch(x, dtype, requires_grad=True) for x in (q, k, v)]
  tb = None if bias is None else helpers.to_torch(bias, dtype, requires_grad=True)
  out = ref.attention(*tensors, bias=tb, **_to_torch_kw(kw))
  out.backward(helpers.to_torch(g, dtype))
  return (out, *(t.grad for t in tensors), *(() if tb is None else (tb.grad,)))


NAMES = ("out", "dq", "dk", "dv", "dbias")


def _assert_matches_torch(got, want, what=""):
  for x, y, name in zip(got, want, NAMES):
    helpers.assert_close(x, y, what=f"{what} {name}")
    assert not np.isnan(helpers.to_numpy(x)).any(), f"{what} {name} has NaN"


# Float32 against torch, across lengths, heads and masks ----------------------------------------

# (batch, q_len, kv_len, q_heads, kv_heads, head_dim). XLA runs every length; Pallas runs in
# interpret mode on CPU, so it takes the small ones.
XLA_SHAPES = [
    (2, 1, 1, 2, 2, 64),
    (2, 77, 77, 4, 2, 64),        # GQA
    (1, 1000, 1000, 2, 1, 64),    # MQA, not a multiple of any tile
    (1, 1024, 1024, 2, 2, 32),
]
PALLAS_CASES = [
    ((2, 1, 1, 2, 2, 64), True),
    ((2, 77, 77, 4, 2, 40), False),     # GQA, head dim not a power of 2
    ((2, 77, 77, 4, 2, 40), True),
    ((1, 130, 130, 2, 1, 32), False),   # MQA, several tiles with a tail
]


def _shape_id(s):
  return "b{}_tq{}_tk{}_h{}/{}_d{}".format(*s)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", XLA_SHAPES, ids=_shape_id)
def test_xla_fp32_matches_torch(shape, causal):
  q, k, v, g = _inputs(*shape)
  got = _jax(q, k, v, g, "xla", causal=causal)
  _assert_matches_torch(got, _torch(q, k, v, g, causal=causal), f"{shape} causal={causal}")


@pytest.mark.parametrize("shape, causal", PALLAS_CASES,
                         ids=[_shape_id(s) + ("-causal" if c else "-full") for s, c in PALLAS_CASES])
def test_pallas_fp32_matches_torch(shape, causal, pallas_mode):
  q, k, v, g = _inputs(*shape, seed=1)
  got = _jax(q, k, v, g, "pallas", causal=causal)
  _assert_matches_torch(got, _torch(q, k, v, g, causal=causal), f"{shape} causal={causal}")


@pytest.mark.parametrize("impl", helpers.CPU_IMPLEMENTATIONS)
@pytest.mark.parametrize("lengths, causal", [((77, 130), True), ((130, 77), False),
                                             ((130, 77), True), ((77, 130), False)],
                         ids=["q<kv-causal", "q>kv-full", "q>kv-causal", "q<kv-full"])
def test_q_and_kv_lengths_differ(impl, lengths, causal, pallas_mode):
  if impl == "pallas" and lengths[0] < lengths[1] != causal:
    pytest.skip("interpret mode is slow: the other two cases cover the kernels")
  q, k, v, g = _inputs(1, lengths[0], lengths[1], 2, 1, 32, seed=2)
  got = _jax(q, k, v, g, impl, causal=causal)
  _assert_matches_torch(got, _torch(q, k, v, g, causal=causal), f"{lengths}")


@pytest.mark.parametrize("impl, d", [("xla", 32), ("xla", 256), ("pallas", 256)])
def test_head_dim_range(impl, d, pallas_mode):
  q, k, v, g = _inputs(1, 50, 50, 2, 2, d, seed=3)
  scale = 1.5 / d**0.5
  got = _jax(q, k, v, g, impl, causal=True, scale=scale)
  _assert_matches_torch(got, _torch(q, k, v, g, causal=True, scale=scale), f"d={d}")


@pytest.mark.parametrize("impl", helpers.CPU_IMPLEMENTATIONS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_padding_segments_and_fully_masked_rows(impl, causal, pallas_mode):
  """kv_lengths (one full row, one padded, one empty) and segment ids (sorted, with queries
  whose segment has no key): the output and gradients match torch; rows that see no key give
  zeros, keys past kv_lengths get zero gradients, and nothing is NaN."""
  t = 300 if impl == "xla" else 77
  q, k, v, g = _inputs(3, t, t, 2, 1, 32, seed=4)
  kv_lengths = jnp.array([t, t // 3, 0], jnp.int32)
  rng = np.random.default_rng(4)
  kv_seg = np.sort(rng.integers(0, 4, (3, t)), axis=1).astype(np.int32)
  q_seg = kv_seg.copy()
  q_seg[0, :5] = 9                    # no key has segment 9
  seg = (jnp.asarray(q_seg), jnp.asarray(kv_seg))
  kw = dict(causal=causal, kv_lengths=kv_lengths, segment_ids=seg)
  got = _jax(q, k, v, g, impl, **kw)
  _assert_matches_torch(got, _torch(q, k, v, g, **kw), "masks")
  out, dq, dk, dv = (helpers.to_numpy(x) for x in got)
  for x in (out, dq):
    assert (x[2] == 0).all() and (x[0, :5] == 0).all()
  assert (dk[1, t // 3:] == 0).all() and (dv[1, t // 3:] == 0).all()
  assert (dk[2] == 0).all() and (dv[2] == 0).all()


@pytest.mark.parametrize("impl, bias_shape", [
    ("xla", (2, 4, 60, 70)), ("xla", (1, 1, 60, 70)), ("xla", (2, 1, 1, 70)),
    ("pallas", (2, 4, 60, 70)), ("pallas", (1, 1, 60, 70))], ids=str)
def test_bias_and_its_gradient(impl, bias_shape, pallas_mode):
  q, k, v, g = _inputs(2, 60, 70, 4, 2, 32, seed=7)
  bias = jax.random.normal(jax.random.key(8), bias_shape)
  # -inf entries mask too; with a batch axis, some query rows are masked out entirely.
  bias = jnp.where(jax.random.uniform(jax.random.key(9), bias_shape) < 0.2, -jnp.inf, bias)
  if bias_shape[0] == 2:
    bias = bias.at[1, :, :].set(-jnp.inf) if bias_shape[2] == 1 else bias.at[1, :, 5].set(-jnp.inf)
  got = _jax(q, k, v, g, impl, bias=bias, causal=True)
  want = _torch(q, k, v, g, bias=bias, causal=True)
  assert got[4].shape == bias.shape
  _assert_matches_torch(got, want, f"bias {bias_shape}")


# Low precision ---------------------------------------------------------------------------------


@pytest.mark.parametrize("impl, dtype, causal", [
    ("xla", jnp.bfloat16, False), ("xla", jnp.bfloat16, True), ("xla", jnp.float16, False),
    ("xla", jnp.float16, True), ("pallas", jnp.bfloat16, True), ("pallas", jnp.float16, False)],
    ids=lambda x: jnp.dtype(x).name if not isinstance(x, (str, bool)) else str(x))
def test_low_precision_within_twice_torch_error(impl, dtype, causal, pallas_mode):
  """Against float64, our output and gradients err at most 2x torch's in the same dtype."""
  shape = (1, 1000, 1000, 2, 1, 64) if impl == "xla" else (1, 77, 77, 2, 1, 64)
  q, k, v, g = _inputs(*shape, dtype=dtype, seed=10)
  got = _jax(q, k, v, g, impl, causal=causal)
  exact = _torch(q, k, v, g, dtype=torch.float64, causal=causal)
  torch_low = _torch(q, k, v, g, causal=causal)
  for x, e, t, name in zip(got, exact, torch_low, NAMES):
    assert x.dtype == dtype
    helpers.assert_within_torch_error(x, e, t, k=2.0, what=f"{impl} {name}")


# Composition -----------------------------------------------------------------------------------


def test_jit_vmap_and_remat_compose():
  q, k, v, g = _inputs(3, 50, 50, 2, 2, 32, seed=11)

  def loss(q, k, v):
    return jnp.sum(attention(q, k, v, causal=True) * g)

  grads = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2)),
                  compiler_options=FAST_COMPILE)(q, k, v)
  want = _torch(q, k, v, g, causal=True)
  for x, y in zip(grads, want[1:]):
    helpers.assert_close(x, y)
  per_example = jax.vmap(lambda q, k, v: attention(q[None], k[None], v[None], causal=True)[0])
  helpers.assert_close(jax.jit(per_example, compiler_options=FAST_COMPILE)(q, k, v), want[0])


def test_reference_matches_torch():
  q, k, v, g = _inputs(2, 33, 45, 4, 2, 16, seed=12)
  seg = (jnp.arange(33)[None].repeat(2, 0) // 10, jnp.arange(45)[None].repeat(2, 0) // 14)
  kw = dict(causal=True, segment_ids=seg, kv_lengths=jnp.array([45, 20]))
  def value_and_grads(q, k, v, g):
    out, vjp = jax.vjp(lambda q, k, v: attention_reference(q, k, v, **kw), q, k, v)
    return (out, *vjp(g))

  got = jax.jit(value_and_grads, compiler_options=FAST_COMPILE)(q, k, v, g)
  _assert_matches_torch(got, _torch(q, k, v, g, **kw), "reference")


# Memory ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", helpers.CPU_IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_backward_keeps_only_output_and_logsumexp(impl, dtype, pallas_mode):
  b, t, h, d = 1, 256, 4, 64
  q, k, v, _ = _inputs(b, t, t, h, h, d, dtype=dtype)
  f = lambda q, k, v: jnp.sum(attention(q, k, v, causal=True, implementation=impl))  # noqa: E731
  kept = residual_bytes(f, q, k, v)
  assert kept == q.nbytes + b * h * t * 4   # o, and one float32 per query row and head
  naive = residual_bytes(lambda q, k, v: jnp.sum(attention_reference(q, k, v, causal=True)),
                         q, k, v)
  assert naive >= t / (d + 1) * kept        # the unfused softmax keeps [t, t] per head


def test_residuals_at_most_torch_sdpa():
  b, t, h, d = 1, 512, 4, 64
  q, k, v, _ = _inputs(b, t, t, h, h, d)
  ours = residual_bytes(lambda q, k, v: jnp.sum(attention(q, k, v, causal=True)), q, k, v)
  tq, tk, tv = (helpers.to_torch(x).transpose(1, 2).contiguous().requires_grad_()
                for x in (q, k, v))
  theirs = torch_residual_bytes(
      lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True).sum(),
      exclude=[tq, tk, tv])
  assert 0 < ours <= 1.25 * theirs


# Lowering for GPUs -----------------------------------------------------------------------------

KERNELS = ["attention_bwd_dkdv", "attention_bwd_dq", "attention_fwd_res"]


@pytest.mark.parametrize("dtype, d", [(jnp.float32, 40), (jnp.float32, 128), (jnp.float32, 256),
                                      (jnp.bfloat16, 64), (jnp.bfloat16, 256), (jnp.float16, 128)],
                         ids=lambda x: jnp.dtype(x).name if not isinstance(x, int) else f"d{x}")
def test_pallas_kernels_lower_for_cuda(dtype, d):
  q, k, v, _ = _inputs(2, 77, 100, 4, 2, d, dtype=dtype)
  step = jax.value_and_grad(
      lambda q, k, v: jnp.sum(attention(q, k, v, causal=True, implementation="pallas")
                              .astype(jnp.float32) ** 2), argnums=(0, 1, 2))
  assert sorted(helpers.triton_kernel_names(helpers.lower_for_gpu(step, q, k, v))) == KERNELS


def test_pallas_kernels_lower_for_cuda_with_every_mask():
  q, k, v, _ = _inputs(2, 77, 100, 4, 2, 64, dtype=jnp.bfloat16)
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


def test_remat_runs_each_kernel_once():
  """Under jit(value_and_grad(remat(f))): the primal pass runs the forward kernel that writes
  only the output; the backward recomputes the residuals once with the kernel that also writes
  the log-sum-exp, then runs the two backward kernels. Each launches exactly once."""
  q, k, v, w = _inputs(1, 100, 100, 2, 2, 64)
  loss = lambda q, k, v: jnp.sum(attention(q, k, v, causal=True, implementation="pallas") * w)  # noqa: E731
  step = jax.jit(jax.value_and_grad(jax.checkpoint(loss), argnums=(0, 1, 2)))
  names = sorted(helpers.triton_kernel_names(helpers.lower_for_gpu(step, q, k, v)))
  assert names == ["attention_bwd_dkdv", "attention_bwd_dq", "attention_fwd", "attention_fwd_res"]


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
  q, k, v, _ = _inputs(1, 20, 20, 1, 1, 32)
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


# Bad input -------------------------------------------------------------------------------------


def test_errors_name_the_argument():
  q = jnp.ones((2, 8, 4, 16))
  kv = jnp.ones((2, 8, 2, 16))
  with pytest.raises(ValueError, match=r"q must have rank 4, got shape \(8, 4, 16\)"):
    attention(q[0], kv, kv)
  with pytest.raises(TypeError, match=r"k must have a floating dtype.*int32"):
    attention(q, kv.astype(jnp.int32), kv)
  with pytest.raises(TypeError, match=r"q, k, v must share one dtype.*bfloat16"):
    attention(q, kv.astype(jnp.bfloat16), kv.astype(jnp.bfloat16))
  with pytest.raises(ValueError, match=r"k, v must have the same shape"):
    attention(q, kv, kv[:, :4])
  with pytest.raises(ValueError, match=r"kv heads of k .*3.* must divide the heads of q"):
    attention(q, jnp.ones((2, 8, 3, 16)), jnp.ones((2, 8, 3, 16)))
  with pytest.raises(ValueError, match=r"k must have size 16 on axis 3 \(the head dim of q\)"):
    attention(q, jnp.ones((2, 8, 2, 8)), jnp.ones((2, 8, 2, 8)))
  with pytest.raises(ValueError, match=r"k must have size 2 on axis 0 \(the batch size of q\)"):
    attention(q, kv[:1], kv[:1])
  with pytest.raises(ValueError, match=r"segment_ids must have shape \(2, 8\), got \(2, 7\)"):
    attention(q, kv, kv, segment_ids=jnp.zeros((2, 7), jnp.int32))
  with pytest.raises(TypeError, match=r"segment_ids must be an integer array, got float32"):
    attention(q, kv, kv, segment_ids=jnp.zeros((2, 8)))
  with pytest.raises(ValueError, match=r"segment_ids as one array needs q and k of one length"):
    attention(q, kv[:, :5], kv[:, :5], segment_ids=jnp.zeros((2, 8), jnp.int32))
  with pytest.raises(ValueError, match=r"kv_lengths must have shape \(2,\), got \(3,\)"):
    attention(q, kv, kv, kv_lengths=jnp.array([1, 2, 3]))
  with pytest.raises(TypeError, match=r"kv_lengths must be an integer array, got float32"):
    attention(q, kv, kv, kv_lengths=jnp.array([1.0, 2.0]))
  with pytest.raises(ValueError, match=r"bias must have shape .*got shape \(2, 3, 8, 8\)"):
    attention(q, kv, kv, bias=jnp.zeros((2, 3, 8, 8)))
  with pytest.raises(ValueError, match=r"bias must have rank 4"):
    attention(q, kv, kv, bias=jnp.zeros((8, 8)))
  with pytest.raises(TypeError, match=r"scale must be a Python float"):
    attention(q, kv, kv, scale="big")
  with pytest.raises(ValueError, match=r"implementation must be None or one of.*'cuda'"):
    attention(q, kv, kv, implementation="cuda")
  with pytest.raises(ValueError, match=r"implementation='triton' is not provided"):
    attention(q, kv, kv, implementation="triton")


@pytest.mark.skipif(helpers.ON_GPU, reason="checks the CPU error")
def test_kernels_need_a_gpu_or_interpret_mode():
  x = jnp.ones((1, 8, 2, 16))
  with pytest.raises(jaxfuse.ImplementationUnavailableError, match=r"Available here: \['xla'\]"):
    attention(x, x, x, implementation="pallas")
  assert jnp.array_equal(attention(x, x, x), attention(x, x, x, implementation="xla"))


def test_empty_sequences():
  q, k, v, _ = _inputs(1, 5, 0, 2, 2, 16)
  assert jnp.array_equal(attention(q, k, v), jnp.zeros_like(q))
