"""Property tests over shapes and dtypes (hypothesis): for any shape, including odd sizes, size
one and empty axes, and any supported dtype, each op's XLA implementation agrees with its
plain-jnp reference in value and gradient, keeps its dtype and shape, and stays finite.

The torch twin tests check the references themselves at chosen shapes; these check that no
shape breaks the fused implementations' tiling, padding or reshapes.
"""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxfuse import ops
from tests import helpers

DTYPES = st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16])
SETTINGS = settings(max_examples=5, deadline=None, derandomize=True)


def _shape(min_rank=1, max_rank=3, min_size=0, max_size=40):
  return st.lists(st.integers(min_size, max_size), min_size=min_rank, max_size=max_rank).map(tuple)


def _normal(shape, dtype, seed, scale=1.0):
  return helpers.normal(seed, shape, dtype, scale)  # no sampler compiled for each new shape


def _value_and_grads(fn, args, g):
  return helpers.jax_value_and_grads(fn, args, g)


def _agree(op, reference, args, g, what):
  """``op`` against ``reference`` by the suite's one rule: float32 by the float32 rule; low
  precision against the reference run in float32 on the same values, with at most twice the
  error of the reference run in the low precision itself, plus two units of the dtype at the
  result's scale: a fused backward reads its residuals as stored (softmax: its rounded output),
  where the reference's autodiff keeps float32 intermediates."""
  dtype = args[0].dtype
  got = _value_and_grads(op, args, g)
  want = _value_and_grads(reference, args, g)
  for i, (a, b) in enumerate(zip(got, want)):
    assert a.shape == b.shape and a.dtype == b.dtype, (what, i, a.shape, b.shape)
    assert np.all(np.isfinite(np.asarray(a, np.float32))), (what, i)
  if jnp.dtype(dtype) == jnp.float32:
    for i, (a, b) in enumerate(zip(got, want)):
      helpers.assert_close(a, b, what=f"{what} {i}")
    return
  up = lambda xs: tuple(x.astype(jnp.float32) for x in xs)  # noqa: E731
  exact = _value_and_grads(reference, up(args), g.astype(jnp.float32))
  eps = float(jnp.finfo(dtype).eps)
  for i, (a, e, b) in enumerate(zip(got, exact, want)):
    scale = float(np.max(np.abs(np.asarray(e, np.float32)))) if e.size else 0.0
    helpers.assert_within_low_precision_error(a, e, b, floor=2 * eps * max(1.0, scale),
                                              what=f"{what} {i}")


@SETTINGS
@given(shape=_shape(), dtype=DTYPES, act=st.sampled_from(["relu", "gelu", "silu", "gelu_tanh"]))
def test_add_act_matches_its_reference(shape, dtype, act):
  a, b, g = (_normal(shape, dtype, s) for s in range(3))
  _agree(lambda a, b: ops.add_act(a, b, act), lambda a, b: ops.add_act_reference(a, b, act),
         (a, b), g, f"add_act {act} {shape}")


@SETTINGS
@given(shape=_shape(), dtype=DTYPES, packed=st.booleans())
def test_glu_matches_its_reference(shape, dtype, packed):
  if packed:
    x = _normal(shape[:-1] + (2 * shape[-1],), dtype, 0)
    g = _normal(shape, dtype, 1)
    _agree(lambda x: ops.glu(x, "silu"), lambda x: ops.glu_reference(x, "silu"), (x,), g,
           f"glu packed {shape}")
  else:
    a, b, g = (_normal(shape, dtype, s) for s in range(3))
    _agree(lambda a, b: ops.glu(a, b, "gelu"), lambda a, b: ops.glu_reference(a, b, "gelu"),
           (a, b), g, f"glu {shape}")


@SETTINGS
@given(shape=_shape(), dtype=DTYPES)
def test_bias_act_matches_its_reference(shape, dtype):
  x, g = _normal(shape, dtype, 0), _normal(shape, dtype, 1)
  bias = _normal(shape[-1:], dtype, 2)
  _agree(lambda x, b: ops.bias_act(x, b, "gelu"),
         lambda x, b: ops.bias_act_reference(x, b, "gelu"), (x, bias), g, f"bias_act {shape}")


@SETTINGS
@given(shape=_shape(), dtype=DTYPES, data=st.data())
def test_softmax_matches_its_reference(shape, dtype, data):
  axis = data.draw(st.integers(-len(shape), len(shape) - 1))
  x, g = _normal(shape, dtype, 0, 3.0), _normal(shape, dtype, 1)
  _agree(lambda x: ops.softmax(x, axis=axis), lambda x: ops.softmax_reference(x, axis=axis),
         (x,), g, f"softmax axis={axis} {shape}")


@SETTINGS
@given(lead=_shape(min_rank=0, max_rank=2), hidden=st.integers(8, 300), dtype=DTYPES,
       centered=st.booleans())
def test_normalizations_match_their_references(lead, hidden, dtype, centered):
  # At least 8 features: with two or three the variance of a row is the difference of nearly
  # equal numbers, and its reciprocal amplifies every rounding (the gradient is ill-posed).
  shape = lead + (hidden,)
  x, r, g = (_normal(shape, dtype, s) for s in range(3))
  scale = _normal(shape[-1:], dtype, 3)
  if centered:
    op, reference = ops.add_layer_norm, ops.add_layer_norm_reference
  else:
    op, reference = ops.add_rms_norm, ops.add_rms_norm_reference
  gz = _normal(shape, dtype, 4)
  # Both outputs, with their cotangents stacked into one array: (normed, x + residual).
  stacked = lambda f: lambda x, r, s: jnp.stack(f(x, r, s))  # noqa: E731
  _agree(stacked(op), stacked(reference), (x, r, scale), jnp.stack([g, gz]),
         f"{op.__name__} {shape}")


@SETTINGS
@given(b=st.integers(0, 2), tq=st.integers(0, 40), tk=st.integers(1, 40),
       groups=st.sampled_from([(1, 1), (4, 2), (3, 1)]), d=st.sampled_from([1, 8, 12]),
       causal=st.booleans(), dtype=DTYPES)
def test_attention_matches_its_reference(b, tq, tk, groups, d, causal, dtype):
  hq, hkv = groups
  q, g = _normal((b, tq, hq, d), dtype, 0), _normal((b, tq, hq, d), dtype, 1)
  k, v = _normal((b, tk, hkv, d), dtype, 2), _normal((b, tk, hkv, d), dtype, 3)
  _agree(lambda q, k, v: ops.attention(q, k, v, causal=causal),
         lambda q, k, v: ops.attention_reference(q, k, v, causal=causal), (q, k, v), g,
         f"attention b={b} tq={tq} tk={tk} {groups} d={d} causal={causal}")
