"""The Triton linear cross-entropy kernels (``implementation="triton"``) on a CPU: their bodies
under Triton's interpreter (TRITON_INTERPRET=1, set by conftest without a GPU) against float64
torch, the jax-triton wrappers' plumbing with stand-ins for ``jax_triton``, and the bytes each
kernel moves (the stand-ins and the bfloat16 patch of the interpreter are
tests/test_triton_attention.py's)."""

import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxfuse.ops import dispatch, linear_cross_entropy
from jaxfuse.testing.torch_ref import cross_entropy as ref
from tests import helpers

triton = pytest.importorskip("triton")
from jaxfuse.kernels.triton import cross_entropy as kernels  # noqa: E402
from jaxfuse.metrics import triton_traffic  # noqa: E402
from tests.test_triton_attention import InterpretedJaxTriton, RecordingJaxTriton  # noqa: E402
from tests.test_triton_attention import bfloat16_as_on_a_gpu  # noqa: E402

pytestmark = pytest.mark.skipif(helpers.ON_GPU, reason="interpreter tests; GPUs run jax-triton")

@pytest.fixture(autouse=True)
def _gpu_bfloat16():
  with bfloat16_as_on_a_gpu():
    yield


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


# Tiles smaller than the GPU's, so that every axis has several and a tail at these sizes.
SMALL = (16, 32, 16)
IGNORE = -100


def _inputs(n, v, d, *, seed=0, dtype=jnp.float32, bias=False, ignored=3):
  rng = np.random.default_rng(seed)
  h, w, b = (rng.standard_normal(shape, dtype=np.float32) for shape in ((n, d), (v, d), (v,)))
  h, w, b = helpers.to_jax(dtype, h, 0.3 * w, 0.5 * b)
  y = rng.integers(0, v, (n,)).astype(np.int32)
  y[:ignored] = IGNORE  # ignored labels
  return h, w, b if bias else None, jnp.asarray(y)


def _coefficients(y, v, g, smoothing):
  """The per-token factors ``(a, b, c)`` of the logit gradient ``a p - b onehot - c`` of the
  loss ``g * ((1 - eps) nll + eps mean(-log_softmax))``, zero for ignored labels."""
  g = jnp.where(y != IGNORE, g, 0.0)
  return g, g * (1.0 - smoothing), g * (smoothing / v)


def _labels(y):
  return torch.from_numpy(np.array(y)).long()


def _torch_logits(h, w, b, dtype=torch.float64):
  """float64 logits before the soft-cap, as a leaf that collects their gradient."""
  logits = helpers.to_torch(h, dtype) @ helpers.to_torch(w, dtype).T
  if b is not None:
    logits = logits + helpers.to_torch(b, dtype)
  return logits.detach().requires_grad_()


def _torch_stats_and_grad(h, w, b, y, g, *, softcap, smoothing, dtype=torch.float64):
  """torch's logsumexp, target logit, sum and argmax of the capped logits, and the gradient of
  ``sum(g * loss)`` with respect to the logits before the cap (the kernel's ``dz``)."""
  z0 = _torch_logits(h, w, b, dtype)
  v = z0.shape[1]
  # The twin on logits: h = the logits, weight = the identity.
  loss = ref.linear_cross_entropy(z0, torch.eye(v, dtype=dtype), _labels(y),
                                  ignore_index=IGNORE, reduction="none",
                                  label_smoothing=smoothing, logit_softcap=softcap)
  (loss * helpers.to_torch(g, dtype)).sum().backward()
  z = z0.detach() if softcap is None else softcap * torch.tanh(z0.detach() / softcap)
  labels = _labels(y)
  safe = labels.clamp(0, v - 1)
  target = torch.where(labels >= 0, z.gather(1, safe[:, None])[:, 0], 0.0)
  return (torch.logsumexp(z, dim=1), target, z.sum(dim=1), z.argmax(dim=1)), z0.grad


