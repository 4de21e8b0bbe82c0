"""Benchmark suite ``norm``: RMSNorm, LayerNorm and the fused residual add + RMSNorm.

Every case times forward + backward: one jit-compiled step returning the outputs and the
gradients of every input and parameter, or one torch autograd step, interleaved across

- ``jaxfuse-<implementation>``, one row per implementation the op has (its registry entry,
  ``jaxfuse.ops.base.REGISTRY``: ``jaxfuse-pallas``, ``jaxfuse-triton``, ``jaxfuse-cpu``,
  ``jaxfuse-xla``), the kernel rows timed where they compile (GPUs; the CPU kernels on CPUs);
- ``jax-unfused``: the plain jnp chain (``jaxfuse.ops.*_reference``), differentiated by JAX;
- ``torch-eager`` and ``torch-compile`` (``torch.nn.functional.rms_norm`` / ``layer_norm``, which
  ``torch.nn.RMSNorm`` / ``LayerNorm`` call; ``torch.compile`` of the forward, with its compiled
  backward);
- ``tokamax-xla``: ``tokamax.layer_norm(..., implementation="xla")`` (``subtract_mean=False`` for
  RMSNorm), skipped with a note when tokamax does not import.

Every candidate gets the same settings: the same epsilon, float32 statistics (tokamax upcasts
low-precision inputs as jaxfuse does); normalization has no matmul, so no precision setting
applies.

``ratio`` is a row's median time over the fastest of torch-eager, torch-compile and tokamax-xla
in the same case (``ratio_to`` names it). ``residual_bytes`` is what the backward keeps beyond
inputs and parameters (for the add variant it includes ``x + residual``, which is an output
anyway). ``bytes_moved`` is the HBM traffic of the Pallas kernels counted by
``jaxfuse.metrics.bytes_moved``, for the whole forward + backward step (for the CPU kernels, the
operands and results of their calls: ``jaxfuse.metrics.cpu_kernel_traffic``); the ``jax-unfused`` row
of ``add_rms_norm`` carries the bytes of the same chain run as Pallas kernels (an add kernel,
then the rms_norm kernels, and an add kernel joining the two gradients of ``x + residual``). JAX
rows compiled here also carry XLA's own cost analysis (``xla_bytes_accessed``) and compiled temp
memory (``temp_bytes``). On CPU, kernel rows are not timed: Pallas rows' errors come from an
interpret-mode run at a reduced row count (said in ``note``); Triton rows run the op, kernels in
Triton's interpreter (``benchmarks/triton_interpreted.py``), at the same reduced row count, for
their errors and for ``bytes_moved`` (counted at that reduced shape: the interpreter takes
about 10 ms a row, so the case's shape would take minutes), and trace their residuals at the
case's shape through a stand-in jax-triton.
Errors are against torch eager in float64 on the same inputs (``torch-float64``); ``note`` says
whether a row's errors are within twice torch eager's in the row's dtype (the tests' rule for
low precision). Each record's ``sources`` says how each of its figures was produced.

The records of ``benchmarks/suites/norm_mlp.py`` (softmax, bias + activation, GLU, the gated MLP)
are appended, so that the whole family lands in one table.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

import jaxfuse
from benchmarks import harness
from benchmarks import records as records_lib
from benchmarks import triton_interpreted
from benchmarks.records import Record
from benchmarks.suites import norm_mlp
from jaxfuse import ops

SUITE = "norm"
PEERS = ("torch-eager", "torch-compile", "tokamax-xla")
REFERENCE = "torch-float64"
# Rows at which Pallas kernels run in interpret mode on CPU, for their error figures, and the
# Triton kernels in Triton's interpreter, for their errors and bytes moved.
INTERPRET_ROWS = 64
EPS = {"rms_norm": 1e-6, "layer_norm": 1e-5, "add_rms_norm": 1e-6}


@dataclasses.dataclass
class Case:
  op: str
  rows: int
  hidden: int
  dtype: object

  @property
  def name(self) -> str:
    return f"{self.op} {self.rows}x{self.hidden}"

  @property
  def eps(self) -> float:
    return EPS[self.op]

  @property
  def has_residual(self) -> bool:
    return self.op.startswith("add_")


# Inputs -----------------------------------------------------------------------------------------


def _inputs(case: Case, rows: int, seed: int = 0):
  """``(args, cotangents)``: x, [residual], scale, [bias]; the output gradient(s)."""
  rng = np.random.default_rng(seed)
  shape, hidden = (rows, case.hidden), case.hidden

  def normal(s, loc=0.0, scale=1.0):
    return jnp.asarray(loc + scale * rng.standard_normal(s, dtype=np.float32)).astype(case.dtype)

  args = [normal(shape)]
  if case.has_residual:
    args.append(normal(shape))
  args.append(normal((hidden,), 1.0, 0.1))
  if case.op == "layer_norm":
    args.append(normal((hidden,), 0.0, 0.1))
  g = normal(shape)
  cts = (g, normal(shape)) if case.has_residual else g
  return args, cts


# Implementations --------------------------------------------------------------------------------


def _has_row(implementation: str) -> bool:
  """Whether jaxfuse's ``implementation`` of an op gets a row: where it runs (natively, or in
  Pallas' interpret mode) or Triton's interpreter can give its figures."""
  return harness.runs(implementation) or triton_interpreted.has_row(implementation)


def _jax_fns(case: Case, tokamax) -> tuple[dict[str, Callable], dict[str, str]]:
  """The JAX rows: jaxfuse's implementations of the op that run here (natively, in Pallas'
  interpret mode, or in Triton's interpreter), the plain jnp chain, and tokamax."""
  eps, op = case.eps, case.op
  reference = getattr(ops, f"{op}_reference")
  fns = harness.jaxfuse_rows(op, functools.partial(getattr(ops, op), eps=eps), keep=_has_row)
  fns["jax-unfused"] = lambda *a: reference(*a, eps=eps)
  notes = {}
  if tokamax is None:
    notes["jax-unfused"] = "tokamax is not installed: no tokamax-xla row"
    return fns, notes
  notes["tokamax-xla"] = (f"epsilon={eps} as every row; statistics in float32 (tokamax "
                          "upcasts); no matmul, so no precision setting")
  if op == "rms_norm":
    fns["tokamax-xla"] = lambda x, s: tokamax.layer_norm(
        x, s, None, epsilon=eps, subtract_mean=False, implementation="xla")
  elif op == "layer_norm":
    fns["tokamax-xla"] = lambda x, s, b: tokamax.layer_norm(x, s, b, epsilon=eps,
                                                            implementation="xla")
  else:
    def tokamax_add_rms_norm(x, r, s):
      z = x + r
      return tokamax.layer_norm(z, s, None, epsilon=eps, subtract_mean=False,
                                implementation="xla"), z
    fns["tokamax-xla"] = tokamax_add_rms_norm
    notes["tokamax-xla"] = ("x + residual in jnp, then tokamax.layer_norm(subtract_mean=False); "
                            + notes["tokamax-xla"])
  return fns, notes


