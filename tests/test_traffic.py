"""Bytes moved, derived from the kernels themselves, against oracles written from their shapes.

Every Pallas kernel is traced for a GPU (nothing runs) and its loads and stores are counted over
its grid by :mod:`jaxfuse.metrics.traffic`. Each oracle below is exact arithmetic from the
shapes, the tiles and the masks of what the kernel body does, so a kernel that starts to read
more (a tile loaded twice, a mask lost) fails its test. The Triton kernels are counted by
:mod:`jaxfuse.metrics.triton_traffic` while Triton's interpreter runs them.
"""

import functools
import math

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from jaxfuse import metrics, ops
from jaxfuse.kernels.pallas import bias_activation as pallas_bias_act
from jaxfuse.kernels.pallas import cross_entropy as pallas_xent
from jaxfuse.kernels.pallas import elementwise as pallas_elementwise
from jaxfuse.kernels.pallas import flash_attention as pallas_attention
from jaxfuse.kernels.pallas import gated_linear as pallas_glu
from jaxfuse.kernels.pallas import linear as pallas_linear
from jaxfuse.kernels.pallas import normalization as pallas_norm
from jaxfuse.kernels.pallas import softmax as pallas_softmax
from jaxfuse.metrics import traffic
from jaxfuse.ops import dispatch
from tests import helpers

S = jax.ShapeDtypeStruct
F32, BF16 = jnp.float32, jnp.bfloat16
cdiv = pl.cdiv


def _counted(f, *specs):
  """The traffic of every ``pallas_call`` that ``f`` traces for a GPU, in trace order."""
  with dispatch.target_platform("gpu"):
    closed = jax.make_jaxpr(f)(*specs)
  return [traffic.pallas_call_traffic(eqn) for eqn, _ in traffic.pallas_calls(closed.jaxpr)]


def _one(f, *specs):
  (counted,) = _counted(f, *specs)
  assert counted.exact, counted.name
  return counted


def _size(shape, dtype):
  return math.prod(shape) * jnp.dtype(dtype).itemsize


def _assert_traffic(counted, reads, writes):
  assert (counted.reads, counted.writes) == (reads, writes), counted.name


# The counter on small hand-made kernels -----------------------------------------------------------


def _call(kernel, x, out, grid, block):
  spec = pl.BlockSpec((block,), lambda i: (i,))
  return pl.pallas_call(kernel, out_shape=out, grid=grid, in_specs=[spec],
                        out_specs=spec, name=kernel.__name__)(x)


def test_a_block_loaded_twice_is_counted_twice():
  def twice(x_ref, y_ref):
    pl_triton.store(y_ref, pl_triton.load(x_ref) + pl_triton.load(x_ref))

  def once(x_ref, y_ref):
    pl_triton.store(y_ref, 2 * pl_triton.load(x_ref))

  x = S((24,), F32)
  _assert_traffic(_one(lambda x: _call(twice, x, x, (3,), 8), x), 2 * 96, 96)
  _assert_traffic(_one(lambda x: _call(once, x, x, (3,), 8), x), 96, 96)


def test_a_masked_tail_counts_only_the_kept_elements():
  def copy(x_ref, y_ref):
    ok = pl.program_id(0) * 8 + jnp.arange(8) < 21
    pl_triton.store(y_ref, pl_triton.load(x_ref, mask=ok, other=0.0), mask=ok)

  def unmasked(x_ref, y_ref):
    y_ref[...] = x_ref[...]

  x = S((21,), F32)
  _assert_traffic(_one(lambda x: _call(copy, x, x, (3,), 8), x), 21 * 4, 21 * 4)
  # Without a mask the last block runs past the end: 3 whole blocks each way.
  _assert_traffic(_one(lambda x: _call(unmasked, x, x, (3,), 8), x), 24 * 4, 24 * 4)


def test_primitives_without_a_rule_are_evaluated_with_jax():
  def prefix_mask(x_ref, y_ref):
    ok = jnp.cumsum(jnp.ones((8,), jnp.int32)) <= pl.program_id(0) + 2  # cumsum: no rule
    pl_triton.store(y_ref, pl_triton.load(x_ref, mask=ok, other=0.0), mask=ok)

  x = S((24,), F32)
  # Programs 0, 1, 2 keep 2, 3, 4 elements.
  _assert_traffic(_one(lambda x: _call(prefix_mask, x, x, (3,), 8), x), 9 * 4, 9 * 4)


def test_a_loop_whose_bound_depends_on_the_program():
  def prefix(x_ref, y_ref):
    def body(i, acc):
      return acc + pl_triton.load(x_ref.at[pl.ds(i * 8, 8)])

    total = lax.fori_loop(0, pl.program_id(0) + 1, body, jnp.zeros((8,), F32))
    pl_triton.store(y_ref.at[pl.ds(pl.program_id(0) * 8, 8)], total)

  x = S((32,), F32)
  spec = pl.BlockSpec((32,), lambda i: (0,))
  f = lambda x: pl.pallas_call(prefix, out_shape=x, grid=(4,), in_specs=[spec],  # noqa: E731
                               out_specs=spec)(x)
  # Program p loads p + 1 blocks of 8 floats and stores one.
  _assert_traffic(_one(f, x), (1 + 2 + 3 + 4) * 32, 4 * 32)


