"""Benchmark rows for the activation family: softmax, bias + activation, SwiGLU and the GatedMLP
block (LLaMA's MLP). The ``norm`` suite appends these records to its own; ``run(ctx)`` also runs
alone.

Every case times forward + backward (one jit-compiled step returning the output and all
gradients, or one torch autograd step), interleaved across implementations:

- ``jaxfuse-xla`` and, where it compiles (GPUs), ``jaxfuse-pallas`` / ``jaxfuse-triton``;
- ``jax-unfused``: the plain jnp chain, differentiated by JAX;
- ``torch-eager`` and ``torch-compile``;
- ``tokamax-xla``: ``tokamax.gated_linear_unit`` in the GatedMLP case (tokamax has no standalone
  softmax, bias + activation or elementwise GLU).

``ratio`` is the median time over the fastest of torch eager, torch.compile and tokamax in the
same case. On CPU, Pallas rows are not timed (interpret mode is for tests): they report the
kernels' ``bytes_moved`` at the benchmark shape and errors from an interpret-mode run at a
reduced row count (said in ``note``). Errors are against torch eager in the same dtype.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import jaxfuse
from benchmarks import harness
from benchmarks.records import Record
from jaxfuse.metrics import bytes_moved, residual_bytes, torch_residual_bytes
from jaxfuse.ops import activations, bias_act, glu, softmax
from jaxfuse.remat import mlp as blocks

SUITE = "norm"
PEERS = ("torch-eager", "torch-compile", "tokamax-xla")
# Rows of the reduced shape at which Pallas kernels run in interpret mode on CPU.
INTERPRET_ROWS = 64


@dataclasses.dataclass
class Case:
  """One benchmark case: inputs (the differentiated ones first), and each implementation."""

  name: str
  make_inputs: Callable[[int], list[jax.Array]]  # rows -> inputs
  rows: int
  n_diff: int  # how many leading inputs are differentiated
  jax_fns: dict[str, Callable]  # impl -> f(*inputs)
  torch_fn: Callable  # f(*tensors)
  torch_module: Callable | None = None  # builds a torch module from the inputs (GatedMLP)
  notes: dict[str, str] = dataclasses.field(default_factory=dict)


def _torch():
  import torch

  return torch


def _device():
  torch = _torch()
  return "cuda" if torch.cuda.is_available() else "cpu"


def _to_torch(x, requires_grad=False):
  torch = _torch()
  x = jnp.asarray(x)
  if x.dtype == jnp.bfloat16:
    t = torch.from_numpy(np.asarray(x.astype(jnp.float32))).to(torch.bfloat16)
  else:
    t = torch.from_numpy(np.array(x))
  return t.to(_device()).requires_grad_(requires_grad)


def _cotangent(y):
  return jax.random.normal(jax.random.key(99), y.shape, jnp.float32).astype(y.dtype)


def _jax_step(f, n_diff, g):
  """jit: inputs -> (output, gradients of the first n_diff inputs)."""

  def step(*args):
    diff, rest = args[:n_diff], args[n_diff:]
    y, vjp = jax.vjp(lambda *d: f(*d, *rest), *diff)
    return y, vjp(g)

  return jax.jit(step)


def _torch_step(fn, n_diff, g):
  torch = _torch()

  def step(*args):
    diff = [a.detach().requires_grad_() for a in args[:n_diff]]
    y = fn(*diff, *args[n_diff:])
    return y, torch.autograd.grad(y, diff, g)

  return step


def _sync(out):
  if any(hasattr(x, "detach") for x in jax.tree_util.tree_leaves(out)):
    return harness.torch_sync(out)
  return jax.block_until_ready(out)


def _errors(got, want) -> tuple[float, float]:
  y, grads = got
  ty, tgrads = want
  return harness.max_abs_err([y], [ty]), harness.max_abs_err(list(grads), list(tgrads))


def _residual_bytes(f, inputs, n_diff):
  rest = inputs[n_diff:]
  return residual_bytes(lambda *d: f(*d, *rest), *inputs[:n_diff])


def run_case(ctx, case: Case, dtype) -> list[Record]:
  torch = _torch()
  ctx.step(f"{case.name}: inputs")
  inputs = case.make_inputs(case.rows)
  y0 = case.jax_fns["jaxfuse-xla"](*inputs)
  g = _cotangent(y0)
  tg = _to_torch(g)
  t_inputs = [_to_torch(x) for x in inputs]
  platform = ctx.platform
  dt = jnp.dtype(dtype).name

  timed: dict[str, Callable] = {}
  outputs: dict[str, object] = {}
  for impl, f in case.jax_fns.items():
    native = impl in ("jaxfuse-xla", "jax-unfused", "tokamax-xla") or ctx.native(
        impl.removeprefix("jaxfuse-"))
    if not native:
      continue
    step = _jax_step(f, case.n_diff, g)
    ctx.step(f"{case.name}: compile {impl}")
    outputs[impl] = step(*inputs)
    timed[impl] = (lambda step: lambda: step(*inputs))(step)
  eager = _torch_step(case.torch_fn, case.n_diff, tg)
  ctx.step(f"{case.name}: torch.compile")
  compiled = torch.compile(eager)
  for impl, step in (("torch-eager", eager), ("torch-compile", compiled)):
    outputs[impl] = step(*t_inputs)
    timed[impl] = (lambda step: lambda: step(*t_inputs))(step)

  ctx.step(f"{case.name}: timing {len(timed)} implementations")
  times = ctx.time(timed, warmup=1, sync=_sync)
  peers = {impl: times[impl]["median"] for impl in PEERS if impl in times}
  fastest = min(peers, key=peers.get)

  records = []
  reference = outputs["torch-eager"]
  for impl in [*case.jax_fns, "torch-eager", "torch-compile"]:
    rec = Record(suite=SUITE, case=case.name, impl=impl, platform=platform, dtype=dt,
                 reference="torch-eager", note=case.notes.get(impl))
    if impl in times:
      rec.time_ms = times[impl]
      rec.ratio_to = fastest
      rec.ratio = times[impl]["median"] / peers[fastest]
    if impl in outputs and impl != "torch-eager":
      rec.max_abs_err, rec.max_grad_err = _errors(outputs[impl], reference)
    if impl.startswith("torch"):
      ctx.step(f"{case.name}: torch residuals")
      diff = [t.detach().requires_grad_() for t in t_inputs[:case.n_diff]]
      rec.residual_bytes = torch_residual_bytes(
          lambda: case.torch_fn(*diff, *t_inputs[case.n_diff:]), exclude=t_inputs + diff)
    else:
      ctx.step(f"{case.name}: {impl} residuals")
      with jaxfuse.pallas_interpret(not ctx.native("pallas")):  # traced only, never run
        rec.residual_bytes = _residual_bytes(case.jax_fns[impl], inputs, case.n_diff)
    if impl == "jaxfuse-pallas" or impl == "jaxfuse-triton":
      _kernel_figures(ctx, case, impl, rec, inputs, g)
    records.append(rec)
  return records


def _kernel_figures(ctx, case, impl, rec, inputs, g):
  """bytes_moved of the Pallas kernels; on CPU, errors from interpret mode at a reduced shape."""
  f = case.jax_fns[impl]
  if impl == "jaxfuse-pallas":
    ctx.step(f"{case.name}: Pallas bytes moved")
    with jaxfuse.pallas_interpret(not ctx.native("pallas")):
      step = _jax_step(f, case.n_diff, g)
      rec.bytes_moved = bytes_moved(lambda *a: step(*a), *inputs)
  if ctx.native(impl.removeprefix("jaxfuse-")):
    return
  if impl == "jaxfuse-triton":
    rec.note = "Triton kernels run on GPUs (tested on CPU with Triton's interpreter)"
    return
  rows = min(case.rows, INTERPRET_ROWS)
  ctx.step(f"{case.name}: Pallas interpret run at {rows} rows")
  small = case.make_inputs(rows)
  y = case.jax_fns["jaxfuse-xla"](*small)
  g_small = _cotangent(y)
  with jaxfuse.pallas_interpret():
    got = _jax_step(f, case.n_diff, g_small)(*small)
  want = _torch_step(case.torch_fn, case.n_diff, _to_torch(g_small))(
      *[_to_torch(x) for x in small])
  rec.max_abs_err, rec.max_grad_err = _errors(got, want)
  extra = f"errors from interpret mode at {rows} rows (CPU)"
  rec.note = f"{rec.note}; {extra}" if rec.note else extra


# Cases ------------------------------------------------------------------------------------------


def _normal(key, shape, dtype, scale=1.0):
  return (scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)).astype(dtype)


def softmax_case(rows, n, dtype) -> Case:
  torch = _torch()
  return Case(
      name=f"softmax {rows}x{n}",
      make_inputs=lambda r: [_normal(0, (r, n), dtype, 3.0)],
      rows=rows, n_diff=1,
      jax_fns={
          "jaxfuse-pallas": lambda x: softmax(x, implementation="pallas"),
          "jaxfuse-xla": lambda x: softmax(x, implementation="xla"),
          "jax-unfused": lambda x: jax.nn.softmax(x, axis=-1),
      },
      torch_fn=lambda x: torch.softmax(x, dim=-1),
      notes={"jaxfuse-xla": "tokamax has no softmax op: no tokamax-xla row"})


def _torch_act(act):
  import torch.nn.functional as F  # noqa: N812

  return {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu,
          "relu": F.relu}[act]


def bias_act_case(rows, n, act, dtype) -> Case:
  fn = activations.get(act)
  torch_act = _torch_act(act)
  return Case(
      name=f"bias+{act} {rows}x{n}",
      make_inputs=lambda r: [_normal(1, (r, n), dtype, 2.0), _normal(2, (n,), dtype)],
      rows=rows, n_diff=2,
      jax_fns={
          "jaxfuse-pallas": lambda x, b: bias_act(x, b, act, implementation="pallas"),
          "jaxfuse-xla": lambda x, b: bias_act(x, b, act, implementation="xla"),
          "jax-unfused": lambda x, b: fn(x + b),
      },
      torch_fn=lambda x, b: torch_act(x + b),
      notes={"jaxfuse-xla": "tokamax has no bias + activation op: no tokamax-xla row"})


def glu_case(rows, h, act, dtype) -> Case:
  fn = activations.get(act)
  torch_act = _torch_act(act)
  fns = {
      "jaxfuse-pallas": lambda a, b: glu(a, b, act, implementation="pallas"),
      "jaxfuse-xla": lambda a, b: glu(a, b, act, implementation="xla"),
      "jax-unfused": lambda a, b: fn(a) * b,
  }
  if jaxfuse.ops.dispatch.runs_natively("triton"):
    fns["jaxfuse-triton"] = lambda a, b: glu(a, b, act, implementation="triton")
  name = {"silu": "swiglu", "gelu": "geglu", "relu": "reglu"}.get(act, f"glu-{act}")
  return Case(
      name=f"{name} {rows}x{h}",
      make_inputs=lambda r: [_normal(3, (r, h), dtype, 2.0), _normal(4, (r, h), dtype)],
      rows=rows, n_diff=2, jax_fns=fns, torch_fn=lambda a, b: torch_act(a) * b,
      notes={"jaxfuse-xla": "tokamax has no elementwise GLU (its gated_linear_unit includes "
                            "the projections): no tokamax-xla row, see the gated_mlp case"})


def _plain_gated_mlp(x, wg, wu, wd):
  hp = jax.lax.Precision.HIGHEST
  gate = jnp.matmul(x, wg, precision=hp)
  up = jnp.matmul(x, wu, precision=hp)
  return jnp.matmul(jax.nn.silu(gate) * up, wd, precision=hp)


def gated_mlp_case(tokens, d, hidden, dtype) -> Case:
  torch = _torch()
  import torch.nn.functional as F  # noqa: N812

  def make(rows):
    scale_in, scale_hidden = 1 / math.sqrt(d), 1 / math.sqrt(hidden)
    return [_normal(5, (rows, d), dtype), _normal(6, (d, hidden), dtype, scale_in),
            _normal(7, (d, hidden), dtype, scale_in), _normal(8, (hidden, d), dtype, scale_hidden)]

  def torch_mlp(x, wg, wu, wd):
    # LLaMA's MLP on the same (in, out) weights: down_proj(silu(gate_proj(x)) * up_proj(x)).
    return (F.silu(x @ wg) * (x @ wu)) @ wd

  fns = {
      "jaxfuse-pallas": lambda *a: blocks.gated_mlp(*a, implementation="pallas"),
      "jaxfuse-xla": lambda *a: blocks.gated_mlp(*a, implementation="xla"),
      "jax-unfused": _plain_gated_mlp,
  }
  notes = {"jaxfuse-pallas": "bytes_moved: the GLU kernels only (the matmuls are XLA's)",
           "jaxfuse-xla": "keeps gate and up; recomputes the hidden activation"}
  tokamax = harness.tokamax()
  if tokamax is not None:
    def tokamax_mlp(x, wg, wu, wd):
      hidden_act = tokamax.gated_linear_unit(x, (wg, wu), activation=jax.nn.silu,
                                             precision=jax.lax.Precision.HIGHEST,
                                             implementation="xla")
      return jnp.matmul(hidden_act, wd, precision=jax.lax.Precision.HIGHEST)
    fns["tokamax-xla"] = tokamax_mlp
  else:
    notes["jax-unfused"] = "tokamax is not installed: no tokamax-xla row"
  return Case(name=f"gated_mlp {tokens}x{d}->{hidden}", make_inputs=make, rows=tokens, n_diff=4,
              jax_fns=fns, torch_fn=torch_mlp, notes=notes)


def cases(ctx) -> Sequence[tuple[Case, object]]:
  dtype = jnp.float32 if ctx.platform == "cpu" else jnp.bfloat16
  if ctx.quick:
    rows, n, tokens, d, hidden = 4096, 1024, 512, 512, 1536
  else:
    rows, n, tokens, d, hidden = 16384, 4096, 4096, 1024, 4096
  return [
      (softmax_case(rows, n, dtype), dtype),
      (bias_act_case(rows, n, "gelu", dtype), dtype),
      (glu_case(rows, n, "silu", dtype), dtype),
      (gated_mlp_case(tokens, d, hidden, dtype), dtype),
  ]


def run(ctx) -> list[Record]:
  records: list[Record] = []
  for case, dtype in cases(ctx):
    records.extend(run_case(ctx, case, dtype))
  return records
