"""Property tests over shapes and dtypes (hypothesis), for every case of the op tables
(``tests/cases``) that has a plain-jnp reference and a shape generator: for any shape,
including odd sizes, size one and empty axes, and any supported dtype, the op's XLA
implementation agrees with its reference in value and gradient, keeps its dtype and shape, and
stays finite.

The torch twin tests check the references themselves at chosen shapes; these check that no
shape breaks the fused implementations' tiling, padding or reshapes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests import cases, helpers

DTYPES = st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16])
SETTINGS = settings(max_examples=5, deadline=None, derandomize=True)
# Each op's first case with a reference and a shape generator, and attention's masks (whose
# tile skipping depends on the shapes).
PROPERTY_CASES = [c for i, c in enumerate(cases.CASES)
                  if c.reference is not None and c.draw is not None
                  and (c.op == "attention" and "causal" in c.label
                       or all(p.op != c.op or p.reference is None or p.draw is None
                              for p in cases.CASES[:i]))]


def _value_and_grads(f, args):
  def run(args):
    out, vjp = jax.vjp(f, *args)
    return (cases.outputs(out), *vjp(out if isinstance(out, tuple)
                                     else cases.cotangents(out)[0]))
  return jax.jit(run, compiler_options=helpers.FAST_COMPILE)(tuple(args))


def _agree(case, args, what):
  """The XLA implementation against the reference by the suite's one rule: float32 by the
  float32 rule; low precision against the reference run in float32 on the same values, with at
  most twice the error of the reference run in the low precision itself, plus two units of the
  dtype at the result's scale: a fused backward reads its residuals as stored (softmax: its
  rounded output), where the reference's autodiff keeps float32 intermediates."""
  diff = case.diff_args
  op, diff_args = case.bind(args, "xla")

  def reference(*d):
    full = list(args)
    for i, x in zip(diff, d):
      full[i] = x
    return case.reference(*full)

  got = jax.tree.leaves(_value_and_grads(op, diff_args))
  want = jax.tree.leaves(_value_and_grads(reference, diff_args))
  for i, (a, b) in enumerate(zip(got, want)):
    assert a.shape == b.shape and a.dtype == b.dtype, (what, i, a.shape, b.shape)
    assert np.all(np.isfinite(np.asarray(a, np.float32))), (what, i)
  dtype = diff_args[0].dtype
  if jnp.dtype(dtype) == jnp.float32:
    for i, (a, b) in enumerate(zip(got, want)):
      helpers.assert_close(a, b, what=f"{what} {i}")
    return
  up = [a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a for a in args]
  _, up_diff = case.bind(up, "xla")

  def reference_up(*d):
    full = list(up)
    for i, x in zip(diff, d):
      full[i] = x
    return case.reference(*full)

  exact = jax.tree.leaves(_value_and_grads(reference_up, up_diff))
  eps = float(jnp.finfo(dtype).eps)
  for i, (a, e, b) in enumerate(zip(got, exact, want)):
    scale = float(np.max(np.abs(np.asarray(e, np.float32)))) if e.size else 0.0
    helpers.assert_within_low_precision_error(a, e, b, floor=2 * eps * max(1.0, scale),
                                              what=f"{what} {i}")


@pytest.mark.parametrize("case", PROPERTY_CASES, ids=[c.id for c in PROPERTY_CASES])
@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), dtype=DTYPES)
def test_the_xla_implementation_matches_its_reference(case, seed, dtype):
  shapes = case.draw(np.random.default_rng(seed))
  args = case.inputs(shapes, dtype, seed % 1000)
  _agree(case, args, f"{case.id} {shapes} {jnp.dtype(dtype).name}")