def test_a_data_dependent_branch_is_an_upper_bound():
  def branchy(x_ref, y_ref):
    first = pl_triton.load(x_ref.at[pl.ds(0, 1)])
    big = lambda: pl_triton.load(x_ref) * 2  # noqa: E731
    small = lambda: jnp.zeros((8,), F32)  # noqa: E731
    pl_triton.store(y_ref, lax.cond(first[0] > 0, big, small))

  x = S((16,), F32)
  (counted,) = _counted(lambda x: _call(branchy, x, x, (2,), 8), x)
  assert not counted.exact
  # Each program: the flag (1 float), then the costlier branch (8 floats); stores 8 floats.
  _assert_traffic(counted, 2 * (1 + 8) * 4, 2 * 8 * 4)


def test_a_loop_bound_read_from_memory_is_an_upper_bound():
  def walk(n_ref, x_ref, y_ref):
    n = jnp.clip(n_ref[0], 0, 3)
    body = lambda i, acc: acc + pl_triton.load(x_ref.at[pl.ds(i * 8, 8)])  # noqa: E731
    pl_triton.store(y_ref, lax.fori_loop(0, n, body, jnp.zeros((8,), F32)))

  whole = lambda shape: pl.BlockSpec(shape, lambda: (0,) * len(shape))  # noqa: E731
  f = lambda n, x: pl.pallas_call(  # noqa: E731
      walk, out_shape=S((8,), F32), in_specs=[whole((1,)), whole((24,))],
      out_specs=whole((8,)))(n, x)
  (counted,) = _counted(f, S((1,), jnp.int32), S((24,), F32))
  assert not counted.exact
  _assert_traffic(counted, 4 + 3 * 32, 32)
  assert [(o.role, o.reads, o.writes) for o in counted.operands] == [
      ("input", 4, 0), ("input", 96, 0), ("output", 0, 32)]


def test_a_loop_bound_read_from_memory_without_a_clip_is_refused(monkeypatch):
  def walk(n_ref, x_ref, y_ref):
    body = lambda i, acc: acc + pl_triton.load(x_ref)  # noqa: E731
    pl_triton.store(y_ref, lax.fori_loop(0, n_ref[0], body, jnp.zeros((8,), F32)))

  whole = lambda shape: pl.BlockSpec(shape, lambda: (0,) * len(shape))  # noqa: E731
  f = lambda n, x: pl.pallas_call(  # noqa: E731
      walk, out_shape=S((8,), F32), in_specs=[whole((1,)), whole((8,))],
      out_specs=whole((8,)))(n, x)
  monkeypatch.setattr(traffic, "MAX_LOOP_STEPS", 50)
  with pytest.raises(RuntimeError, match="while loop in the kernel ran past 50 steps"):
    _counted(f, S((1,), jnp.int32), S((8,), F32))


def test_kernels_inside_scan_count_once_per_step():
  a = S((1000,), F32)

  def steps(a):
    body = lambda c, _: (pallas_elementwise.add_forward(c, c), None)  # noqa: E731
    return lax.scan(body, a, None, length=3)[0]

  costs = metrics.kernel_costs(steps, a)
  assert [c.name for c in costs] == ["add"] * 3
  assert metrics.bytes_moved(steps, a) == 3 * 3 * 4000


# Elementwise kernels ---------------------------------------------------------------------------


ELEMENTWISE = {  # name: (kernel of n-element arrays, inputs, outputs)
    "add_act_fwd": (lambda a, b: pallas_elementwise.add_act_forward(a, b, jax.nn.gelu), 2, 1),
    "add_act_bwd": (lambda a, b, g: pallas_elementwise.add_act_backward(a, b, g, jax.nn.gelu),
                    3, 1),
    "add": (pallas_elementwise.add_forward, 2, 1),
    "act_fwd": (lambda c: pallas_elementwise.act_forward(c, jax.nn.silu), 1, 1),
    "act_bwd": (lambda c, g: pallas_elementwise.act_backward(c, g, jax.nn.silu), 2, 1),
    "relu_bwd": (pallas_elementwise.relu_backward_from_output, 2, 1),
}


