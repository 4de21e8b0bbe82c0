"""Benchmark suite ``norm``: RMSNorm, LayerNorm and the fused residual add + RMSNorm.

Every case times forward + backward: one jit-compiled step returning the outputs and the
gradients of every input and parameter, or one torch autograd step, interleaved across

- ``jaxfuse-xla``, and where they compile (GPUs) ``jaxfuse-pallas`` / ``jaxfuse-triton``;
- ``jax-unfused``: the plain jnp chain (``jaxfuse.ops.*_reference``), differentiated by JAX;
- ``torch-eager`` and ``torch-compile`` (``torch.nn.functional.rms_norm`` / ``layer_norm``, which
  ``torch.nn.RMSNorm`` / ``LayerNorm`` call; ``torch.compile`` of the forward, with its compiled
  backward);
- ``tokamax-xla``: ``tokamax.layer_norm(..., implementation="xla")`` (``subtract_mean=False`` for
  RMSNorm), skipped with a note when tokamax does not import.

``ratio`` is a row's median time over the fastest of torch-eager, torch-compile and tokamax-xla
in the same case (``ratio_to`` names it). ``residual_bytes`` is what the backward keeps beyond
inputs and parameters (for the add variant it includes ``x + residual``, which is an output
anyway). ``bytes_moved`` is the HBM traffic of the Pallas kernels from their block specs, for the
whole forward + backward step; the ``jax-unfused`` row of ``add_rms_norm`` carries the bytes of
the same chain run as Pallas kernels (an add kernel, then the rms_norm kernels, and an add kernel
joining the two gradients of ``x + residual``). On CPU, Pallas rows are not timed: their errors
come from an interpret-mode run at a reduced row count (said in ``note``). Errors are against
torch eager in float64 on the same inputs (``torch-float64``); ``note`` says whether a row's
errors are within twice torch eager's in the row's dtype (the tests' rule for low precision).

The records of ``benchmarks/suites/norm_mlp.py`` (softmax, bias + activation, GLU, the gated MLP)
are appended, so that the whole family lands in one table.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jaxfuse
from benchmarks import harness
from benchmarks.suites import norm_mlp
from benchmarks.records import Record
from jaxfuse import ops
from jaxfuse.metrics import bytes_moved, residual_bytes, torch_residual_bytes

SUITE = "norm"
PEERS = ("torch-eager", "torch-compile", "tokamax-xla")
REFERENCE = "torch-float64"
# Rows at which Pallas kernels run in interpret mode on CPU, for their error figures.
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


def _to_torch(x):
  import torch

  x = jnp.asarray(x)
  if x.dtype == jnp.bfloat16:
    t = torch.from_numpy(np.asarray(x.astype(jnp.float32))).to(torch.bfloat16)
  else:
    t = torch.from_numpy(np.array(x))
  return t.to("cuda" if torch.cuda.is_available() else "cpu")


# Implementations --------------------------------------------------------------------------------


def _jax_fns(case: Case, tokamax) -> tuple[dict[str, Callable], dict[str, str]]:
  eps, op = case.eps, case.op
  fused = getattr(ops, op)
  reference = getattr(ops, f"{op}_reference")
  fns = {
      "jaxfuse-pallas": lambda *a: fused(*a, eps=eps, implementation="pallas"),
      "jaxfuse-xla": lambda *a: fused(*a, eps=eps, implementation="xla"),
      "jax-unfused": lambda *a: reference(*a, eps=eps),
  }
  notes = {}
  if op == "rms_norm" and importlib.util.find_spec("triton") is not None:
    fns["jaxfuse-triton"] = lambda *a: fused(*a, eps=eps, implementation="triton")
  if tokamax is None:
    notes["jax-unfused"] = "tokamax is not installed: no tokamax-xla row"
    return fns, notes
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
    notes["tokamax-xla"] = "x + residual in jnp, then tokamax.layer_norm(subtract_mean=False)"
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


def _jax_step(f):
  """(args, cotangents) -> (outputs, gradients of every arg), jit-compiled.

  A gradient that is the very same array as an earlier one (x's and residual's in the add
  variants) leaves the compiled step once, as torch's autograd returns one tensor for both:
  returning it twice would make XLA copy it.
  """
  layout = []

  @jax.jit
  def compiled(args, cts):
    out, vjp = jax.vjp(f, *args)
    grads = list(vjp(cts))
    layout.clear()
    unique = []
    for grad in grads:
      same = [i for i, u in enumerate(unique) if u is grad]
      layout.append(same[0] if same else len(unique))
      if not same:
        unique.append(grad)
    return out, unique

  def step(args, cts):
    out, unique = compiled(args, cts)
    return out, [unique[i] for i in layout]

  return step


def _torch_step(fn):
  import torch

  def step(args, cts):
    leaves = [a.detach().requires_grad_() for a in args]
    out = fn(*leaves)
    outs = list(out) if isinstance(out, tuple) else [out]
    grads = torch.autograd.grad(outs, leaves, list(cts) if isinstance(cts, tuple) else [cts])
    return out, grads

  return step


def _flat(result):
  out, grads = result
  outs = list(out) if isinstance(out, (tuple, list)) else [out]
  return outs, list(grads)


def _errors(got, want) -> tuple[float, float]:
  (outs, grads), (t_outs, t_grads) = _flat(got), _flat(want)
  return harness.max_abs_err(outs, t_outs), harness.max_abs_err(grads, t_grads)


# One case ---------------------------------------------------------------------------------------


def run_case(ctx, case: Case, tokamax) -> list[Record]:
  import torch

  ctx.step(f"{case.name}: inputs")
  args, cts = _inputs(case, case.rows)
  t_args = [_to_torch(a) for a in args]
  t_cts = tuple(_to_torch(c) for c in cts) if case.has_residual else _to_torch(cts)
  fns, notes = _jax_fns(case, tokamax)
  torch_fn = _torch_fn(case)

  timed: dict[str, Callable] = {}
  results: dict[str, object] = {}
  for impl, f in fns.items():
    if impl.startswith("jaxfuse-") and not ctx.native(impl.removeprefix("jaxfuse-")):
      continue
    ctx.step(f"{case.name}: compile {impl}")
    step = _jax_step(f)
    results[impl] = step(args, cts)
    timed[impl] = (lambda step: lambda: step(args, cts))(step)
  ctx.step(f"{case.name}: torch.compile")
  compiled_fn = torch.compile(torch_fn)
  for impl, fn in (("torch-eager", torch_fn), ("torch-compile", compiled_fn)):
    step = _torch_step(fn)
    results[impl] = step(t_args, t_cts)
    timed[impl] = (lambda step: lambda: step(t_args, t_cts))(step)

  ctx.step(f"{case.name}: float64 reference")
  exact = _exact(case, t_args, t_cts)

  ctx.step(f"{case.name}: timing {len(timed)} implementations")
  times = ctx.time(timed)
  peers = {impl: times[impl]["median"] for impl in PEERS if impl in times}
  fastest = min(peers, key=peers.get)

  records = []
  dt = jnp.dtype(case.dtype).name
  for impl in [*fns, "torch-eager", "torch-compile"]:
    rec = Record(suite=SUITE, case=case.name, impl=impl, platform=ctx.platform, dtype=dt,
                 reference=REFERENCE, note=notes.get(impl))
    if impl in times:
      rec.time_ms = times[impl]
      rec.ratio_to = fastest
      rec.ratio = times[impl]["median"] / peers[fastest]
    if impl in results:
      rec.max_abs_err, rec.max_grad_err = _errors(results[impl], exact)
      if impl != "torch-eager":
        _tolerance_note(rec, _errors(results["torch-eager"], exact))
    ctx.step(f"{case.name}: {impl} residuals")
    if impl == "jaxfuse-triton" and not ctx.native("triton"):
      pass  # jax-triton does not import without a GPU: the kernels cannot be traced here.
    elif impl.startswith("torch"):
      fn = torch_fn if impl == "torch-eager" else compiled_fn
      leaves = [a.detach().requires_grad_() for a in t_args]
      rec.residual_bytes = torch_residual_bytes(lambda: fn(*leaves), exclude=t_args + leaves)
    else:
      with jaxfuse.pallas_interpret(not ctx.native("pallas")):  # traced, never run
        rec.residual_bytes = _residual_bytes(fns[impl], args)
    if impl == "jaxfuse-pallas":
      _pallas_figures(ctx, case, fns[impl], rec, args, cts)
    elif impl == "jaxfuse-triton":
      _triton_figures(ctx, case, rec)
    elif impl == "jax-unfused" and case.op == "add_rms_norm":
      rec.bytes_moved = _step_bytes(
          lambda *a: ops.add_rms_norm_unfused(*a, eps=case.eps, implementation="pallas"),
          args, cts, ctx)
      chain = ("bytes_moved: the chain as Pallas kernels (add; rms_norm forward and backward; "
               "add of the two gradients of x + residual)")
      rec.note = f"{rec.note}; {chain}" if rec.note else chain
    records.append(rec)
  _add_chain_ratio(records)
  return records


def _exact(case: Case, t_args, t_cts):
  """torch eager in float64 on the same inputs: the reference every row's errors are taken to."""
  import torch

  def wide(t):
    return t.to(device="cpu", dtype=torch.float64)

  cts = tuple(wide(c) for c in t_cts) if case.has_residual else wide(t_cts)
  return _torch_step(_torch_fn(case))([wide(a) for a in t_args], cts)