def _kernels(h, w, b, y, g, *, softcap, smoothing, blocks=SMALL, out_dtype=None):
  lse, target, total, argmax = kernels.stats_forward(h, w, b, y, softcap=softcap, blocks=blocks)
  a, b2, c = _coefficients(y, w.shape[0], g, smoothing)
  dz = kernels.logit_grad(h, w, b, y, lse, a, b2, c, softcap=softcap, smoothing=bool(smoothing),
                          blocks=blocks, out_dtype=out_dtype)
  return (lse, target, total, argmax), dz


# (name, (n, v, d), bias, softcap, label smoothing)
CASES = [
    ("plain", (37, 100, 40), False, None, 0.0),
    ("bias", (37, 100, 40), True, None, 0.0),
    ("softcap", (37, 100, 40), False, 2.0, 0.0),
    ("smoothing", (37, 100, 40), False, None, 0.1),
    ("everything", (21, 257, 24), True, 3.0, 0.2),
    ("one token", (1, 33, 16), True, None, 0.1),
]


@pytest.mark.parametrize("name,shape,bias,softcap,smoothing", CASES, ids=[c[0] for c in CASES])
def test_fp32_matches_torch_float64(name, shape, bias, softcap, smoothing, interpreted):
  n, v, d = shape
  h, w, b, y = _inputs(n, v, d, seed=len(name), bias=bias, ignored=min(n - 1, 3))
  g = jnp.asarray(np.random.default_rng(7).random(n, dtype=np.float32) + 0.5)
  (lse, target, total, argmax), dz = _kernels(h, w, b, y, g, softcap=softcap,
                                              smoothing=smoothing)
  (lse_t, target_t, total_t, argmax_t), dz_t = _torch_stats_and_grad(
      h, w, b, y, g, softcap=softcap, smoothing=smoothing)
  helpers.assert_close(lse, lse_t, what="lse")
  helpers.assert_close(target, target_t, what="target logit")
  helpers.assert_close(total, total_t, what="sum of logits")
  assert np.array_equal(np.asarray(argmax), argmax_t.numpy()), "argmax"
  helpers.assert_close(dz, dz_t, what="logit gradient")
  assert interpreted.names == ["xent_stats_kernel", "xent_logit_grad_kernel"]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
def test_low_precision_within_twice_torch_error(dtype, interpreted):
  """bfloat16/float16 inputs: the float32 statistics and the logit gradient (in the input
  dtype) against float64, within twice the error of torch computing in that dtype."""
  n, v, d, softcap, smoothing = 37, 300, 40, 3.0, 0.1
  h, w, b, y = _inputs(n, v, d, seed=1, dtype=dtype, bias=True)
  g = jnp.asarray(np.random.default_rng(7).random(n, dtype=np.float32) + 0.5)
  (lse, target, total, _), dz = _kernels(h, w, b, y, g, softcap=softcap, smoothing=smoothing)
  exact = _torch_stats_and_grad(h, w, b, y, g, softcap=softcap, smoothing=smoothing)
  low = _torch_stats_and_grad(h, w, b, y, g, softcap=softcap, smoothing=smoothing,
                              dtype=helpers.TORCH_DTYPES[jnp.dtype(dtype)])
  assert dz.dtype == dtype and lse.dtype == jnp.float32
  for got, e, t, what in zip((lse, target, total, dz), (*exact[0][:3], exact[1]),
                             (*low[0][:3], low[1]), ("lse", "target", "sum", "dz")):
    helpers.assert_within_low_precision_error(got, e, t, what=what)


def test_labels_outside_the_vocabulary_gather_zero(interpreted):
  h, w, _, _ = _inputs(5, 40, 16)
  y = jnp.array([-1, 40, 1000, IGNORE, 3], jnp.int32)
  _, target, _, _ = kernels.stats_forward(h, w, None, y, blocks=SMALL)
  z = np.asarray(h, np.float64) @ np.asarray(w, np.float64).T
  helpers.assert_close(target, [0.0, 0.0, 0.0, 0.0, z[4, 3]])


# The op with implementation="triton" ----------------------------------------------------------


