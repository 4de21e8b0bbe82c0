"""The attention features a decoder needs: bottom-right causal alignment, sliding windows, logit
soft-capping and decoding from a KV cache, on both implementations (Pallas in interpret mode)
against float64 torch twins, second order included, and the tiles the sliding window lets the
XLA path skip (the Pallas kernels' tile ranges are tested in test_attention_pallas.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxfuse.kernels.pallas.flash_attention import BlockSizes
from jaxfuse.ops import attention
from jaxfuse.ops.flash_attention import tuning, xla
from tests import helpers

# Query and key tiles of different sizes, so that several of each are visited at these lengths
# and the kernels' tile arithmetic meets tiles of both shapes.
SMALL_BLOCKS = BlockSizes(16, 32, 32, 16, 16, 32)


# The XLA path runs strips up to 2048 positions and tile loops beyond; "xla-tiles"
# runs the tile loops at these short lengths.
XLA_TILES = "xla-tiles"
IMPLEMENTATIONS = (*helpers.TABLE_IMPLEMENTATIONS, XLA_TILES)


@pytest.fixture
def small_tiles(monkeypatch, request):
  """16- and 32-wide tiles on every path and strips of 16 rows on XLA's, so that several of
  each are visited; the tile loops for XLA_TILES. Returns the implementation to ask for."""
  impl = request.node.callspec.params["impl"]
  monkeypatch.setattr(xla, "XLA_BLOCK", 16)
  monkeypatch.setattr(xla, "XLA_STRIP_ROWS", 16)
  monkeypatch.setattr(xla, "XLA_STRIP_LONG_ROWS", 16)
  if impl == XLA_TILES:
    monkeypatch.setattr(xla, "XLA_STRIP_MAX_SCORES", 0)
  monkeypatch.setattr(tuning, "block_sizes_for",
                      lambda q, k, **_: SMALL_BLOCKS.clipped(q.shape[1], k.shape[1]))
  return "xla" if impl == XLA_TILES else impl


def _inputs(b, tq, tk, hq, hkv, d, seed=0, dtype=jnp.float32):
  return helpers.normals(seed, (b, tq, hq, d), (b, tk, hkv, d), (b, tk, hkv, d), (b, tq, hq, d),
                         dtype=dtype)


def _torch_attention(q, k, v, *, causal, window=None, softcap=None, kv_lengths=None,
                     bias=None):
  """Attention written out in torch (float64 in, float64 out), with an explicit mask:
  ``causal`` is None, "top_left" or "bottom_right" (relative to the valid keys); ``bias`` is
  added after the soft-cap."""
  b, tq, hq, d = q.shape
  tk, hkv = k.shape[1], k.shape[2]
  qh = q.permute(0, 2, 1, 3)
  kh = k.permute(0, 2, 1, 3).repeat_interleave(hq // hkv, dim=1)
  vh = v.permute(0, 2, 1, 3).repeat_interleave(hq // hkv, dim=1)
  s = qh @ kh.transpose(-1, -2) / d ** 0.5
  if softcap is not None:
    s = softcap * torch.tanh(s / softcap)
  if bias is not None:
    s = s + bias
  lengths = torch.full((b,), tk) if kv_lengths is None else torch.tensor(
      np.array(kv_lengths))
  key = torch.arange(tk)[None, None, :]
  mask = key < lengths[:, None, None]
  if causal is not None:
    offset = (lengths - tq) if causal == "bottom_right" else torch.zeros(b, dtype=torch.long)
    row = torch.arange(tq)[None, :, None] + offset[:, None, None]
    mask = mask & (key <= row)
    if window is not None:
      mask = mask & (key > row - window)
  s = s.masked_fill(~mask[:, None], float("-inf"))
  p = torch.softmax(s, dim=-1).nan_to_num(0.0)   # rows that see no key: zeros, as jaxfuse
  return (p @ vh).permute(0, 2, 1, 3)


CASES = [
    # (tq, tk, causal, window, softcap, with kv_lengths)
    (37, 37, "top_left", 7, None, False),
    (37, 37, "top_left", 1, None, False),
    (20, 53, "bottom_right", None, None, False),
    (20, 53, "bottom_right", 9, None, True),
    (53, 20, "bottom_right", None, None, False),
    (1, 40, "bottom_right", None, None, True),
    (33, 33, None, None, 3.0, False),
    (40, 45, "top_left", 12, 5.0, True),
]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("tq,tk,causal,window,softcap,lengths", CASES, ids=str)
def test_features_match_torch_float64(tq, tk, causal, window, softcap, lengths, impl,
                                      small_tiles, pallas_mode):
  q, k, v, g = _inputs(2, tq, tk, 4, 2, 16, seed=tq + tk)
  kv_lengths = jnp.array([tk, max(1, tk - 11)]) if lengths else None
  kw = dict(causal=causal or False, sliding_window=window, logit_softcap=softcap,
            kv_lengths=kv_lengths, implementation=small_tiles)
  got = helpers.jax_value_and_grads(lambda q, k, v: attention(q, k, v, **kw), (q, k, v), g)
  want = helpers.torch_value_and_grads(
      lambda q, k, v: _torch_attention(q, k, v, causal=causal, window=window, softcap=softcap,
                                       kv_lengths=kv_lengths), (q, k, v), g, torch.float64)
  for a, b, what in zip(got, want, ("out", "dq", "dk", "dv")):
    helpers.assert_close(a, b, what=what)


# The CPU kernels take no bias (their refusal is tested in test_cpu_kernels.py).
@pytest.mark.parametrize("impl", [i for i in IMPLEMENTATIONS if i not in helpers.CPU_KERNELS])
def test_features_with_a_bias_match_torch_float64(impl, small_tiles, pallas_mode):
  """The bias is added after the soft-cap: its gradient is taken before the cap's factor."""
  tq, tk = 29, 45
  q, k, v, g = _inputs(2, tq, tk, 4, 2, 16, seed=8)
  bias = helpers.normal(9, (1, 4, tq, tk))
  kv_lengths = jnp.array([tk, 30])
  kw = dict(causal="bottom_right", window=13, softcap=3.0, kv_lengths=kv_lengths)
  got = helpers.jax_value_and_grads(
      lambda q, k, v, bias: attention(q, k, v, bias=bias, causal=kw["causal"],
                                      sliding_window=kw["window"], logit_softcap=kw["softcap"],
                                      kv_lengths=kv_lengths, implementation=small_tiles),
      (q, k, v, bias), g)
  want = helpers.torch_value_and_grads(
      lambda q, k, v, bias: _torch_attention(q, k, v, bias=bias, **kw), (q, k, v, bias), g,
      torch.float64)
  for a, b, what in zip(got, want, ("out", "dq", "dk", "dv", "dbias")):
    helpers.assert_close(a, b, what=what)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