def _tolerance_note(rec: Record, torch_errors) -> None:
  """The low-precision rule of the tests, for every dtype: errors against float64 at most twice
  torch eager's in the same dtype (plus 1e-6 for float32 rounding noise)."""
  out_ok = rec.max_abs_err <= 2 * torch_errors[0] + 1e-6
  grad_ok = rec.max_grad_err <= 2 * torch_errors[1] + 1e-6
  verdict = ("errors within 2x torch-eager's" if out_ok and grad_ok
             else "errors ABOVE 2x torch-eager's")
  rec.note = f"{rec.note}; {verdict}" if rec.note else verdict


def _residual_bytes(f, args):
  def loss(*a):
    out = f(*a)
    leaves = out if isinstance(out, tuple) else (out,)
    return sum(jnp.sum(o.astype(jnp.float32)) for o in leaves)
  return residual_bytes(loss, *args)


def _step_bytes(f, args, cts, ctx) -> int | None:
  with jaxfuse.pallas_interpret(not ctx.native("pallas")):  # traced, never run
    return bytes_moved(lambda *a: _jax_step(f)(a, cts), *args)


def _pallas_figures(ctx, case: Case, f, rec: Record, args, cts) -> None:
  """bytes_moved of the forward + backward step; on CPU, errors from interpret mode at a reduced
  row count."""
  ctx.step(f"{case.name}: Pallas bytes moved")
  rec.bytes_moved = _step_bytes(f, args, cts, ctx)
  if ctx.native("pallas"):
    return
  rows = min(case.rows, INTERPRET_ROWS)
  ctx.step(f"{case.name}: Pallas interpret run at {rows} rows")
  small, small_cts = _inputs(case, rows, seed=1)
  with jaxfuse.pallas_interpret():
    got = _jax_step(f)(small, small_cts)
  t_small = [_to_torch(a) for a in small]
  t_cts = (tuple(_to_torch(c) for c in small_cts) if case.has_residual
           else _to_torch(small_cts))
  exact = _exact(case, t_small, t_cts)
  rec.max_abs_err, rec.max_grad_err = _errors(got, exact)
  extra = f"errors from interpret mode at {rows}x{case.hidden} (CPU)"
  rec.note = f"{rec.note}; {extra}" if rec.note else extra
  _tolerance_note(rec, _errors(_torch_step(_torch_fn(case))(t_small, t_cts), exact))


