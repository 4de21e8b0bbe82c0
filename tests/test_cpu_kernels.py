"""The C++ CPU kernels (jaxfuse.kernels.cpu): how they are built and chosen, and against XLA's
formulas where the op tables do not reach (glu's every activation and dtype, the activations'
tails, NaN, vmap; the normalizations' parameter and residual combinations, many rows;
attention over many tiles with every mask, low precision, vmap). The op tables test them against
torch (test_op_twins.py, test_second_order.py, sharding/)."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from jaxfuse.kernels import cpu
from jaxfuse.kernels import activations as kernel_activations
from jaxfuse.ops import (add_layer_norm, add_rms_norm, attention, attention_reference, base,
                         dispatch, glu, layer_norm, rms_norm)
from tests import helpers

needs_cpu_kernels = pytest.mark.skipif(not helpers.CPU_KERNELS,
                                       reason="no C++ compiler here, or not on a CPU")

# Values at the activations' tails and their exp's clamps, with normal draws around them.
TAILS = np.array([-100.0, -88.5, -87.0, -30.0, -5.0, -1e-3, 0.0, 1e-3, 0.6, 5.0, 30.0, 88.0,
                  88.5, 100.0], np.float32)


def _ffi_targets(f, *args) -> list[str]:
  text = jax.jit(f).lower(*args).as_text()
  return sorted(re.findall(r"custom_call @(jaxfuse_\w+)", text))


def _grads(act, impl, dtype):
  def run(a, b, g):
    y, vjp = jax.vjp(lambda a, b: glu(a, b, act, implementation=impl), a, b)
    return (y, *vjp(g))
  return jax.jit(run)


def _inputs(dtype, seed=0):
  a, b, g = helpers.random_pair((48, 700), jnp.float32, seed=seed)   # two chunks: both threads
  a = a.at[0, :TAILS.size].set(TAILS)
  return a.astype(dtype), b.astype(dtype), g.astype(dtype)


@needs_cpu_kernels
def test_none_takes_the_cpu_kernels_one_call_each_way():
  """On a CPU, ``implementation=None`` runs glu's CPU kernels: the forward and the backward
  are one FFI call each (XLA:CPU's formulas take two loops for the backward's two gradients)."""
  a, b, g = _inputs(jnp.float32)
  loss = lambda a, b: jnp.sum(glu(a, b, "silu") * g)
  names = _ffi_targets(jax.value_and_grad(loss, argnums=(0, 1)), a, b)
  assert names == ["jaxfuse_glu_backward", "jaxfuse_glu_forward"]
  xla = lambda a, b: jnp.sum(glu(a, b, "silu", implementation="xla") * g)
  assert _ffi_targets(jax.value_and_grad(xla, argnums=(0, 1)), a, b) == []
  assert base.REGISTRY["glu"].preference["cpu"] == ("cpu", "xla")
  assert base.REGISTRY["softmax"].preference["cpu"] == ("xla",)


@needs_cpu_kernels
@pytest.mark.parametrize("act", kernel_activations.ACTIVATIONS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_every_activation_and_dtype_against_xla(act, dtype):
  """Output and both gradients against XLA's formulas, tails included: float32 to the float32
  rule, bfloat16 and float16 to one rounding of the same float32 value (both compute in
  float32 and round once)."""
  dtype = jnp.dtype(dtype)
  args = _inputs(dtype, seed=len(act))
  got = _grads(act, "cpu", dtype)(*args)
  want = _grads(act, "xla", dtype)(*args)
  for name, x, y in zip(("y", "da", "db"), got, want):
    assert x.dtype == dtype, name
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    if dtype == jnp.float32:
      helpers.assert_close(x, y, what=f"{act} {name}")
    else:   # one rounding apart (a step of the format) beyond the float32 rule's tolerance
      eps = float(jnp.finfo(dtype).eps)
      atol = helpers.FP32_ATOL * max(1.0, float(np.max(np.abs(y))))
      bad = np.abs(x - y) > eps * np.abs(y) + atol
      assert not bad.any(), f"{act} {name}: {x[bad][:4]} against {y[bad][:4]}"


@needs_cpu_kernels
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh", "relu", "tanh"])
def test_nan_stays_nan(act):
  a = jnp.array([[jnp.nan, 1.0]], jnp.float32)
  b = g = jnp.ones_like(a)
  y, da, db = _grads(act, "cpu", jnp.float32)(a, b, g)
  assert np.isnan(y[0, 0]) and np.isnan(db[0, 0]), act
  np.testing.assert_array_equal(np.isnan(np.asarray(da)),
                                np.isnan(np.asarray(_grads(act, "xla", jnp.float32)(a, b, g)[1])))


@needs_cpu_kernels
def test_packed_and_vmapped():
  """The packed form over many rows (the row-parallel loop), and vmap with an unbatched value
  (``broadcast_all``), against XLA."""
  a, b, g = _inputs(jnp.float32, seed=5)
  x = jnp.concatenate([a, b], axis=-1)
  packed = lambda impl: jax.jit(jax.grad(
      lambda x: jnp.sum(glu(x, "gelu", implementation=impl) * g)))
  helpers.assert_close(packed("cpu")(x), packed("xla")(x))
  stack = jnp.stack([a, 2 * a, -a])
  f = lambda impl: jax.jit(jax.vmap(
      jax.grad(lambda a, b: jnp.sum(glu(a, b, implementation=impl) * g), argnums=(0, 1)),
      in_axes=(0, None)))
  for got, want in zip(f("cpu")(stack, b), f("xla")(stack, b)):
    helpers.assert_close(got, want)


@needs_cpu_kernels
def test_a_function_activation_goes_to_xla():
  """The kernels take the named activations; ``None`` runs a function on XLA, and asking for
  the kernels with one says what they take."""
  fn = lambda a: jnp.sin(a) * a
  a, b, _ = _inputs(jnp.float32)
  assert _ffi_targets(lambda a, b: glu(a, b, fn), a, b) == []
  helpers.assert_close(glu(a, b, fn), fn(a) * b)
  with pytest.raises(ValueError, match=r"glu: implementation='cpu' supports the named "
                                       r"activations .*; use .*'xla'"):
    glu(a, b, fn, implementation="cpu")


def test_turned_off_by_the_environment(monkeypatch):
  """``JAXFUSE_CPU_KERNELS=0``: ``None`` runs XLA, and asking for the kernels says why not."""
  monkeypatch.setenv("JAXFUSE_CPU_KERNELS", "0")
  assert not cpu.available()
  if helpers.ON_GPU:
    return
  assert base.REGISTRY["glu"].resolve(None) == "xla"
  with pytest.raises(jaxfuse.ImplementationUnavailableError,
                     match=r"glu: implementation='cpu' cannot run on platform 'cpu': CPU "
                           r"kernels need a C\+\+ compiler .*JAXFUSE_CPU_KERNELS=0"):
    glu(jnp.ones(3), jnp.ones(3), implementation="cpu")


@needs_cpu_kernels
def test_built_once_into_the_cache(monkeypatch, tmp_path):
  """A fresh cache gets the library on first use; a second build finds it (same file, not
  rewritten); a compiler that fails raises with what it said."""
  monkeypatch.setenv("JAXFUSE_CACHE_DIR", str(tmp_path))
  first = cpu.build("gated_linear")
  assert first.parent == tmp_path / "cpu-kernels" and first.is_file()
  stamp = first.stat().st_mtime_ns
  assert cpu.build("gated_linear") == first and first.stat().st_mtime_ns == stamp
  built = lambda: sorted(p.name for p in first.parent.iterdir() if p.suffix != ".lock")
  assert built() == [first.name]   # no temporary left
  monkeypatch.setenv("CXX", "false")   # exits 1, prints nothing
  with pytest.raises(cpu.CompileError, match=r"the C\+\+ compiler cannot build jaxfuse's CPU "
                                             r"kernels .*: the probe"):
    cpu.build("gated_linear")
  assert built() == [first.name]


def test_kinds_come_from_the_kernel_packages():
  """An op has a kernel kind exactly where that kind's package holds its kernel module, unless
  its entry names its kinds (the unfused baseline, whose add has no CPU kernel)."""
  kernels_dir = os.path.dirname(os.path.dirname(cpu.__file__))
  for op in base.REGISTRY.values():
    if op.name == "add_rms_norm_unfused":
      assert op.kinds == ("pallas", "triton")
      continue
    for kind in dispatch.KINDS.values():
      if kind.package is None:
        continue
      folder = kind.package.rpartition(".")[2]
      here = bool(op.kernels) and os.path.isfile(
          os.path.join(kernels_dir, folder, f"{op.kernels}.py"))
      assert (kind.name in op.kinds) == here, (op.name, kind.name)
  assert sorted(name for name, op in base.REGISTRY.items() if "cpu" in op.kinds) == [
      "add_layer_norm", "add_rms_norm", "attention", "glu", "layer_norm", "rms_norm"]


# Normalization ------------------------------------------------------------------------------------

NORMS = {
    "layer_norm": lambda x, r, s, b, impl: layer_norm(x, s, b, implementation=impl),
    "layer_norm no params": lambda x, r, s, b, impl: layer_norm(x, implementation=impl),
    "layer_norm scale only": lambda x, r, s, b, impl: layer_norm(x, s, implementation=impl),
    "rms_norm": lambda x, r, s, b, impl: rms_norm(x, s, implementation=impl),
    "rms_norm no scale": lambda x, r, s, b, impl: rms_norm(x, implementation=impl),
    "add_layer_norm": lambda x, r, s, b, impl: add_layer_norm(x, r, s, b, implementation=impl),
    "add_rms_norm": lambda x, r, s, b, impl: add_rms_norm(x, r, s, implementation=impl),
}


def _norm_step(name, impl):
  def run(x, r, s, b, g):
    f = lambda x, r, s, b: NORMS[name](x, r, s, b, impl)
    out, vjp = jax.vjp(f, x, r, s, b)
    outs = out if isinstance(out, tuple) else (out,)
    cts = tuple(g * (i + 1) for i in range(len(outs)))
    return outs, vjp(cts if isinstance(out, tuple) else cts[0])
  return jax.jit(run)


@needs_cpu_kernels
@pytest.mark.parametrize("name", list(NORMS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_normalizations_against_xla(name, dtype):
  """Outputs and every gradient against XLA's formulas over 3 x 70 x 300 rows (the row loop
  split over the threads, the parameter gradients summed over the chunks), float32 parameters
  with low-precision rows."""
  dtype = jnp.dtype(dtype)
  x, r, g = (t.astype(dtype) for t in helpers.random_pair((3, 70, 300), jnp.float32, seed=9))
  s, b, _ = helpers.random_pair((300,), jnp.float32, seed=10)
  got = _norm_step(name, "cpu")(x + 0.5, r, s, b, g)
  want = _norm_step(name, "xla")(x + 0.5, r, s, b, g)
  for x_got, x_want in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert x_got.dtype == x_want.dtype and x_got.shape == x_want.shape
    x_got, x_want = np.asarray(x_got, np.float32), np.asarray(x_want, np.float32)
    if dtype == jnp.float32:
      helpers.assert_close(x_got, x_want, what=name)
    else:
      eps = float(jnp.finfo(dtype).eps)
      atol = helpers.FP32_ATOL * max(1.0, float(np.max(np.abs(x_want))))
      assert np.all(np.abs(x_got - x_want) <= eps * np.abs(x_want) + atol), name


@needs_cpu_kernels
def test_normalization_one_call_each_way():
  """``None`` runs LayerNorm's CPU kernels, one call each way; RMSNorm's only by name (they
  measure no faster than XLA's formulas, which may fuse with their neighbours)."""
  x, _, g = helpers.random_pair((64, 256), jnp.float32)
  s = jnp.ones(256)
  for op, impl, want in ((layer_norm, None, ["jaxfuse_norm_backward", "jaxfuse_norm_forward"]),
                         (rms_norm, None, []),
                         (rms_norm, "cpu", ["jaxfuse_norm_backward", "jaxfuse_norm_forward"])):
    step = jax.value_and_grad(lambda x, s, op=op, impl=impl: jnp.sum(
        op(x, s, implementation=impl) * g), argnums=(0, 1))
    assert _ffi_targets(step, x, s) == want, (op, impl)
  prefs = {name: base.REGISTRY[name].preference["cpu"] for name in (
      "layer_norm", "add_layer_norm", "rms_norm", "add_rms_norm", "add_rms_norm_unfused")}
  assert prefs == {"layer_norm": ("cpu", "xla"), "add_layer_norm": ("cpu", "xla"),
                   "rms_norm": ("xla", "cpu"), "add_rms_norm": ("xla", "cpu"),
                   "add_rms_norm_unfused": ("xla",)}


@needs_cpu_kernels
@pytest.mark.parametrize("name", ["layer_norm", "rms_norm", "add_rms_norm"])
def test_normalization_vmapped_over_parameters(name):
  """vmap with per-example parameters: each example is normalized with its own scale (and
  bias) and sums its own parameter gradients (the kernels read the examples off the
  parameters' leading axes)."""
  x, r, g = helpers.random_pair((3, 5, 40, 96), jnp.float32, seed=11)
  s, b, _ = helpers.random_pair((3, 96), jnp.float32, seed=12)
  step = _norm_step(name, "cpu")
  mapped = jax.jit(jax.vmap(lambda *a: step(*a)))(x, r, s, b, g)
  for i in range(3):
    want = _norm_step(name, "xla")(x[i], r[i], s[i], b[i], g[i])
    for got_leaf, want_leaf in zip(jax.tree.leaves(mapped), jax.tree.leaves(want)):
      helpers.assert_close(got_leaf[i], want_leaf, what=f"{name} example {i}")


# Attention ------------------------------------------------------------------------------------


def _attention_step(impl, **options):
  def run(q, k, v, g):
    out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, implementation=impl, **options),
                       q, k, v)
    return (out, *vjp(g))
  return jax.jit(run)