def _torch_fn(case: Case):
  import torch.nn.functional as F  # noqa: N812

  eps, hidden = case.eps, (case.hidden,)
  if case.op == "rms_norm":
    return lambda x, s: F.rms_norm(x, hidden, s, eps)
  if case.op == "layer_norm":
    return lambda x, s, b: F.layer_norm(x, hidden, s, b, eps)

  def add_rms_norm(x, r, s):
    z = x + r
    return F.rms_norm(z, hidden, s, eps), z
  return add_rms_norm


# One case ---------------------------------------------------------------------------------------


def _torch_cts(case: Case, cts):
  return tuple(harness.to_torch(c) for c in cts) if case.has_residual else harness.to_torch(cts)


def run_case(ctx, case: Case, tokamax) -> list[Record]:
  import torch

  ctx.step(f"{case.name}: inputs")
  args, cts = _inputs(case, case.rows)
  t_args = [harness.to_torch(a) for a in args]
  t_cts = _torch_cts(case, cts)
  fns, notes = _jax_fns(case, tokamax)
  torch_fn = _torch_fn(case)

  timed: dict[str, Callable] = {}
  steps: dict[str, Callable] = {}
  results: dict[str, object] = {}
  for impl, f in fns.items():
    kind = harness.kernel_kind(impl)
    if kind is not None and not ctx.native(kind.name):
      continue
    ctx.step(f"{case.name}: compile {impl}")
    steps[impl] = step = harness.jax_step(f)
    results[impl] = step(args, cts)
    timed[impl] = (lambda step: lambda: step(args, cts))(step)
  ctx.step(f"{case.name}: torch.compile")
  compiled_fn = torch.compile(torch_fn)
  torch_fns = {"torch-eager": torch_fn, "torch-compile": compiled_fn}
  for impl, fn in torch_fns.items():
    step = harness.torch_step(fn)
    results[impl] = step(t_args, t_cts)
    timed[impl] = (lambda step: lambda: step(t_args, t_cts))(step)

  ctx.step(f"{case.name}: float64 reference")
  exact = _exact(case, t_args, t_cts)

  ctx.step(f"{case.name}: timing {len(timed)} implementations")
  times = ctx.time(timed)

  records = []
  dt = jnp.dtype(case.dtype).name
  for impl in [*fns, "torch-eager", "torch-compile"]:
    rec = Record(suite=SUITE, case=case.name, impl=impl, platform=ctx.platform, dtype=dt,
                 reference=REFERENCE, note=notes.get(impl))
    rec.set("time_ms", times.get(impl), harness.time_source(times.get(impl)))
    if impl in results:
      harness.set_errors(rec, harness.errors(results[impl], exact),
                         f"the timed step's own outputs against {REFERENCE}")
      if impl != "torch-eager":
        _tolerance_note(rec, harness.errors(results["torch-eager"], exact))
    ctx.step(f"{case.name}: {impl} residuals")
    kind = harness.kernel_kind(impl)
    if kind is not None and not harness.runs(kind.name):  # the Triton kernels, on CPU
      if triton_interpreted.available():
        rec.set("residual_bytes", triton_interpreted.residual_bytes(fns[impl], args),
                records_lib.JAX_RESIDUAL_SOURCE + triton_interpreted.RESIDUAL_SUFFIX)
      else:
        rec.add_note("residual_bytes null: the Triton implementation is traced through "
                     "jax-triton, which needs a GPU")
    elif impl.startswith("torch"):
      rec.set("residual_bytes", harness.torch_residual_bytes(torch_fns[impl], t_args),
              records_lib.TORCH_RESIDUAL_SOURCE)
    else:
      with ctx.tracing(impl):  # traced, never run
        rec.set("residual_bytes", harness.residual_bytes(fns[impl], args),
                records_lib.JAX_RESIDUAL_SOURCE)
    if impl in steps:
      ctx.step(f"{case.name}: {impl} compiled figures")
      harness.record_compiled_figures(rec, steps[impl], args, cts)
    if harness.runs_cpu_kernels(impl):
      harness.record_cpu_kernel_figures(rec, fns[impl], args, cts)
    elif kind is not None and kind.interpretable:
      _pallas_figures(ctx, case, fns[impl], rec, args, cts)
    elif kind is not None:  # the Triton kernels
      _triton_figures(ctx, case, fns[impl], rec)
    elif impl == "jax-unfused" and case.op == "add_rms_norm":
      rec.set("bytes_moved", harness.step_bytes_moved(
          lambda *a: ops.add_rms_norm_unfused(*a, eps=case.eps, implementation="pallas"),
          args, cts),
          f"{records_lib.KERNEL_BYTES_SOURCE}, of the same chain run as Pallas kernels (add; "
          "rms_norm forward and backward; add of the two gradients of x + residual)")
    records.append(rec)
  harness.ratio_to_fastest(records, PEERS)
  _add_chain_ratio(records)
  return records


