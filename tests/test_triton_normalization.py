"""The Triton normalization kernels' bodies, run by Triton's interpreter on torch CPU tensors
(TRITON_INTERPRET=1 is set by conftest on machines without a GPU), against torch.nn.RMSNorm and
torch.nn.LayerNorm, alone and after a residual add; the jax-triton wrappers' launches, and the
four ops with implementation="triton" end to end through a stand-in jax_triton."""

import jax
import jax.numpy as jnp
import pytest
import torch

from jaxfuse import ops
from jaxfuse.testing import triton_interpreter as interp
from jaxfuse.testing.torch_ref import normalization as ref
from tests import helpers

triton = pytest.importorskip("triton")
from jaxfuse.kernels.triton import normalization as kernels  # noqa: E402

pytestmark = pytest.mark.skipif(helpers.ON_GPU, reason="interpreter tests; GPUs run jax-triton")

EPS = 1e-6


def _run(x, w, g, out_dtype=None):
  """Forward and backward kernels: (y, dx, dw); dw is None without a scale."""
  rows, hidden = x.shape
  block = kernels.block_for(hidden)
  y = torch.empty_like(x, dtype=out_dtype or x.dtype)
  rstd = torch.empty(rows, 1)
  kernels.rms_norm_fwd_kernel[(rows,)](x, x if w is None else w, y, rstd, H=hidden, eps=EPS,
                                       BLOCK_H=block, HAS_SCALE=w is not None)
  programs, per_program = kernels.backward_grid(rows)
  dx = torch.empty_like(x, dtype=out_dtype or x.dtype)
  partial = torch.zeros(programs, hidden)
  kernels.rms_norm_bwd_kernel[(programs,)](x, g, x if w is None else w, rstd, dx, partial,
                                           R=rows, H=hidden, ROWS_PER_PROGRAM=per_program,
                                           BLOCK_H=block, HAS_SCALE=w is not None)
  return y, dx, (None if w is None else partial.sum(0)), rstd


def _torch(x, w, g, dtype=None):
  x = x.to(dtype or x.dtype).requires_grad_()
  w = None if w is None else w.to(dtype or w.dtype).requires_grad_()
  y = ref.rms_norm(x, w, eps=EPS)
  y.backward(g.to(dtype or g.dtype))
  return y.detach(), x.grad, (None if w is None else w.grad)


@pytest.mark.parametrize("rows,hidden", [(5, 64), (33, 1000), (3, 4097), (2, 8192)])
def test_fp32_matches_torch(rows, hidden):
  torch.manual_seed(hidden)
  x, g = torch.randn(rows, hidden) + 1.0, torch.randn(rows, hidden)
  w = 1.0 + 0.5 * torch.randn(hidden)
  y, dx, dw, rstd = _run(x, w, g)
  want = _torch(x, w, g)
  for got, expected, what in zip((y, dx, dw), want, ("out", "grad x", "grad scale")):
    helpers.assert_close(got, expected, what=what)
  helpers.assert_close(rstd[:, 0], torch.rsqrt(x.pow(2).mean(-1) + EPS), what="rstd")


def test_without_scale():
  torch.manual_seed(1)
  x, g = torch.randn(7, 300), torch.randn(7, 300)
  y, dx, dw, _ = _run(x, None, g)
  want_y, want_dx, _ = _torch(x, None, g)
  assert dw is None
  helpers.assert_close(y, want_y)
  helpers.assert_close(dx, want_dx)