def _attention_inputs(b, tq, tk, hq, hkv, d, seed=0, dtype=jnp.float32):
  return helpers.normals(seed, (b, tq, hq, d), (b, tk, hkv, d), (b, tk, hkv, d), (b, tq, hq, d),
                         dtype=dtype)


@needs_cpu_kernels
def test_attention_none_takes_the_cpu_kernels_without_a_bias():
  """On a CPU, ``None`` runs attention's CPU kernels (one FFI call each way); with a bias,
  which they do not take, XLA's algorithm; asked for by name with a bias, an error saying so."""
  q, k, v, g = _attention_inputs(1, 40, 40, 2, 2, 16)
  loss = lambda q, k, v: jnp.sum(attention(q, k, v, causal=True) * g)
  names = _ffi_targets(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)
  assert names == ["jaxfuse_attention_backward", "jaxfuse_attention_forward"]
  bias = jnp.zeros((1, 2, 40, 40))
  with_bias = lambda q, k, v: jnp.sum(attention(q, k, v, bias=bias) * g)
  assert _ffi_targets(jax.grad(with_bias, argnums=(0, 1, 2)), q, k, v) == []
  with pytest.raises(ValueError, match="takes no bias"):
    attention(q, k, v, bias=bias, implementation="cpu")
  assert base.REGISTRY["attention"].preference["cpu"] == ("cpu", "xla")


