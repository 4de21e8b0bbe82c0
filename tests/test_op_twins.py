"""Every case of the op tables (``tests/cases``) against its PyTorch twin: the outputs and the
gradient of every differentiated argument (inputs and parameters).

- float32 at the case's weird shape, for every implementation that runs here (XLA, and Pallas
  in interpret mode), by the suite's float32 rule;
- bfloat16 and float16 at the weird shape: the error against the twin in float64 at most twice
  the twin's own error in the same dtype (FlashAttention's and Cut Cross-Entropy's rule), for
  each op's first case on every implementation and its other cases in bfloat16 on the kernels;
- float32 at the realistic shape of each op's first case, on XLA;
- each op's first case with Triton kernels, with ``implementation="triton"``, its kernels run
  in Triton's interpreter (:mod:`jaxfuse.testing.triton_interpreter`), in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests import cases, helpers

FIRST = {c.op: c for c in reversed(cases.CASES)}
TRITON = {c.op: c for c in reversed(cases.CASES) if c.runs_on("triton")}


def _implementations(case: cases.Case) -> list[str]:
  return [i for i in helpers.TABLE_IMPLEMENTATIONS if case.runs_on(i)]


def _params(dtypes=("float32",), *, narrow=False):
  """``(case, implementation, dtype)``: every case, implementation and dtype; with ``narrow``
  each op's first case in every dtype and implementation, its other cases (options that change
  the kernels' masks and tiles, not their arithmetic) in bfloat16 on the kernels only."""
  return [pytest.param(c, impl, dtype, id=f"{c.id}-{impl}-{dtype}")
          for c in cases.CASES for impl in _implementations(c) for dtype in dtypes
          if dtype in c.dtypes and (not narrow or FIRST[c.op] is c or (
              dtype == "bfloat16" and (impl != "xla" or len(_implementations(c)) == 1)))]


def jax_values_and_grads(case: cases.Case, args, implementation: str):
  """``(outputs, grads)``: the op's outputs and the gradients of its differentiated arguments
  pulled back from :func:`cases.cotangents` of the outputs, in one jitted program."""
  f, diff = case.bind(args, implementation)

  def run(diff):
    out, vjp = jax.vjp(f, *diff)
    return cases.outputs(out), vjp(cases.cotangents(out) if isinstance(out, tuple)
                                   else cases.cotangents(out)[0])

  return jax.jit(run, compiler_options=helpers.FAST_COMPILE)(diff)


def torch_values_and_grads(case: cases.Case, args, cts, dtype=None):
  """The twin's outputs and gradients, on the same values (in ``dtype`` if given)."""
  ints = dict(case.ints)
  targs = [torch.from_numpy(np.array(a)).long() if i in ints
           else helpers.to_torch(a, dtype, requires_grad=i in case.diff_args)
           for i, a in enumerate(args)]
  outs = cases.outputs(case.twin(*targs))
  loss = sum((o * helpers.to_torch(g, o.dtype)).sum() for o, g in zip(outs, cts)
             if o.dtype.is_floating_point)
  loss.backward()
  grads = [targs[i].grad if targs[i].grad is not None else torch.zeros_like(targs[i])
           for i in case.diff_args]
  return outs, grads


@pytest.mark.parametrize("case,impl,dtype", _params())
def test_float32_matches_the_torch_twin(case, impl, dtype, pallas_mode):
  del dtype
  args = case.inputs()
  outs, grads = jax_values_and_grads(case, args, impl)
  _assert_matches_twin(case, args, outs, grads, impl)


@pytest.mark.parametrize("case,impl,dtype", _params(("bfloat16", "float16"), narrow=True))
def test_low_precision_within_twice_the_twins_error(case, impl, dtype, pallas_mode):
  args = case.inputs(dtype=jnp.dtype(dtype))
  outs, grads = jax_values_and_grads(case, args, impl)
  # Every implementation returns the XLA implementation's dtypes (the inputs' for arrays like
  # the inputs; a loss in float32).
  f, diff = case.bind(args, "xla")
  want = jax.eval_shape(lambda d: (lambda out, vjp: (out, vjp(out)))(*jax.vjp(f, *d)), diff)
  assert [x.dtype for x in jax.tree.leaves((outs, grads))] == [
      x.dtype for x in jax.tree.leaves(want)], case.id
  cts = cases.cotangents(outs if len(outs) > 1 else outs[0])
  exact = torch_values_and_grads(case, args, cts, torch.float64)
  low = torch_values_and_grads(case, args, cts)
  got = list(outs) + list(grads)
  for i, (x, e, t) in enumerate(zip(got, exact[0] + tuple(exact[1]),
                                    low[0] + tuple(low[1]))):
    if jnp.issubdtype(x.dtype, jnp.floating):
      helpers.assert_within_low_precision_error(x, e, t, k=case.low_precision_k,
                                                what=f"{case.id} {impl} {dtype} {i}")


@pytest.mark.parametrize("case", list(FIRST.values()), ids=list(FIRST))
def test_realistic_shape_matches_the_torch_twin_on_xla(case):
  args = case.inputs(case.shapes)
  outs, grads = jax_values_and_grads(case, args, "xla")
  _assert_matches_twin(case, args, outs, grads, "xla realistic")


def _assert_matches_twin(case, args, outs, grads, what):
  cts = cases.cotangents(outs if len(outs) > 1 else outs[0])
  t_outs, t_grads = torch_values_and_grads(case, args, cts)
  assert len(outs) == len(t_outs)
  for i, (got, want) in enumerate(zip(outs, t_outs)):
    helpers.assert_close(got, want, what=f"{case.id} {what} output {i}")
  for i, got, want in zip(case.diff_args, grads, t_grads):
    helpers.assert_close(got, want, what=f"{case.id} {what} grad of arg {i}")


@pytest.mark.parametrize("case", list(TRITON.values()), ids=list(TRITON))
def test_triton_kernels_in_the_interpreter_match_the_torch_twin(case, monkeypatch):
  pytest.importorskip("triton")
  from jaxfuse.testing import triton_interpreter

  args = case.inputs()
  with triton_interpreter.triton_ops(monkeypatch) as launches:
    outs, grads = jax_values_and_grads(case, args, "triton")
  assert launches, f"{case.id}: no Triton kernel ran"
  _assert_matches_twin(case, args, outs, grads, "triton")
