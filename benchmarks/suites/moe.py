"""Benchmark suite ``moe``: one Mixture-of-Experts block, forward + backward.

The block is Mixtral's sparse MoE MLP: a router ``[d, E]`` (softmax in float32, the top ``k``
experts of each token, their weights renormalized to sum to 1) and ``E`` SwiGLU experts
(``gate``, ``up`` ``[E, d, f]``, ``down`` ``[E, f, d]``, no biases), dropless. The full case
has 8 experts, top 2, d_model 1024, expert width 2816 and 4096 tokens; ``--quick`` 8 experts,
top 2, d_model 256, width 704 and 1024 tokens. Cases are named
``moe E<experts> top<k> d<d_model> f<width> T<tokens>``, float32.

A step is the block's output and the gradients of the tokens and of every parameter (router,
gate, up, down) under a random output cotangent: one jit-compiled ``jax.vjp``, or one torch
autograd step. Rows:

- ``jaxfuse-<implementation>``: :class:`jaxfuse.models.decoder_block.MoE` as the decoder runs
  it (``fused=True``: tokens sorted by expert, the experts' MLP as one op,
  :func:`jaxfuse.ops.grouped_mlp`; the backward keeps the router logits, the routing, the
  routed rows and the experts' outputs and recomputes the gate and up products once), one row
  per implementation of ``grouped_mlp`` that compiles here (its registry entry; on CPU, XLA).
- ``jaxfuse-<implementation>[keep gate]``: the same block with ``expert_keep=("gate",)``: the
  backward also keeps the experts' gate products (``[T·k, f]``) and recomputes only the up
  products (ten grouped products a step instead of eleven).
- ``jax-ragged_dot``: the same block in plain JAX, written out: the top-k routing, a stable
  sort of the token-expert pairs by expert, :func:`jax.lax.ragged_dot` for gate and up, SiLU
  times up, ``ragged_dot`` for down, the pairs put back in token order and summed with their
  weights. No recomputation: JAX keeps what its autodiff keeps.
- ``jax-dense``: every expert on every token (:func:`jaxfuse.blocks.moe.moe_mlp_dense`), the
  outputs weighted by routing weights that are zero outside each token's top k: ``E / k``
  times the products of the sparse rows, no gathers.
- ``torch-eager``: Hugging Face's ``transformers.models.mixtral.modeling_mixtral.
  MixtralSparseMoeBlock`` (``experts_implementation="eager"``: a loop over the experts that
  have tokens) holding the same weights: the router's ``gate.weight`` ``[E, d]``, the experts'
  fused ``gate_up_proj`` ``[E, 2f, d]`` and ``down_proj`` ``[E, d, f]``. Its parameters are
  given to the step by ``torch.func.functional_call``, so that they are the step's leaves.
- ``torch-eager[grouped_mm]``: the same block with ``experts_implementation="grouped_mm"``
  (what ``transformers`` picks by default for a model: ``torch.nn.functional.grouped_mm``, or
  its own fallback where that cannot run).

Every matmul is float32 at full precision (``HIGHEST`` on the JAX side, torch's float32 on the
other). Figures: ``time_ms`` (interleaved rounds) and ``ratio`` (to the fastest row of the
case); ``residual_bytes`` (JAX: ``jax.vjp`` residuals; torch: the tensors autograd saves);
``flops`` (JAX: the step's jaxpr as it runs, :func:`jaxfuse.metrics.flops`: loops counted
per iteration, recomputation included, a grouped product ``2·M·K·N`` over its rows; torch: an
analytic count of the router's and experts' products, forward and backward, as the sources
say; the note of each JAX row adds XLA's cost analysis of the lowered step, which counts a
loop's body once and a ``ragged_dot`` on CPU as the product over every group it computes); ``max_abs_err`` and ``max_grad_err`` against a float64 reference: Hugging Face's
``MixtralExperts`` run in float64 on the same weights, routed in float64 (its own router takes
the softmax in float32). Gradients are compared in the JAX layout (torch's are transposed and
split back).

Goal: jaxfuse's row at most 1.0x the fastest row's time, with at most 0.5x torch-eager's
residual bytes. The note of each jaxfuse row says whether it is met.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import harness
from benchmarks import records as rec
from benchmarks.records import Record
from jaxfuse import metrics
from jaxfuse.blocks import moe as moe_blocks
from jaxfuse.models import DecoderConfig
from jaxfuse.models.decoder_block import MoE

SUITE = "moe"
RAGGED = "jax-ragged_dot"
DENSE = "jax-dense"
TORCH = "torch-eager"
TORCH_GROUPED = "torch-eager[grouped_mm]"
# Rows of Hugging Face's block: impl -> its experts_implementation.
TORCH_ROWS = {TORCH: "eager", TORCH_GROUPED: "grouped_mm"}
REFERENCE = "hf-float64"
SEED = 0
# The goal: jaxfuse's time over the fastest row's at most TIME_GOAL, its residual bytes over
# torch-eager's at most 1 / RESIDUAL_GOAL.
TIME_GOAL, RESIDUAL_GOAL = 1.0, 2.0
_HIGHEST = jax.lax.Precision.HIGHEST

ERROR_SOURCE = (f"the timed step's own outputs against {REFERENCE}: transformers' "
                "MixtralExperts in float64 on the same weights, routed in float64; gradients "
                "of the tokens and of every parameter in the JAX layout")
JAX_FLOPS_SOURCE = ("the jitted step's jaxpr as it runs (jaxfuse.metrics.flops: forward + "
                    "backward, recomputation included, loops per iteration, a grouped product "
                    "2·M·K·N over its rows)")
ANALYTIC_FLOPS_SOURCE = ("analytic: 3 × (2·T·k·3·d·f + 2·T·d·E), the experts' gate, up and down "
                         "products of the T·k token-expert pairs and the router's product, "
                         "forward and the two products of each in the backward; elementwise "
                         "ops not counted")
NOTE_SOURCE = ("flops / analytic: the row's FLOPs over the analytic count "
               "3 × (2·T·k·3·d·f + 2·T·d·E); XLA: XLA cost analysis of the lowered step "
               "(jax.jit(step).lower(...).cost_analysis(): a loop's body counted once, a "
               "ragged_dot as the product XLA:CPU computes over every group); residual / torch-eager: residual bytes over "
               f"torch-eager's; goal: time / fastest <= {TIME_GOAL} and residual / "
               f"torch-eager <= 1/{RESIDUAL_GOAL:g}")


@dataclasses.dataclass(frozen=True)
class Shape:
  """One MoE block and its tokens."""

  experts: int
  top_k: int
  d_model: int
  width: int
  tokens: int

  @property
  def name(self) -> str:
    return (f"moe E{self.experts} top{self.top_k} d{self.d_model} f{self.width} "
            f"T{self.tokens}")

  def config(self) -> DecoderConfig:
    """A Mixtral decoder config with this block (the attention fields are unused here)."""
    heads = max(1, self.d_model // 64)
    return DecoderConfig(vocab_size=256, d_model=self.d_model, num_layers=1, num_heads=heads,
                         num_kv_heads=heads, mlp_dim=self.width, num_experts=self.experts,
                         experts_per_token=self.top_k, expert_mlp_dim=self.width,
                         model_type="mixtral")

  def analytic_flops(self) -> int:
    """``3 × (2·T·k·3·d·f + 2·T·d·E)``: see :data:`ANALYTIC_FLOPS_SOURCE`."""
    t, k, d, f, e = self.tokens, self.top_k, self.d_model, self.width, self.experts
    return 3 * (2 * t * k * 3 * d * f + 2 * t * d * e)


FULL = Shape(experts=8, top_k=2, d_model=1024, width=2816, tokens=4096)
QUICK = Shape(experts=8, top_k=2, d_model=256, width=704, tokens=1024)


def inputs(shape: Shape, seed: int = SEED):
  """``(args, cotangent)``: tokens ``[T, d]``, router ``[d, E]``, gate and up ``[E, d, f]``,
  down ``[E, f, d]`` (each matrix ``randn / sqrt(fan_in)``: routing far from uniform), and the
  output's cotangent ``[T, d]``; float32."""
  rng = np.random.default_rng(seed)
  e, d, f, t = shape.experts, shape.d_model, shape.width, shape.tokens

  def normal(s, scale=1.0):
    return jnp.asarray(scale * rng.standard_normal(s, dtype=np.float32))

  args = [normal((t, d)), normal((d, e), d ** -0.5), normal((e, d, f), d ** -0.5),
          normal((e, d, f), d ** -0.5), normal((e, f, d), f ** -0.5)]
  return args, normal((t, d))