# Lengths that span several 64-wide tiles with ragged tails, each mask and alignment, grouped
# heads and head dims that are not multiples of 16.
ATTENTION_CASES = [
    dict(shape=(2, 200, 200, 6, 2, 40), causal=True),
    dict(shape=(1, 130, 250, 4, 1, 24), causal="bottom_right", sliding_window=70),
    dict(shape=(2, 250, 130, 2, 2, 64), causal="bottom_right", kv_lengths=(100, 0)),
    dict(shape=(1, 190, 190, 3, 3, 16), causal=True, sliding_window=64, logit_softcap=7.0),
    dict(shape=(2, 150, 170, 4, 2, 32), logit_softcap=3.0, kv_lengths=(170, 65)),
    dict(shape=(2, 180, 180, 2, 1, 8), segments=True, causal=True),
]


@needs_cpu_kernels
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: "-".join(
    f"{k}={v}" for k, v in c.items()))
def test_attention_over_many_tiles_against_the_reference(case):
  """Output and gradients against the float32 reference (the full score matrix) where the
  kernels visit many tiles: diagonal, window-edge and ragged tiles are masked element by
  element, tiles outside the masks skipped; rows that see no key are zero."""
  case = dict(case)
  b, tq, tk, hq, hkv, d = case.pop("shape")
  q, k, v, g = _attention_inputs(b, tq, tk, hq, hkv, d, seed=tq + tk)
  if "kv_lengths" in case:
    case["kv_lengths"] = jnp.array(case["kv_lengths"], jnp.int32)
  if case.pop("segments", False):
    case["segment_ids"] = (jnp.arange(tq)[None].repeat(b, 0) * 7 // tq) % 3
  got = _attention_step("cpu", **case)(q, k, v, g)

  def reference(q, k, v, g):
    out, vjp = jax.vjp(lambda q, k, v: attention_reference(q, k, v, **case), q, k, v)
    return (out, *vjp(g))

  want = jax.jit(reference)(q, k, v, g)
  for name, x, y in zip(("out", "dq", "dk", "dv"), got, want):
    helpers.assert_close(x, y, what=f"{case} {name}")
  if "kv_lengths" in case and int(case["kv_lengths"][-1]) == 0:
    assert not np.asarray(got[0][-1]).any() and not np.asarray(got[1][-1]).any()


@needs_cpu_kernels
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_attention_low_precision_against_float32(dtype):
  """bfloat16 and float16 in, float32 math: within one step of the format (at the result's
  largest magnitude) of the float32 kernels' result on the same rounded inputs; the gradients
  differ by more than their own rounding because the backward reads the rounded output."""
  dtype = jnp.dtype(dtype)
  q, k, v, g = _attention_inputs(1, 150, 150, 4, 2, 64, seed=3, dtype=dtype)
  got = _attention_step("cpu", causal=True)(q, k, v, g)
  want = _attention_step("cpu", causal=True)(*(x.astype(jnp.float32) for x in (q, k, v, g)))
  eps = float(jnp.finfo(dtype).eps)
  for name, x, y in zip(("out", "dq", "dk", "dv"), got, want):
    assert x.dtype == dtype, name
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    assert np.max(np.abs(x - y)) <= eps * np.max(np.abs(y)), name


@needs_cpu_kernels
def test_attention_vmapped_with_per_example_lengths():
  """vmap over a leading axis with per-example kv lengths: the kernels take the extra axis as
  more batch, and each example keeps its own lengths."""
  q, k, v, g = _attention_inputs(6, 70, 70, 2, 1, 16, seed=5)
  q, k, v, g = (x.reshape(3, 2, *x.shape[1:]) for x in (q, k, v, g))
  lengths = jnp.array([[70, 10], [0, 33], [64, 65]], jnp.int32)
  step = lambda q, k, v, g, n: _attention_step("cpu", causal=True, kv_lengths=n)(q, k, v, g)
  mapped = jax.jit(jax.vmap(step))(q, k, v, g, lengths)
  for i in range(3):
    want = _attention_step("xla", causal=True, kv_lengths=lengths[i])(q[i], k[i], v[i], g[i])
    for x, y in zip(mapped, want):
      helpers.assert_close(x[i], y, what=f"example {i}")
