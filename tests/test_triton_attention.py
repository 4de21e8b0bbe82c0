"""The Triton attention kernels (``implementation="triton"``) on a CPU: their bodies under
Triton's interpreter (TRITON_INTERPRET=1, set by conftest without a GPU) against float64 torch
twins, the jax-triton wrappers' plumbing with stand-ins for ``jax_triton``, the tiles the kernels
visit, and the bytes each kernel moves.

Two stand-ins replace the ``jax_triton`` module: :class:`InterpretedJaxTriton`, whose
``triton_call`` runs the kernel under the interpreter on torch copies of the arrays (through
``jax.pure_callback``, so it also runs under ``jit``), and :class:`RecordingJaxTriton`, which
records each call and returns zeros.
"""

import contextlib
import itertools
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxfuse.kernels.pallas.flash_attention import BlockSizes
from jaxfuse.ops import attention, dispatch
from jaxfuse.ops.flash_attention import tuning
from jaxfuse.testing.torch_ref import attention as ref
from tests import helpers

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from jaxfuse.kernels.triton import flash_attention as fa  # noqa: E402
from jaxfuse.metrics import triton_traffic  # noqa: E402

pytestmark = pytest.mark.skipif(helpers.ON_GPU, reason="interpreter tests; GPUs run jax-triton")

# Query and key tiles of different sizes (and different ones per kernel), so that several of
# each are visited at these lengths and the tile arithmetic meets tiles of both shapes.
SMALL_BLOCKS = BlockSizes(16, 32, 32, 16, 16, 32)
LOG2E = 1.4426950408889634


# Triton's interpreter and bfloat16 -------------------------------------------------------------


@contextlib.contextmanager
def bfloat16_as_on_a_gpu():
  """Makes Triton's interpreter treat bfloat16 as GPUs do, while the block runs.

  The interpreter keeps bfloat16 tiles as their raw 16 bits: ``tl.dot`` multiplies those bits
  as integers, and float32 -> bfloat16 conversions truncate. GPUs multiply the values with
  float32 accumulation and round to nearest even; so do the patched ``create_dot`` and
  ``cast_impl``. float32 and float16 are left alone (the interpreter is right for them).
  """
  from triton.runtime import interpreter

  builder = interpreter.interpreter_builder
  cls = type(builder)
  handle = interpreter.TensorHandle

  def to_float32(x):
    bits = np.asarray(x.data).astype(np.uint32) << np.uint32(16)
    return handle(bits.view(np.float32), tl.float32)

  def cast_impl(src, dst_type):
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
      bits = np.asarray(src.data, np.float32).view(np.uint32)
      bits = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
      return handle(bits.astype(np.uint16), tl.bfloat16)
    return cls.cast_impl(builder, src, dst_type)

  def create_dot(a, b, d, input_precision, max_num_imprecise_acc):
    if a.dtype.scalar == tl.bfloat16:
      a, b = to_float32(a), to_float32(b)
    return cls.create_dot(builder, a, b, d, input_precision, max_num_imprecise_acc)

  builder.cast_impl = cast_impl
  builder.create_dot = create_dot
  try:
    yield
  finally:
    del builder.cast_impl
    del builder.create_dot


@pytest.fixture(autouse=True)
def _gpu_bfloat16():
  with bfloat16_as_on_a_gpu():
    yield


def test_the_interpreter_patch_multiplies_and_rounds_bfloat16_as_a_gpu():
  @triton.jit
  def kernel(a_ptr, b_ptr, c_ptr, r_ptr, x_ptr):
    idx = tl.arange(0, 16)
    tile = idx[:, None] * 16 + idx[None, :]
    a = tl.load(a_ptr + tile)
    b = tl.load(b_ptr + tile)
    tl.store(c_ptr + tile, tl.dot(a, b))
    tl.store(r_ptr + idx, tl.load(x_ptr + idx).to(tl.bfloat16))

  torch.manual_seed(0)
  a, b = torch.randn(16, 16).bfloat16(), torch.randn(16, 16).bfloat16()
  c, r = torch.empty(16, 16), torch.empty(16, dtype=torch.bfloat16)
  x = torch.randn(16) * 1.001
  kernel[(1,)](a, b, c, r, x)
  helpers.assert_close(c, a.double() @ b.double())
  assert torch.equal(r, x.bfloat16())  # torch rounds to nearest even


# Stand-ins for jax_triton ------------------------------------------------------------------------


def _to_torch(x: np.ndarray) -> torch.Tensor:
  if x.dtype == jnp.bfloat16:
    return torch.from_numpy(np.ascontiguousarray(x).view(np.uint16).astype(np.int16)).view(
        torch.bfloat16)
  return torch.from_numpy(np.array(x))


def _to_numpy(t: torch.Tensor, dtype) -> np.ndarray:
  if t.dtype == torch.bfloat16:
    return t.view(torch.int16).numpy().view(jnp.bfloat16)
  return t.numpy().astype(dtype)