def test_features_in_low_precision_within_twice_torch_error(dtype, impl, small_tiles,
                                                            pallas_mode):
  q, k, v, g = _inputs(2, 29, 45, 4, 1, 16, seed=3, dtype=dtype)
  kw = dict(causal="bottom_right", window=10, softcap=4.0)
  got = helpers.jax_value_and_grads(
      lambda q, k, v: attention(q, k, v, causal=kw["causal"], sliding_window=kw["window"],
                                logit_softcap=kw["softcap"], implementation=small_tiles),
      (q, k, v), g)
  twin = lambda q, k, v: _torch_attention(q, k, v, **kw)  # noqa: E731
  exact = helpers.torch_value_and_grads(twin, (q, k, v), g, torch.float64)
  low = helpers.torch_value_and_grads(twin, (q, k, v), g)
  for a, e, t, what in zip(got, exact, low, ("out", "dq", "dk", "dv")):
    assert a.dtype == dtype
    helpers.assert_within_low_precision_error(a, e, t, what=what)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_decoding_from_a_cache_equals_the_full_forward(impl, small_tiles, pallas_mode):
  """Prefill a prompt into a key/value buffer, then feed one query at a time with
  causal='bottom_right' and kv_lengths: each output equals that row of full causal attention
  over the whole sequence. The prefix's keys are never recomputed. The batch elements hold
  sequences of different lengths, so the offset differs between them."""
  b, t, hq, hkv, d, buffer = 2, 23, 4, 2, 16, 40
  q, k, v, _ = _inputs(b, t, t, hq, hkv, d, seed=5)
  run = jax.jit(lambda q, k, v, lengths: attention(
      q, k, v, causal="bottom_right", kv_lengths=lengths, sliding_window=9,
      implementation=small_tiles), compiler_options=helpers.FAST_COMPILE)
  full = jax.jit(lambda q, k, v: attention(q, k, v, causal=True, sliding_window=9,
                                           implementation="xla"),
                 compiler_options=helpers.FAST_COMPILE)(q, k, v)
  k_buf = jnp.zeros((b, buffer, hkv, d)).at[:, :t].set(k)
  v_buf = jnp.zeros((b, buffer, hkv, d)).at[:, :t].set(v)
  prompt = 15
  out = run(q[:, :prompt], k_buf, v_buf, jnp.full((b,), prompt))
  helpers.assert_close(out, full[:, :prompt])
  for pos in range(prompt, t):
    ahead = jnp.array([0, 1])   # the second sequence is one token further on
    at = jnp.minimum(pos + ahead, t - 1)
    step = run(q[jnp.arange(b), at][:, None], k_buf, v_buf, at + 1)
    helpers.assert_close(step[:, 0], full[jnp.arange(b), at], what=f"position {pos}")


