"""The ops on the LM head: fused linear cross-entropy, ``loss = cross_entropy(h @ W.T,
labels)``, and per-token log-probabilities with entropies, forward + backward.

Cases are named ``N=<tokens> D=<hidden> V=<vocabulary>``; every row times one jit-compiled
forward + backward (loss, dh, dW) and reports the bytes its backward keeps alive:

- ``jax-unfused``: plain JAX with the full ``[N, V]`` logits (optax's integer-label
  cross-entropy). The timing baseline.
- ``jaxfuse-xla``: :func:`jaxfuse.ops.linear_cross_entropy`, chunked XLA path, logits
  recomputed in the backward (the default).
- ``jaxfuse-xla[grad_in_forward]``: the same op computing the gradients in the forward
  (Liger-Kernel's way): one matmul fewer, the gradients kept as residuals.
- ``jaxfuse-pallas``: the Pallas kernels. Timed on GPUs only; on CPU its errors come from an
  interpret-mode run at a small shape; its bytes moved are counted by
  ``jaxfuse.metrics.bytes_moved`` at the full shape.
- ``jaxfuse-triton``: the jax-triton kernels. Timed on GPUs only; on CPU the op runs with its
  kernels in Triton's interpreter (``benchmarks/triton_interpreted.py``) at the small shape
  ``INTERPRET_SHAPE``, for its errors and its ``bytes_moved`` (counted there: the interpreter
  would take minutes at a case's shape), and its residuals are traced at the case's shape
  through a stand-in jax-triton.
- ``tokamax-xla``: ``tokamax.linear_softmax_cross_entropy_loss(implementation="xla")``; in
  tokamax 0.0.12 that path keeps its gradients as residuals, like ``grad_in_forward`` (its
  chunked kernel is TPU-only). It takes no precision argument (it raises on one): its step is
  traced and run under ``jax.default_matmul_precision("highest")``, so that its matmuls run at
  the float32 HIGHEST precision every other row's do.
- ``torch-eager`` (the error reference) and ``torch-compile``:
  ``F.cross_entropy(h @ W.T, labels)``.

Cases named ``log_probs+entropy N=... D=... V=...`` time
:func:`jaxfuse.ops.linear_log_probs` with ``temperature=0.9`` and ``return_entropy=True``, in the
step of a policy-gradient loss with an entropy bonus (``-(sum(log p) + 0.01 sum(H)) / N``):
``jax-unfused`` is :func:`jaxfuse.ops.linear_log_probs_reference` (full logits),
``torch-eager`` and ``torch-compile`` are TRL's ``selective_log_softmax`` and
``entropy_from_logits`` on the full logits (the installed TRL's functions, as its trainers
compute them), and the kernel rows as above.

Errors are max absolute differences against torch-eager in float32 (loss; dh and dW). The note
of each jaxfuse row gives its time relative to torch-eager and the largest gradient error in
units of the float32 test tolerance ``1e-5 + 1e-5 * |torch|`` (<= 1 passes). JAX rows also
carry XLA's cost analysis (``xla_bytes_accessed``) and compiled temp memory (``temp_bytes``) of
their step; each record's ``sources`` says how each of its figures was produced.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from benchmarks import records as rec
from benchmarks import triton_interpreted
from benchmarks.records import Record
from jaxfuse import metrics
from jaxfuse.ops import (dispatch, linear_cross_entropy, linear_log_probs,
                         linear_log_probs_reference)

SUITE = "xent"
REFERENCE = "torch-eager"
BASELINE = "jax-unfused"
# The XLA implementation computing the gradients in the forward.
GRAD_IN_FORWARD = "jaxfuse-xla[grad_in_forward]"
# The acceptance case: in quick mode too.
MAIN_CASE = (8192, 1024, 32000)
# Pallas' interpret mode and Triton's interpreter on CPU check errors at this shape (N, D, V);
# the Triton kernels' bytes are counted there too.
INTERPRET_SHAPE = (64, 64, 1000)
# Every row's matmuls run in float32 at HIGHEST precision: jaxfuse and the plain loss pass it,
# torch's float32 matmuls are full precision, and tokamax, which takes no precision argument, is
# traced and run under jax.default_matmul_precision.
TOKAMAX_PRECISION = "highest"


# The log-probability rows: their temperature and the entropy bonus of their objective.
TEMPERATURE, ENTROPY_BONUS = 0.9, 0.01


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


def _torch_setup(h, w, y):
  import torch

  return harness.to_torch(h), harness.to_torch(w), harness.to_torch(y, dtype=torch.long)


def _torch_loss(h, w, y):
  import torch.nn.functional as F  # noqa: N812

  return F.cross_entropy(h @ w.T, y)


def _tolerance_units(got, want):
  """Largest |got - want| / (1e-5 + 1e-5 |want|) over all gradient entries."""
  worst = 0.0
  for g, w in zip(got, want):
    g, w = harness.to_numpy(g), harness.to_numpy(w)
    worst = max(worst, float(np.max(np.abs(g - w) / (1e-5 + 1e-5 * np.abs(w)))))
  return worst


def _tokamax_loss():
  """tokamax's loss of (h, w_t, y), or None when tokamax is not installed."""
  tokamax = harness.tokamax()
  if tokamax is None:
    return None

  def loss_fn(h, w_t, y):
    # tokamax 0.0.12 raises NotImplementedError on a precision argument: its step is traced
    # and run under jax.default_matmul_precision instead (TOKAMAX_PRECISION).
    return tokamax.linear_softmax_cross_entropy_loss(h, y, w_t, reduction="mean",
                                                     implementation="xla")

  return loss_fn


