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
import numpy as np
import pytest

import jaxfuse
from jaxfuse import ops
from jaxfuse.kernels.pallas import normalization as pallas_norm
from jaxfuse.ops import base
from jaxfuse.testing import triton_interpreter as interp
from tests import helpers

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


def _normal(seed, shape, dtype=jnp.float32):
  return helpers.normal(seed, shape, dtype)


def _labels(n, v):
  return jnp.asarray(np.random.default_rng(9).integers(0, v, (n,)), jnp.int32)


# op name -> [(label, impl -> (f, args))]: f of the differentiable args returns arrays.
CALLS = {
    "add_act": [("gelu", lambda impl: (
        lambda a, b: ops.add_act(a, b, "gelu", implementation=impl),
        (_normal(0, (5, 7)), _normal(1, (5, 7)))))],
    "add_act_unfused": [("silu", lambda impl: (
        lambda a, b: ops.add_act_unfused(a, b, "silu", implementation=impl),
        (_normal(0, (5, 7)), _normal(1, (5, 7)))))],
    "relu": [("", lambda impl: (
        lambda x: ops.relu(x, implementation=impl), (_normal(0, (5, 7)),)))],
    "bias_act": [("gelu", lambda impl: (
        lambda x, b: ops.bias_act(x, b, "gelu", implementation=impl),
        (_normal(0, (5, 7)), _normal(1, (7,)))))],
    "glu": [("separate", lambda impl: (
        lambda a, b: ops.glu(a, b, "silu", implementation=impl),
        (_normal(0, (5, 7)), _normal(1, (5, 7))))),
            ("packed", lambda impl: (
                lambda x: ops.glu(x, "silu", implementation=impl), (_normal(0, (5, 14)),)))],
    "softmax": [("", lambda impl: (
        lambda x: ops.softmax(x, implementation=impl), (_normal(0, (5, 7)),)))],
    "layer_norm": [("", lambda impl: (
        lambda x, s, b: ops.layer_norm(x, s, b, implementation=impl),
        (_normal(0, (5, 7)), _normal(1, (7,)), _normal(2, (7,)))))],
    "rms_norm": [("", lambda impl: (
        lambda x, s: ops.rms_norm(x, s, implementation=impl),
        (_normal(0, (5, 7)), _normal(1, (7,)))))],
    "add_layer_norm": [("", lambda impl: (
        lambda x, r, s, b: ops.add_layer_norm(x, r, s, b, implementation=impl),
        (_normal(0, (5, 7)), _normal(3, (5, 7)), _normal(1, (7,)), _normal(2, (7,)))))],
    "add_rms_norm": [("", lambda impl: (
        lambda x, r, s: ops.add_rms_norm(x, r, s, implementation=impl),
        (_normal(0, (5, 7)), _normal(3, (5, 7)), _normal(1, (7,)))))],
    "add_rms_norm_unfused": [("", lambda impl: (
        lambda x, r, s: ops.add_rms_norm_unfused(x, r, s, implementation=impl),
        (_normal(0, (5, 7)), _normal(3, (5, 7)), _normal(1, (7,)))))],
    "recompute_linear": [("", lambda impl: (
        lambda x, w, b: ops.recompute_linear(x, w, b, implementation=impl),
        (_normal(0, (5, 7)), _normal(1, (3, 7)), _normal(2, (3,)))))],
    "linear_cross_entropy": [("", lambda impl: (
        lambda h, w: ops.linear_cross_entropy(h, w, _labels(6, 50), implementation=impl),
        (_normal(0, (6, 8)), _normal(1, (50, 8)))))],
    "attention": [("causal", lambda impl: (
        lambda q, k, v: ops.attention(q, k, v, causal=True, implementation=impl),
        (_normal(0, (1, 9, 2, 16)), _normal(1, (1, 9, 1, 16)), _normal(2, (1, 9, 1, 16)))))],
}
WITH_KERNELS = sorted(name for name, op in DECLARED.items()
                      if set(KERNELS) & set(op.implementations))
CASES = [(name, label, make) for name in WITH_KERNELS for label, make in CALLS.get(name, [])]


def test_every_op_with_a_kernel_has_a_representative_call():
  assert sorted(CALLS) == WITH_KERNELS


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
Q = jnp.ones((2, 8, 4, 16))
KV = jnp.ones((2, 8, 2, 16))
H, W, Y = jnp.ones((4, 8)), jnp.ones((10, 8)), jnp.array([0, 1, 2, 3])
Y_OUTSIDE = jnp.array([0, 1, 10, 3])  # concrete: labels are checked only where they are
F32, BF16, I32 = jnp.float32, jnp.bfloat16, jnp.int32