def test_many_rows_per_backward_program(monkeypatch):
  """More rows than backward programs: each program walks several rows and its partial scale
  gradient covers all of them."""
  monkeypatch.setattr(kernels, "MAX_BACKWARD_PROGRAMS", 8)
  rows = 8 + 3
  programs, per_program = kernels.backward_grid(rows)
  assert per_program == 2 and programs * per_program >= rows
  torch.manual_seed(2)
  x, g, w = torch.randn(rows, 16), torch.randn(rows, 16), torch.randn(16)
  _, dx, dw, _ = _run(x, w, g)
  _, want_dx, want_dw = _torch(x, w, g)
  helpers.assert_close(dx, want_dx)
  helpers.assert_close(dw, want_dw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_within_twice_torch_error(dtype):
  torch.manual_seed(3)
  x = torch.randn(9, 1000).to(dtype)
  g = torch.randn(9, 1000).to(dtype)
  w = (1.0 + 0.5 * torch.randn(1000)).to(dtype)
  if dtype == torch.bfloat16:
    # Triton's interpreter truncates float32 -> bfloat16 stores (GPUs round to nearest even), so
    # store float32 and round as a GPU would.
    y, dx, dw, _ = _run(x, w, g, out_dtype=torch.float32)
    y, dx = y.to(dtype), dx.to(dtype)
  else:
    y, dx, dw, _ = _run(x, w, g)
  dw = dw.to(dtype)
  exact = _torch(x, w, g, dtype=torch.float64)
  low = _torch(x, w, g)
  for got, e, t, what in zip((y, dx, dw), exact, low, ("out", "grad x", "grad scale")):
    assert got.dtype == dtype
    helpers.assert_within_low_precision_error(got, e, t, what=what)


def test_rejects_rows_longer_than_one_block():
  with pytest.raises(ValueError, match=rf"hidden size of at most {kernels.MAX_HIDDEN}, "
                                       rf"got {kernels.MAX_HIDDEN + 1}"):
    kernels.block_for(kernels.MAX_HIDDEN + 1)


# The general kernels: LayerNorm and RMSNorm, with a residual add, with or without parameters ----

OPS = {"layer_norm": (True, False), "rms_norm": (False, False),
       "add_layer_norm": (True, True), "add_rms_norm": (False, True)}   # (centered, residual)


def _run_norm(op, x, res, w, b, g, gz, *, eps=EPS, store_stats=True, max_programs=None):
  """The general forward and backward launches as the wrappers make them:
  ``(y, z, dx, dw, db, mean, rstd)``; z, dw, db None where the variant has none."""
  centered, has_residual = OPS[op]
  rows, hidden = x.shape
  block = kernels.block_for(hidden)
  nan = float("nan")
  y = torch.empty_like(x)
  z = torch.full_like(x, nan) if has_residual else None
  mean, rstd = torch.full((rows, 1), nan), torch.full((rows, 1), nan)
  with interp.gpu_numerics():
    kernels.norm_fwd_kernel[(rows,)](
        x, x if res is None else res, x if w is None else w, x if b is None else b, y,
        y if z is None else z, mean, rstd, H=hidden, eps=eps, BLOCK_H=block, CENTERED=centered,
        HAS_RESIDUAL=has_residual, HAS_SCALE=w is not None, HAS_BIAS=b is not None,
        STORE_STATS=store_stats)
    if not store_stats:
      return y, z, None, None, None, mean, rstd
    if max_programs is None:
      programs, per_program = kernels.backward_grid(rows)
    else:
      per_program = -(-rows // max_programs)
      programs = -(-rows // per_program)
    dx = torch.empty_like(x)
    dw, db = torch.full((programs, hidden), nan), torch.full((programs, hidden), nan)
    kernels.norm_bwd_kernel[(programs,)](
        x if z is None else z, g, g if gz is None else gz, x if w is None else w, mean, rstd, dx,
        dw, db, R=rows, H=hidden, ROWS_PER_PROGRAM=per_program, BLOCK_H=block,
        CENTERED=centered, HAS_SUM_GRAD=gz is not None, HAS_SCALE=w is not None,
        HAS_BIAS=b is not None)
  dw = None if w is None else dw.sum(0).to(w.dtype)
  db = None if b is None else db.sum(0).to(b.dtype)
  return y, z, dx, dw, db, mean, rstd


def _torch_norm(op, x, res, w, b, g, gz, *, eps=EPS, dtype=None):
  """torch's ``(y, z, dx, dw, db)`` (z and missing gradients None)."""
  def cast(t, grad=True):
    if t is None:
      return None
    t = t.to(dtype or t.dtype)
    return t.requires_grad_() if grad else t

  tx, tr, tw, tb = cast(x), cast(res), cast(w), cast(b)
  centered, has_residual = OPS[op]
  params = (tw, tb) if centered else (tw,)
  fn = getattr(ref, op)
  if has_residual:
    y, z = fn(tx, tr, *params, eps=eps)
    torch.autograd.backward([y, z], [cast(g, False), cast(gz, False)])
  else:
    y, z = fn(tx, *params, eps=eps), None
    y.backward(cast(g, False))
  grads = [None if t is None else t.grad for t in (tx, tw, tb)]
  return (y.detach(), None if z is None else z.detach(), *grads)


def _norm_inputs(op, rows, hidden, *, scale, bias, seed, dtype=torch.float32):
  torch.manual_seed(seed)
  centered, has_residual = OPS[op]
  x, g = torch.randn(rows, hidden) + 0.5, torch.randn(rows, hidden)
  res = torch.randn(rows, hidden) if has_residual else None
  gz = torch.randn(rows, hidden) if has_residual else None
  w = 1.0 + 0.5 * torch.randn(hidden) if scale else None
  b = 0.5 * torch.randn(hidden) if bias and centered else None
  cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
  return tuple(cast(t) for t in (x, res, w, b, g, gz))


def _compare(got, want, what):
  for a, e, name in zip(got, want, ("out", "z", "grad x", "grad scale", "grad bias")):
    assert (a is None) == (e is None), f"{what} {name}"
    if a is not None:
      helpers.assert_close(a, e, what=f"{what} {name}")


# (op, scale, bias): every op with and without each of its parameters (RMSNorm has no bias).
PARAMS = [(op, scale, bias) for op, (centered, _) in OPS.items() for scale in (True, False)
          for bias in ((True, False) if centered else (False,))]


@pytest.mark.parametrize("op, scale, bias", PARAMS, ids=str)
@pytest.mark.parametrize("rows, hidden", [(5, 123), (3, 423), (4, 1000)])
def test_general_kernels_fp32_match_torch(op, scale, bias, rows, hidden):
  args = _norm_inputs(op, rows, hidden, scale=scale, bias=bias, seed=hidden)
  got = _run_norm(op, *args)
  _compare(got[:5], _torch_norm(op, *args), f"{op} {rows}x{hidden}")
  x = args[0] if args[1] is None else got[1]
  if OPS[op][0]:
    helpers.assert_close(got[5][:, 0], x.mean(-1), what="mean")
    helpers.assert_close(got[6][:, 0], torch.rsqrt(x.var(-1, unbiased=False) + EPS), what="rstd")
  else:
    assert torch.isnan(got[5]).all()  # RMSNorm stores no mean
    helpers.assert_close(got[6][:, 0], torch.rsqrt(x.pow(2).mean(-1) + EPS), what="rstd")


@pytest.mark.parametrize("op", ["layer_norm", "add_rms_norm"])
def test_general_kernels_without_statistics(op):
  args = _norm_inputs(op, 3, 300, scale=True, bias=True, seed=1)
  y, z, _, _, _, mean, rstd = _run_norm(op, *args, store_stats=False)
  want = _torch_norm(op, *args)
  helpers.assert_close(y, want[0])
  if z is not None:
    helpers.assert_close(z, want[1])
  assert torch.isnan(mean).all() and torch.isnan(rstd).all()


@pytest.mark.parametrize("op", ["layer_norm", "add_layer_norm"])
def test_general_backward_walks_several_rows_a_program(op):
  """More rows than backward programs: each program walks several rows (the last one past
  the end) and its partial scale and bias gradients cover all of them."""
  args = _norm_inputs(op, 11, 48, scale=True, bias=True, seed=2)
  _compare(_run_norm(op, *args, max_programs=4)[:5], _torch_norm(op, *args), op)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_general_kernels_low_precision_within_twice_torch_error(op, dtype):
  args = _norm_inputs(op, 9, 1000, scale=True, bias=True, seed=3, dtype=dtype)
  got = _run_norm(op, *args)[:5]
  exact = _torch_norm(op, *args, dtype=torch.float64)
  low = _torch_norm(op, *args)
  for a, e, t, what in zip(got, exact, low, ("out", "z", "grad x", "grad scale", "grad bias")):
    if a is None:
      continue
    assert a.dtype == dtype
    helpers.assert_within_low_precision_error(a, e, t, what=f"{op} {what}")


# The jax-triton wrappers ------------------------------------------------------------------------


def test_wrappers_launch_what_the_kernels_expect():
  x = jax.ShapeDtypeStruct((2500, 1000), jnp.bfloat16)
  p = jax.ShapeDtypeStruct((1000,), jnp.bfloat16)
  stat = jax.ShapeDtypeStruct((2500, 1), jnp.float32)
  unused = jax.ShapeDtypeStruct((1, 1), jnp.float32)
  with interp.jax_triton_stand_in(run=False) as launches:
    outs = jax.eval_shape(lambda x, r, s, b: kernels.forward(
        x, r, s, b, eps=1e-5, centered=True, store_stats=True), x, x, p, p)
    rms = jax.eval_shape(lambda x, s: kernels.forward(
        x, None, s, None, eps=1e-6, centered=False, store_stats=False), x, p)
    grads = jax.eval_shape(lambda x, g, s, m, r: kernels.backward(
        x, g, g, s, m, r, has_bias=True), x, x, p, stat, stat)
    rms_grads = jax.eval_shape(lambda x, g, r: kernels.backward(
        x, g, None, None, None, r, has_bias=False), x, x, stat)
  assert outs == (x, x, stat, stat) and rms == (x, None, None, None)
  h = jax.ShapeDtypeStruct((1000,), jnp.float32)
  assert grads == (x, h, h) and rms_grads == (x, None, None)
  fwd, rms_fwd, bwd, rms_bwd = launches
  assert [c.kernel for c in launches] == ["norm_fwd_kernel"] * 2 + ["norm_bwd_kernel"] * 2
  assert fwd.grid == rms_fwd.grid == (2500,) and bwd.grid == rms_bwd.grid == (834,)
  assert fwd.constexprs == dict(H=1000, eps=1e-5, BLOCK_H=1024, CENTERED=True,
                                HAS_RESIDUAL=True, HAS_SCALE=True, HAS_BIAS=True,
                                STORE_STATS=True)
  assert rms_fwd.constexprs == dict(H=1000, eps=1e-6, BLOCK_H=1024, CENTERED=False,
                                    HAS_RESIDUAL=False, HAS_SCALE=True, HAS_BIAS=False,
                                    STORE_STATS=False)
  assert bwd.constexprs == dict(R=2500, H=1000, ROWS_PER_PROGRAM=3, BLOCK_H=1024, CENTERED=True,
                                HAS_SUM_GRAD=True, HAS_SCALE=True, HAS_BIAS=True)
  assert rms_bwd.constexprs == dict(R=2500, H=1000, ROWS_PER_PROGRAM=3, BLOCK_H=1024,
                                    CENTERED=False, HAS_SUM_GRAD=False, HAS_SCALE=False,
                                    HAS_BIAS=False)
  assert fwd.outputs == [x, x, stat, stat] and rms_fwd.outputs == [x, unused, unused, unused]
  partial = jax.ShapeDtypeStruct((834, 1000), jnp.float32)
  assert bwd.outputs == [x, partial, partial] and rms_bwd.outputs == [x, unused, unused]


@pytest.mark.parametrize("op", OPS)
def test_wrappers_run_in_the_interpreter(op):
  centered, _ = OPS[op]
  x, res, w, b, g, gz = _norm_inputs(op, 5, 123, scale=True, bias=True, seed=4)
  j = lambda t: None if t is None else jnp.asarray(t.numpy())  # noqa: E731
  with interp.jax_triton_stand_in() as launches:
    y, z, mean, rstd = kernels.forward(j(x), j(res), j(w), j(b), eps=EPS, centered=centered,
                                       store_stats=True)
    dx, dw, db = kernels.backward(j(x) if z is None else z, j(g), j(gz), j(w), mean, rstd,
                                  has_bias=b is not None)
  assert len(launches) == 2
  _compare((y, z, dx, dw, db), _torch_norm(op, x, res, w, b, g, gz), op)


def test_rms_norm_wrappers_keep_their_signature():
  x, _, w, _, g, _ = _norm_inputs("rms_norm", 5, 123, scale=True, bias=False, seed=5)
  with interp.jax_triton_stand_in():
    y, rstd = kernels.rms_norm_forward(jnp.asarray(x.numpy()), jnp.asarray(w.numpy()), eps=EPS)
    dx, dw = kernels.rms_norm_backward(jnp.asarray(x.numpy()), jnp.asarray(g.numpy()),
                                       jnp.asarray(w.numpy()), rstd)
  want = _torch(x, w, g)
  for got, expected in zip((y, dx, dw), want):
    helpers.assert_close(got, expected)
  assert rstd.shape == (5, 1)


# The ops, end to end ----------------------------------------------------------------------------


@pytest.mark.parametrize("op", OPS)
def test_ops_match_torch(op, monkeypatch):
  centered, has_residual = OPS[op]
  x, res, w, b, g, gz = _norm_inputs(op, 15, 123, scale=True, bias=True, seed=6)
  j = lambda t: None if t is None else jnp.asarray(t.numpy()).reshape(3, 5, -1)  # noqa: E731
  fn = getattr(ops, op)
  params = (jnp.asarray(w.numpy()),) + ((jnp.asarray(b.numpy()),) if centered else ())
  if has_residual:
    args = (j(x), j(res), *params)
    cot = (j(g), j(gz))
    f = lambda x, r, *p: fn(x, r, *p, eps=EPS, implementation="triton")  # noqa: E731
  else:
    args, cot = (j(x), *params), j(g)
    f = lambda x, *p: fn(x, *p, eps=EPS, implementation="triton")  # noqa: E731
  with interp.triton_ops(monkeypatch) as launches:
    got = helpers.jax_value_and_grads(f, args, cot)
  assert [c.kernel for c in launches] == ["norm_fwd_kernel", "norm_bwd_kernel"]
  assert launches[0].constexprs["STORE_STATS"]
  want = _torch_norm(op, x, res, w, b, g, gz)
  if has_residual:
    (y, z), dx, dres, *dparams = got
    helpers.assert_close(dres, want[2].reshape(3, 5, -1), what="grad residual")
  else:
    y, dx, *dparams = got
    z = None
  flat = lambda t: None if t is None else t.reshape(15, -1)  # noqa: E731
  _compare((flat(y), flat(z), flat(dx), *dparams, *([None] * (not centered))), want, op)


def test_ops_primal_stores_no_statistics(monkeypatch):
  x = jnp.ones((4, 40))
  with interp.triton_ops(monkeypatch) as launches:
    y = ops.layer_norm(x, jnp.ones(40), jnp.zeros(40), implementation="triton")
  assert [c.kernel for c in launches] == ["norm_fwd_kernel"]
  assert not launches[0].constexprs["STORE_STATS"]
  helpers.assert_close(y, jnp.zeros((4, 40)))


def test_ops_reject_rows_longer_than_one_block(monkeypatch):
  x = jax.ShapeDtypeStruct((2, kernels.MAX_HIDDEN + 1), jnp.float32)
  with interp.triton_ops(monkeypatch), pytest.raises(
      ValueError, match=r"add_layer_norm: implementation='triton' takes a hidden size"):
    jax.eval_shape(lambda x: ops.add_layer_norm(x, x, implementation="triton"), x)
