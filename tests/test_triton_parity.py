"""Every op with a Pallas kernel has a jax-triton kernel too, and both behave the same in public.

- The declarations: every :class:`jaxfuse.ops.base.Op` in ``jaxfuse.ops`` that lists
  ``"pallas"`` lists ``"triton"``, and each implementation an op claims really launches its
  kernels, forward and backward (an op that claims a kernel it does not have is caught here).
- The argument checks: bad shapes, dtypes and options raise the same error, type and message,
  with ``implementation="pallas"`` and ``"triton"`` (and ``"xla"``), and the options only one
  kernel set takes are said so by name.

Nothing runs: the calls are traced (``jax.make_jaxpr``, ``jax.eval_shape``), Pallas in interpret
mode and Triton through the stand-in ``jax_triton`` of
:mod:`jaxfuse.testing.triton_interpreter`, which records the launches. No GPU is needed.
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
import re

import jax
import jax.numpy as jnp
import pytest

import jaxfuse
from jaxfuse import ops
from jaxfuse.kernels.pallas import normalization as pallas_norm
from jaxfuse.ops import base
from jaxfuse.testing import triton_interpreter as interp
from tests import cases, helpers

pytest.importorskip("triton")

KERNELS = ("pallas", "triton")


def _declared_ops() -> dict[str, base.Op]:
  """Every ``base.Op`` a module of ``jaxfuse.ops`` declares, by name."""
  found: dict[str, base.Op] = {}
  for info in pkgutil.walk_packages(ops.__path__, prefix="jaxfuse.ops."):
    module = importlib.import_module(info.name)
    for value in vars(module).values():
      if isinstance(value, base.Op):
        found[value.name] = value
  return found


DECLARED = _declared_ops()


def test_the_walk_finds_the_ops():
  assert {"add_act", "rms_norm", "attention", "linear_cross_entropy", "dense"} <= set(DECLARED)


def test_every_op_with_a_pallas_kernel_has_a_triton_kernel():
  missing = sorted(name for name, op in DECLARED.items()
                   if "pallas" in op.implementations and "triton" not in op.implementations)
  assert not missing, f"ops with a Pallas kernel and no Triton kernel: {missing}"


def _reachable(order) -> tuple[str, ...]:
  """The part of a GPU order ``implementation=None`` can reach: up to XLA, which always runs."""
  order = tuple(order)
  return order[:order.index("xla") + 1] if "xla" in order else order


def test_the_triton_kernels_take_pallas_place_where_pallas_triton_is_deprecated(monkeypatch):
  """Where jax has deprecated Pallas' Triton backend, ``implementation=None`` on a GPU tries
  the Triton kernels exactly where it would have tried Pallas'."""
  from jaxfuse.ops import dispatch

  for name, op in DECLARED.items():
    if "pallas" not in op.implementations:
      continue
    monkeypatch.setattr(dispatch, "pallas_triton_current", lambda: True)
    current = op.preference["gpu"]
    monkeypatch.setattr(dispatch, "pallas_triton_current", lambda: False)
    deprecated = op.preference["gpu"]
    swapped = tuple("triton" if i == "pallas" else i for i in current if i != "triton")
    assert _reachable(deprecated) == _reachable(swapped), (name, current, deprecated)


# Representative calls ---------------------------------------------------------------------------


# Each op's first case of the table (tests/cases) that runs on the kernels: (f, args) of impl.
FIRST = {}
for _case in cases.CASES:
  if _case.runs_on("pallas") and _case.op not in FIRST:
    FIRST[_case.op] = _case
WITH_KERNELS = sorted(name for name, op in DECLARED.items()
                      if set(KERNELS) & set(op.implementations))
CASES = [(name, FIRST[name].label, lambda impl, c=FIRST.get(name): c.bind(c.inputs(), impl))
         for name in WITH_KERNELS if name in FIRST]


def test_every_op_with_a_kernel_has_a_representative_call():
  assert sorted(FIRST) == WITH_KERNELS


@contextlib.contextmanager
def _kernels(impl, monkeypatch):
  """Lets ``impl`` trace here (Pallas in interpret mode on CPU; Triton as on a GPU with
  jax-triton); yields the Triton launches, recorded and never run, whichever ``impl``."""
  if impl == "triton":
    with interp.triton_ops(monkeypatch, run=False) as launches:
      yield launches
  else:
    with jaxfuse.pallas_interpret(not helpers.ON_GPU), interp.jax_triton_stand_in(
        run=False) as launches:
      yield launches


def _loss(f):
  def loss(*args):
    leaves = jax.tree_util.tree_leaves(f(*args))
    return sum(jnp.sum(x.astype(jnp.float32)) for x in leaves)
  return loss


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("name,label,make", CASES, ids=[f"{n}-{lab}" if lab else n
                                                         for n, lab, _ in CASES])