def _empty(shape, dtype) -> torch.Tensor:
  """Outputs start as NaN (floats) or -7 (ints): an element no program writes shows."""
  t = torch.empty(shape, dtype=helpers.TORCH_DTYPES.get(jnp.dtype(dtype), torch.int32))
  return t.fill_(float("nan") if t.dtype.is_floating_point else -7)


class InterpretedJaxTriton:
  """A ``jax_triton`` whose ``triton_call`` runs the kernel under Triton's interpreter."""

  def __init__(self):
    self.names = []

  def triton_call(self, *args, kernel, out_shape, grid, num_warps, num_stages, **constants):
    del num_warps, num_stages
    self.names.append(kernel.__name__)
    shapes = list(out_shape) if isinstance(out_shape, (list, tuple)) else [out_shape]

    def run(*arrays):
      outs = [_empty(s.shape, s.dtype) for s in shapes]
      kernel[grid](*[_to_torch(np.asarray(a)) for a in arrays], *outs, **constants)
      return [_to_numpy(o, s.dtype) for o, s in zip(outs, shapes)]

    results = jax.pure_callback(run, shapes, *args, vmap_method="sequential")
    return results if isinstance(out_shape, (list, tuple)) else results[0]


class RecordingJaxTriton:
  """A ``jax_triton`` whose ``triton_call`` records its arguments and returns zeros."""

  def __init__(self):
    self.calls = []

  def triton_call(self, *args, kernel, out_shape, grid, **params):
    self.calls.append(dict(args=args, kernel=kernel, name=kernel.__name__, out_shape=out_shape,
                           grid=grid, **params))
    shapes = list(out_shape) if isinstance(out_shape, (list, tuple)) else [out_shape]
    zeros = [jnp.zeros(s.shape, s.dtype) for s in shapes]
    return zeros if isinstance(out_shape, (list, tuple)) else zeros[0]


@pytest.fixture
def interpreted(monkeypatch):
  module = InterpretedJaxTriton()
  monkeypatch.setitem(sys.modules, "jax_triton", module)
  return module


@pytest.fixture
def recording(monkeypatch):
  module = RecordingJaxTriton()
  monkeypatch.setitem(sys.modules, "jax_triton", module)
  return module


@pytest.fixture
def triton_runs_here(monkeypatch):
  """``implementation="triton"`` resolves on this CPU (its calls go to a stand-in)."""
  can_run = dispatch.can_run
  monkeypatch.setattr(dispatch, "can_run", lambda impl: impl == "triton" or can_run(impl))


# Twins -------------------------------------------------------------------------------------------


def _inputs(b, tq, tk, hq, hkv, d, seed=0, dtype=jnp.float32):
  return helpers.normals(seed, (b, tq, hq, d), (b, tk, hkv, d), (b, tk, hkv, d), (b, tq, hq, d),
                         dtype=dtype)


def _torch_attention(q, k, v, bias=None, *, causal=None, window=None, softcap=None,
                     kv_lengths=None, segments=None, with_lse=False):
  """Attention written out in torch with an explicit mask (the masks torch's own attention
  lacks: bottom-right alignment, windows, soft-caps): ``causal`` None, "top_left" or
  "bottom_right" (relative to the valid keys); ``bias`` added after the soft-cap; rows that see
  no key give zeros. With ``with_lse`` also the natural log-sum-exp ``[b, hq, tq]``."""
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
  lengths = torch.full((b,), tk) if kv_lengths is None else torch.from_numpy(
      np.array(kv_lengths)).long()
  key = torch.arange(tk)[None, None, :]
  mask = (key < lengths[:, None, None]).expand(b, tq, tk)
  if causal is not None:
    offset = lengths - tq if causal == "bottom_right" else torch.zeros(b, dtype=torch.long)
    row = torch.arange(tq)[None, :, None] + offset[:, None, None]
    mask = mask & (key <= row)
    if window is not None:
      mask = mask & (key > row - window)
  if segments is not None:
    q_seg, kv_seg = (torch.from_numpy(np.array(x)) for x in segments)
    mask = mask & (q_seg[:, :, None] == kv_seg[:, None, :])
  s = s.masked_fill(~mask[:, None], float("-inf"))
  p = torch.softmax(s, dim=-1).nan_to_num(0.0)
  o = (p @ vh).permute(0, 2, 1, 3)
  return (o, torch.logsumexp(s, dim=-1)) if with_lse else o


def _twin(masks, bias_given):
  """The torch twin of these masks: torch's own attention (jaxfuse/testing/torch_ref) where it
  has them, the explicit one otherwise."""
  sdpa = (masks.get("window") is None and masks.get("softcap") is None
          and masks.get("causal") in (None, "top_left"))
  if sdpa:
    segments = masks.get("segments")
    segments = None if segments is None else tuple(torch.from_numpy(np.array(s))
                                                   for s in segments)
    kv_lengths = masks.get("kv_lengths")
    kv_lengths = None if kv_lengths is None else torch.from_numpy(np.array(kv_lengths))

    def twin(q, k, v, bias=None):
      return ref.attention(q, k, v, causal=masks.get("causal") is not None,
                           segment_ids=segments, kv_lengths=kv_lengths, bias=bias)
  else:
    def twin(q, k, v, bias=None):
      return _torch_attention(q, k, v, bias, **masks)
  return twin if bias_given else (lambda q, k, v: twin(q, k, v))


