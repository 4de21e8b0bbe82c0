"""layer_norm, rms_norm, add_layer_norm and add_rms_norm against torch.nn.LayerNorm / RMSNorm:
the forward and every gradient (input, residual, scale, bias)."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxfuse
from jaxfuse import ops
from jaxfuse.kernels.pallas import normalization as pallas_norm
from jaxfuse.metrics import bytes_moved, residual_bytes, residuals
from tests import helpers
from jaxfuse.testing.torch_ref import normalization as ref


@dataclasses.dataclass(frozen=True)
class Op:
  name: str
  fn: object
  twin: object
  residual: bool     # takes (x, residual, ...) and returns (normalized, x + residual)
  bias: bool         # takes a bias
  eps: float


OPS = {
    "layer_norm": Op("layer_norm", ops.layer_norm, ref.layer_norm, False, True, 1e-5),
    "rms_norm": Op("rms_norm", ops.rms_norm, ref.rms_norm, False, False, 1e-6),
    "add_layer_norm": Op("add_layer_norm", ops.add_layer_norm, ref.add_layer_norm, True, True,
                         1e-5),
    "add_rms_norm": Op("add_rms_norm", ops.add_rms_norm, ref.add_rms_norm, True, False, 1e-6),
}
NAMES = list(OPS)

# Hidden sizes: tiny, BERT, one past a chunk (two chunks, the second nearly all masked), two full
# chunks. Row counts are not multiples of the row tiles. (1000, not a power of 2, is the hidden
# size of the op table's weird shape: test_op_twins.py checks it in every dtype.)
SHAPES = {64: (2, 5, 64), 768: (7, 768), 4097: (3, 4097), 8192: (3, 8192)}


def _normal(rng, shape, dtype, loc=0.0, scale=1.0):
  return jnp.asarray(loc + scale * rng.standard_normal(shape, dtype=np.float32)).astype(dtype)


def _inputs(op: Op, shape, dtype, *, seed=0, offset=0.0, scale=True, bias=True):
  """Arguments (x, [residual], scale, [bias]) and output cotangents, in ``dtype``."""
  rng = np.random.default_rng(seed)
  hidden = shape[-1]
  args = [_normal(rng, shape, dtype, loc=offset)]
  if op.residual:
    args.append(_normal(rng, shape, dtype))
  args.append(_normal(rng, (hidden,), dtype, 1.0, 0.5) if scale else None)
  if op.bias:
    args.append(_normal(rng, (hidden,), dtype, 0.0, 0.5) if bias else None)
  g = _normal(rng, shape, dtype)
  cts = (g, _normal(rng, shape, dtype)) if op.residual else g
  return args, cts


def _jax(op: Op, args, cts, impl):
  """Outputs and the gradients of every array argument, as one flat list (one jit)."""
  present = [i for i, a in enumerate(args) if a is not None]

  def f(*arrays):
    full = list(args)
    for i, a in zip(present, arrays):
      full[i] = a
    return op.fn(*full, eps=op.eps, implementation=impl)

  @jax.jit
  def run(arrays, cts):
    out, vjp = jax.vjp(f, *arrays)
    return out, vjp(cts)

  out, grads = run([args[i] for i in present], cts)
  outs = list(out) if op.residual else [out]
  return outs + list(grads)


def _torch(op: Op, args, cts, dtype=None):
  tensors = [None if a is None else helpers.to_torch(a, dtype, requires_grad=True) for a in args]
  out = op.twin(*tensors, eps=op.eps)
  outs = list(out) if op.residual else [out]
  cts = cts if op.residual else (cts,)
  torch.autograd.backward(outs, [helpers.to_torch(c, dtype) for c in cts])
  return [o.detach() for o in outs] + [t.grad for t in tensors if t is not None]


def _labels(op, args):
  outs = ["out", "x + residual"] if op.residual else ["out"]
  names = ["x", "residual", "scale", "bias"] if op.residual else ["x", "scale", "bias"]
  return outs + [f"grad {n}" for n, a in zip(names, args) if a is not None]


def _assert_matches_torch(op, args, cts, impl, **tolerances):
  got = _jax(op, args, cts, impl)
  want = _torch(op, args, cts)
  assert len(got) == len(want)
  for g, w, what in zip(got, want, _labels(op, args)):
    helpers.assert_close(g, w, what=f"{op.name} {what}", **tolerances)


# float32 against the torch twin -----------------------------------------------------------------


def _cases(impls_for):
  """(name, ..., impl) cases: every implementation where ``impls_for`` says so, XLA always.
  Interpret mode costs seconds per case on CPU, so the add variants, whose kernels are the plain
  ones with one more input and output, run Pallas on fewer shapes."""
  return [(*case, impl) for case in impls_for for impl in helpers.CPU_IMPLEMENTATIONS
          if impl != "pallas" or impls_for[case]]


FP32_CASES = _cases({(name, hidden): not name.startswith("add_") or hidden == 4097
                     for name in NAMES for hidden in SHAPES})


@pytest.mark.parametrize("name,hidden,impl", FP32_CASES, ids=str)
def test_fp32_matches_torch_at_every_hidden_size(name, hidden, impl, pallas_mode):
  op = OPS[name]
  args, cts = _inputs(op, SHAPES[hidden], jnp.float32, seed=hidden)
  _assert_matches_torch(op, args, cts, impl)


# layer_norm with a bias only is the op table's case "bias only" (tests/cases/normalization.py).
PARAM_CASES = {
    "layer_norm": [(True, False), (False, False)],
    "add_layer_norm": [(True, False), (False, False)],
    "rms_norm": [(False, False)],
    "add_rms_norm": [(False, False)],
}


@pytest.mark.parametrize("impl", helpers.CPU_IMPLEMENTATIONS)
@pytest.mark.parametrize("name,params", [(n, p) for n in NAMES for p in PARAM_CASES[n]],
                         ids=lambda v: str(v))
def test_without_scale_or_bias(name, params, impl, pallas_mode):
  """scale=None is elementwise_affine=False; bias=None is bias=False (or F.layer_norm's
  weight=None with a bias)."""
  op = OPS[name]
  scale, bias = params
  args, cts = _inputs(op, (3, 7, 100), jnp.float32, seed=3, scale=scale, bias=bias)
  _assert_matches_torch(op, args, cts, impl)


@pytest.mark.parametrize("name,impl", _cases({(n,): "layer_norm" in n for n in NAMES}), ids=str)
def test_rows_around_1e4_are_stable(name, impl, pallas_mode):
  """Rows with a mean near 1e4 and unit spread: as accurate as torch in float32 against float64
  (a one-pass E[x^2] - E[x]^2 variance would lose every digit here)."""
  op = OPS[name]
  args, cts = _inputs(op, (6, 4097), jnp.float32, seed=4, offset=1e4)
  got = _jax(op, args, cts, impl)
  exact = _torch(op, args, cts, dtype=torch.float64)
  torch32 = _torch(op, args, cts)
  for g, e, t, what in zip(got, exact, torch32, _labels(op, args)):
    helpers.assert_within_low_precision_error(g, e, t, k=2.0, what=f"{name} {what}")


@pytest.mark.parametrize("impl", helpers.CPU_IMPLEMENTATIONS)
def test_mixed_parameter_dtype(impl, pallas_mode):
  """bfloat16 activations with float32 parameters: the output keeps x's dtype, each gradient
  its argument's dtype."""
  op = OPS["layer_norm"]
  args, cts = _inputs(op, (4, 96), jnp.float32, seed=6)
  args[0] = args[0].astype(jnp.bfloat16)
  cts = cts.astype(jnp.bfloat16)
  out, dx, dscale, dbias = _jax(op, args, cts, impl)
  assert (out.dtype, dx.dtype, dscale.dtype, dbias.dtype) == (
      jnp.bfloat16, jnp.bfloat16, jnp.float32, jnp.float32)
  exact = _torch(op, args, cts, dtype=torch.float64)
  low = _torch(op, args, cts, dtype=torch.bfloat16)   # the twin in bfloat16 throughout
  helpers.assert_within_low_precision_error(dscale, exact[2], low[2], what="grad scale")
  helpers.assert_within_low_precision_error(dbias, exact[3], low[3], what="grad bias")


