"""Causal self-attention, forward + backward, against torch SDPA and the JAX attention peers.

Every case is ``causal T=<len> H=8 D=64`` with batch 1. Each implementation runs one training
step of the attention alone (output and the gradients of q, k and v for a random cotangent),
timed interleaved with the others. ``residual_bytes`` is what the backward keeps beyond q, k and
v; errors are against torch's ``scaled_dot_product_attention`` in the same dtype. FLOPs count
the causal half once: 4·T²·D per head forward (two matmuls) and 10·T²·D backward (five),
halved. On CPU the Pallas kernels run only in interpret mode: their row has no time, its
``bytes_moved`` is counted by ``jaxfuse.metrics.bytes_moved`` at the full shape and its errors
come from an interpret-mode run at a small shape. The jax-triton kernels (``jaxfuse-triton``)
are timed on GPUs; on CPU the op runs with its kernels in Triton's interpreter
(``benchmarks/triton_interpreted.py``) at the same small shape, for its errors and its
``bytes_moved`` (counted there: the interpreter takes seconds at T=128 and minutes at the
longer cases), and its residuals are traced at each case's shape through a stand-in jax-triton.
Timed JAX rows also carry XLA's cost analysis
(``xla_bytes_accessed``) and compiled temp memory (``temp_bytes``) of their step; each record's
``sources`` says how each of its figures was produced.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxfuse
from benchmarks import harness
from benchmarks import records as rec
from benchmarks import triton_interpreted
from benchmarks.harness import Context
from benchmarks.records import Record
from jaxfuse.ops import attention, attention_reference

HEADS, HEAD_DIM, BATCH = 8, 64, 1
FULL_LENGTHS = (256, 512, 1024, 2048, 4096, 8192)
QUICK_LENGTHS = (256, 512, 1024, 2048)
# Peers that keep O(T²) per head: skipped above this length (the [T, T] scores of 8 heads at
# T=8192 are 2 GiB per copy in float32).
DENSE_MAX_T = 4096
# Slow peers: skipped above this length in quick mode, to keep it within about two minutes.
QUICK_SLOW_MAX_T = 1024
GPU_XLA_MAX_T = 2048
SMALL_PALLAS = dict(t=128, heads=2)   # the interpret-mode runs on CPU (Pallas' and Triton's)
FP32_RTOL, FP32_ATOL = 1e-5, 1e-5
REFERENCE = "torch-sdpa"
FLOPS_SOURCE = "modelled: 14·T²·D per head (4 forward, 10 backward), the causal half"


def flops(t: int, causal: bool = True) -> float:
  """Forward + backward FLOPs of one step, the causal half counted once."""
  per_head = 14 * t * t * HEAD_DIM
  return BATCH * HEADS * per_head * (0.5 if causal else 1.0)


class _Torch:
  """torch SDPA on [b, h, t, d] tensors holding the same values as the JAX inputs."""

  def __init__(self, q, k, v, g):
    self.args = [harness.to_torch(x).transpose(1, 2).contiguous() for x in (q, k, v)]
    self.g = harness.to_torch(g).transpose(1, 2).contiguous()
    self._step = harness.torch_step(self.forward)

  @staticmethod
  def forward(q, k, v):
    import torch

    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

  def step(self):
    return self._step(self.args, self.g)

  def results(self):
    """Output and grads in the JAX layout ([b, t, h, d]), as one step's (outputs, gradients)."""
    out, grads = self.step()
    out, *grads = (harness.to_numpy(x.transpose(1, 2)) for x in (out, *grads))
    return out, grads

  def residual_bytes(self):
    return harness.torch_residual_bytes(self.forward, self.args)


# On CPUs the wall time of torch's kernel comes from all cores (OpenMP), and XLA splits only its
# larger products over them; the CPU seconds per step show each one's efficiency.
CPU_TIMED = ("torch-sdpa", "jaxfuse-xla", "jaxfuse-cpu")


def _cpu_time_ms(fn, runs: int = 3) -> float:
  """Least process CPU time (all threads) of ``runs`` calls of ``fn``, in ms."""
  best = float("inf")
  for _ in range(runs):
    start = time.process_time()
    jax.block_until_ready(fn())
    best = min(best, (time.process_time() - start) * 1e3)
  return best