def _exact(case: Case, t_args, t_cts):
  """torch eager in float64 on the same inputs: the reference every row's errors are taken to."""
  cts = tuple(harness.to_float64_cpu(t_cts)) if case.has_residual else (
      harness.to_float64_cpu([t_cts])[0])
  return harness.torch_step(_torch_fn(case))(harness.to_float64_cpu(t_args), cts)


def _tolerance_note(rec: Record, torch_errors) -> None:
  """The low-precision rule of the tests, for every dtype: errors against float64 at most twice
  torch eager's in the same dtype (plus 1e-6 for float32 rounding noise)."""
  out_ok = rec.max_abs_err <= 2 * torch_errors[0] + 1e-6
  grad_ok = rec.max_grad_err <= 2 * torch_errors[1] + 1e-6
  rec.add_note("errors within 2x torch-eager's" if out_ok and grad_ok
               else "errors ABOVE 2x torch-eager's")




def _pallas_figures(ctx, case: Case, f, rec: Record, args, cts) -> None:
  """bytes_moved of the forward + backward step; on CPU, errors from interpret mode at a reduced
  row count."""
  ctx.step(f"{case.name}: Pallas bytes moved")
  rec.set("bytes_moved", harness.step_bytes_moved(f, args, cts), records_lib.KERNEL_BYTES_SOURCE)
  if ctx.native("pallas"):
    return
  rows = min(case.rows, INTERPRET_ROWS)
  ctx.step(f"{case.name}: Pallas interpret run at {rows} rows")
  small, small_cts = _inputs(case, rows, seed=1)
  with jaxfuse.pallas_interpret():
    got = harness.jax_step(f)(small, small_cts)
  t_small = [harness.to_torch(a) for a in small]
  t_cts = _torch_cts(case, small_cts)
  exact = _exact(case, t_small, t_cts)
  harness.set_errors(rec, harness.errors(got, exact),
                     f"Pallas interpret mode at {rows}x{case.hidden} against {REFERENCE}")
  rec.add_note(f"errors from interpret mode at {rows}x{case.hidden} (CPU)")
  _tolerance_note(rec, harness.errors(harness.torch_step(_torch_fn(case))(t_small, t_cts),
                                      exact))