@pytest.mark.parametrize("option", ["plain", "everything"])
def test_the_op_runs_the_triton_kernels_under_jit(option, interpreted, triton_runs_here,
                                                  monkeypatch):
  """linear_cross_entropy(..., implementation="triton"): the loss and the gradients of h, the
  weight and the bias against torch in float64, in chunks of tokens, under jit."""
  monkeypatch.setattr(kernels, "GPU_BLOCKS", SMALL)
  h, w, b, y = _inputs(45, 130, 24, seed=4, bias=True)
  kw = dict(label_smoothing=0.1, z_loss=1e-3, logit_softcap=5.0) if option == "everything" else {}

  def jax_loss(h, w, b):
    return linear_cross_entropy(h, w, y, bias=b, chunk_size=16, implementation="triton", **kw)

  got = helpers.jax_value_and_grads(jax_loss, (h, w, b), jnp.float32(1.0))
  want = helpers.torch_value_and_grads(
      lambda h, w, b: ref.linear_cross_entropy(h, w, _labels(y), b,
                                               ignore_index=IGNORE, **kw),
      (h, w, b), jnp.float32(1.0), torch.float64)
  for a, e, what in zip(got, want, ("loss", "dh", "dweight", "dbias")):
    helpers.assert_close(a, e, what=what)
  assert set(interpreted.names) == {"xent_stats_kernel", "xent_logit_grad_kernel"}
  assert interpreted.names.count("xent_stats_kernel") == 1


def test_triton_needs_a_gpu_here():
  h, w, _, y = _inputs(4, 8, 16)
  with pytest.raises(dispatch.ImplementationUnavailableError, match="Triton kernels need a GPU"):
    linear_cross_entropy(h, w, y, implementation="triton")


# The wrappers' plumbing --------------------------------------------------------------------------


def _constants(call):
  skip = ("args", "kernel", "out_shape", "grid", "name", "num_warps", "num_stages")
  return {k: v for k, v in call.items() if k not in skip}


def test_stats_launch_plumbing(recording):
  h, w, b, y = _inputs(100, 1000, 48, dtype=jnp.bfloat16, bias=True)
  outs = kernels.stats_forward(h, w, b, y, softcap=30.0)
  [call] = recording.calls
  assert call["kernel"] is kernels.xent_stats_kernel and call["name"] == "xent_stats_kernel"
  assert call["grid"] == (2,)  # cdiv(100, 64) token blocks
  assert (call["num_warps"], call["num_stages"]) == (4, 2)
  assert all(x is e for x, e in zip(call["args"], (h, w, b, y), strict=True))
  assert _constants(call) == dict(N=100, V=1000, D=48, BT=64, BV=128, BD=32, SOFTCAP=30.0,
                                  SCALE=1.0, ENTROPY=False, HAS_BIAS=True, PRECISION="tf32")
  assert [(s.shape, s.dtype) for s in call["out_shape"]] == [((100,), jnp.float32)] * 3 + [
      ((100,), jnp.int32)]
  assert len(outs) == 4 and outs[3].dtype == jnp.int32


def test_float32_launches_take_the_tiles_that_do_not_spill(recording):
  """float32 (IEEE products in registers): 64x64 logit tiles over 8 warps."""
  h, w, _, y = _inputs(100, 1000, 48)
  kernels.stats_forward(h, w, None, y)
  zeros = jnp.zeros((100,), jnp.float32)
  kernels.logit_grad(h, w, None, y, zeros, zeros, zeros, zeros)
  for call in recording.calls:
    assert call["num_warps"] == kernels.NUM_WARPS_F32 == 8
    assert (call["BT"], call["BV"], call["BD"]) == kernels.GPU_BLOCKS_F32 == (64, 64, 32)