@pytest.mark.parametrize("dtype", [F32, BF16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name", ELEMENTWISE)
def test_elementwise_kernels_read_their_inputs_and_write_their_outputs_once(name, dtype):
  kernel, n_in, n_out = ELEMENTWISE[name]
  x = S((3, 1667), dtype)  # 5001 elements: 3 blocks of 2048 on a GPU, the last one masked
  counted = _one(kernel, *[x] * n_in)
  assert (counted.name, counted.programs) == (name, 3)
  _assert_traffic(counted, n_in * _size(x.shape, dtype), n_out * _size(x.shape, dtype))


# Gated linear units, bias + activation ------------------------------------------------------------


@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
def test_glu_forward_and_backward(packed):
  rows, h = 37, 300  # 8 x 512 tiles on a GPU: both dimensions have tails
  half = _size((rows, h), F32)
  x, a = S((rows, 2 * h), F32), S((rows, h), F32)
  fn = jax.nn.silu
  if packed:
    fwd = _one(lambda x: pallas_glu.glu_forward(x, None, fn), x)
    bwd = _one(lambda x, g: pallas_glu.glu_backward(x, None, g, fn), x, a)
  else:
    fwd = _one(lambda a, b: pallas_glu.glu_forward(a, b, fn), a, a)
    bwd = _one(lambda a, b, g: pallas_glu.glu_backward(a, b, g, fn), a, a, a)
  _assert_traffic(fwd, 2 * half, half)
  _assert_traffic(bwd, 3 * half, 2 * half)


def test_bias_act_forward_reads_the_bias_once_per_row_of_tiles():
  rows, n = 37, 700
  x, bias = S((rows, n), F32), S((n,), BF16)
  br, bc = pallas_bias_act.tiles.plan(rows, n, interpret=False)
  row_tiles = cdiv(rows, br)
  counted = _one(lambda x, b: pallas_bias_act.bias_act_forward(x, b, jax.nn.gelu), x, bias)
  _assert_traffic(counted, _size(x.shape, F32) + row_tiles * _size(bias.shape, BF16),
                  _size(x.shape, F32))


@pytest.mark.parametrize("steps", [None, 4])
def test_bias_act_backward_walks_its_row_groups(steps):
  rows, n = 37, 700
  x, bias = S((rows, n), F32), S((n,), F32)
  *_, groups = pallas_bias_act.backward_plan(rows, n, interpret=False, steps=steps)
  counted = _one(lambda x, b, g: pallas_bias_act.bias_act_backward(x, b, g, jax.nn.gelu,
                                                                   steps=steps), x, bias, x)
  # x and g once, the bias once per row group; dx once and a float32 row of partials per group.
  _assert_traffic(counted, 2 * _size(x.shape, F32) + groups * n * 4,
                  _size(x.shape, F32) + groups * n * 4)


# Normalization -----------------------------------------------------------------------------------


NORMS = [  # (centered, has_residual, has_scale, has_bias)
    (True, False, True, True),     # layer_norm
    (False, False, True, False),   # rms_norm
    (True, True, True, True),      # add_layer_norm
    (False, True, True, False),    # add_rms_norm
    (False, False, False, False),  # rms_norm without a scale
]


@pytest.mark.parametrize("hidden", [300, 5000], ids=["one_chunk", "chunked"])
@pytest.mark.parametrize("store_stats", [False, True], ids=["fwd", "fwd_res"])
@pytest.mark.parametrize("centered, has_residual, has_scale, has_bias", NORMS)
def test_normalization_forward(centered, has_residual, has_scale, has_bias, store_stats, hidden):
  rows, dtype = 37, BF16
  x, param = S((rows, hidden), dtype), S((hidden,), F32)
  t = pallas_norm.tiling(rows, hidden)
  programs, passes = cdiv(rows, t.rows), (1 if t.chunks == 1 else 2)
  counted = _one(lambda x, r, s, b: pallas_norm.forward(
      x, r if has_residual else None, s if has_scale else None, b if has_bias else None,
      eps=1e-5, centered=centered, store_stats=store_stats), x, x, param, param)
  rows_bytes = _size(x.shape, dtype)
  # x (and the residual) once per pass over the row, each parameter row once per program; y
  # (and x + residual) written once, with a float32 mean and rstd a row for the backward.
  reads = passes * (1 + has_residual) * rows_bytes + programs * (has_scale + has_bias) * hidden * 4
  writes = (1 + has_residual) * rows_bytes + store_stats * (1 + centered) * rows * 4
  _assert_traffic(counted, reads, writes)


@pytest.mark.parametrize("hidden", [300, 5000], ids=["one_chunk", "chunked"])
@pytest.mark.parametrize("max_programs", [512, 2])
@pytest.mark.parametrize("centered, has_sum_grad, has_scale, has_bias", NORMS)
def test_normalization_backward(centered, has_sum_grad, has_scale, has_bias, max_programs,
                                hidden):
  rows, dtype = 37, F32
  x, param, stat = S((rows, hidden), dtype), S((hidden,), F32), S((rows, 1), F32)
  t = pallas_norm.tiling(rows, hidden)
  tiles = cdiv(rows, t.rows)
  per_program = cdiv(tiles, min(tiles, max_programs))
  programs = cdiv(tiles, per_program)
  counted = _one(lambda x, g, gz, s, m, r: pallas_norm.backward(
      x, g, gz if has_sum_grad else None, s if has_scale else None, m if centered else None, r,
      has_bias=has_bias, max_programs=max_programs), x, x, x, param, stat, stat)
  rows_bytes = _size(x.shape, dtype)
  # x and g once, the scale once for every tile a program walks (tiles past the last row too:
  # the scale's load is masked by column only), the sum's gradient once; the statistics (and,
  # with several column chunks, the row sums an XLA reduction gives the kernel) once per chunk;
  # dx once and a float32 row of partials per program and parameter.
  walked = programs * per_program
  row_floats = (1 + centered) * (1 if t.chunks == 1 else 2) * t.chunks
  reads = (2 * rows_bytes + has_scale * walked * hidden * 4 + has_sum_grad * rows_bytes
           + row_floats * rows * 4)
  writes = rows_bytes + programs * (has_scale + has_bias) * hidden * 4
  assert walked > tiles or max_programs == 512
  _assert_traffic(counted, reads, writes)


# Softmax -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, max_chunk", [(300, None), (1000, 256), (20000, None)],
                         ids=["one_chunk", "four_chunks", "longer_than_a_gpu_chunk"])
@pytest.mark.parametrize("masked", [False, True])
def test_softmax_forward_and_backward(n, max_chunk, masked):
  rows = 5 if n > 10000 else 37
  x, mask = S((rows, n), F32), S((rows, n), jnp.bool_)
  _, _, chunks = pallas_softmax.plan(rows, n, interpret=False, max_chunk=max_chunk)
  passes = 1 if chunks == 1 else 2
  size = _size(x.shape, F32)
  fwd = _one(lambda x, m: pallas_softmax.softmax_forward(x, m if masked else None, scale=0.5,
                                                         max_chunk=max_chunk), x, mask)
  # x (and the int8 mask) once per pass: once for a row in one chunk, twice for longer rows.
  _assert_traffic(fwd, passes * (size + masked * rows * n), size)
  bwd = _one(lambda y, g: pallas_softmax.softmax_backward(y, g, max_chunk=max_chunk), x, x)
  _assert_traffic(bwd, passes * 2 * size, size)


# Linear ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("a_layout", ["ik", "ki"])
@pytest.mark.parametrize("b_layout", ["jk", "kj"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matmul_reads_each_operand_once_per_program_row_or_column(a_layout, b_layout,
                                                                  with_bias):
  size_i, size_j, size_k = 100, 130, 70  # 64 x 64 x 32 tiles: tails everywhere
  a = S((size_i, size_k) if a_layout == "ik" else (size_k, size_i), BF16)
  b = S((size_j, size_k) if b_layout == "jk" else (size_k, size_j), BF16)
  bias = S((size_j,), F32)
  bi, bj, _ = pallas_linear.GPU_BLOCKS
  grid_i, grid_j = cdiv(size_i, bi), cdiv(size_j, bj)
  counted = _one(lambda a, b, c: pallas_linear.matmul(
      a, b, a_layout=a_layout, b_layout=b_layout, bias=c if with_bias else None,
      out_dtype=F32), a, b, bias)
  # Program (i, j) walks all of K: its rows of A, its rows of B (and its bias block).
  reads = (grid_j * _size(a.shape, BF16) + grid_i * _size(b.shape, BF16)
           + with_bias * grid_i * size_j * 4)
  _assert_traffic(counted, reads, size_i * size_j * 4)


def test_sum_rows_reads_g_once():
  g = S((130, 70), F32)
  _assert_traffic(_one(pallas_linear.sum_rows, g), _size(g.shape, F32), 70 * 4)


# Linear cross-entropy --------------------------------------------------------------------------


@pytest.mark.parametrize("with_bias", [False, True])
def test_cross_entropy_statistics_reload_h_for_every_vocabulary_tile(with_bias):
  n, d, v = 100, 70, 300
  h, w, bias, y = S((n, d), BF16), S((v, d), BF16), S((v,), F32), S((n,), jnp.int32)
  bt, bv, _ = pallas_xent.gpu_blocks(BF16)
  token_blocks, vocab_tiles = cdiv(n, bt), cdiv(v, bv)
  counted = _one(lambda h, w, b, y: pallas_xent.stats_forward(
      h, w, b if with_bias else None, y), h, w, bias, y)
  # Every token block walks every vocabulary tile, and each tile's logits reload the block's
  # rows of h over the hidden axis: h is read once per vocabulary tile, w (and the bias) once
  # per token block. Labels read once; four 4-byte statistics a token written.
  h_reads = vocab_tiles * _size(h.shape, BF16)
  reads = (h_reads + token_blocks * (_size(w.shape, BF16) + with_bias * v * 4) + 4 * n)
  _assert_traffic(counted, reads, 4 * 4 * n)
  assert counted.operands[0].reads == h_reads


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("smoothing", [False, True])
def test_cross_entropy_logit_gradient(with_bias, smoothing):
  n, d, v = 100, 70, 300
  h, w, bias, y = S((n, d), F32), S((v, d), F32), S((v,), F32), S((n,), jnp.int32)
  row = S((n,), F32)
  bt, bv, _ = pallas_xent.gpu_blocks(F32)
  token_blocks, vocab_tiles = cdiv(n, bt), cdiv(v, bv)
  counted = _one(lambda h, w, b, y, lse, a, b2, c: pallas_xent.logit_grad(
      h, w, b if with_bias else None, y, lse, a, b2, c, smoothing=smoothing),
      h, w, bias, y, row, row, row, row)
  # Program (token block, vocabulary tile): its rows of h, its rows of w (and bias), and four
  # (five with smoothing) 4-byte values of each of its tokens; writes its tile of dz.
  reads = (vocab_tiles * _size(h.shape, F32) + token_blocks * (_size(w.shape, F32)
                                                              + with_bias * v * 4)
           + vocab_tiles * (4 + smoothing) * n * 4)
  _assert_traffic(counted, reads, n * v * 4)


# Attention ---------------------------------------------------------------------------------------


def _offset(causal, tq, tk):
  """Query ``r`` sees keys up to ``r + offset``."""
  return tk - tq if causal == "bottom_right" else 0


def _tiles_over(lo, hi, block, total):
  """Rows of the ``block``-wide tiles holding positions ``lo..hi`` (none if ``hi < lo``),
  clipped to ``total``."""
  if hi < lo:
    return 0
  return min((hi // block + 1) * block, total) - lo // block * block


def _key_rows_seen(i, bq, bk, tq, tk, causal, window=None):
  """Key rows query tile ``i`` loads: all of them, or (causal) the key tiles from the one
  holding its first row's window start to the one holding its last row's diagonal."""
  if not causal:
    return tk
  offset = _offset(causal, tq, tk)
  first, last = i * bq, min((i + 1) * bq, tq) - 1
  start = 0 if window is None else max(0, first + offset - window + 1)
  return _tiles_over(start, min(last + offset, tk - 1), bk, tk)


def _query_rows_seen(j, bq, bk, tq, tk, causal, window=None):
  """Query rows key tile ``j`` loads (per query head): all of them, or (causal) the query
  tiles from the one holding the first row that sees the tile's first key to the one holding
  the last row whose window reaches its last key."""
  if not causal:
    return tq
  offset = _offset(causal, tq, tk)
  first, last = j * bk, min((j + 1) * bk, tk) - 1
  end = tq - 1 if window is None else min(tq - 1, last - offset + window - 1)
  return _tiles_over(max(0, first - offset), end, bq, tq)


def _rows(i, block, total):
  return max(0, min(block, total - i * block))


ATTENTION = [  # (batch, q_len, q_heads, kv_len, kv_heads, head_dim, dtype)
    (2, 100, 4, 90, 2, 40, F32),   # grouped-query, tails on every axis
    (1, 70, 2, 130, 2, 64, BF16),  # more keys than queries
]
BLOCKS = pallas_attention.BlockSizes(32, 16, 32, 16, 16, 32)


MASKS = [  # (causal, sliding window)
    (False, None), (True, None), ("bottom_right", None), (True, 24), ("bottom_right", 40)]


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("causal, window", MASKS, ids=str)
@pytest.mark.parametrize("b, tq, hq, tk, hkv, d, dtype", ATTENTION)
def test_attention_kernels(b, tq, hq, tk, hkv, d, dtype, causal, window, with_bias):
  q, k, do = S((b, tq, hq, d), dtype), S((b, tk, hkv, d), dtype), S((b, tq, hq, d), dtype)
  lse = S((b, hq, tq), F32)
  bias = S((b, hq, tq, tk), dtype) if with_bias else None
  item, b_item = jnp.dtype(dtype).itemsize, jnp.dtype(dtype).itemsize
  blocks = BLOCKS
  args = (q, k, k) + ((bias,) if with_bias else ())
  softcap = 30.0 if with_bias else None   # moves nothing; tested with the bias

  def forward(with_lse):
    def f(q, k, v, *bias):
      return pallas_attention.forward(q, k, v, None, None, None, bias[0] if bias else None,
                                      causal=causal, window=window, softcap=softcap, scale=0.125,
                                      blocks=blocks, with_lse=with_lse)
    return _one(f, *args)

  def backward(q, k, v, o, lse, do, *bias):
    return pallas_attention.backward(q, k, v, None, None, None, bias[0] if bias else None, o,
                                     lse, do, causal=causal, window=window, softcap=softcap,
                                     scale=0.125, blocks=blocks)

  # Forward, grid (query tiles, heads, batch): the query tile once, the key and value rows of
  # the key tiles it visits, the bias tiles there; writes o (and the float32 lse).
  bq, bk = blocks.block_q, blocks.block_k
  tiles = range(cdiv(tq, bq))
  seen = [_key_rows_seen(i, bq, bk, tq, tk, causal, window) for i in tiles]
  keys = sum(seen)
  bias_reads = with_bias * sum(_rows(i, bq, tq) * seen[i] for i in tiles) * b_item
  reads = b * hq * (tq * d * item + 2 * keys * d * item + bias_reads)
  for with_lse in (False, True):
    counted = forward(with_lse)
    assert counted.name == ("attention_fwd_res" if with_lse else "attention_fwd")
    _assert_traffic(counted, reads, b * hq * tq * (d * item + with_lse * 4))

  kernels = {c.name: c for c in _counted(backward, q, k, k, q, lse, do, *args[3:])}
  assert all(c.exact for c in kernels.values())
  assert sorted(kernels) == sorted(["attention_bwd_dq", "attention_bwd_dkdv"]
                                   + with_bias * ["attention_bwd_dbias"])

  # dq, grid (query tiles, heads, batch): q and do, lse and delta once, k and v as the forward.
  bq, bk = blocks.block_q_dq, blocks.block_k_dq
  tiles = range(cdiv(tq, bq))
  seen = [_key_rows_seen(i, bq, bk, tq, tk, causal, window) for i in tiles]
  keys = sum(seen)
  bias_reads = with_bias * sum(_rows(i, bq, tq) * seen[i] for i in tiles) * b_item
  reads = b * hq * (2 * tq * d * item + 2 * tq * 4 + 2 * keys * d * item + bias_reads)
  _assert_traffic(kernels["attention_bwd_dq"], reads, b * hq * tq * d * item)

  # dk/dv, grid (key tiles, kv heads, batch): its own k and v rows once, and for each query
  # head of the group the q, do, lse and delta rows (and bias tiles) of the query tiles it
  # visits; writes dk and dv.
  bq, bk = blocks.block_q_dkdv, blocks.block_k_dkdv
  key_tiles = range(cdiv(tk, bk))
  seen = [_query_rows_seen(j, bq, bk, tq, tk, causal, window) for j in key_tiles]
  queries = sum(seen)
  bias_reads = with_bias * sum(seen[j] * _rows(j, bk, tk) for j in key_tiles) * b_item
  reads = (b * hkv * 2 * tk * d * item
           + b * hq * (queries * (2 * d * item + 2 * 4) + bias_reads))
  _assert_traffic(kernels["attention_bwd_dkdv"], reads, b * hkv * 2 * tk * d * item)

  if with_bias:
    # dbias, grid (query tiles, key tiles, batch x heads): every tile pair, whatever the mask.
    bq, bk = blocks.block_q_dq, blocks.block_k_dq
    nq, nk = cdiv(tq, bq), cdiv(tk, bk)
    reads = b * hq * (nk * tq * (2 * d * item + 2 * 4) + nq * tk * 2 * d * item
                      + tq * tk * b_item)
    _assert_traffic(kernels["attention_bwd_dbias"], reads, b * hq * tq * tk * 4)


def _attention_traffic(causal, window, with_lengths=False, b=1, t=256, h=2, d=64):
  """``{kernel name: traffic}`` of the forward and backward kernels at one shape."""
  x, lse = S((b, t, h, d), F32), S((b, h, t), F32)
  specs = (x, x, x, x, lse, x) + ((S((b,), jnp.int32),) if with_lengths else ())
  kw = dict(causal=causal, window=window, scale=0.125, blocks=BLOCKS)

  def both(q, k, v, o, lse, do, *lengths):
    lengths = lengths[0] if lengths else None
    return (pallas_attention.forward(q, k, v, None, None, lengths, None, **kw),
            pallas_attention.backward(q, k, v, None, None, lengths, None, o, lse, do, **kw))

  return {c.name: c for c in _counted(both, *specs)}


@pytest.mark.parametrize("causal", [True, "bottom_right"])
def test_attention_window_skips_the_key_tiles_outside(causal):
  """A window of 48 keys at 256 positions: every kernel reads fewer tiles than with the causal
  mask alone (it writes the same)."""
  alone, windowed = _attention_traffic(causal, None), _attention_traffic(causal, 48)
  assert sorted(alone) == sorted(windowed) == [
      "attention_bwd_dkdv", "attention_bwd_dq", "attention_fwd_res"]
  for name, counted in windowed.items():
    assert counted.exact and counted.reads < alone[name].reads, name
    assert counted.writes == alone[name].writes, name


def test_attention_with_kv_lengths_is_an_upper_bound():
  """The offset and the key limit come from kv_lengths, loaded in the kernel: the loop bounds
  are intervals and the count is an upper bound, at least what a full-length batch moves."""
  full = _attention_traffic("bottom_right", 48)
  bounded = _attention_traffic("bottom_right", 48, with_lengths=True)
  for name, counted in bounded.items():
    assert not counted.exact, name
    assert counted.reads >= full[name].reads and counted.writes == full[name].writes, name


def test_attention_with_segment_ids_is_an_upper_bound():
  """Key tiles that share no segment with the query tile are skipped by a branch on the loaded
  ids: the count is the upper bound, every tile visited, plus the ids' own loads."""
  b, t, h, d = 1, 100, 2, 32
  q, seg = S((b, t, h, d), F32), S((b, t), jnp.int32)
  blocks = BLOCKS

  def f(q, k, v, seg):
    return pallas_attention.forward(q, k, v, seg, seg, None, None, causal=False, scale=0.2,
                                    blocks=blocks, with_lse=False)

  (counted,) = _counted(f, q, q, q, seg)
  assert not counted.exact
  bq = blocks.block_q
  nq = cdiv(t, bq)
  reads = b * h * (t * d * 4 + nq * 2 * t * d * 4 + t * 4 + nq * t * 4)
  _assert_traffic(counted, reads, b * h * t * d * 4)


# Through the ops and the metrics -----------------------------------------------------------------


def test_kernel_costs_trace_the_ops_for_a_gpu():
  x = jnp.ones((64, 1000))
  loss = lambda x: jnp.sum(ops.glu(x, implementation="pallas"))  # noqa: E731
  costs = metrics.kernel_costs(jax.value_and_grad(loss), x)
  assert [c.name for c in costs] == ["glu_fwd", "glu_bwd"]
  assert all(c.exact for c in costs)
  assert [(c.reads, c.writes) for c in costs] == [(2 * 32_000 * 4, 32_000 * 4),
                                                 (3 * 32_000 * 4, 2 * 32_000 * 4)]
  assert all(c.bytes_accessed == c.reads + c.writes for c in costs)


# Triton kernels, under Triton's interpreter ----------------------------------------------------


triton_only = pytest.mark.skipif(helpers.ON_GPU, reason="counts under Triton's interpreter")


@functools.cache
def _triton_kernels():
  pytest.importorskip("triton")
  from jaxfuse.kernels.triton import elementwise, gated_linear, normalization
  return elementwise, gated_linear, normalization


@triton_only
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_triton_elementwise_kernels(dtype):
  import torch
  kernels, _, _ = _triton_kernels()
  n, item = 3 * 1024 + 5, 4 if dtype == "float32" else 2
  a = torch.ones(n, dtype=getattr(torch, dtype))
  out = torch.empty_like(a)
  with metrics.triton_traffic.counting() as counted:
    kernels.add_act_fwd_kernel[kernels.grid_for(n)](a, a, out, N=n, BLOCK=kernels.BLOCK,
                                                    ACT="silu")
    kernels.add_act_bwd_kernel[kernels.grid_for(n)](a, a, a, out, N=n, BLOCK=kernels.BLOCK,
                                                    ACT="silu")
  assert [(c.name, c.reads, c.writes) for c in counted.launches] == [
      ("add_act_fwd_kernel", 2 * n * item, n * item),
      ("add_act_bwd_kernel", 3 * n * item, n * item)]


@triton_only
@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
def test_triton_glu_kernels(packed):
  import torch
  _, kernels, _ = _triton_kernels()
  rows, h = 10, 300  # 8 x 256 tiles: tails on both axes
  half = rows * h * 4
  grid = kernels.grid_for(rows, h)
  blocks = dict(BLOCK_R=kernels.BLOCK_R, BLOCK_C=kernels.BLOCK_C, ACT="silu")
  g = torch.ones(rows, h)
  with metrics.triton_traffic.counting() as counted:
    if packed:
      x, dx, y = torch.ones(rows, 2 * h), torch.empty(rows, 2 * h), torch.empty(rows, h)
      kernels.glu_fwd_kernel[grid](x, x, y, ROWS=rows, H=h, IN_STRIDE=2 * h, B_OFFSET=h,
                                   **blocks)
      kernels.glu_bwd_packed_kernel[grid](x, g, dx, ROWS=rows, H=h, **blocks)
    else:
      a, y, da, db = (torch.ones(rows, h) for _ in range(4))
      kernels.glu_fwd_kernel[grid](a, a, y, ROWS=rows, H=h, IN_STRIDE=h, B_OFFSET=0, **blocks)
      kernels.glu_bwd_kernel[grid](a, a, g, da, db, ROWS=rows, H=h, IN_STRIDE=h, B_OFFSET=0,
                                   **blocks)
  assert [(c.reads, c.writes) for c in counted.launches] == [(2 * half, half),
                                                             (3 * half, 2 * half)]


@triton_only
@pytest.mark.parametrize("with_scale", [False, True])
def test_triton_rms_norm_kernels(with_scale):
  import torch
  _, _, kernels = _triton_kernels()
  rows, hidden = 5, 1000
  block = kernels.block_for(hidden)
  programs, per_program = 3, 2  # the last program's second row is past the end
  x, g, w = torch.ones(rows, hidden), torch.ones(rows, hidden), torch.ones(hidden)
  y, dx, rstd = torch.empty_like(x), torch.empty_like(x), torch.empty(rows, 1)
  partial = torch.zeros(programs, hidden)
  with metrics.triton_traffic.counting() as counted:
    kernels.rms_norm_fwd_kernel[(rows,)](x, w, y, rstd, H=hidden, eps=1e-6, BLOCK_H=block,
                                         HAS_SCALE=with_scale)
    kernels.rms_norm_bwd_kernel[(programs,)](x, g, w, rstd, dx, partial, R=rows, H=hidden,
                                             ROWS_PER_PROGRAM=per_program, BLOCK_H=block,
                                             HAS_SCALE=with_scale)
  size = rows * hidden * 4
  # Forward, one row a program: the row (and the scale), writes the row and its rstd.
  fwd = (size + with_scale * rows * hidden * 4, size + rows * 4)
  # Backward: the scale once a program, x, g and rstd of its rows; dx, and a float32 row of
  # scale-gradient partials a program.
  bwd = (with_scale * programs * hidden * 4 + 2 * size + rows * 4,
         size + with_scale * programs * hidden * 4)
  assert [(c.reads, c.writes) for c in counted.launches] == [fwd, bwd]


@functools.cache
def _more_triton_kernels():
  pytest.importorskip("triton")
  from jaxfuse.kernels.triton import bias_activation, linear, softmax
  return softmax, bias_activation, linear


@triton_only
@pytest.mark.parametrize("chunk", [512, 128], ids=["one chunk", "3 chunks"])
@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
def test_triton_softmax_kernels(chunk, masked):
  import torch
  kernels, _, _ = _more_triton_kernels()
  rows, n = 5, 300  # 8-row tiles (3 rows past the end) and a column tail
  block_r, block_n, n_chunks = kernels.plan(rows, n, max_chunk=chunk)
  grid = kernels.grid_for(rows, block_r)
  meta = dict(ROWS=rows, N=n, SCALE=0.5, BLOCK_R=block_r, BLOCK_N=block_n, N_CHUNKS=n_chunks)
  x, y, dx = torch.ones(rows, n), torch.empty(rows, n), torch.empty(rows, n)
  mask = torch.ones(rows, n, dtype=torch.int8)
  with metrics.triton_traffic.counting() as counted:
    kernels.softmax_fwd_kernel[grid](x, mask, y, HAS_MASK=masked, **meta)
    kernels.softmax_bwd_kernel[grid](x, x, dx, **meta)
  size, passes = rows * n * 4, 1 if n_chunks == 1 else 2
  # Forward: x (and the int8 mask) once a pass, the output once. Backward: y and g once a pass.
  fwd = (passes * (size + masked * rows * n), size)
  bwd = (passes * 2 * size, size)
  assert [(c.reads, c.writes) for c in counted.launches] == [fwd, bwd]


@triton_only
def test_triton_bias_act_kernels():
  import torch
  _, kernels, _ = _more_triton_kernels()
  rows, n = 37, 700  # 8 x 512 tiles: tails on both axes
  block_r, block_c = kernels.blocks_for(rows, n)
  _, _, steps, groups, col_blocks = kernels.backward_plan(rows, n, target_programs=4)
  row_blocks = cdiv(rows, block_r)
  x, y, dx = torch.ones(rows, n), torch.empty(rows, n), torch.empty(rows, n)
  b, partials = torch.ones(n), torch.empty(groups, n)
  with metrics.triton_traffic.counting() as counted:
    kernels.bias_act_fwd_kernel[kernels.forward_grid(rows, n)](
        x, b, y, ROWS=rows, N=n, BLOCK_R=block_r, BLOCK_C=block_c, ACT="gelu")
    kernels.bias_act_bwd_kernel[(groups, col_blocks)](
        x, b, x, dx, partials, ROWS=rows, N=n, BLOCK_R=block_r, BLOCK_C=block_c, STEPS=steps,
        ACT="gelu")
  size = rows * n * 4
  # Forward: x, and the bias once a row block. Backward: the bias once a row group, x and g;
  # dx and a float32 row of bias-gradient partials a group.
  fwd = (size + row_blocks * n * 4, size)
  bwd = (groups * n * 4 + 2 * size, size + groups * n * 4)
  assert (steps, groups) == (3, 2)
  assert [(c.reads, c.writes) for c in counted.launches] == [fwd, bwd]


@triton_only
@pytest.mark.parametrize("centered, residual, scale, bias", [
    (True, False, True, True), (True, True, True, True), (False, True, True, False),
    (True, True, False, False)], ids=["layer_norm", "add_layer_norm", "add_rms_norm",
                                      "add_layer_norm plain"])
def test_triton_norm_kernels(centered, residual, scale, bias):
  import torch
  _, _, kernels = _triton_kernels()
  rows, hidden, item = 5, 1000, 2  # bfloat16 rows, float32 statistics and partials
  block = kernels.block_for(hidden)
  programs, per_program = 3, 2  # the last program's second row is past the end
  x = torch.ones(rows, hidden, dtype=torch.bfloat16)
  p = torch.ones(hidden, dtype=torch.bfloat16)
  y, z, dx = torch.empty_like(x), torch.ones_like(x), torch.empty_like(x)
  mean, rstd = torch.empty(rows, 1), torch.empty(rows, 1)
  dw, db = torch.empty(programs, hidden), torch.empty(programs, hidden)
  with metrics.triton_traffic.counting() as counted:
    kernels.norm_fwd_kernel[(rows,)](x, x, p, p, y, z, mean, rstd, H=hidden, eps=1e-5,
                                     BLOCK_H=block, CENTERED=centered, HAS_RESIDUAL=residual,
                                     HAS_SCALE=scale, HAS_BIAS=bias, STORE_STATS=True)
    kernels.norm_bwd_kernel[(programs,)](z, x, x, p, mean, rstd, dx, dw, db, R=rows, H=hidden,
                                         ROWS_PER_PROGRAM=per_program, BLOCK_H=block,
                                         CENTERED=centered, HAS_SUM_GRAD=residual,
                                         HAS_SCALE=scale, HAS_BIAS=bias)
  size = rows * hidden * item
  params = (scale + bias) * hidden * item
  stats = (1 + centered) * rows * 4
  # Forward, one row a program: x (and the residual), the parameters a row; writes y (and z)
  # and the statistics. Backward: the scale once a program, the rows' x, g (and the sum's
  # gradient) and statistics; writes dx and a float32 row of each parameter's partials a
  # program.
  fwd = ((1 + residual) * size + rows * params, (1 + residual) * size + stats)
  bwd = (programs * scale * hidden * item + (2 + residual) * size + stats,
         size + (scale + bias) * programs * hidden * 4)
  assert [(c.reads, c.writes) for c in counted.launches] == [fwd, bwd]


@triton_only
@pytest.mark.parametrize("a_layout, b_layout", [("ik", "jk"), ("ik", "kj"), ("ki", "kj")])
def test_triton_matmul_and_sum_rows_kernels(a_layout, b_layout):
  import torch
  _, _, kernels = _more_triton_kernels()
  size_i, size_j, size_k, item = 70, 45, 100, 2  # bfloat16; 64 x 32 x 32 tiles, tails
  bi, bj, bk = kernels.blocks_for(size_i, size_j, size_k, (64, 32, 32))
  grid = kernels.matmul_grid(size_i, size_j, bi, bj)
  a = torch.ones((size_i, size_k) if a_layout == "ik" else (size_k, size_i), dtype=torch.bfloat16)
  b = torch.ones((size_j, size_k) if b_layout == "jk" else (size_k, size_j), dtype=torch.bfloat16)
  bias = torch.ones(size_j, dtype=torch.bfloat16)
  c, total = torch.empty(size_i, size_j, dtype=torch.bfloat16), torch.empty(size_j)
  has_bias = a_layout == "ik" and b_layout == "jk"  # the forward product has the bias
  with metrics.triton_traffic.counting() as counted:
    kernels.matmul_kernel[grid](a, b, bias, c, SIZE_I=size_i, SIZE_J=size_j, SIZE_K=size_k,
                                A_LAYOUT=a_layout, B_LAYOUT=b_layout, HAS_BIAS=has_bias,
                                IEEE=False, BLOCK_I=bi, BLOCK_J=bj, BLOCK_K=bk)
    kernels.sum_rows_kernel[(cdiv(size_j, 32),)](c, total, SIZE_I=size_i, SIZE_J=size_j,
                                                 BLOCK_I=16, BLOCK_J=32)
  # Each program reads its rows of A and its columns of B over all of K (and its columns of
  # the bias), and writes its tile of C; so A is read once a column block, B once a row block.
  n_i, n_j = grid
  matmul = ((size_i * size_k * n_j + size_j * size_k * n_i + has_bias * size_j * n_i) * item,
            size_i * size_j * item)
  # The row sum reads every element once and writes a float32 sum a column.
  sum_rows = (size_i * size_j * item, size_j * 4)
  assert grid == (2, 2)
  assert [(c.reads, c.writes) for c in counted.launches] == [matmul, sum_rows]