# The JAX rows -----------------------------------------------------------------------------------


def jaxfuse_block(shape: Shape, *, implementation: str, keep: tuple[str, ...] = ()) -> Callable:
  """``f(x, router, gate, up, down)``: :class:`jaxfuse.models.decoder_block.MoE` (fused, as
  the decoder builds it, keeping the experts' products ``keep``) holding the given
  parameters."""
  cfg = shape.config().replace(expert_keep=keep)
  module = nnx.eval_shape(lambda: MoE(cfg, fused=True,
                                      implementation=implementation, rngs=nnx.Rngs(SEED)))
  graphdef, params, rest = nnx.split(module, nnx.Param, ...)

  def block(x, router, gate, up, down):
    state = jax.tree.map(lambda v: v, params)  # a fresh state to fill in
    nnx.replace_by_pure_dict(state, {"router": {"kernel": router},
                                     "experts": {"gate_proj": gate, "up_proj": up,
                                                 "down_proj": down}})
    return nnx.merge(graphdef, state, rest)(x)

  return block


def ragged_dot_block(x, router, gate, up, down, *, top_k: int):
  """The block in plain JAX over :func:`jax.lax.ragged_dot`: route, sort the pairs by expert,
  gate and up, SiLU(gate) * up, down, unsort, and sum each token's ``top_k`` outputs with its
  routing weights."""
  tokens, num_experts = x.shape[0], router.shape[-1]
  logits = jnp.dot(x, router, precision=_HIGHEST)
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  weights, experts = jax.lax.top_k(probs, top_k)
  weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
  rows = x[order // top_k]
  g = jax.lax.ragged_dot(rows, gate, sizes, precision=_HIGHEST)
  u = jax.lax.ragged_dot(rows, up, sizes, precision=_HIGHEST)
  down_rows = jax.lax.ragged_dot(jax.nn.silu(g) * u, down, sizes, precision=_HIGHEST)
  pairs = down_rows[jnp.argsort(order)].reshape(tokens, top_k, -1)
  return jnp.sum(pairs * weights[..., None], axis=1).astype(x.dtype)


def dense_block(x, router, gate, up, down, *, top_k: int):
  """Every expert on every token, weighted by routing weights that are zero outside the top
  ``top_k`` (:func:`jaxfuse.blocks.moe.moe_mlp_dense`)."""
  return moe_blocks.moe_mlp_dense(x, router, gate, up, down, top_k=top_k)


# jaxfuse's rows that keep products: the suffix of their names -> the products kept.
KEEP_ROWS = {"[keep gate]": ("gate",)}


def jax_rows(ctx, shape: Shape) -> dict[str, Callable]:
  """jaxfuse's rows (each implementation of ``grouped_matmul`` that compiles here, then each
  again keeping the products of :data:`KEEP_ROWS`), then the plain-JAX ragged_dot and dense
  rows."""
  impls = harness.jaxfuse_rows("grouped_mlp", lambda implementation: implementation,
                               keep=ctx.native)
  rows = {name: jaxfuse_block(shape, implementation=impl()) for name, impl in impls.items()}
  for suffix, keep in KEEP_ROWS.items():
    rows.update({name + suffix: jaxfuse_block(shape, implementation=impl(), keep=keep)
                 for name, impl in impls.items()})
  rows[RAGGED] = lambda *a: ragged_dot_block(*a, top_k=shape.top_k)
  rows[DENSE] = lambda *a: dense_block(*a, top_k=shape.top_k)
  return rows


def lowered_flops(f: Callable, args: Sequence, ct) -> float | None:
  """XLA's FLOPs of the lowered forward + backward of ``f`` (before the CPU compiler folds
  recomputation back into the forward)."""

  def step(*a):
    out, vjp = jax.vjp(f, *a)
    return out, vjp(ct)

  analysis = jax.jit(step).lower(*args).cost_analysis()
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0] if analysis else {}
  value = (analysis or {}).get("flops")
  return None if value is None or value < 0 else float(value)