def _kernels(q, k, v, g, bias=None, *, blocks=SMALL_BLOCKS, causal=None, window=None,
             softcap=None, kv_lengths=None, segments=None):
  """``(o, lse), (dq, dk, dv[, dbias])`` from the jax-triton wrappers (with a stand-in)."""
  q_seg, kv_seg = (None, None) if segments is None else segments
  kw = dict(causal=causal, scale=1.0 / math.sqrt(q.shape[-1]), blocks=blocks, window=window,
            softcap=softcap)
  o, lse = fa.forward(q, k, v, q_seg, kv_seg, kv_lengths, bias, **kw)
  grads = fa.backward(q, k, v, q_seg, kv_seg, kv_lengths, bias, o, lse, g, **kw)
  return (o, lse), grads if bias is not None else grads[:3]


# The kernels a forward with lse and a backward launch, in order (dbias only with a bias).
BACKWARD = ["attention_fwd_res_kernel", "attention_bwd_dq_kernel", "attention_bwd_dkdv_kernel",
            "attention_bwd_dbias_kernel"]


def _segments(b, t, seed, count=3):
  """Sorted random segment ids ``[b, t]`` (packed sequences)."""
  ids = np.random.default_rng(seed).integers(0, count, (b, t))
  return jnp.asarray(np.sort(ids, axis=1).astype(np.int32))


# (name, (batch, tq, tk, hq, hkv, d), masks, bias shape or None); two batch elements where
# something differs between them. A bias over heads (shared across the batch) is in
# "everything"; a causal mask with a bias in "whole tiles".
CASES = [
    ("plain gqa d40", (1, 37, 45, 4, 2, 40), {}, None),
    ("plain mha d16", (1, 20, 33, 3, 3, 16), {}, None),
    ("causal top_left", (1, 37, 45, 4, 2, 40), dict(causal="top_left"), None),
    ("causal bottom_right", (1, 20, 53, 4, 2, 40), dict(causal="bottom_right"), None),
    ("causal bottom_right, more queries", (1, 53, 20, 4, 1, 24), dict(causal="bottom_right"),
     None),
    ("window top_left", (1, 37, 37, 4, 2, 40), dict(causal="top_left", window=7), None),
    ("window 1", (1, 37, 37, 2, 2, 16), dict(causal="top_left", window=1), None),
    ("window bottom_right, kv_lengths", (2, 20, 53, 2, 1, 40),
     dict(causal="bottom_right", window=9, kv_lengths=(53, 42)), None),
    ("softcap", (1, 33, 33, 4, 2, 40), dict(softcap=3.0), None),
    ("softcap causal", (1, 33, 45, 2, 2, 16), dict(causal="top_left", softcap=5.0), None),
    ("segments", (2, 37, 45, 2, 1, 40), dict(segments="pair"), None),
    ("segments causal", (2, 40, 40, 2, 1, 40), dict(segments="one", causal="top_left"), None),
    ("kv_lengths", (2, 37, 45, 2, 1, 40), dict(kv_lengths=(45, 0)), None),
    ("bias", (2, 29, 45, 2, 1, 40), {}, (2, 2, 29, 45)),
    ("bias over batch", (2, 29, 45, 2, 1, 40), {}, (2, 1, 29, 45)),
    ("bias shared", (2, 29, 45, 2, 1, 40), {}, (1, 1, 29, 45)),
    ("whole tiles", (1, 64, 64, 2, 1, 32), dict(causal="top_left"), (1, 2, 64, 64)),
    ("everything", (2, 29, 45, 4, 2, 40),
     dict(causal="bottom_right", window=13, softcap=3.0, kv_lengths=(45, 30), segments="pair"),
     (1, 4, 29, 45)),
]


def _case_masks(masks, b, tq, tk, seed):
  masks = dict(masks)
  if masks.get("segments") == "pair":
    masks["segments"] = (_segments(b, tq, seed), _segments(b, tk, seed + 1))
  elif masks.get("segments") == "one":
    ids = _segments(b, tq, seed)
    masks["segments"] = (ids, ids)
  if masks.get("kv_lengths") is not None:
    masks["kv_lengths"] = jnp.array(masks["kv_lengths"], jnp.int32)
  return masks


def _case(shape, masks, bias_shape, dtype, seed):
  b, tq, tk, hq, hkv, d = shape
  q, k, v, g = _inputs(b, tq, tk, hq, hkv, d, seed=seed, dtype=dtype)
  bias = None
  if bias_shape is not None:
    bias = helpers.normal(seed + 7, bias_shape, dtype)
  return (q, k, v, g, bias), _case_masks(masks, b, tq, tk, seed)