def _inputs(t, heads, dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  return [jax.random.normal(key, (BATCH, t, heads, HEAD_DIM)).astype(dtype) for key in keys]


def _errors(got, want):
  """Output and gradient errors of one step against torch's, and whether all are within the
  float32 tolerance."""
  out_err, grad_err = harness.errors(got, want)
  within = all(np.allclose(harness.to_numpy(x), y, rtol=FP32_RTOL, atol=FP32_ATOL)
               for x, y in zip([got[0], *got[1]], [want[0], *want[1]]))
  return out_err, grad_err, within


SLOW_PEERS = ("jax-unfused", "jax-nn", "tokamax-xla", "tokamax-xla_chunked")


def _attention(q, k, v, *, implementation):
  return attention(q, k, v, causal=True, implementation=implementation)


def _candidates(ctx: Context, t: int):
  """name -> (differentiable fn of q, k, v, note) for the JAX implementations at length t:
  jaxfuse's that compile here, then the peers."""
  out = {name: (fn, None)
         for name, fn in harness.jaxfuse_rows("attention", _attention, keep=ctx.native).items()}
  dense = t <= DENSE_MAX_T
  if dense:
    out["jax-unfused"] = (lambda q, k, v: attention_reference(q, k, v, causal=True),
                          "softmax(q kᵀ) v in plain jnp")
    out["jax-nn"] = (lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
                     "jax.nn.dot_product_attention, implementation=None (XLA)")
    if ctx.platform == "gpu":
      out["jax-nn-cudnn"] = (
          lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                       implementation="cudnn"), "cuDNN")
  tokamax = harness.tokamax()
  if tokamax is not None:
    impls = ["xla", "xla_chunked"] + (["triton", "mosaic"] if ctx.platform == "gpu" else [])
    for impl in impls:
      if impl == "xla" and not dense:
        continue
      out[f"tokamax-{impl}"] = (
          lambda q, k, v, impl=impl: tokamax.dot_product_attention(
              q, k, v, is_causal=True, implementation=impl), None)
  return out


def _timed(ctx: Context, name: str, t: int) -> bool:
  """Quick mode runs the slow peers only up to QUICK_SLOW_MAX_T (CPU). On GPUs the XLA path
  (a fallback there: thousands of small tile launches) runs only up to GPU_XLA_MAX_T."""
  if ctx.platform == "gpu":
    return not (name == "jaxfuse-xla" and t > GPU_XLA_MAX_T)
  return not (ctx.quick and t > QUICK_SLOW_MAX_T and name in SLOW_PEERS)


def _skipped_notes(t: int) -> list[tuple[str, str]]:
  notes = []
  if t > DENSE_MAX_T:
    gib = 4 * HEADS * t * t / 2**30
    for name in ("jax-unfused", "jax-nn", "tokamax-xla"):
      notes.append((name, f"skipped at T={t}: keeps [T, T] scores ({gib:.0f} GiB per copy)"))
  if harness.tokamax() is None:
    notes.append(("tokamax-xla", "skipped: tokamax is not installed (pip install "
                                  "'jaxfuse[compare]')"))
  return notes


def _pallas_cpu_errors(fn) -> tuple[float | None, float | None, bool | None, str]:
  """Errors of the Pallas kernels (``fn``) in interpret mode at a small shape, against
  torch."""
  t, heads = SMALL_PALLAS["t"], SMALL_PALLAS["heads"]
  q, k, v, g = _inputs(t, heads, jnp.float32, seed=1)
  with jaxfuse.pallas_interpret():
    got = harness.jax_step(fn)((q, k, v), g)
  want = _Torch(q, k, v, g).results()
  out_err, grad_err, within = _errors(got, want)
  return out_err, grad_err, within, f"interpret mode at T={t} H={heads}"


def _triton_cpu_figures(fn):
  """Errors (and whether within the float32 tolerance), bytes moved and where, of the op with
  its Triton kernels (``fn``) in Triton's interpreter at the small shape, against torch."""
  t, heads = SMALL_PALLAS["t"], SMALL_PALLAS["heads"]
  q, k, v, g = _inputs(t, heads, jnp.float32, seed=1)
  got, traffic = triton_interpreted.run_step(fn, (q, k, v), g)
  out_err, grad_err, within = _errors(got, _Torch(q, k, v, g).results())
  return out_err, grad_err, within, traffic.bytes, f"T={t} H={heads}"