@pytest.mark.parametrize("impl", helpers.CPU_IMPLEMENTATIONS)
@pytest.mark.parametrize("shape", [(64,), (2, 3, 4, 33)], ids=str)
def test_any_leading_shape(shape, impl, pallas_mode):
  op = OPS["add_rms_norm"]
  args, cts = _inputs(op, shape, jnp.float32, seed=7)
  got = _jax(op, args, cts, impl)
  assert got[0].shape == shape and got[1].shape == shape
  _assert_matches_torch(op, args, cts, impl)


EMPTY_OPS = {**OPS, "add_rms_norm_unfused": dataclasses.replace(
    OPS["add_rms_norm"], name="add_rms_norm_unfused", fn=ops.add_rms_norm_unfused)}


@pytest.mark.parametrize("impl", helpers.CPU_IMPLEMENTATIONS)
@pytest.mark.parametrize("shape", [(0, 8), (2, 0, 8), (8, 0)], ids=str)
@pytest.mark.parametrize("name", list(EMPTY_OPS))
def test_no_rows_or_no_features(name, shape, impl, pallas_mode):
  """Empty inputs (no rows, or rows of no features) on every implementation: outputs of the
  input's shape, gradients of their arguments' shapes and dtypes, all zero (no element
  contributes), and a second derivative as well."""
  op = EMPTY_OPS[name]
  args, cts = _inputs(op, shape, jnp.float32)
  got = _jax(op, args, cts, impl)
  n_out = 2 if op.residual else 1
  for out in got[:n_out]:
    assert out.shape == shape
  for g, a in zip(got[n_out:], [a for a in args if a is not None], strict=True):
    assert (g.shape, g.dtype) == (a.shape, a.dtype)
    np.testing.assert_array_equal(g, np.zeros(a.shape, np.float32))

  def loss(x):
    out = op.fn(x, *args[1:], eps=op.eps, implementation=impl)
    return jnp.sum(jnp.concatenate(out, -1) ** 2 if op.residual else out ** 2)

  direction = cts[0] if op.residual else cts
  hvp = jax.jit(jax.grad(lambda x: jnp.sum(jax.grad(loss)(x) * direction)))
  assert hvp(args[0]).shape == shape