def _torch_grads(twin, args, g, dtype=None):
  return helpers.torch_value_and_grads(twin, [a for a in args if a is not None], g, dtype)


@pytest.mark.parametrize("name,shape,masks,bias_shape", CASES, ids=[c[0] for c in CASES])
def test_fp32_matches_torch_float64(name, shape, masks, bias_shape, interpreted):
  (q, k, v, g, bias), masks = _case(shape, masks, bias_shape, jnp.float32, seed=len(name))
  (o, lse), grads = _kernels(q, k, v, g, bias, **masks)
  want = _torch_grads(_twin(masks, bias is not None), (q, k, v, bias), g, torch.float64)
  for got, expected, what in zip((o, *grads), want, ("out", "dq", "dk", "dv", "dbias")):
    helpers.assert_close(got, expected, what=f"{name}: {what}")
  # The base-2 log-sum-exp; +inf where a row sees no key.
  targs = [helpers.to_torch(x, torch.float64) for x in (q, k, v)]
  tbias = None if bias is None else helpers.to_torch(bias, torch.float64)
  _, lse_e = _torch_attention(*targs, tbias, with_lse=True, **masks)
  lse, lse_e = np.asarray(lse), (lse_e * LOG2E).numpy()
  assert np.array_equal(np.isposinf(lse), np.isneginf(lse_e)), f"{name}: rows without keys"
  helpers.assert_close(np.where(np.isinf(lse), 0, lse), np.where(np.isinf(lse_e), 0, lse_e),
                       what=f"{name}: lse")
  assert interpreted.names == BACKWARD[:3] + (BACKWARD[3:] if bias is not None else [])


def test_the_output_only_forward_writes_the_same_output(interpreted):
  (q, k, v, _, bias), _ = _case((1, 37, 45, 2, 1, 40),
                                dict(causal="bottom_right", window=11), (1, 2, 37, 45),
                                jnp.float32, seed=5)
  kw = dict(scale=0.125, blocks=SMALL_BLOCKS, causal="bottom_right", window=11)
  o, _ = fa.forward(q, k, v, None, None, None, bias, **kw)
  o_only, none = fa.forward(q, k, v, None, None, None, bias, with_lse=False, **kw)
  assert none is None and interpreted.names == ["attention_fwd_res_kernel", "attention_fwd_kernel"]
  assert np.array_equal(np.asarray(o), np.asarray(o_only))


def test_heuristic_tiles_match_torch(interpreted):
  """The tiles the op uses (the heuristic table's, clipped) rather than small test tiles."""
  q, k, v, g = _inputs(1, 77, 100, 2, 1, 40, seed=3)
  blocks = tuning.block_sizes_for(q, k, causal=True)
  assert blocks == tuning.heuristic_block_sizes(40, jnp.float32).clipped(77, 100)
  (o, _), grads = _kernels(q, k, v, g, blocks=blocks, causal="top_left")
  want = _torch_grads(_twin(dict(causal="top_left"), False), (q, k, v), g, torch.float64)
  for got, expected, what in zip((o, *grads), want, ("out", "dq", "dk", "dv")):
    helpers.assert_close(got, expected, what=what)