# Hugging Face's block ---------------------------------------------------------------------------


def hf_block(shape: Shape, experts_implementation: str = "eager"):
  """``transformers``' ``MixtralSparseMoeBlock`` of this shape, float32, in training mode
  (the router's jitter noise is 0)."""
  import torch
  import transformers
  from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

  config = transformers.MixtralConfig(hidden_size=shape.d_model, intermediate_size=shape.width,
                                      num_local_experts=shape.experts,
                                      num_experts_per_tok=shape.top_k, router_jitter_noise=0.0,
                                      hidden_act="silu",
                                      experts_implementation=experts_implementation)
  torch.manual_seed(SEED)
  block = MixtralSparseMoeBlock(config).float().train()
  if block.experts.config._experts_implementation != experts_implementation:
    raise RuntimeError(f"expected experts_implementation={experts_implementation!r}, got "
                       f"{block.experts.config._experts_implementation!r}")
  return block


def torch_args(args: Sequence, *, dtype=None, device: str | None = None) -> list:
  """The JAX arguments in the Hugging Face layout: tokens ``[1, T, d]``, ``gate.weight``
  ``[E, d]``, ``experts.gate_up_proj`` ``[E, 2f, d]`` (gate rows first) and
  ``experts.down_proj`` ``[E, d, f]``."""
  x, router, gate, up, down = (np.asarray(a) for a in args)
  hf = [x[None], router.T, np.concatenate([gate.transpose(0, 2, 1), up.transpose(0, 2, 1)], 1),
        down.transpose(0, 2, 1)]
  return [harness.to_torch(np.ascontiguousarray(a), dtype=dtype, device=device) for a in hf]