def test_default_implementation_on_cpu():
  """On a CPU, ``None`` is the CPU kernels where they build, XLA otherwise."""
  op = OPS["layer_norm"]
  args, _ = _inputs(op, (3, 50), jnp.float32)
  if not helpers.ON_GPU:
    np.testing.assert_array_equal(
        ops.layer_norm(*args), ops.layer_norm(*args, implementation=(*helpers.CPU_KERNELS,
                                                                      "xla")[0]))


def test_jit_and_remat_compose(pallas_mode):
  op = OPS["add_layer_norm"]
  args, (g, g_sum) = _inputs(op, (5, 200), jnp.float32, seed=8)

  def loss(*a):
    y, z = ops.add_layer_norm(*a, implementation="pallas")
    return jnp.sum(y * g) + jnp.sum(z * g_sum)

  grads = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2, 3)))(*args)
  want = _torch(op, args, (g, g_sum))[2:]
  for got, w in zip(grads, want):
    helpers.assert_close(got, w)


# The backward kernel's reduction across programs ------------------------------------------------


@pytest.mark.parametrize("centered", [True, False], ids=["layer_norm", "rms_norm"])
def test_backward_kernel_sums_partials_over_programs(centered):
  """Small tiles force many tiles per program, several programs, four column chunks and masked
  tails in both directions; the per-program partial gradients must add up exactly as one pass."""
  rows, hidden = 13, 100
  rng = np.random.default_rng(9)
  x = _normal(rng, (rows, hidden), jnp.float32, loc=2.0)
  g = _normal(rng, (rows, hidden), jnp.float32)
  scale = _normal(rng, (hidden,), jnp.float32)
  bias = _normal(rng, (hidden,), jnp.float32) if centered else None
  tile = pallas_norm.Tiling(rows=2, cols=32, chunks=4, num_warps=4)

  @jax.jit
  def run(x, g, scale, bias):
    y, _, mean, rstd = pallas_norm.forward(x, None, scale, bias, eps=1e-5, centered=centered,
                                           store_stats=True, interpret=True, tile=tile)
    return y, pallas_norm.backward(x, g, None, scale, mean, rstd, has_bias=centered,
                                   interpret=True, tile=tile, max_programs=3)

  y, (dx, dscale, dbias) = run(x, g, scale, bias)
  reference = ops.layer_norm_reference if centered else ops.rms_norm_reference
  params = (scale, bias) if centered else (scale,)
  want_y, vjp = jax.vjp(lambda x, *p: reference(x, *p, eps=1e-5), x, *params)
  want = vjp(g)
  helpers.assert_close(y, want_y)
  helpers.assert_close(dx, want[0])
  helpers.assert_close(dscale, want[1])
  if centered:
    helpers.assert_close(dbias, want[2])


# What the backward keeps, and what the kernels move ---------------------------------------------