def _interpreted(ctx: Context) -> dict[str, tuple[object, tuple | None]]:
  """jaxfuse's kernel rows that do not compile here: row -> (fn, its figures at the small
  shape), from Pallas' interpret mode (a kind that interprets) or Triton's interpreter (None
  where it does not run here)."""
  out = {}
  rows = harness.jaxfuse_rows("attention", _attention, kernels_only=True,
                              keep=lambda impl: not ctx.native(impl))
  for name, fn in rows.items():
    if harness.kernel_kind(name).interpretable:
      ctx.step("pallas kernels in interpret mode (errors only)")
      out[name] = (fn, _pallas_cpu_errors(fn))
    elif triton_interpreted.available():
      ctx.step("triton kernels in Triton's interpreter (errors and bytes moved)")
      out[name] = (fn, _triton_cpu_figures(fn))
    else:
      out[name] = (fn, None)
  return out


def _failure(e: Exception) -> str:
  return f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"


def run(ctx: Context) -> list[Record]:
  on_gpu = ctx.platform == "gpu"
  dtype = jnp.bfloat16 if on_gpu else jnp.float32
  dtype_name = jnp.dtype(dtype).name
  records: list[Record] = []
  interpreted = _interpreted(ctx)

  for t in (QUICK_LENGTHS if ctx.quick else FULL_LENGTHS):
    case = f"causal T={t} H={HEADS} D={HEAD_DIM}"
    q, k, v, g = _inputs(t, HEADS, dtype)
    args = (q, k, v)
    ref = _Torch(q, k, v, g)
    ctx.step(f"{case}: torch reference")
    want = ref.results()
    error_source = f"the timed step's own outputs against {REFERENCE}"

    def record(impl, residual=None, residual_source=rec.JAX_RESIDUAL_SOURCE, note=None):
      r = Record(suite="attention", case=case, impl=impl, platform=ctx.platform,
                 dtype=dtype_name, reference=REFERENCE, note=note)
      r.set("flops", flops(t), FLOPS_SOURCE)
      r.set("residual_bytes", residual, residual_source)
      records.append(r)
      return r

    candidates = _candidates(ctx, t)
    timers = {"torch-sdpa": ref.step}
    rows = {"torch-sdpa": record("torch-sdpa", ref.residual_bytes(), rec.TORCH_RESIDUAL_SOURCE,
                                 note="torch.nn.functional.scaled_dot_product_attention")}
    steps = {}
    for name, (fn, note) in candidates.items():
      ctx.step(f"{case}: {name}")
      notes = [n for n in (note,) if n]
      try:
        kept = harness.residual_bytes(fn, args)
      except Exception as e:  # noqa: BLE001 - a peer that cannot run here is reported, not fatal.
        record(name, note=_failure(e))
        continue
      if not _timed(ctx, name, t):
        limit = GPU_XLA_MAX_T if ctx.platform == "gpu" else QUICK_SLOW_MAX_T
        notes.append(f"not run above T={limit}{'' if ctx.platform == 'gpu' else ' in --quick'} "
                     f"(slow here); residual bytes from its trace")
        record(name, kept, note="; ".join(notes))
        continue
      step = harness.jax_step(fn)
      try:
        got = step(args, g)
      except Exception as e:  # noqa: BLE001
        record(name, note=_failure(e))
        continue
      out_err, grad_err, within = _errors(got, want)
      if dtype == jnp.float32 and name.startswith("jaxfuse"):
        notes.append(f"grads {'within' if within else 'NOT within'} rtol={FP32_RTOL:g} "
                     f"atol={FP32_ATOL:g} of torch")
      r = rows[name] = record(name, kept, note="; ".join(notes) or None)
      harness.set_errors(r, (out_err, grad_err), error_source)
      kind = harness.kernel_kind(name)
      if kind is not None and kind.interpretable:
        r.set("bytes_moved", harness.step_bytes_moved(fn, args, g), rec.KERNEL_BYTES_SOURCE)
      elif harness.runs_cpu_kernels(name):
        pass   # their figures are set with the compiled ones, below
      elif kind is not None:  # the Triton kernels
        r.add_note("bytes_moved null: Triton compiles here (no interpreter to count in)")
      steps[name] = step
      timers[name] = lambda step=step: step(args, g)

    for name, (fn, small) in interpreted.items():
      if harness.kernel_kind(name).interpretable:
        out_err, grad_err, within, where = small
        with jaxfuse.pallas_interpret():  # traced, never run
          kept = harness.residual_bytes(fn, args)
        moved = harness.step_bytes_moved(fn, args, g)
        r = record(name, kept, f"{rec.JAX_RESIDUAL_SOURCE} (traced in interpret mode)",
                   note=(f"not timed: no GPU, Pallas runs only in interpret mode here; errors "
                         f"from {where} (grads {'within' if within else 'NOT within'} "
                         f"rtol={FP32_RTOL:g} atol={FP32_ATOL:g})"))
        r.set("bytes_moved", moved, rec.KERNEL_BYTES_SOURCE)
        harness.set_errors(r, (out_err, grad_err), f"Pallas {where} against {REFERENCE}")
      elif small is not None:  # the Triton kernels, in Triton's interpreter
        out_err, grad_err, within, moved, where = small
        kept = triton_interpreted.residual_bytes(fn, args)
        r = record(name, kept, rec.JAX_RESIDUAL_SOURCE + triton_interpreted.RESIDUAL_SUFFIX,
                   note=(f"{triton_interpreted.NOTE.format(where=where)} (grads "
                         f"{'within' if within else 'NOT within'} rtol={FP32_RTOL:g} "
                         f"atol={FP32_ATOL:g})"))
        r.set("bytes_moved", moved, triton_interpreted.BYTES_SOURCE.format(where=where))
        harness.set_errors(r, (out_err, grad_err), triton_interpreted.ERRORS_SOURCE.format(
            where=where, reference=REFERENCE))
      else:
        record(name, note="not run: Triton needs a GPU (or triton, for its interpreter)")
    for name, note in _skipped_notes(t):
      record(name, note=note)

    ctx.step(f"{case}: timing {len(timers)} implementations")
    times = ctx.time(timers)
    cpu_ms = {name: _cpu_time_ms(timers[name]) for name in CPU_TIMED if name in timers}
    for name, t_ms in times.items():
      rows[name].set("time_ms", t_ms, harness.time_source(t_ms))
      tflops = flops(t) / (t_ms["median"] * 1e-3) / 1e12
      cpu = (f"process CPU time {cpu_ms[name]:.0f} ms per step (all threads)"
             if name in cpu_ms and ctx.platform == "cpu" else None)
      rows[name].note = "; ".join(n for n in (f"{tflops:.3f} TFLOP/s", cpu, rows[name].note) if n)
    for name, step in steps.items():
      ctx.step(f"{case}: {name} compiled figures")
      harness.record_compiled_figures(rows[name], step, args, g)
      if harness.runs_cpu_kernels(name):
        harness.record_cpu_kernel_figures(rows[name], candidates[name][0], args, g)
        rows[name].add_note("the kernels re-read their float32 copies of k and v (forward) and "
                            "of q and do (backward) tile by tile, from cache: not counted; "
                            "those copies are the kernels' own allocations, outside XLA's "
                            "temp_bytes (forward: k and v, backward: one head's q, do and dq "
                            "per thread, in float32)")
  harness.ratio_to_fastest(records, (REFERENCE,))
  return records