def _losses(y, **options) -> dict[str, Callable]:
  """jaxfuse's rows: the loss of (h, w) for each implementation the op has."""
  def loss(h, w, *, implementation):
    return linear_cross_entropy(h, w, y, implementation=implementation, **options)
  return harness.jaxfuse_rows("linear_cross_entropy", loss)


def _policy_objective(logp, entropy):
  """A policy-gradient loss with an entropy bonus, of per-token log-probs and entropies."""
  return -(logp.sum() + ENTROPY_BONUS * entropy.sum()) / logp.shape[0]


def _log_prob_losses(y) -> dict[str, Callable]:
  """The log-probability rows' objective of (h, w) for each implementation the op has."""
  def loss(h, w, *, implementation):
    return _policy_objective(*linear_log_probs(h, w, y, temperature=TEMPERATURE,
                                               return_entropy=True,
                                               implementation=implementation))
  return harness.jaxfuse_rows("linear_log_probs", loss)


def _plain_log_probs(h, w, y):
  return _policy_objective(*linear_log_probs_reference(h, w, y, temperature=TEMPERATURE,
                                                       return_entropy=True))


# The torch rows' tokens as [sequences, SEQUENCE] (TRL's functions loop over the leading axis).
SEQUENCE = 1024


def _torch_log_probs(h, w, y):
  """TRL's functions on the full logits ``[sequences, SEQUENCE, V]``, as its trainers call
  them."""
  from trl.trainer.utils import entropy_from_logits, selective_log_softmax

  rows = SEQUENCE if h.shape[0] % SEQUENCE == 0 else h.shape[0]
  logits = (h @ w.T).reshape(-1, rows, w.shape[0])
  logp = selective_log_softmax(logits, y.reshape(-1, rows), temperature=TEMPERATURE)
  return _policy_objective(logp.reshape(-1), entropy_from_logits(logits / TEMPERATURE).reshape(-1))


# The two problems of the suite: (jaxfuse rows of y, the plain-JAX loss, the torch loss).
PROBLEMS = {"cross_entropy": (_losses, _plain, _torch_loss),
            "log_probs": (_log_prob_losses, _plain_log_probs, _torch_log_probs)}


@functools.cache
def _small_figures(name: str, problem: str = "cross_entropy"):
  """``(out_err, grad_err, tolerance units, bytes)`` of a kernel row at INTERPRET_SHAPE against
  torch (the same for every case): with Pallas' kernels in interpret mode (bytes None), or the
  Triton kernels in Triton's interpreter (their bytes counted there)."""
  rows, _, torch_loss = PROBLEMS[problem]
  n, d, v = INTERPRET_SHAPE
  h, w, y = _inputs(n, d, v, seed=1)
  loss = rows(y)[name]
  if harness.kernel_kind(name).interpretable:
    with dispatch.pallas_interpret():
      got, moved = harness.jax_step(loss)((h, w)), None
  else:
    got, traffic = triton_interpreted.run_step(loss, (h, w))
    moved = traffic.bytes
  want = harness.torch_step(torch_loss, n_diff=2)(_torch_setup(h, w, y))
  out_err, grad_err = harness.errors(got, want)
  return out_err, grad_err, _tolerance_units(got[1], want[1]), moved


