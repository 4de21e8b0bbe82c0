"""Causal self-attention, forward + backward, against torch SDPA and the JAX attention peers.

Every case is ``causal T=<len> H=8 D=64`` with batch 1. Each implementation runs one training
step of the attention alone (output and the gradients of q, k and v for a random cotangent),
timed interleaved with the others. ``residual_bytes`` is what the backward keeps beyond q, k and
v; errors are against torch's ``scaled_dot_product_attention`` in the same dtype. FLOPs count
the causal half once: 4·T²·D per head forward (two matmuls) and 10·T²·D backward (five),
halved. On CPU the Pallas kernels run only in interpret mode: their row has no time, its
``bytes_moved`` comes from the kernels' cost estimates at the full shape and its errors from an
interpret-mode run at a small shape.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxfuse
from benchmarks import harness
from benchmarks.harness import Context, max_abs_err
from benchmarks.records import Record, set_ratios
from jaxfuse.metrics import bytes_moved, residual_bytes, torch_residual_bytes
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
SMALL_PALLAS = dict(t=128, heads=2)   # the interpret-mode run on CPU
FP32_RTOL, FP32_ATOL = 1e-5, 1e-5


def flops(t: int, causal: bool = True) -> float:
  """Forward + backward FLOPs of one step, the causal half counted once."""
  per_head = 14 * t * t * HEAD_DIM
  return BATCH * HEADS * per_head * (0.5 if causal else 1.0)


def _torch_device():
  import torch

  return "cuda" if torch.cuda.is_available() else "cpu"


class _Torch:
  """torch SDPA on [b, h, t, d] leaf tensors holding the same values as the JAX inputs."""

  def __init__(self, q, k, v, g):
    import torch

    self.torch = torch
    device = _torch_device()
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

    def leaf(x, grad):
      t = torch.from_numpy(np.array(x.astype(jnp.float32))).to(device)
      t = t.to(dtypes[jnp.dtype(x.dtype).name]).transpose(1, 2).contiguous()
      return t.requires_grad_(grad)

    self.q, self.k, self.v = (leaf(x, True) for x in (q, k, v))
    self.g = leaf(g, False)

  def forward(self):
    return self.torch.nn.functional.scaled_dot_product_attention(self.q, self.k, self.v,
                                                                is_causal=True)

  def step(self):
    for t in (self.q, self.k, self.v):
      t.grad = None
    out = self.forward()
    out.backward(self.g)
    if self.q.is_cuda:
      self.torch.cuda.synchronize()
    return out

  def results(self):
    """Output and grads in the JAX layout ([b, t, h, d]), as numpy float64."""
    out = self.step()
    return [x.detach().transpose(1, 2).double().cpu().numpy()
            for x in (out, self.q.grad, self.k.grad, self.v.grad)]

  def residual_bytes(self):
    return torch_residual_bytes(lambda: self.forward().sum(), exclude=[self.q, self.k, self.v])


# On CPUs the wall time of torch's kernel comes from all cores (OpenMP), while XLA runs the tiled
# jaxfuse program on one; the CPU seconds per step show each one's efficiency.
CPU_TIMED = ("torch-sdpa", "jaxfuse-xla")


def _cpu_time_ms(fn, runs: int = 3) -> float:
  """Least process CPU time (all threads) of ``runs`` calls of ``fn``, in ms."""
  best = float("inf")
  for _ in range(runs):
    start = time.process_time()
    jax.block_until_ready(fn())
    best = min(best, (time.process_time() - start) * 1e3)
  return best


def _jax_step(fn):
  """jit(inputs, cotangent -> (output, dq, dk, dv))."""
  def step(q, k, v, g):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(g))

  return jax.jit(step)


def _inputs(t, heads, dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  return [jax.random.normal(key, (BATCH, t, heads, HEAD_DIM)).astype(dtype) for key in keys]


def _errors(got, want):
  out_err = max_abs_err([got[0]], [want[0]])
  grad_err = max_abs_err(list(got[1:]), list(want[1:]))
  within = all(np.allclose(np.asarray(x, np.float64), y, rtol=FP32_RTOL, atol=FP32_ATOL)
               for x, y in zip(got, want))
  return out_err, grad_err, within


SLOW_PEERS = ("jax-unfused", "jax-nn", "tokamax-xla", "tokamax-xla_chunked")


def _candidates(ctx: Context, t: int):
  """name -> (differentiable fn of q, k, v, note) for the JAX implementations at length t."""
  out = {}
  out["jaxfuse-xla"] = (lambda q, k, v: attention(q, k, v, causal=True, implementation="xla"),
                        None)
  if ctx.native("pallas"):
    out["jaxfuse-pallas"] = (
        lambda q, k, v: attention(q, k, v, causal=True, implementation="pallas"), None)
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


def _pallas_cpu_errors() -> tuple[float | None, float | None, bool | None, str]:
  """Errors of the Pallas kernels in interpret mode at a small shape, against torch."""
  t, heads = SMALL_PALLAS["t"], SMALL_PALLAS["heads"]
  q, k, v, g = _inputs(t, heads, jnp.float32, seed=1)
  with jaxfuse.pallas_interpret():
    got = _jax_step(lambda q, k, v: attention(q, k, v, causal=True,
                                              implementation="pallas"))(q, k, v, g)
  want = _Torch(q, k, v, g).results()
  out_err, grad_err, within = _errors(got, want)
  return out_err, grad_err, within, f"interpret mode at T={t} H={heads}"


def run(ctx: Context) -> list[Record]:
  on_gpu = ctx.platform == "gpu"
  dtype = jnp.bfloat16 if on_gpu else jnp.float32
  dtype_name = jnp.dtype(dtype).name
  records: list[Record] = []
  pallas_small = None
  if not ctx.native("pallas"):
    ctx.step("pallas kernels in interpret mode (errors only)")
    pallas_small = _pallas_cpu_errors()

  for t in (QUICK_LENGTHS if ctx.quick else FULL_LENGTHS):
    case = f"causal T={t} H={HEADS} D={HEAD_DIM}"
    q, k, v, g = _inputs(t, HEADS, dtype)
    ref = _Torch(q, k, v, g)
    ctx.step(f"{case}: torch reference")
    want = ref.results()
    case_flops = flops(t)

    def record(impl, **kw):
      rec = Record(suite="attention", case=case, impl=impl, platform=ctx.platform,
                   dtype=dtype_name, flops=case_flops, reference="torch-sdpa", **kw)
      records.append(rec)
      return rec

    candidates = _candidates(ctx, t)
    timers = {"torch-sdpa": ref.step}
    rows = {"torch-sdpa": record("torch-sdpa", residual_bytes=ref.residual_bytes(),
                                 note="torch.nn.functional.scaled_dot_product_attention")}
    for name, (fn, note) in candidates.items():
      ctx.step(f"{case}: {name}")
      loss = lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32))  # noqa: E731
      notes = [n for n in (note,) if n]
      try:
        kept = residual_bytes(loss, q, k, v)
      except Exception as e:  # noqa: BLE001 - a peer that cannot run here is reported, not fatal.
        record(name, note=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        continue
      if not _timed(ctx, name, t):
        limit = GPU_XLA_MAX_T if ctx.platform == "gpu" else QUICK_SLOW_MAX_T
        notes.append(f"not run above T={limit}{'' if ctx.platform == 'gpu' else ' in --quick'} "
                     f"(slow here); residual bytes from its trace")
        record(name, residual_bytes=kept, note="; ".join(notes))
        continue
      step = _jax_step(fn)
      try:
        got = step(q, k, v, g)
      except Exception as e:  # noqa: BLE001
        record(name, note=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        continue
      out_err, grad_err, within = _errors(got, want)
      if dtype == jnp.float32 and name.startswith("jaxfuse"):
        notes.append(f"grads {'within' if within else 'NOT within'} rtol={FP32_RTOL:g} "
                     f"atol={FP32_ATOL:g} of torch")
      moved = bytes_moved(step, q, k, v, g) if name == "jaxfuse-pallas" else None
      rows[name] = record(name, residual_bytes=kept, bytes_moved=moved, max_abs_err=out_err,
                          max_grad_err=grad_err, note="; ".join(notes) or None)
      timers[name] = lambda step=step: step(q, k, v, g)

    if pallas_small is not None:
      out_err, grad_err, within, where = pallas_small
      pallas = lambda q, k, v: jnp.sum(attention(q, k, v, causal=True,  # noqa: E731
                                                 implementation="pallas"))
      with jaxfuse.pallas_interpret():
        kept = residual_bytes(pallas, q, k, v)
        moved = bytes_moved(_jax_step(lambda q, k, v: attention(
            q, k, v, causal=True, implementation="pallas")), q, k, v, g)
      record("jaxfuse-pallas", residual_bytes=kept, bytes_moved=moved, max_abs_err=out_err,
             max_grad_err=grad_err,
             note=(f"not timed: no GPU, Pallas runs only in interpret mode here; errors from "
                   f"{where} (grads {'within' if within else 'NOT within'} rtol={FP32_RTOL:g} "
                   f"atol={FP32_ATOL:g}); bytes_moved from the kernels' cost estimates"))
    for name, note in _skipped_notes(t):
      record(name, note=note)

    ctx.step(f"{case}: timing {len(timers)} implementations")
    times = ctx.time(timers)
    cpu_ms = {name: _cpu_time_ms(timers[name]) for name in CPU_TIMED if name in timers}
    for name, t_ms in times.items():
      rows[name].time_ms = t_ms
      tflops = case_flops / (t_ms["median"] * 1e-3) / 1e12
      cpu = (f"process CPU time {cpu_ms[name]:.0f} ms per step (all threads)"
             if name in cpu_ms and ctx.platform == "cpu" else None)
      rows[name].note = "; ".join(n for n in (f"{tflops:.3f} TFLOP/s", cpu, rows[name].note) if n)
  set_ratios(records, "torch-sdpa")
  return records


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


__all__ = ["flops", "plot", "run"]