# (label, call(impl)): each raises with every implementation, before any kernel runs.
BAD_CALLS = [
    ("add_act shapes", lambda i: ops.add_act(X, jnp.ones((4, 1)), implementation=i)),
    ("add_act int", lambda i: ops.add_act(X.astype(I32), X.astype(I32), implementation=i)),
    ("add_act dtypes", lambda i: ops.add_act(X, X.astype(BF16), implementation=i)),
    ("add_act name", lambda i: ops.add_act(X, X, "geluu", implementation=i)),
    ("add_act_unfused shapes", lambda i: ops.add_act_unfused(X, X[:1, :3], implementation=i)),
    ("add_act_unfused name", lambda i: ops.add_act_unfused(X, X, "swish", implementation=i)),
    ("relu int", lambda i: ops.relu(X.astype(I32), implementation=i)),
    ("bias_act size", lambda i: ops.bias_act(X, jnp.ones(7), implementation=i)),
    ("bias_act rank", lambda i: ops.bias_act(X, jnp.ones((1, 8)), implementation=i)),
    ("bias_act dtypes", lambda i: ops.bias_act(X, S.astype(BF16), implementation=i)),
    ("bias_act name", lambda i: ops.bias_act(X, S, "swish", implementation=i)),
    ("glu shapes", lambda i: ops.glu(X, jnp.ones((4, 1)), implementation=i)),
    ("glu dtypes", lambda i: ops.glu(X, X.astype(jnp.float16), implementation=i)),
    ("glu odd packed", lambda i: ops.glu(jnp.ones((4, 5)), "silu", implementation=i)),
    ("glu int", lambda i: ops.glu(X.astype(I32), implementation=i)),
    ("glu name", lambda i: ops.glu(X, X, "swish", implementation=i)),
    ("softmax int", lambda i: ops.softmax(X.astype(I32), implementation=i)),
    ("softmax axis", lambda i: ops.softmax(X, axis=2, implementation=i)),
    ("softmax axis type", lambda i: ops.softmax(X, axis=1.0, implementation=i)),
    ("softmax scale", lambda i: ops.softmax(X, scale=jnp.ones(()), implementation=i)),
    ("softmax mask dtype", lambda i: ops.softmax(X, mask=X, implementation=i)),
    ("softmax mask shape", lambda i: ops.softmax(X, mask=jnp.ones((3, 8), bool),
                                                 implementation=i)),
    ("rms_norm int", lambda i: ops.rms_norm(X.astype(I32), S, implementation=i)),
    ("layer_norm rank 0", lambda i: ops.layer_norm(jnp.float32(1.0), implementation=i)),
    ("rms_norm scale size", lambda i: ops.rms_norm(X, jnp.ones(7), implementation=i)),
    ("layer_norm bias rank", lambda i: ops.layer_norm(X, S, jnp.ones((1, 8)),
                                                      implementation=i)),
    ("layer_norm scale int", lambda i: ops.layer_norm(X, S.astype(I32), implementation=i)),
    ("add_rms_norm shapes", lambda i: ops.add_rms_norm(X, X[:1], S, implementation=i)),
    ("add_layer_norm dtypes", lambda i: ops.add_layer_norm(X, X.astype(BF16), S,
                                                           implementation=i)),
    ("rms_norm eps", lambda i: ops.rms_norm(X, S, eps=-1, implementation=i)),
    ("add_rms_norm_unfused shapes", lambda i: ops.add_rms_norm_unfused(X, X[:1], S,
                                                                       implementation=i)),
    ("recompute_linear x size", lambda i: ops.recompute_linear(
        jnp.ones((4, 6)), jnp.ones((3, 5)), jnp.ones(3), implementation=i)),
    ("recompute_linear bias size", lambda i: ops.recompute_linear(
        jnp.ones((4, 5)), jnp.ones((3, 5)), jnp.ones(4), implementation=i)),
    ("recompute_linear weight rank", lambda i: ops.recompute_linear(
        jnp.ones((4, 5)), jnp.ones((3, 5, 1)), jnp.ones(3), implementation=i)),
    ("recompute_linear dtypes", lambda i: ops.recompute_linear(
        jnp.ones((4, 5)), jnp.ones((3, 5), BF16), jnp.ones(3), implementation=i)),
    ("xent weight size", lambda i: ops.linear_cross_entropy(H, W[:, :7], Y, implementation=i)),
    ("xent weight rank", lambda i: ops.linear_cross_entropy(H, W[None], Y, implementation=i)),
    ("xent labels shape", lambda i: ops.linear_cross_entropy(H, W, Y[:, None],
                                                             implementation=i)),
    ("xent labels dtype", lambda i: ops.linear_cross_entropy(H, W, Y.astype(F32),
                                                             implementation=i)),
    ("xent dtypes", lambda i: ops.linear_cross_entropy(H, W.astype(BF16), Y, implementation=i)),
    ("xent bias", lambda i: ops.linear_cross_entropy(H, W, Y, bias=jnp.ones(9),
                                                     implementation=i)),
    ("xent labels range", lambda i: ops.linear_cross_entropy(H, W, Y_OUTSIDE,
                                                             implementation=i)),
    ("xent empty vocabulary", lambda i: ops.linear_cross_entropy(H, W[:0], Y,
                                                                 implementation=i)),
    ("xent reduction", lambda i: ops.linear_cross_entropy(H, W, Y, reduction="avg",
                                                          implementation=i)),
    ("xent smoothing", lambda i: ops.linear_cross_entropy(H, W, Y, label_smoothing=1.5,
                                                          implementation=i)),
    ("xent z_loss", lambda i: ops.linear_cross_entropy(H, W, Y, z_loss=-1.0, implementation=i)),
    ("xent softcap", lambda i: ops.linear_cross_entropy(H, W, Y, logit_softcap=0.0,
                                                        implementation=i)),
    ("xent chunk", lambda i: ops.linear_cross_entropy(H, W, Y, chunk_size=0, implementation=i)),
    ("attention rank", lambda i: ops.attention(Q[0], KV, KV, implementation=i)),
    ("attention int", lambda i: ops.attention(Q, KV.astype(I32), KV, implementation=i)),
    ("attention dtypes", lambda i: ops.attention(Q, KV.astype(BF16), KV.astype(BF16),
                                                 implementation=i)),
    ("attention k v shapes", lambda i: ops.attention(Q, KV, KV[:, :4], implementation=i)),
    ("attention kv heads", lambda i: ops.attention(Q, jnp.ones((2, 8, 3, 16)),
                                                   jnp.ones((2, 8, 3, 16)), implementation=i)),
    ("attention head dim", lambda i: ops.attention(Q, jnp.ones((2, 8, 2, 8)),
                                                   jnp.ones((2, 8, 2, 8)), implementation=i)),
    ("attention batch", lambda i: ops.attention(Q, KV[:1], KV[:1], implementation=i)),
    ("attention segments", lambda i: ops.attention(
        Q, KV, KV, segment_ids=jnp.zeros((2, 7), I32), implementation=i)),
    ("attention kv_lengths", lambda i: ops.attention(
        Q, KV, KV, kv_lengths=jnp.array([1.0, 2.0]), implementation=i)),
    ("attention bias", lambda i: ops.attention(Q, KV, KV, bias=jnp.zeros((2, 3, 8, 8)),
                                               implementation=i)),
    ("attention scale", lambda i: ops.attention(Q, KV, KV, scale="big", implementation=i)),
    ("attention causal", lambda i: ops.attention(Q, KV, KV, causal="left", implementation=i)),
    ("attention window", lambda i: ops.attention(Q, KV, KV, sliding_window=3,
                                                 implementation=i)),
    ("attention softcap", lambda i: ops.attention(Q, KV, KV, logit_softcap=0.0,
                                                  implementation=i)),
]


def _error(call, impl, monkeypatch) -> tuple[type, str]:
  with _kernels(impl, monkeypatch):
    try:
      jax.eval_shape(lambda: call(impl))
    except Exception as e:  # noqa: BLE001 - the error is what is compared
      return type(e), str(e)
  return type(None), f"implementation={impl!r} raised nothing"


@pytest.mark.parametrize("label,call", BAD_CALLS, ids=[label for label, _ in BAD_CALLS])
def test_bad_arguments_raise_the_same_error_on_every_implementation(label, call, monkeypatch):
  errors = {impl: _error(call, impl, monkeypatch) for impl in (*KERNELS, "xla")}
  assert errors["xla"][0] is not type(None), f"{label}: the call raised nothing"
  assert errors["pallas"] == errors["xla"], label
  assert errors["triton"] == errors["xla"], label


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