def _case(ctx, n, d, v, with_peers, problem: str = "cross_entropy") -> list[Record]:
  import torch

  rows, plain, torch_loss = PROBLEMS[problem]
  case = f"N={n} D={d} V={v}" if problem == "cross_entropy" else \
      f"log_probs+entropy N={n} D={d} V={v}"
  ctx.step(case)
  h, w, y = _inputs(n, d, v)
  t_args = _torch_setup(h, w, y)

  jaxfuse = rows(y)
  kernels = [name for name in jaxfuse if harness.kernel_kind(name) is not None]
  losses = {BASELINE: lambda h, w: plain(h, w, y), "jaxfuse-xla": jaxfuse["jaxfuse-xla"]}
  if problem == "cross_entropy":
    losses[GRAD_IN_FORWARD] = _losses(y, grad_in_forward=True)["jaxfuse-xla"]
  losses.update((name, jaxfuse[name]) for name in kernels
                if ctx.native(harness.kernel_kind(name).name))
  steps = {name: (harness.jax_step(loss), (h, w)) for name, loss in losses.items()}
  tokamax_loss = _tokamax_loss() if with_peers and problem == "cross_entropy" else None
  if tokamax_loss is not None:
    w_t = jnp.asarray(w.T)
    losses["tokamax-xla"] = lambda h, w_t: tokamax_loss(h, w_t, y)
    steps["tokamax-xla"] = (harness.jax_step(losses["tokamax-xla"],
                                             matmul_precision=TOKAMAX_PRECISION), (h, w_t))

  # One call each (compiles and warms up), kept for the errors.
  outputs, notes = {}, {}
  for name, (step, args) in list(steps.items()):
    try:
      outputs[name] = jax.block_until_ready(step(args))
    except Exception as e:  # noqa: BLE001 - a peer that cannot run here gets a note, no time.
      notes[name] = f"did not run: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
      del steps[name]
  if "tokamax-xla" in outputs:
    loss, (dh, dw_t) = outputs["tokamax-xla"]
    outputs["tokamax-xla"] = (loss, [dh, jnp.asarray(dw_t).T])
    notes["tokamax-xla"] = ("tokamax 0.0.12's XLA path: gradients computed in the forward "
                            "and kept; its chunked kernel is TPU-only; matmuls at float32 "
                            f"{TOKAMAX_PRECISION} precision through jax.default_matmul_precision "
                            "(it takes no precision argument), as every row's")
  torch_losses = {"torch-eager": torch_loss}
  if with_peers:
    torch_losses["torch-compile"] = torch.compile(torch_loss)
  candidates = {name: functools.partial(step, args) for name, (step, args) in steps.items()}
  for name, loss in torch_losses.items():
    step = harness.torch_step(loss, n_diff=2)
    try:
      outputs[name] = step(t_args)
      candidates[name] = functools.partial(step, t_args)
    except Exception as e:  # noqa: BLE001 - no compiler here: note it.
      notes[name] = f"did not run: {type(e).__name__}"
  # The first calls above were the warm-up.
  times = ctx.time(candidates, warmup=0)

  # What the backward keeps: traced for JAX (the Pallas kernels in interpret mode where they do
  # not compile, the Triton ones through a stand-in jax-triton); saved_tensors_hooks for torch.
  # The Pallas kernels' bytes are counted from their grid and block specs.
  residual = {name: harness.residual_bytes(losses[name], args)
              for name, (_, args) in steps.items()
              if name not in kernels or not harness.kernel_kind(name).interpretable}
  moved = {}
  for name in kernels:
    kind = harness.kernel_kind(name)
    if kind.interpretable:
      with ctx.tracing(name):  # traced, never run
        residual[name] = harness.residual_bytes(jaxfuse[name], (h, w))
      moved[name] = harness.step_bytes_moved(jaxfuse[name], (h, w))
    elif not ctx.native(kind.name) and triton_interpreted.available():
      residual[name] = triton_interpreted.residual_bytes(jaxfuse[name], (h, w))
  for name, loss in torch_losses.items():
    if name in outputs:
      residual[name] = harness.torch_residual_bytes(loss, t_args, n_diff=2)

  # Kernel rows that do not compile here: figures at INTERPRET_SHAPE.
  small = {}
  for name in kernels:
    kind = harness.kernel_kind(name)
    if ctx.native(kind.name):
      continue
    if kind.interpretable:
      small[name] = _small_figures(name, problem)
      notes[name] = (f"CPU: no time (needs a GPU); errors from interpret mode at "
                     f"{_small_where()} (grad err {small[name][2]:.2f} x fp32 tol)")
    elif triton_interpreted.available():
      ctx.step(f"{case}: Triton interpreter run at {_small_where()}")
      small[name] = _small_figures(name, problem)
      notes[name] = (triton_interpreted.NOTE.format(where=_small_where())
                     + f" (grad err {small[name][2]:.2f} x fp32 tol)")
    else:
      notes[name] = "not run: Triton needs a GPU (or triton, for its interpreter)"

  peaks = _peaks(steps, t_args, torch_loss) if ctx.platform == "gpu" else {}
  reference = outputs["torch-eager"]
  torch_ms = (times.get("torch-eager") or {}).get("median")
  records = []
  order = [BASELINE, "jaxfuse-xla", GRAD_IN_FORWARD, *kernels, "tokamax-xla", "torch-eager",
           "torch-compile"]
  for name in order:
    if name in ("tokamax-xla", "torch-compile") and not with_peers:
      continue
    if problem != "cross_entropy" and name in ("tokamax-xla", GRAD_IN_FORWARD):
      continue
    out = outputs.get(name)
    kind = harness.kernel_kind(name)
    r = Record(SUITE, case, name, ctx.platform, "float32", note=notes.get(name))
    records.append(r)
    r.set("time_ms", times.get(name), harness.time_source(times.get(name)))
    r.set("flops", 6 * n * d * v, "modelled: 6·N·D·V (three N×D×V matmuls)")
    if name in small and kind.interpretable:
      harness.set_errors(r, small[name][:2],
                         f"Pallas interpret mode at {_small_where()} against {REFERENCE}")
    elif name in small:
      harness.set_errors(r, small[name][:2], triton_interpreted.ERRORS_SOURCE.format(
          where=_small_where(), reference=REFERENCE))
      r.set("bytes_moved", small[name][3],
            triton_interpreted.BYTES_SOURCE.format(where=_small_where()))
    elif out is not None and name != "torch-eager":
      harness.set_errors(r, harness.errors(out, reference),
                         f"the timed step's own outputs against {REFERENCE}")
      if name.startswith("jaxfuse"):
        extra = f"grad err {_tolerance_units(out[1], reference[1]):.2f} x fp32 tol"
        if times.get(name) and torch_ms:
          extra = f"time / torch-eager = {times[name]['median'] / torch_ms:.2f}; " + extra
        r.add_note(extra)
    if r.max_abs_err is not None:
      r.reference = REFERENCE
    if name == "tokamax-xla" and out is None and r.note is None:
      r.note = "tokamax is not installed"
    if out is not None or kind is not None:
      source = (rec.TORCH_RESIDUAL_SOURCE if name.startswith("torch")
                else rec.JAX_RESIDUAL_SOURCE)
      if name in small and not kind.interpretable:
        source += triton_interpreted.RESIDUAL_SUFFIX
      r.set("residual_bytes", residual.get(name), source)
    if kind is not None and kind.interpretable:
      r.set("bytes_moved", moved[name], rec.KERNEL_BYTES_SOURCE)
    elif kind is not None and ctx.native(kind.name):
      r.add_note("bytes_moved null: Triton compiles here (no interpreter to count in)")
    if name in steps:
      ctx.step(f"{case}: {name} compiled figures")
      harness.record_compiled_figures(r, *steps[name])
    if name in peaks:
      r.set("peak_bytes", *peaks[name])
  harness.ratio_to_fastest(records, (BASELINE,))
  return records