def _triton_figures(ctx, case: Case, rec: Record) -> None:
  from jaxfuse.kernels.triton import normalization as triton_norm

  itemsize = jnp.dtype(case.dtype).itemsize
  rec.bytes_moved = (triton_norm.traffic_bytes(case.rows, case.hidden, itemsize)
                     + triton_norm.traffic_bytes(case.rows, case.hidden, itemsize, backward=True))
  if not ctx.native("triton"):
    rec.note = ("Triton kernels run on GPUs through jax-triton (tested on CPU with Triton's "
                "interpreter); bytes_moved from their block layout")


def _add_chain_ratio(records) -> None:
  """Says, on the fused Pallas row, what share of the unfused chain's bytes it moves."""
  fused = [r for r in records if r.impl == "jaxfuse-pallas" and r.bytes_moved]
  chain = [r for r in records if r.impl == "jax-unfused" and r.bytes_moved]
  if fused and chain:
    share = f"bytes_moved {fused[0].bytes_moved / chain[0].bytes_moved:.0%} of the unfused chain"
    fused[0].note = f"{share}; {fused[0].note}" if fused[0].note else share


# The suite --------------------------------------------------------------------------------------


def cases(ctx) -> list[Case]:
  dtype = jnp.float32 if ctx.platform == "cpu" else jnp.bfloat16
  rows, hidden = (4096, 1024) if ctx.quick else (16384, 4096)
  return [Case(op, rows, hidden, dtype) for op in ("rms_norm", "layer_norm", "add_rms_norm")]


def run(ctx) -> list[Record]:
  tokamax = harness.tokamax()
  records: list[Record] = []
  for case in cases(ctx):
    records.extend(run_case(ctx, case, tokamax))
  records.extend(norm_mlp.run(ctx))
  return records
