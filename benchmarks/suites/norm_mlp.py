"""Benchmark rows for the activation family: softmax, bias + activation, SwiGLU, the GatedMLP
block (LLaMA's MLP) and the grouped matmul of Mixture-of-Experts MLPs. The ``norm`` suite
appends these records to its own; ``run(ctx)`` also runs alone.

Every case times forward + backward (one jit-compiled step returning the output and all
gradients, or one torch autograd step), interleaved across implementations:

- ``jaxfuse-<implementation>`` for each implementation the op has (its registry entry; the
  GatedMLP block's are the GLU op's): ``jaxfuse-xla``, ``jaxfuse-pallas`` (timed where it
  compiles, GPUs) and ``jaxfuse-triton`` (only where it compiles);
- ``jax-unfused``: the plain jnp chain, differentiated by JAX;
- ``torch-eager`` and ``torch-compile`` (``torch.compile`` of the function, autograd's backward
  through it);
- ``tokamax-xla``: ``tokamax.gated_linear_unit`` in the GatedMLP case (tokamax has no standalone
  softmax, bias + activation or elementwise GLU).

The grouped matmul case (``grouped_matmul``: tokens sorted by expert, uneven expert sizes) has
``jax-unfused`` = ``jax.lax.ragged_dot`` differentiated by JAX and torch's loop over the
experts; its Pallas and Triton rows appear only where they compile.

``ratio`` is the median time over the fastest of torch eager, torch.compile and tokamax in the
same case. On CPU, Pallas rows are not timed (interpret mode is for tests): they report the
kernels' ``bytes_moved`` at the benchmark shape and errors from an interpret-mode run at a
reduced row count (said in ``note``). Errors are against torch eager in the same dtype. In the
GatedMLP case every candidate's matmuls run at ``Precision.HIGHEST`` (torch's float32 matmuls
are full precision on CPU). Each record's ``sources`` says how each of its figures was
produced.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

import jaxfuse
from benchmarks import harness
from benchmarks import records as records_lib
from benchmarks.records import Record
from jaxfuse import ops
from jaxfuse.ops import activations
from jaxfuse.remat import mlp as blocks

SUITE = "norm"
PEERS = ("torch-eager", "torch-compile", "tokamax-xla")
REFERENCE = "torch-eager"
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


def _cotangent(y):
  return jax.random.normal(jax.random.key(99), y.shape, jnp.float32).astype(y.dtype)


def run_case(ctx, case: Case, dtype) -> list[Record]:
  import torch

  ctx.step(f"{case.name}: inputs")
  inputs = case.make_inputs(case.rows)
  g = _cotangent(case.jax_fns["jaxfuse-xla"](*inputs))
  tg = harness.to_torch(g)
  t_inputs = [harness.to_torch(x) for x in inputs]
  dt = jnp.dtype(dtype).name

  timed: dict[str, Callable] = {}
  steps: dict[str, Callable] = {}
  outputs: dict[str, object] = {}
  for impl, f in case.jax_fns.items():
    kind = harness.kernel_kind(impl)
    if kind is not None and not ctx.native(kind.name):
      continue
    steps[impl] = step = harness.jax_step(f, n_diff=case.n_diff)
    ctx.step(f"{case.name}: compile {impl}")
    outputs[impl] = step(inputs, g)
    timed[impl] = (lambda step: lambda: step(inputs, g))(step)
  ctx.step(f"{case.name}: torch.compile")
  torch_fns = {"torch-eager": case.torch_fn, "torch-compile": torch.compile(case.torch_fn)}
  for impl, fn in torch_fns.items():
    step = harness.torch_step(fn, n_diff=case.n_diff)
    outputs[impl] = step(t_inputs, tg)
    timed[impl] = (lambda step: lambda: step(t_inputs, tg))(step)

  ctx.step(f"{case.name}: timing {len(timed)} implementations")
  times = ctx.time(timed, warmup=1)

  records = []
  reference = outputs["torch-eager"]
  for impl in [*case.jax_fns, "torch-eager", "torch-compile"]:
    rec = Record(suite=SUITE, case=case.name, impl=impl, platform=ctx.platform, dtype=dt,
                 reference=REFERENCE, note=case.notes.get(impl))
    rec.set("time_ms", times.get(impl), harness.time_source(times.get(impl)))
    if impl in outputs and impl != "torch-eager":
      harness.set_errors(rec, harness.errors(outputs[impl], reference),
                         f"the timed step's own outputs against {REFERENCE}")
    ctx.step(f"{case.name}: {impl} residuals")
    if impl.startswith("torch"):
      rec.set("residual_bytes",
              harness.torch_residual_bytes(torch_fns[impl], t_inputs, n_diff=case.n_diff),
              records_lib.TORCH_RESIDUAL_SOURCE)
    else:
      with ctx.tracing(impl):  # traced only, never run
        rec.set("residual_bytes",
                harness.residual_bytes(case.jax_fns[impl], inputs, n_diff=case.n_diff),
                records_lib.JAX_RESIDUAL_SOURCE)
    if impl in steps:
      ctx.step(f"{case.name}: {impl} compiled figures")
      harness.record_compiled_figures(rec, steps[impl], inputs, g)
    if harness.kernel_kind(impl) is not None:
      _kernel_figures(ctx, case, impl, rec, inputs, g)
    records.append(rec)
  harness.ratio_to_fastest(records, PEERS)
  return records


def _kernel_figures(ctx, case, impl, rec, inputs, g):
  """bytes_moved of the Pallas kernels (counted from their grid and block specs); on CPU, errors
  from interpret mode at a reduced shape."""
  f = case.jax_fns[impl]
  kind = harness.kernel_kind(impl)
  if harness.runs_cpu_kernels(impl):
    harness.record_cpu_kernel_figures(rec, f, inputs, g, n_diff=case.n_diff)
    return
  if kind.interpretable:
    ctx.step(f"{case.name}: Pallas bytes moved")
    rec.set("bytes_moved", harness.step_bytes_moved(f, inputs, g, n_diff=case.n_diff),
            records_lib.KERNEL_BYTES_SOURCE)
  if ctx.native(kind.name):
    return
  if not kind.interpretable:
    rec.add_note("Triton kernels run on GPUs (tested on CPU with Triton's interpreter)")
    return
  rows = min(case.rows, INTERPRET_ROWS)
  ctx.step(f"{case.name}: Pallas interpret run at {rows} rows")
  small = case.make_inputs(rows)
  g_small = _cotangent(case.jax_fns["jaxfuse-xla"](*small))
  with jaxfuse.pallas_interpret():
    got = harness.jax_step(f, n_diff=case.n_diff)(small, g_small)
  want = harness.torch_step(case.torch_fn, n_diff=case.n_diff)(
      [harness.to_torch(x) for x in small], harness.to_torch(g_small))
  harness.set_errors(rec, harness.errors(got, want),
                     f"Pallas interpret mode at {rows} rows against {REFERENCE}")
  rec.add_note(f"errors from interpret mode at {rows} rows (CPU)")


# Cases ------------------------------------------------------------------------------------------


def _normal(key, shape, dtype, scale=1.0):
  return (scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)).astype(dtype)


def _jax_fns(op_name: str, call: Callable, unfused: Callable) -> dict[str, Callable]:
  """jaxfuse's rows of ``op_name`` that run here (natively, or in Pallas' interpret mode: the
  Triton rows only where they compile), then ``jax-unfused``."""
  return {**harness.jaxfuse_rows(op_name, call, keep=harness.runs), "jax-unfused": unfused}


def softmax_case(rows, n, dtype) -> Case:
  import torch

  return Case(
      name=f"softmax {rows}x{n}",
      make_inputs=lambda r: [_normal(0, (r, n), dtype, 3.0)],
      rows=rows, n_diff=1,
      jax_fns=_jax_fns("softmax", ops.softmax, lambda x: jax.nn.softmax(x, axis=-1)),
      torch_fn=lambda x: torch.softmax(x, dim=-1),
      notes={"jaxfuse-xla": "tokamax has no softmax op: no tokamax-xla row"})


def _torch_act(act):
  import torch.nn.functional as F  # noqa: N812

  return {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu,
          "relu": F.relu}[act]


def _activation_case(name: str, op_name: str, act: str, make_inputs, rows: int,
                     chain: Callable, note: str) -> Case:
  """A case of an op of two differentiated inputs and an activation (bias_act, glu):
  ``chain(act, a, b)`` is its unfused computation, with JAX's or torch's activation."""
  fn, torch_act = activations.get(act), _torch_act(act)
  return Case(
      name=name, make_inputs=make_inputs, rows=rows, n_diff=2,
      jax_fns=_jax_fns(op_name, functools.partial(getattr(ops, op_name), activation=act),
                       functools.partial(chain, fn)),
      torch_fn=functools.partial(chain, torch_act),
      notes={"jaxfuse-xla": note})


def bias_act_case(rows, n, act, dtype) -> Case:
  return _activation_case(
      f"bias+{act} {rows}x{n}", "bias_act", act,
      lambda r: [_normal(1, (r, n), dtype, 2.0), _normal(2, (n,), dtype)], rows,
      lambda fn, x, b: fn(x + b), "tokamax has no bias + activation op: no tokamax-xla row")


def glu_case(rows, h, act, dtype) -> Case:
  name = {"silu": "swiglu", "gelu": "geglu", "relu": "reglu"}.get(act, f"glu-{act}")
  return _activation_case(
      f"{name} {rows}x{h}", "glu", act,
      lambda r: [_normal(3, (r, h), dtype, 2.0), _normal(4, (r, h), dtype)], rows,
      lambda fn, a, b: fn(a) * b,
      "tokamax has no elementwise GLU (its gated_linear_unit includes the projections): no "
      "tokamax-xla row, see the gated_mlp case")


def _plain_gated_mlp(x, wg, wu, wd):
  hp = jax.lax.Precision.HIGHEST
  gate = jnp.matmul(x, wg, precision=hp)
  up = jnp.matmul(x, wu, precision=hp)
  return jnp.matmul(jax.nn.silu(gate) * up, wd, precision=hp)


def gated_mlp_case(tokens, d, hidden, dtype) -> Case:
  import torch.nn.functional as F  # noqa: N812

  def make(rows):
    scale_in, scale_hidden = 1 / math.sqrt(d), 1 / math.sqrt(hidden)
    return [_normal(5, (rows, d), dtype), _normal(6, (d, hidden), dtype, scale_in),
            _normal(7, (d, hidden), dtype, scale_in), _normal(8, (hidden, d), dtype, scale_hidden)]

  def torch_mlp(x, wg, wu, wd):
    # LLaMA's MLP on the same (in, out) weights: down_proj(silu(gate_proj(x)) * up_proj(x)).
    return (F.silu(x @ wg) * (x @ wu)) @ wd

  # The block's kernels are the GLU op's.
  fns = _jax_fns("glu", blocks.gated_mlp, _plain_gated_mlp)
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


def _group_sizes(rows: int, experts: int) -> jax.Array:
  """int32 ``[experts]`` summing to ``rows``: tokens routed to experts of uneven popularity
  (a fixed draw, so every row count gets the same proportions)."""
  logits = jnp.linspace(0.0, 1.5, experts)   # the most popular expert ~4.5x the least
  ids = jax.random.categorical(jax.random.key(11), logits, shape=(rows,))
  return jnp.bincount(ids, length=experts).astype(jnp.int32)


def grouped_matmul_case(tokens, d, hidden, experts, dtype, ctx) -> Case:
  """A Mixture-of-Experts projection: ``tokens`` rows sorted by expert, each expert's rows
  times its own ``[d, hidden]`` weight, forward and both gradients. On CPU only the rows that
  compile run (the kernels' interpret mode is for tests)."""
  from jaxfuse.testing.torch_ref import grouped_matmul as torch_gmm

  hp = jax.lax.Precision.HIGHEST

  def make(rows):
    return [_normal(12, (rows, d), dtype), _normal(13, (experts, d, hidden), dtype,
                                                   1 / math.sqrt(d)),
            _group_sizes(rows, experts)]

  def plain(lhs, rhs, sizes):
    out = jax.lax.ragged_dot(lhs, rhs, sizes, precision=hp, preferred_element_type=jnp.float32)
    return out.astype(lhs.dtype)

  fns = {**harness.jaxfuse_rows("grouped_matmul", ops.grouped_matmul,
                                keep=lambda impl: impl == "xla" or ctx.native(impl)),
         "jax-unfused": plain}
  notes = {"jax-unfused": "jax.lax.ragged_dot, differentiated by JAX",
           "torch-eager": "a loop over the experts (jaxfuse.testing.torch_ref.grouped_matmul)"}
  if not ctx.native("pallas"):
    notes["jaxfuse-xla"] = ("the Pallas and Triton rows run where they compile (GPUs); their "
                            "kernels are tested in interpret mode")
  return Case(name=f"grouped_matmul {tokens}x{d}->{hidden} experts={experts}", make_inputs=make,
              rows=tokens, n_diff=2, jax_fns=fns, torch_fn=torch_gmm.grouped_matmul,
              notes=notes)


def qk_norm_rope_case(tokens, heads, d, dtype) -> Case:
  """Qwen3's query norm and rotary embedding on ``[tokens, heads, head_dim]`` (the positions
  0..tokens-1); unfused: RMSNorm, then the rotation, each a pass over the heads."""
  import torch

  from jaxfuse.testing.torch_ref import normalization as torch_norm

  half = d // 2
  angles = jnp.arange(tokens, dtype=jnp.float32)[:, None] * 10000.0 ** (
      -jnp.arange(half, dtype=jnp.float32) / half)
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  t_cos, t_sin = (torch.from_numpy(harness.to_numpy(t)) for t in (cos, sin))

  def unfused(x, w):
    return ops.rotary_embedding(ops.rms_norm_reference(x, w), jnp.arange(x.shape[0]))

  return Case(
      name=f"qk_norm_rope {tokens}x{heads}x{d}",
      make_inputs=lambda r: [_normal(9, (r, heads, d), dtype, 2.0),
                             _normal(10, (d,), dtype)],
      rows=tokens, n_diff=2,
      jax_fns=_jax_fns("qk_norm_rope",
                       lambda x, w, implementation: ops.qk_norm_rope(
                           x, w, cos[:x.shape[0]], sin[:x.shape[0]],
                           implementation=implementation), unfused),
      torch_fn=lambda x, w: torch_norm.qk_norm_rope(x, w, t_cos[:x.shape[0]],
                                                    t_sin[:x.shape[0]]),
      notes={"jax-unfused": "jaxfuse.ops.rms_norm_reference, then rotary_embedding",
             "jaxfuse-xla": "tokamax has no query/key norm with rotary: no tokamax-xla row"})


def cases(ctx) -> Sequence[tuple[Case, object]]:
  dtype = jnp.float32 if ctx.platform == "cpu" else jnp.bfloat16
  if ctx.quick:
    rows, n, tokens, d, hidden = 4096, 1024, 512, 512, 1536
    moe = (1024, 256, 704, 8)
  else:
    rows, n, tokens, d, hidden = 16384, 4096, 4096, 1024, 4096
    moe = (4096, 1024, 2816, 8)   # tokens, model -> expert hidden, experts
  return [
      (softmax_case(rows, n, dtype), dtype),
      (bias_act_case(rows, n, "gelu", dtype), dtype),
      (glu_case(rows, n, "silu", dtype), dtype),
      (gated_mlp_case(tokens, d, hidden, dtype), dtype),
      (qk_norm_rope_case(rows, 8 if ctx.quick else 16, 128, dtype), dtype),
      (grouped_matmul_case(*moe, dtype, ctx), dtype),
  ]


def run(ctx) -> list[Record]:
  records: list[Record] = []
  for case, dtype in cases(ctx):
    records.extend(run_case(ctx, case, dtype))
  return records
