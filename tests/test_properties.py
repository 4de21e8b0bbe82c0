"""Property tests over shapes and dtypes (hypothesis): for any shape, including odd sizes, size
one and empty axes, and any supported dtype, each op's XLA implementation agrees with its
plain-jnp reference in value and gradient, keeps its dtype and shape, and stays finite.

The torch twin tests check the references themselves at chosen shapes; these check that no
shape breaks the fused implementations' tiling, padding or reshapes.
"""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxfuse import ops
from tests import helpers

DTYPES = st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16])
SETTINGS = settings(max_examples=12, deadline=None, derandomize=True)


def _shape(min_rank=1, max_rank=3, min_size=0, max_size=40):
  return st.lists(st.integers(min_size, max_size), min_size=min_rank, max_size=max_rank).map(tuple)


def _normal(shape, dtype, seed, scale=1.0):
  return (scale * jax.random.normal(jax.random.key(seed), shape)).astype(dtype)


def _value_and_grads(fn, args, g):
  return helpers.jax_value_and_grads(fn, args, g)


def _agree(got, want, dtype, what):
  """Float32: the float32 rule; low precision: within two units in the last place of the
  dtype's precision at the result's scale (the implementations round once, from float32)."""
  for i, (a, b) in enumerate(zip(got, want)):
    assert a.shape == b.shape and a.dtype == b.dtype, (what, i, a.shape, b.shape)
    assert np.all(np.isfinite(np.asarray(a, np.float32))), (what, i)
    if jnp.dtype(dtype) == jnp.float32:
      helpers.assert_close(a, b, what=f"{what} {i}")
    else:
      eps = float(jnp.finfo(dtype).eps)
      scale = max(1.0, float(np.max(np.abs(np.asarray(b, np.float32)))) if b.size else 1.0)
      helpers.assert_close(a, b, rtol=2 * eps, atol=2 * eps * scale, what=f"{what} {i}")


@SETTINGS
@given(shape=_shape(), dtype=DTYPES, act=st.sampled_from(["relu", "gelu", "silu", "gelu_tanh"]))
def test_add_act_matches_its_reference(shape, dtype, act):
  a, b, g = (_normal(shape, dtype, s) for s in range(3))
  got = _value_and_grads(lambda a, b: ops.add_act(a, b, act), (a, b), g)
  want = _value_and_grads(lambda a, b: ops.add_act_reference(a, b, act), (a, b), g)
  _agree(got, want, dtype, f"add_act {act} {shape}")


@SETTINGS
@given(shape=_shape(), dtype=DTYPES, packed=st.booleans())
def test_glu_matches_its_reference(shape, dtype, packed):
  if packed:
    x = _normal(shape[:-1] + (2 * shape[-1],), dtype, 0)
    g = _normal(shape, dtype, 1)
    got = _value_and_grads(lambda x: ops.glu(x, "silu"), (x,), g)
    want = _value_and_grads(lambda x: ops.glu_reference(x, "silu"), (x,), g)
  else:
    a, b, g = (_normal(shape, dtype, s) for s in range(3))
    got = _value_and_grads(lambda a, b: ops.glu(a, b, "gelu"), (a, b), g)
    want = _value_and_grads(lambda a, b: ops.glu_reference(a, b, "gelu"), (a, b), g)
  _agree(got, want, dtype, f"glu packed={packed} {shape}")


@SETTINGS
@given(shape=_shape(), dtype=DTYPES)
def test_bias_act_matches_its_reference(shape, dtype):
  x, g = _normal(shape, dtype, 0), _normal(shape, dtype, 1)
  bias = _normal(shape[-1:], dtype, 2)
  got = _value_and_grads(lambda x, b: ops.bias_act(x, b, "gelu"), (x, bias), g)
  want = _value_and_grads(lambda x, b: ops.bias_act_reference(x, b, "gelu"), (x, bias), g)
  # The bias gradient is a float32 sum over every row in both, in another order.
  _agree(got[:2], want[:2], dtype, f"bias_act {shape}")
  helpers.assert_close(got[2].astype(jnp.float32), want[2].astype(jnp.float32),
                       rtol=2 * float(jnp.finfo(dtype).eps), what="bias gradient")


@SETTINGS
@given(shape=_shape(), dtype=DTYPES, data=st.data())
def test_softmax_matches_its_reference(shape, dtype, data):
  axis = data.draw(st.integers(-len(shape), len(shape) - 1))
  x, g = _normal(shape, dtype, 0, 3.0), _normal(shape, dtype, 1)
  got = _value_and_grads(lambda x: ops.softmax(x, axis=axis), (x,), g)
  want = _value_and_grads(lambda x: ops.softmax_reference(x, axis=axis), (x,), g)
  _agree(got, want, dtype, f"softmax axis={axis} {shape}")


@SETTINGS
@given(shape=_shape(min_size=1), dtype=DTYPES, centered=st.booleans())
def test_normalizations_match_their_references(shape, dtype, centered):
  x, r, g = (_normal(shape, dtype, s) for s in range(3))
  scale = _normal(shape[-1:], dtype, 3)
  if centered:
    op, reference = ops.add_layer_norm, ops.add_layer_norm_reference
  else:
    op, reference = ops.add_rms_norm, ops.add_rms_norm_reference
  gz = _normal(shape, dtype, 4)

  def run(f):
    @jax.jit
    def step(x, r, scale):
      out, vjp = jax.vjp(lambda x, r: f(x, r, scale), x, r)
      return (*out, *vjp((g, gz)))
    return step(x, r, scale)

  got, want = run(op), run(reference)
  _agree(got, want, dtype, f"{op.__name__} {shape}")


@SETTINGS
@given(b=st.integers(0, 2), tq=st.integers(0, 40), tk=st.integers(1, 40),
       groups=st.sampled_from([(1, 1), (4, 2), (3, 1)]), d=st.sampled_from([1, 8, 12]),
       causal=st.booleans(), dtype=DTYPES)
def test_attention_matches_its_reference(b, tq, tk, groups, d, causal, dtype):
  hq, hkv = groups
  q, g = _normal((b, tq, hq, d), dtype, 0), _normal((b, tq, hq, d), dtype, 1)
  k, v = _normal((b, tk, hkv, d), dtype, 2), _normal((b, tk, hkv, d), dtype, 3)
  got = _value_and_grads(lambda q, k, v: ops.attention(q, k, v, causal=causal), (q, k, v), g)
  want = _value_and_grads(lambda q, k, v: ops.attention_reference(q, k, v, causal=causal),
                          (q, k, v), g)
  _agree(got, want, dtype, f"attention b={b} tq={tq} tk={tk} {groups} d={d} causal={causal}")