@pytest.mark.parametrize("impl", helpers.CPU_IMPLEMENTATIONS)
@pytest.mark.parametrize("name", NAMES)
def test_backward_keeps_rows_and_float32_statistics_only(name, impl, pallas_mode):
  """Beyond the inputs: the per-row float32 rstd (and mean for LayerNorm), plus, for the add
  variants, z = x + residual, which is an output anyway. Never the normalized output."""
  op = OPS[name]
  shape = (4, 6, 128)
  args, _ = _inputs(op, shape, jnp.float32)
  rows = 24

  def loss(*a):
    out = op.fn(*a, implementation=impl)
    return jnp.sum(out[0]) + jnp.sum(out[1]) if op.residual else jnp.sum(out)

  kept = sorted((r.shape, r.dtype) for r in residuals(loss, *args))
  want = [((4, 6, 1), "float32")] * (2 if op.bias else 1)   # one statistic per row
  if op.residual:
    want.append((shape, "float32"))
  assert kept == sorted(want)
  assert residual_bytes(loss, *args) == 4 * rows * (2 if op.bias else 1) + (
      args[0].nbytes if op.residual else 0)


def test_fused_add_moves_fewer_bytes_than_the_chain(pallas_mode):
  """Forward: the fused kernel reads x and residual and writes out and z; the chain (an add
  kernel, then the norm kernel) also writes z and reads it back. Backward: one kernel reads z
  and both output gradients and writes one input gradient, where the chain's norm backward
  writes a gradient for z that an add kernel then combines with z's own."""
  op = OPS["add_rms_norm"]
  rows, hidden = 64, 256
  args, cts = _inputs(op, (rows, hidden), jnp.float32)
  n = args[0].nbytes
  programs = rows // pallas_norm.tiling(rows, hidden).rows
  # Every program loads the scale (counted per load, before any cache).
  param, stats = programs * args[2].nbytes, 4 * rows
  partials = 4 * hidden * programs

  def step(fn):
    def run(*a):
      out, vjp = jax.vjp(lambda *a: fn(*a, implementation="pallas"), *a)
      return out, vjp(cts)
    return run

  assert bytes_moved(lambda *a: ops.add_rms_norm(*a, implementation="pallas"), *args) == (
      4 * n + param)
  assert bytes_moved(lambda *a: ops.add_rms_norm_unfused(*a, implementation="pallas"),
                     *args) == 5 * n + param + stats
  fused = bytes_moved(step(ops.add_rms_norm), *args)
  chain = bytes_moved(step(ops.add_rms_norm_unfused), *args)
  assert fused == (4 * n + param + stats) + (4 * n + param + stats + partials)
  assert chain == (3 * n) + (2 * n + param + stats) + (3 * n + param + stats + partials) + 3 * n


# Lowering for GPUs -------------------------------------------------------------------------------


def _step(op, impl="pallas"):
  def loss(*a):
    out = op.fn(*a, implementation=impl)
    if op.residual:
      return jnp.sum(out[0].astype(jnp.float32) ** 2) + jnp.sum(out[1].astype(jnp.float32))
    return jnp.sum(out.astype(jnp.float32) ** 2)
  return loss


LOWERING = [(64, jnp.float32), (1000, jnp.bfloat16), (4097, jnp.float16), (8192, jnp.float32)]


@pytest.mark.parametrize("hidden,dtype", LOWERING,
                         ids=lambda v: str(v) if isinstance(v, int) else jnp.dtype(v).name)
@pytest.mark.parametrize("name", NAMES)
def test_pallas_kernels_lower_for_cuda(name, hidden, dtype):
  """One chunk (64, 1000) and several (4097, 8192), in each dtype."""
  op = OPS[name]
  args, _ = _inputs(op, (5, hidden), dtype)
  step = jax.value_and_grad(_step(op), argnums=tuple(range(len(args))))
  names = helpers.triton_kernel_names(helpers.lower_for_gpu(step, *args))
  assert sorted(names) == [f"{name}_bwd", f"{name}_fwd_res"]
  forward_only = helpers.triton_kernel_names(helpers.lower_for_gpu(
      lambda *a: op.fn(*a, implementation="pallas"), *args))
  assert forward_only == [f"{name}_fwd"]