@pytest.mark.parametrize("impl", helpers.TABLE_IMPLEMENTATIONS)
def test_second_order_of_the_features_matches_torch(impl, small_tiles, pallas_mode):
  """Hessian-vector products (reverse over reverse, forward over reverse) with bottom-right
  alignment, a window, a soft-cap and grouped-query heads, against torch's double backward."""
  q, k, v, w = _inputs(2, 11, 19, 4, 2, 8, seed=6)
  kw = dict(causal="bottom_right", window=6, softcap=2.0)
  vs = _inputs(2, 11, 19, 4, 2, 8, seed=7)[:3]

  def fn(q, k, v):
    return attention(q, k, v, causal=kw["causal"], sliding_window=kw["window"],
                     logit_softcap=kw["softcap"], implementation=impl)

  reverse, forward = helpers.jax_hessian_vector_products(fn, (q, k, v), w, vs)
  want = helpers.torch_hessian_vector_products(
      lambda q, k, v: _torch_attention(q, k, v, **kw), (q, k, v), w, vs)
  helpers.assert_second_order_close(reverse, want, what="reverse over reverse")
  helpers.assert_second_order_close(forward, want, what="forward over reverse")


@pytest.mark.parametrize("window", [1, 16, 17, 40])
def test_sliding_window_skips_the_tiles_outside(window):
  """The XLA path visits, per query tile, exactly the key tiles that some row's window
  reaches; of those, only the ones a window edge crosses are masked."""
  blk, t = 16, 128
  un = xla._Units(q=jnp.zeros((1, t, 1, 8)), k=jnp.zeros((1, t, 8)), v=None, key_bias=None,
                  q_seg=None, kv_seg=None, bias=None, kv_lengths=None, b=1, tq=t, tk=t, hq=1,
                  hkv=1, g=1, d=8, blk=blk)

  class Cfg:
    causal, sliding_window, softcap = "top_left", window, None

  tiles = xla._Tiles(un, 0, Cfg)
  for i in range(t // blk):
    lo, a, b, hi = (int(x) for x in tiles.key_tiles(i))
    rows = range(i * blk, (i + 1) * blk)
    needed = sorted({key // blk for r in rows for key in range(max(0, r - window + 1), r + 1)})
    assert list(range(lo, hi)) == needed, (i, lo, hi)
    crossed = [j for j in needed
               if not all(r - window < key <= r for r in rows
                          for key in range(j * blk, (j + 1) * blk))]
    assert [j for j in range(lo, hi) if not a <= j < b] == crossed, (i, a, b)
    for j in range(t // blk):   # and from the keys' side, for the backward
      qlo, qa, qb, qhi = (int(x) for x in tiles.query_tiles(j))
      seen = [q for q in range(t // blk) if j in
              {key // blk for r in range(q * blk, (q + 1) * blk)
               for key in range(max(0, r - window + 1), r + 1)}]
      assert list(range(qlo, qhi)) == seen, (j, qlo, qhi)


@pytest.mark.parametrize("causal, window, lengths", [
    ("top_left", None, False), ("top_left", 5, False), ("bottom_right", None, False),
    ("bottom_right", 7, False), ("bottom_right", 7, True), (None, None, False)], ids=str)
@pytest.mark.parametrize("tq, tk", [(37, 37), (20, 53), (53, 20)])
def test_strips_span_exactly_the_keys_and_queries_they_may_need(tq, tk, causal, window, lengths):
  """The strip path's spans: for a strip of queries, from the first to the last key that one
  of them sees at some allowed offset (every kv length with kv_lengths); for a strip of keys,
  likewise the queries."""
  un = xla._Units(q=None, k=None, v=None, key_bias=None, q_seg=None, kv_seg=None, bias=None,
                  kv_lengths=jnp.zeros(1) if lengths else None, b=1, tq=tq, tk=tk, hq=1,
                  hkv=1, g=1, d=8, blk=1)

  class Cfg:
    causal, sliding_window = None, None

  Cfg.causal, Cfg.sliding_window = causal, window
  spans = xla._Spans(un, Cfg)
  kv_lens = range(tk + 1) if lengths else [tk]

  def sees(r, key):
    return any(key < n and (causal is None or (
        key <= r + (n - tq if causal == "bottom_right" else 0) and
        (window is None or key > r + (n - tq if causal == "bottom_right" else 0) - window)))
        for n in kv_lens)

  for height in (1, 6, 16):
    for qs, qn in xla._strips(tq, height):
      needed = [key for key in range(tk) if any(sees(r, key) for r in range(qs, qs + qn))]
      lo, hi = spans.keys_of(qs, qn)
      assert (lo, hi) == ((needed[0], needed[-1] + 1) if needed else (lo, lo)), (qs, qn)
    for ks, kn in xla._strips(tk, height):
      needed = [r for r in range(tq) if any(sees(r, key) for key in range(ks, ks + kn))]
      lo, hi = spans.queries_of(ks, kn)
      assert (lo, hi) == ((needed[0], needed[-1] + 1) if needed else (lo, lo)), (ks, kn)


def test_bad_feature_arguments_are_named():
  """The error the op table's BAD list (tests/cases/attention.py) has no entry for."""
  q = jnp.ones((1, 4, 2, 8))
  with pytest.raises(ValueError, match="attention: sliding_window must be None or a positive"):
    attention(q, q, q, causal=True, sliding_window=0)