LOW_CASES = [
    ("causal gqa d40", (1, 37, 45, 4, 2, 40), dict(causal="top_left"), None),
    ("window softcap bias", (2, 29, 45, 4, 1, 40),
     dict(causal="bottom_right", window=10, softcap=4.0), (1, 4, 29, 45)),
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name,shape,masks,bias_shape", LOW_CASES, ids=[c[0] for c in LOW_CASES])
def test_low_precision_within_twice_torch_error(name, shape, masks, bias_shape, dtype,
                                                interpreted):
  (q, k, v, g, bias), masks = _case(shape, masks, bias_shape, dtype, seed=len(name))
  (o, _), grads = _kernels(q, k, v, g, bias, **masks)
  twin = _twin(masks, bias is not None)
  exact = _torch_grads(twin, (q, k, v, bias), g, torch.float64)
  low = _torch_grads(twin, (q, k, v, bias), g)
  for got, e, t, what in zip((o, *grads), exact, low, ("out", "dq", "dk", "dv", "dbias")):
    assert got.dtype == dtype
    helpers.assert_within_low_precision_error(got, e, t, what=f"{name}: {what}")


# The op with implementation="triton" ------------------------------------------------------------


@pytest.fixture
def small_tiles(monkeypatch):
  monkeypatch.setattr(tuning, "block_sizes_for",
                      lambda q, k, **_: SMALL_BLOCKS.clipped(q.shape[1], k.shape[1]))


def test_the_op_runs_the_triton_kernels_under_jit(interpreted, triton_runs_here, small_tiles):
  """attention(..., implementation="triton") through its custom_vjp, under jit, each kernel
  through base.kernel_call, against torch in float64."""
  q, k, v, g = _inputs(2, 29, 45, 4, 2, 40, seed=11)
  bias = helpers.normal(12, (1, 4, 29, 45))
  kv_lengths = jnp.array([45, 31], jnp.int32)
  kw = dict(causal="bottom_right", sliding_window=12, logit_softcap=4.0, kv_lengths=kv_lengths)
  got = helpers.jax_value_and_grads(
      lambda q, k, v, bias: attention(q, k, v, bias=bias, implementation="triton", **kw),
      (q, k, v, bias), g)
  want = helpers.torch_value_and_grads(
      lambda q, k, v, bias: _torch_attention(q, k, v, bias, causal="bottom_right", window=12,
                                             softcap=4.0, kv_lengths=kv_lengths),
      (q, k, v, bias), g, torch.float64)
  for a, b, what in zip(got, want, ("out", "dq", "dk", "dv", "dbias")):
    helpers.assert_close(a, b, what=what)
  assert sorted(interpreted.names) == sorted(BACKWARD)
  interpreted.names.clear()
  jax.block_until_ready(attention(q, k, v, implementation="triton"))  # the primal alone
  assert interpreted.names == ["attention_fwd_kernel"]


def test_the_op_takes_second_order_from_the_reference(interpreted, triton_runs_here,
                                                      small_tiles):
  """grad of grad: the backward kernels' derivatives are their XLA twins'."""
  q, k, v, _ = _inputs(1, 20, 20, 2, 1, 16, seed=2)

  def grad_of_grad(q, impl):
    def loss(q):
      return jnp.sum(attention(q, k, v, causal=True, implementation=impl) ** 2)
    return jax.grad(lambda q: jnp.sum(jax.grad(loss)(q) ** 2))(q)

  got, want = (jax.jit(grad_of_grad, static_argnums=1)(q, impl) for impl in ("triton", "xla"))
  helpers.assert_close(got, want, rtol=1e-4)
  assert "attention_bwd_dq_kernel" in interpreted.names


def test_triton_needs_a_gpu_here():
  x = jnp.ones((1, 8, 2, 16))
  with pytest.raises(dispatch.ImplementationUnavailableError, match="Triton kernels need a GPU"):
    attention(x, x, x, implementation="triton")


# The wrappers' plumbing --------------------------------------------------------------------------


def test_forward_launch_plumbing(recording):
  q, k, v, _ = _inputs(2, 37, 45, 4, 2, 40)
  q_seg = jnp.zeros((2, 37), jnp.int32)
  kv_seg = jnp.zeros((2, 45), jnp.int32)
  kv_lengths = jnp.array([45, 30], jnp.int32)
  bias = jnp.zeros((1, 4, 37, 45), jnp.bfloat16)
  o, lse = fa.forward(q, k, v, q_seg, kv_seg, kv_lengths, bias, causal="bottom_right",
                      scale=0.25, blocks=SMALL_BLOCKS, window=9, softcap=2.5)
  [call] = recording.calls
  assert call["kernel"] is fa.attention_fwd_res_kernel
  assert call["name"] == "attention_fwd_res_kernel"
  assert call["grid"] == (3, 4, 2)  # (cdiv(37, 16) query tiles, heads, batch)
  assert (call["num_warps"], call["num_stages"]) == (4, 2)
  assert [a.shape for a in call["args"]] == [q.shape, k.shape, v.shape, (2,), (2, 37), (2, 45),
                                             bias.shape]
  assert call["args"][3] is kv_lengths and call["args"][6] is bias
  assert [(s.shape, s.dtype) for s in call["out_shape"]] == [
      (q.shape, jnp.float32), ((2, 4, 37), jnp.float32)]
  constants = {k: v for k, v in call.items()
               if k not in ("args", "kernel", "out_shape", "grid", "name", "num_warps",
                            "num_stages")}
  assert constants == dict(TQ=37, TK=45, HQ=4, HKV=2, D=40, DP=64, BQ=16, BK=32, SCALE=0.25,
                           CAUSAL="bottom_right", WINDOW=9, SOFTCAP=2.5, HAS_KV_LENGTHS=True,
                           HAS_SEGMENTS=True, HAS_BIAS=True, BIAS_B=1, BIAS_H=4,
                           PRECISION="ieee")
  assert o.shape == q.shape and lse.shape == (2, 4, 37)


def test_forward_without_options_passes_q_for_them(recording):
  q, k, v, _ = _inputs(1, 8, 8, 2, 2, 16, dtype=jnp.bfloat16)
  o, lse = fa.forward(q, k, v, None, None, None, None, causal=True, scale=0.25,
                      blocks=BlockSizes(), with_lse=False)
  [call] = recording.calls
  assert call["kernel"] is fa.attention_fwd_kernel and call["name"] == "attention_fwd_kernel"
  assert all(a is q for a in call["args"][3:]) and len(call["args"]) == 7
  assert [(s.shape, s.dtype) for s in call["out_shape"]] == [(q.shape, jnp.bfloat16)]
  assert (call["CAUSAL"], call["WINDOW"], call["SOFTCAP"], call["PRECISION"]) == (
      "top_left", 0, 0.0, "tf32")
  assert (call["HAS_KV_LENGTHS"], call["HAS_SEGMENTS"], call["HAS_BIAS"]) == (False,) * 3
  assert call["grid"] == (1, 2, 1) and (call["BQ"], call["BK"]) == (64, 64)
  assert o.shape == q.shape and lse is None


@pytest.mark.parametrize("bias_shape", [(2, 4, 37, 45), (1, 4, 37, 45), (2, 1, 37, 45),
                                        (1, 1, 37, 45)], ids=str)
def test_backward_launch_plumbing(bias_shape, recording):
  q, k, v, g = _inputs(2, 37, 45, 4, 2, 40, seed=1)
  o = helpers.normal(5, q.shape)
  lse = jnp.zeros((2, 4, 37), jnp.float32)
  bias = jnp.zeros(bias_shape, jnp.bfloat16)
  blocks = BlockSizes(16, 32, 32, 16, 16, 32, num_warps=8, num_stages=3, num_warps_bwd=2,
                      num_stages_bwd=1)
  dq, dk, dv, dbias = fa.backward(q, k, v, None, None, None, bias, o, lse, g, causal=None,
                                  scale=0.5, blocks=blocks)
  dq_call, dkdv_call, dbias_call = recording.calls
  assert [c["name"] for c in recording.calls] == [
      "attention_bwd_dq_kernel", "attention_bwd_dkdv_kernel", "attention_bwd_dbias_kernel"]
  assert dq_call["kernel"] is fa.attention_bwd_dq_kernel
  assert dkdv_call["kernel"] is fa.attention_bwd_dkdv_kernel
  assert dbias_call["kernel"] is fa.attention_bwd_dbias_kernel
  # dq and dbias on the dq tiles (32 x 16), dk/dv on its own (16 x 32).
  assert dq_call["grid"] == (2, 4, 2) and (dq_call["BQ"], dq_call["BK"]) == (32, 16)
  assert dbias_call["grid"] == (2, 3, 8) and (dbias_call["BQ"], dbias_call["BK"]) == (32, 16)
  assert dkdv_call["grid"] == (2, 2, 2) and (dkdv_call["BQ"], dkdv_call["BK"]) == (16, 32)
  for call in recording.calls:
    assert (call["num_warps"], call["num_stages"]) == (2, 1)
    assert call["CAUSAL"] == "none" and (call["BIAS_B"], call["BIAS_H"]) == bias_shape[:2]
    args = call["args"]
    assert len(args) == 10 and args[6] is bias and args[7] is g and args[8] is lse
    # delta = rowsum(o * do), [b, heads, q_len], in float32.
    want = np.einsum("bthd,bthd->bht", np.asarray(o, np.float64), np.asarray(g, np.float64))
    assert args[9].dtype == jnp.float32
    helpers.assert_close(args[9], want)
  assert [(s.shape, s.dtype) for s in dq_call["out_shape"]] == [(q.shape, q.dtype)]
  assert [(s.shape, s.dtype) for s in dkdv_call["out_shape"]] == [(k.shape, k.dtype)] * 2
  assert [(s.shape, s.dtype) for s in dbias_call["out_shape"]] == [((2, 4, 37, 45), jnp.float32)]
  assert dq.shape == q.shape and dk.shape == dv.shape == k.shape
  assert dbias.shape == bias_shape and dbias.dtype == jnp.bfloat16


def test_backward_sums_dbias_over_the_broadcast_axes():
  ds = jnp.arange(2 * 3 * 4 * 5, dtype=jnp.float32).reshape(2, 3, 4, 5)
  for shape, axes in [((2, 3, 4, 5), ()), ((1, 3, 4, 5), (0,)), ((2, 1, 4, 5), (1,)),
                      ((1, 1, 4, 5), (0, 1))]:
    got = fa.reduce_dbias(ds, jnp.zeros(shape, jnp.float16))
    assert got.dtype == jnp.float16
    helpers.assert_close(got, jnp.sum(ds, axis=axes, keepdims=True).astype(jnp.float16))


def test_the_op_plumbs_its_config_into_the_launches(recording, triton_runs_here):
  """Tiles from the tuning table, masks and soft-cap from the op's arguments; the primal pass
  launches the output-only forward, a gradient the forward with lse and the backward."""
  q, k, v, _ = _inputs(2, 100, 130, 4, 2, 128, dtype=jnp.bfloat16)
  kw = dict(causal="bottom_right", sliding_window=33, logit_softcap=7.0, scale=0.3)
  attention(q, k, v, implementation="triton", **kw)
  jax.grad(lambda q: jnp.sum(attention(q, k, v, implementation="triton", **kw)
                             .astype(jnp.float32)))(q)
  blocks = tuning.block_sizes_for(q, k, causal=True)
  assert blocks == tuning.heuristic_block_sizes(128, jnp.bfloat16).clipped(100, 130)
  names = [c["name"] for c in recording.calls]
  assert names == ["attention_fwd_kernel", "attention_fwd_res_kernel", "attention_bwd_dq_kernel",
                   "attention_bwd_dkdv_kernel"]
  fwd, _, dq, dkdv = recording.calls
  for call, (bq, bk) in [(fwd, (blocks.block_q, blocks.block_k)),
                         (dq, (blocks.block_q_dq, blocks.block_k_dq)),
                         (dkdv, (blocks.block_q_dkdv, blocks.block_k_dkdv))]:
    assert (call["BQ"], call["BK"]) == (bq, bk)
    assert (call["CAUSAL"], call["WINDOW"], call["SOFTCAP"], call["SCALE"]) == (
        "bottom_right", 33, 7.0, 0.3)
    assert call["PRECISION"] == "tf32" and call["DP"] == 128
  assert (fwd["num_warps"], fwd["num_stages"]) == (blocks.num_warps, blocks.num_stages)
  assert (dq["num_warps"], dq["num_stages"]) == (blocks.num_warps_bwd, blocks.num_stages_bwd)
  assert dkdv["grid"] == (math.ceil(130 / blocks.block_k_dkdv), 2, 2)


# The tiles the kernels visit ----------------------------------------------------------------------


@triton.jit
def _tile_ranges_kernel(kv_len_ptr, key_ptr, query_ptr, TQ: tl.constexpr, TK: tl.constexpr,
                        BQ: tl.constexpr, BK: tl.constexpr, CAUSAL: tl.constexpr,
                        WINDOW: tl.constexpr):
  t = tl.program_id(0)
  kv_limit, offset = fa._kv_limit_and_offset(kv_len_ptr, t * 0, TQ, TK, CAUSAL, True)
  lo, a, b, hi = fa._key_tiles(t * BQ, kv_limit, offset, TQ, BQ, BK, CAUSAL, WINDOW)
  tl.store(key_ptr + 4 * t + tl.arange(0, 4),
           tl.where(tl.arange(0, 4) == 0, lo, tl.where(tl.arange(0, 4) == 1, a,
                                                        tl.where(tl.arange(0, 4) == 2, b, hi))))
  lo, a, b, hi = fa._query_tiles(t * BK, kv_limit, offset, TQ, BQ, BK, CAUSAL, WINDOW)
  tl.store(query_ptr + 4 * t + tl.arange(0, 4),
           tl.where(tl.arange(0, 4) == 0, lo, tl.where(tl.arange(0, 4) == 1, a,
                                                        tl.where(tl.arange(0, 4) == 2, b, hi))))


@pytest.mark.parametrize("causal", ["top_left", "bottom_right"])
def test_kernels_visit_exactly_the_tiles_the_masks_reach(causal):
  """Per query tile, the forward and dq kernels visit exactly the key tiles holding a pair that
  the causal mask, the window and the key limit leave, and mask only those a mask edge crosses;
  per key tile, the dk/dv kernel does the same over query tiles (the Pallas kernels' test, on
  the Triton port of the arithmetic, floor division included)."""
  for tq, tk, (bq, bk), window, short in itertools.product(
      [1, 37, 64], [20, 53], [(16, 32), (32, 16)], [None, 1, 7, 40], [0, 11]):
    limit = tk - short
    offset = limit - tq if causal == "bottom_right" else 0
    row, key = np.arange(tq)[:, None] + offset, np.arange(limit)[None, :]
    seen = (key <= row) & (True if window is None else key > row - window)
    nq, nk = -(-tq // bq), -(-tk // bk)
    key_tiles = torch.empty(max(nq, nk), 4, dtype=torch.int32)
    query_tiles = torch.empty(max(nq, nk), 4, dtype=torch.int32)
    _tile_ranges_kernel[(max(nq, nk),)](torch.tensor([limit], dtype=torch.int32), key_tiles,
                                        query_tiles, TQ=tq, TK=tk, BQ=bq, BK=bk, CAUSAL=causal,
                                        WINDOW=window or 0)
    what = dict(tq=tq, tk=tk, bq=bq, bk=bk, window=window, limit=limit)

    def expected(tile):
      return ([t for t, pairs in enumerate(tile) if pairs.any()],
              [t for t, pairs in enumerate(tile) if pairs.any() and pairs.all()])

    for i, (lo, a, b, hi) in enumerate(key_tiles[:nq].tolist()):
      rows = seen[i * bq:(i + 1) * bq]
      visited, unmasked = expected([rows[:, j * bk:(j + 1) * bk] for j in range(nk)])
      assert list(range(lo, hi)) == visited and list(range(a, b)) == unmasked, (what, i)
    for j, (lo, a, b, hi) in enumerate(query_tiles[:nk].tolist()):
      cols = seen[:, j * bk:(j + 1) * bk]
      visited, unmasked = expected([cols[i * bq:(i + 1) * bq] for i in range(nq)])
      assert list(range(lo, hi)) == visited and list(range(a, b)) == unmasked, (what, j)


# Bytes moved ----------------------------------------------------------------------------------


def _launch(launch, *tensors):
  launch.kernel[launch.grid](*tensors, **launch.constants)


def _torch_inputs(b, tq, tk, hq, hkv, d):
  q, do, o = (torch.ones(b, tq, hq, d) for _ in range(3))
  k, v = torch.ones(b, tk, hkv, d), torch.ones(b, tk, hkv, d)
  return q, k, v, do, o, torch.zeros(b, hq, tq), torch.zeros(b, hq, tq)


OPTIONS = dict(scale=0.25, window=None, softcap=None, has_kv_lengths=False, has_segments=False,
               dtype_name="float32")


@pytest.mark.parametrize("with_lse", [True, False])
def test_forward_bytes(with_lse):
  """Every program reads its query tile once and every key tile's k and v (no mask: all of
  them); it writes its output rows and (with lse) one float32 a row. Tails count what the
  masks keep."""
  b, tq, tk, hq, hkv, d = 2, 37, 45, 4, 2, 40
  q, k, v, _, o, lse, _ = _torch_inputs(b, tq, tk, hq, hkv, d)
  launch = fa.forward_launch(q.shape, k.shape, SMALL_BLOCKS, with_lse=with_lse, causal=None,
                             bias_shape=None, **OPTIONS)
  nq = math.ceil(tq / 16)
  with triton_traffic.counting() as counted:
    _launch(launch, q, k, v, q, q, q, q, o, *([lse] if with_lse else []))
  [count] = counted.launches
  assert count.grid == (nq, hq, b)
  assert count.reads == 4 * b * hq * (tq * d + nq * 2 * tk * d)
  assert count.writes == 4 * b * hq * (tq * d + (tq if with_lse else 0))


def test_causal_forward_skips_the_tiles_above_the_diagonal():
  """Causal, square, one tile size: query tile ``i`` reads key tiles ``0..i`` only."""
  b, t, h, d = 1, 64, 2, 16
  q, k, v, _, o, lse, _ = _torch_inputs(b, t, t, h, h, d)
  blocks = BlockSizes(16, 16, 16, 16, 16, 16)
  launch = fa.forward_launch(q.shape, k.shape, blocks, causal="top_left", bias_shape=None,
                             **OPTIONS)
  with triton_traffic.counting() as counted:
    _launch(launch, q, k, v, q, q, q, q, o, lse)
  nq = t // 16
  assert counted.launches[0].reads == 4 * b * h * (t * d + nq * (nq + 1) // 2 * 2 * 16 * d)


def test_backward_bytes():
  """dq: per program its q, do, lse and delta rows and every key tile's k, v and bias; dk/dv:
  per program its k and v rows and, for each of the g query heads of its kv head, every query
  tile's q, do, lse, delta and bias; dbias: per (query tile, key tile) both tiles' rows, lse,
  delta and the bias tile, and a float32 ds tile."""
  b, tq, tk, hq, hkv, d = 2, 37, 45, 4, 2, 40
  g = hq // hkv
  q, k, v, do, _, lse, delta = _torch_inputs(b, tq, tk, hq, hkv, d)
  bias = torch.zeros(1, hq, tq, tk)
  launches = fa.backward_launches(q.shape, k.shape, SMALL_BLOCKS, causal=None,
                                  bias_shape=tuple(bias.shape), **OPTIONS)
  dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
  ds = torch.empty(b, hq, tq, tk)
  with triton_traffic.counting() as counted:
    for name, outs in (("dq", [dq]), ("dkdv", [dk, dv]), ("dbias", [ds])):
      _launch(launches[name], q, k, v, q, q, q, bias, do, lse, delta, *outs)
  dq_count, dkdv_count, dbias_count = counted.launches
  nq_dq, nk_dq = math.ceil(tq / 32), math.ceil(tk / 16)  # the dq (and dbias) tiles: 32 x 16
  nk = math.ceil(tk / 32)                                 # the dk/dv kernel's key tiles
  rows = tq * d * 2 + tq * 2                              # q, do, lse, delta of one head
  assert dq_count.grid == (nq_dq, hq, b)
  # Every (query, key) pair's bias once, in the three kernels.
  assert dq_count.reads == 4 * b * hq * (rows + nq_dq * 2 * tk * d + tq * tk)
  assert dq_count.writes == 4 * b * hq * tq * d
  assert dkdv_count.grid == (nk, hkv, b)
  assert dkdv_count.reads == 4 * b * hkv * (2 * tk * d + nk * g * rows + g * tq * tk)
  assert dkdv_count.writes == 4 * 2 * b * hkv * tk * d
  assert dbias_count.grid == (nq_dq, nk_dq, b * hq)
  assert dbias_count.reads == 4 * b * hq * (nk_dq * rows + nq_dq * 2 * tk * d + tq * tk)
  assert dbias_count.writes == 4 * b * hq * tq * tk