def torch_fn(block) -> Callable:
  """``fn(x, gate_weight, gate_up_proj, down_proj)``: the block with these parameters."""
  from torch.func import functional_call

  def fn(x, router, gate_up, down):
    return functional_call(block, {"gate.weight": router, "experts.gate_up_proj": gate_up,
                                   "experts.down_proj": down}, (x,))

  return fn


def to_jax_layout(result) -> tuple[np.ndarray, list[np.ndarray]]:
  """A torch step's ``(output, gradients)`` as float64 numpy arrays in the JAX layout: output
  and token gradient ``[T, d]``, router ``[d, E]``, gate and up ``[E, d, f]``, down
  ``[E, f, d]``."""
  out, grads = result
  out = harness.to_numpy(out)[0]
  dx, d_router, d_gate_up, d_down = (harness.to_numpy(g) for g in grads)
  f = d_gate_up.shape[1] // 2
  return out, [dx[0], d_router.T, d_gate_up[:, :f].transpose(0, 2, 1),
               d_gate_up[:, f:].transpose(0, 2, 1), d_down.transpose(0, 2, 1)]


def reference(shape: Shape, args: Sequence, ct) -> tuple[np.ndarray, list[np.ndarray]]:
  """The float64 reference: the router's softmax and top-k in float64, then Hugging Face's
  ``MixtralExperts`` in float64, on the same weights; output and gradients in the JAX layout."""
  import torch

  block = hf_block(shape).double()
  leaves = [a.requires_grad_() for a in torch_args(args, dtype=torch.float64, device="cpu")]
  x, router, gate_up, down = leaves
  hidden = x.reshape(-1, shape.d_model)
  probs = torch.softmax(hidden @ router.T, dim=-1)
  weights, experts = torch.topk(probs, shape.top_k, dim=-1)
  weights = weights / weights.sum(dim=-1, keepdim=True)
  from torch.func import functional_call

  out = functional_call(block.experts, {"gate_up_proj": gate_up, "down_proj": down},
                        (hidden, experts, weights)).reshape(x.shape)
  t_ct = harness.to_torch(ct, dtype=torch.float64, device="cpu")[None]
  grads = torch.autograd.grad(out, leaves, t_ct)
  return to_jax_layout((out, grads))