def test_logit_grad_launch_plumbing(recording):
  h, w, _, y = _inputs(5, 20, 8)
  zeros = jnp.zeros((5,), jnp.float32)
  dz = kernels.logit_grad(h, w, None, y, zeros, zeros, zeros, zeros, smoothing=False,
                          out_dtype=jnp.float16)
  [call] = recording.calls
  assert call["kernel"] is kernels.xent_logit_grad_kernel
  assert call["name"] == "xent_logit_grad_kernel"
  assert call["grid"] == (1, 1) and len(call["args"]) == 8
  assert call["args"][2] is h  # stands in for the absent bias
  # Tiles at least 16 wide (tl.dot's smallest) even for 5 tokens, 20 words and 8 features.
  assert _constants(call) == dict(N=5, V=20, D=8, BT=16, BV=32, BD=16, SOFTCAP=0.0,
                                  SCALE=1.0, ENTROPY=False, HAS_BIAS=False, SMOOTHING=False,
                                  PRECISION="ieee")
  assert [(s.shape, s.dtype) for s in call["out_shape"]] == [((5, 20), jnp.float16)]
  assert dz.shape == (5, 20) and dz.dtype == jnp.float16


def test_the_op_plumbs_its_config_into_the_launches(recording, triton_runs_here):
  """One stats launch over all tokens; one logit-gradient launch per chunk (under a scan),
  on the chunk's tokens, with the soft-cap and the smoothing flag of the op's arguments."""
  h, w, b, y = _inputs(40, 300, 32, bias=True, ignored=0)
  jax.grad(lambda h: linear_cross_entropy(h, w, y, bias=b, chunk_size=16, logit_softcap=9.0,
                                          label_smoothing=0.2, implementation="triton"))(h)
  stats, grad = recording.calls
  assert stats["name"] == "xent_stats_kernel" and stats["grid"] == (1,)
  assert (stats["N"], stats["SOFTCAP"], stats["HAS_BIAS"]) == (40, 9.0, True)
  assert grad["name"] == "xent_logit_grad_kernel"
  assert grad["grid"] == (1, math.ceil(300 / kernels.GPU_BLOCKS_F32[1])) and grad["N"] == 16
  assert (grad["SOFTCAP"], grad["SMOOTHING"]) == (9.0, True)
  assert grad["out_shape"][0].shape == (16, 300)


# Bytes moved ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True])
def test_stats_bytes(bias):
  """Every token block reads its labels, and for every vocabulary tile its rows of h, the
  tile's rows of w (and bias); it writes four 4-byte statistics a token."""
  n, v, d = 37, 100, 40
  h, w, y = torch.ones(n, d), torch.ones(v, d), torch.zeros(n, dtype=torch.int32)
  outs = [torch.empty(n) for _ in range(3)] + [torch.empty(n, dtype=torch.int32)]
  launch = kernels.stats_launch(n, v, d, has_bias=bias, blocks=SMALL)
  nt, nv = math.ceil(n / 16), math.ceil(v / 32)
  with triton_traffic.counting() as counted:
    launch.kernel[launch.grid](h, w, torch.ones(v) if bias else h, y, *outs, **launch.constants)
  [count] = counted.launches
  assert count.grid == (nt,)
  assert count.reads == 4 * (n + nv * n * d + nt * v * d + bias * nt * v)
  assert count.writes == 4 * 4 * n


@pytest.mark.parametrize("smoothing", [False, True])
def test_logit_grad_bytes(smoothing):
  """Every (token block, vocabulary tile) reads the block's labels, lse, a, b (and c), its rows
  of h and the tile's rows of w, and writes its tile of the gradient (float16 here)."""
  n, v, d = 37, 100, 40
  h, w, y = torch.ones(n, d), torch.ones(v, d), torch.zeros(n, dtype=torch.int32)
  vectors = [torch.zeros(n) for _ in range(4)]
  dz = torch.empty(n, v, dtype=torch.float16)
  launch = kernels.logit_grad_launch(n, v, d, smoothing=smoothing, blocks=SMALL)
  nt, nv = math.ceil(n / 16), math.ceil(v / 32)
  with triton_traffic.counting() as counted:
    launch.kernel[launch.grid](h, w, h, y, *vectors, dz, **launch.constants)
  [count] = counted.launches
  assert count.grid == (nt, nv)
  assert count.reads == 4 * (nv * n * (4 + smoothing) + nv * n * d + nt * v * d)
  assert count.writes == 2 * n * v