def test_a_claimed_kernel_is_launched_forward_and_backward(name, label, make, impl,
                                                           monkeypatch):
  """``implementation=impl`` launches impl's kernels (and no other kernel set's) in the forward
  pass, and more of them when differentiated: no silent fallback, no kernel-less claim."""
  del label
  if impl not in DECLARED[name].implementations:
    pytest.skip(f"{name} has no {impl} implementation")
  f, args = make(impl)
  with _kernels(impl, monkeypatch) as launches:
    forward = jax.make_jaxpr(f)(*args)
    n_forward = len(launches)
    both = jax.make_jaxpr(jax.value_and_grad(_loss(f), argnums=tuple(range(len(args)))))(*args)
    n_both = len(launches) - n_forward
  counts = {"pallas": (_count(forward, "pallas_call"), _count(both, "pallas_call")),
            "triton": (n_forward, n_both)}
  other = "triton" if impl == "pallas" else "pallas"
  assert counts[other] == (0, 0), f"{name}: implementation={impl!r} launched {other} kernels"
  n_fwd, n_grad = counts[impl]
  assert n_fwd >= 1, f"{name}: implementation={impl!r} launches no kernel in the forward pass"
  assert n_grad > n_fwd, f"{name}: implementation={impl!r} launches no backward kernel"


def _count(closed, primitive: str) -> int:
  """Equations of ``primitive`` in a closed jaxpr, those of nested jaxprs (custom_vjp, pjit,
  cond, ...) included."""
  def walk(jaxpr):
    total = 0
    for eqn in jaxpr.eqns:
      total += eqn.primitive.name == primitive
      for param in eqn.params.values():
        for sub in param if isinstance(param, (list, tuple)) else (param,):
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns"):
            total += walk(inner)
    return total
  return walk(closed.jaxpr)


# The same argument checks -----------------------------------------------------------------------


X = jnp.ones((4, 8))
S = jnp.ones(8)
H, W, Y = jnp.ones((4, 8)), jnp.ones((10, 8)), jnp.array([0, 1, 2, 3])


def _error(call, impl, monkeypatch) -> tuple[type, str]:
  with _kernels(impl, monkeypatch):
    try:
      jax.eval_shape(lambda: call(impl))
    except Exception as e:  # noqa: BLE001 - the error is what is compared
      return type(e), str(e)
  return type(None), f"implementation={impl!r} raised nothing"


@pytest.mark.parametrize("bad", cases.BAD, ids=[b.id for b in cases.BAD])
def test_bad_arguments_raise_the_same_error_on_every_implementation(bad, monkeypatch):
  """Each bad argument of the op tables raises its error, the same type and message, with
  every implementation the op has (and before any kernel runs)."""
  implementations = base.REGISTRY[bad.op].implementations
  errors = {impl: _error(bad.call, impl, monkeypatch) for impl in implementations}
  kind, message = errors["xla"]
  assert kind is bad.error, f"{bad.id}: {kind.__name__}: {message}"
  assert re.search(bad.match, message), f"{bad.id}: {message!r} does not match {bad.match!r}"
  for impl in implementations:
    assert errors[impl] == errors["xla"], (bad.id, impl)


def _same_but_the_name(errors) -> set[tuple[type, str]]:
  return {(kind, message.replace(f"'{impl}'", "'<kernels>'"))
          for impl, (kind, message) in errors.items()}


def test_kernel_only_errors_differ_only_in_the_implementation_named(monkeypatch):
  """Arguments only the XLA path takes raise the same error on both kernel sets."""
  calls = {
      "grad_in_forward": lambda i: ops.linear_cross_entropy(H, W, Y, grad_in_forward=True,
                                                            implementation=i),
      "head dim 512": lambda i: ops.attention(*(jnp.ones((1, 8, 1, 512)),) * 3,
                                              implementation=i),
  }
  for label, call in calls.items():
    errors = {impl: _error(call, impl, monkeypatch) for impl in KERNELS}
    assert len(_same_but_the_name(errors)) == 1, (label, errors)
    assert type(None) not in {kind for kind, _ in errors.values()}, (label, errors)
    assert _error(call, "xla", monkeypatch)[0] is type(None), label


@pytest.mark.parametrize("call", [
    lambda i: ops.add_act(X, X, jnp.tanh, implementation=i),
    lambda i: ops.add_act_unfused(X, X, jnp.tanh, implementation=i),
    lambda i: ops.bias_act(X, S, jnp.tanh, implementation=i),
    lambda i: ops.glu(X, X, jnp.tanh, implementation=i),
], ids=["add_act", "add_act_unfused", "bias_act", "glu"])
def test_the_triton_kernels_take_named_activations_only(call, monkeypatch):
  """The one documented difference: Pallas traces any jnp activation into its kernel; Triton's
  kernels are written per activation, and a callable is refused by name."""
  kind, message = _error(call, "triton", monkeypatch)
  assert kind is ValueError
  assert re.search(r"implementation='triton' supports the named activations .*got "
                   r"activation=<", message), message
  assert _error(call, "pallas", monkeypatch)[0] is type(None)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm",
                                "add_rms_norm_unfused"])
def test_the_norm_kernels_each_name_their_hidden_size_limit(op, monkeypatch):
  """Each kernel set holds a row in one block up to its own limit, and says so by name."""
  from jaxfuse.kernels.triton import normalization as triton_norm

  hidden = max(pallas_norm.MAX_HIDDEN, triton_norm.MAX_HIDDEN) + 1
  x = jax.ShapeDtypeStruct((2, hidden), jnp.float32)
  f = getattr(ops, op)
  args = (x, x) if op.startswith("add_") else (x,)
  for impl in KERNELS:
    with _kernels(impl, monkeypatch), pytest.raises(
        ValueError, match=rf"^{op}: implementation='{impl}' takes a hidden size \(x.shape\[-1\]"
                          rf"\) of at most"):
      jax.eval_shape(lambda *a, impl=impl: f(*a, implementation=impl), *args)