# One case ---------------------------------------------------------------------------------------


def case_records(ctx, shape: Shape, *, torch_rows: Sequence[str] = tuple(TORCH_ROWS)
                 ) -> list[Record]:
  """The records of one shape: every row's step on the same weights and cotangent, timed
  interleaved, with its residual bytes, FLOPs and errors against the float64 reference."""
  case = shape.name
  ctx.step(f"{case}: inputs")
  args, ct = inputs(shape)
  fns = jax_rows(ctx, shape)
  results: dict[str, object] = {}
  timed: dict[str, Callable] = {}
  notes: dict[str, list[str]] = {name: [] for name in [*fns, *torch_rows]}
  residual: dict[str, int] = {}
  flops: dict[str, float | None] = {}
  xla_flops: dict[str, float | None] = {}
  for name, f in fns.items():
    ctx.step(f"{case}: compile {name}")
    step = harness.jax_step(f)
    out, grads = step(args, ct)
    results[name] = (out, grads)
    timed[name] = functools.partial(step, args, ct)
    ctx.step(f"{case}: {name} residuals and FLOPs")
    residual[name] = harness.residual_bytes(f, args)
    flops[name] = float(metrics.flops(lambda *a, f=f: jax.vjp(f, *a)[1](ct), *args))
    xla_flops[name] = lowered_flops(f, args, ct)

  t_cts = harness.to_torch(ct)[None]
  for name in torch_rows:
    ctx.step(f"{case}: {name}")
    fn = torch_fn(hf_block(shape, TORCH_ROWS[name]))
    t_args = torch_args(args)
    step = harness.torch_step(fn)
    results[name] = to_jax_layout(step(t_args, t_cts))
    timed[name] = functools.partial(step, t_args, t_cts)
    residual[name] = harness.torch_residual_bytes(fn, t_args)
    flops[name] = float(shape.analytic_flops())

  ctx.step(f"{case}: float64 reference")
  exact = reference(shape, args, ct)
  ctx.step(f"{case}: timing {len(timed)} rows")
  times = ctx.time(timed)

  records = []
  for name in [*fns, *torch_rows]:
    r = Record(SUITE, case, name, ctx.platform, "float32", reference=REFERENCE)
    records.append(r)
    r.set("time_ms", times.get(name), harness.time_source(times.get(name)))
    is_torch = name in TORCH_ROWS
    r.set("residual_bytes", residual.get(name),
          rec.TORCH_RESIDUAL_SOURCE if is_torch else rec.JAX_RESIDUAL_SOURCE)
    r.set("flops", flops.get(name), ANALYTIC_FLOPS_SOURCE if is_torch else JAX_FLOPS_SOURCE)
    harness.set_errors(r, harness.errors(results[name], exact), ERROR_SOURCE)
  harness.ratio_to_fastest(records, [r.impl for r in records])

  torch_residual = residual.get(TORCH)
  analytic = shape.analytic_flops()
  for r in records:
    notes[r.impl].append(f"flops / analytic = {r.flops / analytic:.2f}")
    if xla_flops.get(r.impl) is not None:
      notes[r.impl].append(f"XLA: {xla_flops[r.impl] / 1e9:.3g} GFLOP")
    if r.impl != TORCH and torch_residual:
      notes[r.impl].append(f"residual / torch-eager = {r.residual_bytes / torch_residual:.2f}")
    if r.impl.startswith("jaxfuse-") and r.ratio is not None and torch_residual:
      met = r.ratio <= TIME_GOAL and r.residual_bytes / torch_residual <= 1 / RESIDUAL_GOAL
      notes[r.impl].append(f"goal {'met' if met else 'not met'}")
    for text in notes[r.impl]:
      r.add_note(text)
    r.sources = {**(r.sources or {}), "note": NOTE_SOURCE}
  return records


# Suite entry points -----------------------------------------------------------------------------


def run(ctx) -> list[Record]:
  return case_records(ctx, QUICK if ctx.quick else FULL)


def headline(records) -> list[Record]:
  """Every row (one case per run)."""
  return list(records)


