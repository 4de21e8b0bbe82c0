"""Fused linear cross-entropy: ``loss = cross_entropy(h @ W.T, labels)``, forward + backward.

Cases are named ``N=<tokens> D=<hidden> V=<vocabulary>``; every row times one jit-compiled
forward + backward (loss, dh, dW) and reports the bytes its backward keeps alive:

- ``jax-unfused``: plain JAX with the full ``[N, V]`` logits (optax's integer-label
  cross-entropy). The timing baseline.
- ``jaxfuse-xla``: :func:`jaxfuse.ops.linear_cross_entropy`, chunked XLA path, logits
  recomputed in the backward (the default).
- ``jaxfuse-xla[grad_in_forward]``: the same op computing the gradients in the forward
  (Liger-Kernel's way): one matmul fewer, the gradients kept as residuals.
- ``jaxfuse-pallas``: the Pallas kernels. Timed on GPUs only; on CPU its errors come from an
  interpret-mode run at a small shape and its bytes moved from the kernels' block specs.
- ``tokamax-xla``: ``tokamax.linear_softmax_cross_entropy_loss(implementation="xla")``; in
  tokamax 0.0.12 that path keeps its gradients as residuals, like ``grad_in_forward`` (its
  chunked kernel is TPU-only).
- ``torch-eager`` (the error reference) and ``torch-compile``:
  ``F.cross_entropy(h @ W.T, labels)``.

Errors are max absolute differences against torch-eager in float32 (loss; dh and dW). The note
of each jaxfuse row gives its time relative to torch-eager and the largest gradient error in
units of the float32 test tolerance ``1e-5 + 1e-5 * |torch|`` (<= 1 passes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from benchmarks.records import Record, set_ratios
from jaxfuse import metrics
from jaxfuse.ops import dispatch, linear_cross_entropy

SUITE = "xent"
REFERENCE = "torch-eager"
BASELINE = "jax-unfused"
# The acceptance case: in quick mode too.
MAIN_CASE = (8192, 1024, 32000)
# Pallas' interpret mode on CPU checks errors at this shape (N, D, V).
INTERPRET_SHAPE = (64, 64, 1000)


def _cases(ctx):
  if ctx.quick:
    return [(1024, 256, 32000, True), (*MAIN_CASE, False)]
  cases = [(1024, 1024, 32000, True), (*MAIN_CASE, True), (16384, 1024, 32000, True),
           (4096, 1024, 128256, True)]
  if ctx.platform == "gpu":
    cases.append((16384, 2048, 128256, True))
  return cases


def _inputs(n, d, v, seed=0):
  kh, kw, ky = jax.random.split(jax.random.key(seed), 3)
  h = jax.random.normal(kh, (n, d), jnp.float32)
  w = jax.random.normal(kw, (v, d), jnp.float32) / np.sqrt(d)
  y = jax.random.randint(ky, (n,), 0, v)
  return h, w, y


def _plain(h, w, y):
  import optax

  logits = jnp.dot(h, w.T, precision=jax.lax.Precision.HIGHEST)
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def _step(loss_fn):
  """jit(value_and_grad) over (h, w)."""
  return jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))


def _flat(out):
  loss, (dh, dw) = out
  return [loss], [dh, dw]


def _torch_setup(h, w, y, device):
  import torch

  th = torch.from_numpy(np.array(h)).to(device)
  tw = torch.from_numpy(np.array(w)).to(device)
  ty = torch.from_numpy(np.array(y)).long().to(device)
  return th, tw, ty


def _torch_loss(h, w, y):
  import torch.nn.functional as F

  return F.cross_entropy(h @ w.T, y)


def _torch_step(loss_fn, th, tw, ty):
  h = th.detach().requires_grad_()
  w = tw.detach().requires_grad_()
  loss = loss_fn(h, w, ty)
  loss.backward()
  return [loss], [h.grad, w.grad]


def _tolerance_units(got, want):
  """Largest |got - want| / (1e-5 + 1e-5 |want|) over all gradient entries."""
  worst = 0.0
  for g, w in zip(got, want):
    g, w = harness.to_numpy(g), harness.to_numpy(w)
    worst = max(worst, float(np.max(np.abs(g - w) / (1e-5 + 1e-5 * np.abs(w)))))
  return worst


def _tokamax_step():
  tokamax = harness.tokamax()
  if tokamax is None:
    return None

  def loss_fn(h, w_t, y):
    # tokamax 0.0.12 rejects a precision argument; float32 on CPU is full precision anyway.
    return tokamax.linear_softmax_cross_entropy_loss(h, y, w_t, reduction="mean",
                                                     implementation="xla")

  return loss_fn


def _pallas_small_errors():
  """Errors of the Pallas kernels against torch at a small shape, in interpret mode on CPU."""
  import torch

  n, d, v = INTERPRET_SHAPE
  h, w, y = _inputs(n, d, v, seed=1)
  with dispatch.pallas_interpret():
    got = _flat(_step(lambda h, w: linear_cross_entropy(h, w, y, implementation="pallas"))(h, w))
  want = _torch_step(_torch_loss, *_torch_setup(h, w, y, "cpu"))
  del torch
  return (harness.max_abs_err(got[0], want[0]), harness.max_abs_err(got[1], want[1]),
          _tolerance_units(got[1], want[1]))


def _case(ctx, n, d, v, with_peers) -> list[Record]:
  import torch

  case = f"N={n} D={d} V={v}"
  ctx.step(case)
  h, w, y = _inputs(n, d, v)
  device = "cuda" if ctx.platform == "gpu" and torch.cuda.is_available() else "cpu"
  th, tw, ty = _torch_setup(h, w, y, device)

  steps = {
      BASELINE: (_step(lambda h, w: _plain(h, w, y)), (h, w)),
      "jaxfuse-xla": (_step(lambda h, w: linear_cross_entropy(h, w, y, implementation="xla")),
                      (h, w)),
      "jaxfuse-xla[grad_in_forward]": (_step(lambda h, w: linear_cross_entropy(
          h, w, y, implementation="xla", grad_in_forward=True)), (h, w)),
  }
  if ctx.native("pallas"):
    steps["jaxfuse-pallas"] = (_step(lambda h, w: linear_cross_entropy(
        h, w, y, implementation="pallas")), (h, w))
  tokamax_loss = _tokamax_step() if with_peers else None
  w_t = None
  if tokamax_loss is not None:
    w_t = jnp.asarray(w.T)
    steps["tokamax-xla"] = (_step(lambda h, w_t: tokamax_loss(h, w_t, y)), (h, w_t))

  # One call each (compiles and warms up), kept for the errors.
  outputs, notes = {}, {}
  for name, (fn, args) in list(steps.items()):
    try:
      outputs[name] = _flat(jax.block_until_ready(fn(*args)))
    except Exception as e:  # noqa: BLE001 - a peer that cannot run here gets a note, no time.
      notes[name] = f"did not run: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
      del steps[name]
  if "tokamax-xla" in outputs:
    loss, (dh, dw_t) = outputs["tokamax-xla"][0], outputs["tokamax-xla"][1]
    outputs["tokamax-xla"] = [loss, [dh, jnp.asarray(dw_t).T]]
    notes["tokamax-xla"] = ("tokamax 0.0.12's XLA path: gradients computed in the forward "
                            "and kept; its chunked kernel is TPU-only")
  outputs["torch-eager"] = _torch_step(_torch_loss, th, tw, ty)
  candidates = {name: functools.partial(fn, *args) for name, (fn, args) in steps.items()}
  candidates["torch-eager"] = lambda: _torch_step(_torch_loss, th, tw, ty)
  if with_peers:
    compiled = torch.compile(_torch_loss)
    try:
      outputs["torch-compile"] = _torch_step(compiled, th, tw, ty)
      candidates["torch-compile"] = lambda: _torch_step(compiled, th, tw, ty)
    except Exception as e:  # noqa: BLE001 - no compiler here: note it.
      notes["torch-compile"] = f"did not run: {type(e).__name__}"
  # The first calls above were the warm-up.
  times = ctx.time(candidates, warmup=0)

  # What the backward keeps: traced for JAX; saved_tensors_hooks for torch eager.
  residual = {
      BASELINE: metrics.residual_bytes(lambda h, w: _plain(h, w, y), h, w),
      "jaxfuse-xla": metrics.residual_bytes(
          lambda h, w: linear_cross_entropy(h, w, y, implementation="xla"), h, w),
      "jaxfuse-xla[grad_in_forward]": metrics.residual_bytes(
          lambda h, w: linear_cross_entropy(h, w, y, grad_in_forward=True), h, w),
  }
  with dispatch.pallas_interpret(not ctx.native("pallas")):
    pallas_fn = lambda h, w: linear_cross_entropy(h, w, y, implementation="pallas")  # noqa
    residual["jaxfuse-pallas"] = metrics.residual_bytes(pallas_fn, h, w)
    pallas_bytes = metrics.bytes_moved(jax.value_and_grad(pallas_fn, argnums=(0, 1)), h, w)
  if tokamax_loss is not None and "tokamax-xla" in outputs:
    residual["tokamax-xla"] = metrics.residual_bytes(lambda h, w_t: tokamax_loss(h, w_t, y),
                                                     h, w_t)
  th_, tw_ = th.detach().requires_grad_(), tw.detach().requires_grad_()
  residual["torch-eager"] = metrics.torch_residual_bytes(lambda: _torch_loss(th_, tw_, ty),
                                                         exclude=[th_, tw_, ty])
  if "torch-compile" in outputs:
    notes.setdefault("torch-compile", "residual bytes: saved_tensors_hooks do not see "
                     "compiled graphs")

  if not ctx.native("pallas"):
    err, grad_err, units = _pallas_small_errors()
    pallas_errors = (err, grad_err)
    notes["jaxfuse-pallas"] = (f"CPU: no time (needs a GPU); errors from interpret mode at "
                               f"N={INTERPRET_SHAPE[0]} D={INTERPRET_SHAPE[1]} "
                               f"V={INTERPRET_SHAPE[2]} (grad err {units:.2f} x fp32 tol); "
                               f"bytes moved from the block specs")
  else:
    pallas_errors = None

  peaks = _peaks(steps, th, tw, ty) if ctx.platform == "gpu" else {}
  reference = outputs["torch-eager"]
  torch_ms = (times.get("torch-eager") or {}).get("median")
  records = []
  order = [BASELINE, "jaxfuse-xla", "jaxfuse-xla[grad_in_forward]", "jaxfuse-pallas",
           "tokamax-xla", "torch-eager", "torch-compile"]
  for name in order:
    if name == "tokamax-xla" and not with_peers:
      continue
    if name == "torch-compile" and not with_peers:
      continue
    out = outputs.get(name)
    err = grad_err = None
    note = notes.get(name)
    if name == "jaxfuse-pallas" and pallas_errors is not None:
      err, grad_err = pallas_errors
    elif out is not None and name != "torch-eager":
      err = harness.max_abs_err(out[0], reference[0])
      grad_err = harness.max_abs_err(out[1], reference[1])
      if name.startswith("jaxfuse"):
        units = _tolerance_units(out[1], reference[1])
        extra = f"grad err {units:.2f} x fp32 tol"
        if times.get(name) and torch_ms:
          extra = f"time / torch-eager = {times[name]['median'] / torch_ms:.2f}; " + extra
        note = f"{note}; {extra}" if note else extra
    if name == "tokamax-xla" and out is None and note is None:
      note = "tokamax is not installed"
    records.append(Record(
        SUITE, case, name, ctx.platform, "float32", time_ms=times.get(name),
        residual_bytes=residual.get(name) if (out is not None or name == "jaxfuse-pallas")
        else None,
        bytes_moved=pallas_bytes if name == "jaxfuse-pallas" else None,
        flops=6 * n * d * v, peak_bytes=peaks.get(name),
        max_abs_err=err, max_grad_err=grad_err,
        reference=REFERENCE if (err is not None) else None, note=note))
  set_ratios(records, BASELINE)
  return records


def _peaks(steps, th, tw, ty):
  """GPU only: XLA's compiled footprint (arguments + outputs + temporaries) for JAX rows, and
  torch's peak allocation for torch-eager."""
  import torch

  peaks = {}
  for name, (fn, args) in steps.items():
    stats = metrics.compiled_memory(fn, *args)
    peaks[name] = stats["argument_bytes"] + stats["output_bytes"] + stats["temp_bytes"]
  if torch.cuda.is_available():
    torch.cuda.reset_peak_memory_stats()
    _torch_step(_torch_loss, th, tw, ty)
    peaks["torch-eager"] = int(torch.cuda.max_memory_allocated())
  return peaks


def run(ctx) -> list[Record]:
  records = []
  for n, d, v, with_peers in _cases(ctx):
    records += _case(ctx, n, d, v, with_peers)
  return records