def _triton_figures(ctx, case: Case, f, rec: Record) -> None:
  """On CPU: errors and bytes_moved of the op's forward + backward step with its Triton kernels
  in Triton's interpreter, at a reduced row count."""
  if ctx.native("triton"):
    rec.add_note("bytes_moved null: Triton compiles here (no interpreter to count in)")
    return
  if not triton_interpreted.available():
    rec.add_note("no errors or bytes_moved: Triton's interpreter is not available here")
    return
  rows = min(case.rows, INTERPRET_ROWS)
  where = f"{rows}x{case.hidden}"
  ctx.step(f"{case.name}: Triton interpreter run at {rows} rows")
  small, small_cts = _inputs(case, rows, seed=1)
  got, traffic = triton_interpreted.run_step(f, small, small_cts)
  t_small = [harness.to_torch(a) for a in small]
  t_cts = _torch_cts(case, small_cts)
  exact = _exact(case, t_small, t_cts)
  harness.set_errors(rec, harness.errors(got, exact), triton_interpreted.ERRORS_SOURCE.format(
      where=where, reference=REFERENCE))
  rec.set("bytes_moved", traffic.bytes, triton_interpreted.BYTES_SOURCE.format(where=where))
  rec.add_note(triton_interpreted.NOTE.format(where=where))
  _tolerance_note(rec, harness.errors(harness.torch_step(_torch_fn(case))(t_small, t_cts),
                                      exact))


def _add_chain_ratio(records) -> None:
  """Says, on the fused Pallas row, what share of the unfused chain's bytes it moves (both
  counted from the Pallas kernels' grid and block specs, at the case's shape)."""
  fused = [r for r in records if (kind := harness.kernel_kind(r.impl)) is not None
           and kind.interpretable and r.bytes_moved]
  chain = [r for r in records if r.impl == "jax-unfused" and r.bytes_moved]
  if fused and chain:
    share = f"bytes_moved {fused[0].bytes_moved / chain[0].bytes_moved:.0%} of the unfused chain"
    fused[0].note = f"{share}; {fused[0].note}" if fused[0].note else share


# The suite --------------------------------------------------------------------------------------


def cases(ctx) -> list[Case]:
  dtype = jnp.float32 if ctx.platform == "cpu" else jnp.bfloat16
  rows, hidden = (4096, 1024) if ctx.quick else (16384, 4096)
  return [Case(op, rows, hidden, dtype) for op in ("rms_norm", "layer_norm", "add_rms_norm")]


def headline(records) -> list[Record]:
  """Per case, the timed jaxfuse rows and the fastest peer they are compared with."""
  return [r for r in records if (r.impl.startswith("jaxfuse-") and r.time_ms)
          or r.impl == r.ratio_to]


def run(ctx) -> list[Record]:
  tokamax = harness.tokamax()
  records: list[Record] = []
  for case in cases(ctx):
    records.extend(run_case(ctx, case, tokamax))
  records.extend(norm_mlp.run(ctx))
  return records