def headline(records) -> list[Record]:
  """Per length, torch SDPA and jaxfuse's rows."""
  return [r for r in records if r.impl == REFERENCE or r.impl.startswith("jaxfuse-")]


def plot(records, path: str) -> None:
  """Log-log: median fwd+bwd time and residual bytes against T, one line per implementation."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  def length(case):
    return int(case.split("T=")[1].split()[0])

  impls = list(dict.fromkeys(r.impl for r in records))
  colors = {impl: f"C{i}" for i, impl in enumerate(impls)}
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
  for ax, label, value in (
      (axes[0], "forward + backward time (ms)",
       lambda r: r.time_ms["median"] if r.time_ms else None),
      (axes[1], "residual bytes (MiB)",
       lambda r: r.residual_bytes / 2**20 if r.residual_bytes else None)):
    for impl in impls:
      points = sorted((length(r.case), value(r)) for r in records
                      if r.impl == impl and value(r) is not None)
      if points:
        xs, ys = zip(*points)
        jaxfuse = impl.startswith("jaxfuse")
        ax.plot(xs, ys, marker="o", label=impl, color=colors[impl],
                linestyle="--" if jaxfuse else "-", linewidth=2.5 if jaxfuse else 1.5)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length T (causal, H=8, D=64)")
    ax.set_ylabel(label)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
  platform = records[0].platform if records else "?"
  fig.suptitle(f"attention on {platform}")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


__all__ = ["flops", "headline", "plot", "run"]