@pytest.mark.parametrize("name", NAMES)
def test_remat_runs_each_kernel_once(name):
  """Under jit(value_and_grad(remat(f))): the primal pass runs the forward kernel once, the
  backward pass recomputes the statistics with it once more (what remat asks for), then runs
  the backward kernel once. The primal pass writes the statistics too (4 or 8 bytes a row,
  against the row's H elements): the op's custom_vjp has no separate primal rule under remat,
  which keeps second-order gradients working."""
  op = OPS[name]
  args, _ = _inputs(op, (10, 300), jnp.float32)
  step = jax.value_and_grad(jax.checkpoint(_step(op)), argnums=tuple(range(len(args))))
  names = helpers.triton_kernel_names(helpers.lower_for_gpu(step, *args))
  assert sorted(names) == [f"{name}_bwd", f"{name}_fwd_res", f"{name}_fwd_res"]


# Bad input ---------------------------------------------------------------------------------------


def test_errors_name_the_argument():
  """The error the op table's BAD list (tests/cases/normalization.py) has no entry for."""
  with pytest.raises(ValueError, match=r"implementation must be None or one of.*'cuda'"):
    ops.rms_norm(jnp.ones((4, 8)), jnp.ones(8), implementation="cuda")


@pytest.mark.skipif(helpers.ON_GPU, reason="checks the CPU error")
def test_kernels_need_a_gpu_or_interpret_mode():
  x = jnp.ones((2, 8))
  here = re.escape(str([*helpers.CPU_KERNELS, "xla"]))
  with pytest.raises(jaxfuse.ImplementationUnavailableError, match=f"Available here: {here}"):
    ops.add_layer_norm(x, x, implementation="pallas")
  for op in (ops.layer_norm, ops.rms_norm):
    with pytest.raises(jaxfuse.ImplementationUnavailableError, match="Triton kernels need a GPU"):
      op(x, implementation="triton")
  with pytest.raises(jaxfuse.ImplementationUnavailableError, match="Triton kernels need a GPU"):
    ops.add_layer_norm(x, x, implementation="triton")
  with pytest.raises(jaxfuse.ImplementationUnavailableError, match="Triton kernels need a GPU"):
    ops.add_rms_norm_unfused(x, x, implementation="triton")


def test_pallas_rejects_rows_longer_than_its_chunks_allow(pallas_mode):
  x = jax.ShapeDtypeStruct((2, pallas_norm.MAX_HIDDEN + 1), jnp.float32)
  with pytest.raises(ValueError, match=r"rms_norm: implementation='pallas' takes a hidden size"):
    jax.eval_shape(lambda x: ops.rms_norm(x, implementation="pallas"), x)


@pytest.mark.parametrize("kernels", ["pallas", "triton"])
def test_none_takes_xla_for_rows_wider_than_the_preferred_kernels_take(monkeypatch, kernels):
  """Where ``None`` would pick a kernel set (a GPU) that cannot hold the row, it takes XLA,
  which takes any width; the kernel set asked for by name still refuses the row."""
  from jaxfuse.kernels.triton import normalization as triton_norm
  from jaxfuse.ops import base, dispatch, normalization

  limit = pallas_norm.MAX_HIDDEN if kernels == "pallas" else triton_norm.MAX_HIDDEN
  # As on a GPU where ``None`` prefers ``kernels``.
  monkeypatch.setattr(dispatch, "platform", lambda: "gpu")
  monkeypatch.setattr(dispatch, "can_run", lambda impl: impl in (kernels, "xla"))
  monkeypatch.setattr(dispatch, "runs_natively", lambda impl: impl in (kernels, "xla"))
  monkeypatch.setattr(base.Op, "preference", property(lambda self: {"gpu": (kernels, "xla")}))
  picked = []
  config = normalization._config
  monkeypatch.setattr(normalization, "_config",
                      lambda *a, **k: picked.append(config(*a, **k).impl) or config(*a, **k))
  wide = jax.ShapeDtypeStruct((2, limit + 1), jnp.float32)
  narrow = jax.ShapeDtypeStruct((2, limit), jnp.float32)
  jaxpr = str(jax.make_jaxpr(jax.grad(lambda x: ops.rms_norm(x).sum()))(wide))
  assert picked == ["xla"] and "pallas_call" not in jaxpr
  if kernels == "pallas":  # the kernels keep every row they take
    jax.eval_shape(lambda x: ops.rms_norm(x), narrow)
    assert picked[-1] == "pallas"
  with pytest.raises(ValueError, match=f"implementation='{kernels}' takes a hidden size"):
    jax.eval_shape(lambda x: ops.rms_norm(x, implementation=kernels), wide)