def _small_where() -> str:
  return "N={} D={} V={}".format(*INTERPRET_SHAPE)


def _peaks(steps, t_args, torch_loss):
  """GPU only: XLA's compiled footprint (arguments + outputs + temporaries) for JAX rows, and
  torch's peak allocation for torch-eager; ``name -> (bytes, source)``."""
  import torch

  peaks = {}
  for name, (step, args) in steps.items():
    stats = metrics.compiled_memory(lambda *a, step=step: step(a), *args)
    peaks[name] = (stats["argument_bytes"] + stats["output_bytes"] + stats["temp_bytes"],
                   "XLA compiled memory analysis: argument + output + temp bytes "
                   "(jaxfuse.metrics.compiled_memory)")
  if torch.cuda.is_available():
    torch.cuda.reset_peak_memory_stats()
    harness.torch_step(torch_loss, n_diff=2)(t_args)
    peaks["torch-eager"] = (int(torch.cuda.max_memory_allocated()),
                            "torch.cuda.max_memory_allocated over one step, after a reset")
  return peaks


def headline(records) -> list[Record]:
  """Every row of the main cases (MAIN_CASE: N=8192 D=1024 V=32000, both problems)."""
  main = "N={} D={} V={}".format(*MAIN_CASE)
  return [r for r in records if r.case in (main, f"log_probs+entropy {main}")]


def run(ctx) -> list[Record]:
  records = []
  for n, d, v, with_peers in _cases(ctx):
    records += _case(ctx, n, d, v, with_peers)
  # The log-probability rows at the main case (and, in full, at a larger vocabulary).
  for n, d, v in [MAIN_CASE] + ([] if ctx.quick else [(4096, 1024, 128256)]):
    records += _case(ctx, n, d, v, True, problem="log_probs")
  return records