def plot(records: Sequence[Record], path: str) -> None:
  """One panel per figure: time over the fastest row's (log axis, with the goal), residual
  bytes (with half of torch-eager's, the goal) and GFLOP (hatched where analytic), one bar per
  row; a zero bar is labelled ``0``, a missing figure ``n/a``."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib import ticker

  cases = list(dict.fromkeys(r.case for r in records))
  fig, axes = plt.subplots(len(cases), 3, figsize=(16, 4.8 * len(cases)), squeeze=False)
  for row, case in zip(axes, cases):
    mine = [r for r in records if r.case == case]
    impls = [r.impl for r in mine]
    colors = [f"C{i}" for i in range(len(mine))]
    xs = np.arange(len(mine))
    panels = (
        ("time / fastest row (log)", [r.ratio for r in mine], lambda v: f"{v:.2f}×"),
        ("residual bytes (MiB)",
         [None if r.residual_bytes is None else r.residual_bytes / 2**20 for r in mine],
         lambda v: f"{v:.3g}"),
        ("GFLOP of one step", [None if r.flops is None else r.flops / 1e9 for r in mine],
         lambda v: f"{v:.3g}"))
    for ax, (label, values, text) in zip(row, panels):
      heights = [v if v is not None and math.isfinite(v) else 0.0 for v in values]
      bottom = 0.0
      if label.startswith("time"):  # bars from 1 (the fastest row) on the log axis
        bottom = 1.0
        heights = [v - 1.0 if v > 0 else 0.0 for v in heights]
      bars = ax.bar(xs, heights, 0.7, bottom=bottom, color=colors)
      if label.startswith("GFLOP"):
        for bar, r in zip(bars, mine):
          if r.sources and r.sources.get("flops", "").startswith("analytic"):
            bar.set_hatch("//")
      for x, v in zip(xs, values):
        if v is None or not math.isfinite(v):
          ax.annotate("n/a", (x, 0.02), xycoords=("data", "axes fraction"), ha="center",
                      va="bottom", fontsize=8)
        else:
          ax.annotate("0" if v == 0 else text(v), (x, v), ha="center", va="bottom",
                      fontsize=8, xytext=(0, 2), textcoords="offset points")
      if label.startswith("time"):
        finite = [v for v in values if v is not None and math.isfinite(v) and v > 0]
        ax.set_yscale("log")
        ax.set_ylim(min([*finite, 1.0]) / 1.2, max([*finite, TIME_GOAL]) * 1.5)
        ax.axhline(1.0, color="k", lw=0.7)
        ax.axhline(TIME_GOAL, color="C3", lw=1.2, ls="--", label="goal: jaxfuse at or below")
        ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_minor_locator(ticker.LogLocator(subs=np.arange(1, 10)))
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda y, _: f"{y:g}×"))
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        ax.legend(fontsize=8, loc="upper left")
      elif label.startswith("residual"):
        torch_row = next((r for r in mine if r.impl == TORCH and r.residual_bytes), None)
        if torch_row is not None:
          ax.axhline(torch_row.residual_bytes / 2**20 / RESIDUAL_GOAL, color="C3", lw=1.2,
                     ls="--", label=f"goal: jaxfuse at or below torch-eager / {RESIDUAL_GOAL:g}")
          ax.legend(fontsize=8, loc="upper left")
      else:
        ax.set_title("hatched: analytic count; others: the jaxpr as it runs", fontsize=8)
      ax.set_xticks(xs)
      ax.set_xticklabels(impls, rotation=20, ha="right", fontsize=8)
      ax.set_ylabel(label, fontsize=9)
      if not label.startswith("time"):
        ax.margins(y=0.15)
      ax.grid(axis="y", alpha=0.3, which="both")
    row[0].set_title(case, fontsize=10)
  platform = records[0].platform if records else "?"
  fig.suptitle(f"moe: one MoE block, forward + backward, on {platform}, float32")
  fig.tight_layout()
  fig.savefig(path, dpi=120, bbox_inches="tight")
  plt.close(fig)


__all__ = ["FULL", "QUICK", "Shape", "case_records", "dense_block", "headline", "hf_block",
           "inputs", "jaxfuse_block", "plot", "ragged_dot_block", "reference", "run",
           "to_jax_layout", "torch_args"]
