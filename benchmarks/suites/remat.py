"""Recomputation schedules on layer stacks: residual bytes, FLOPs and time of one training step.

Models (:mod:`jaxfuse.models`, float32, layers stacked and scanned):

- ``decoder``: :class:`~jaxfuse.models.Decoder`, d_model 128, 4 query and 2 key/value heads,
  MLP 384, vocabulary 256, batch 2 × seq 128 (``--quick``) or 4 × 256;
- ``mlp``: :class:`~jaxfuse.models.MLPStack`, width 256, hidden 768, 256 rows (``--quick``) or
  1024.

Each has ``L`` layers (``--quick``: 4 and 36; else 4, 12, 24, 36, 48). Cases are named
``<model> L=<layers> schedule=<schedule>``; schedules:

- ``none``: no recomputation beyond the ops' own (``remat=None``);
- ``full``: every block keeps only its input (``remat="nothing"``);
- ``sqrt``: Chen et al.'s √L segments (``remat="everything", segments="sqrt"``): each segment
  of ``round(√L)`` blocks keeps its input; a segment's blocks keep all their residuals, but only
  while the backward pass recomputes that segment (the note gives those bytes);
- every MaxText recipe of :data:`jaxfuse.remat.RECIPES` but ``full`` (decoder only: the MLP
  stack has no attention names), applied to every block;
- ``plan25``, ``plan50``, ``plan75``: :func:`jaxfuse.remat.plan` at that share of ``none``'s
  residual bytes (``budget_bytes``).

Rows: ``jaxfuse-xla`` for every schedule; ``torch-eager`` for ``none`` and ``full`` (the
decoder: ``transformers.LlamaForCausalLM`` of the same config with and without
activation checkpointing of every layer; the MLP stack: its torch twin with
``torch.utils.checkpoint`` per block) and ``sqrt`` (MLP stack:
``torch.utils.checkpoint.checkpoint_sequential`` with √L segments).

Figures: ``residual_bytes`` (JAX: ``jax.vjp`` residuals of the loss with respect to the
parameters, device memory; what a recipe offloads to host memory is in the note; torch: the
tensors autograd saves); ``flops``: FLOPs of ``jax.value_and_grad`` of the loss, the
recomputation included (:func:`jaxfuse.metrics.flops`, loops counted as they run); the note
gives the extra FLOPs over ``none`` in forward passes of the loss; ``max_grad_err``: the
largest difference of any parameter gradient from ``none``'s; ``time_ms``: the jitted
``value_and_grad``, interleaved with the case's other schedules, ``ratio`` to ``none``. On CPUs
XLA drops the recomputation fences, so the times show what recomputing costs here, not what
memory it saves. A recipe's note gives what the planner needs at that recipe's bytes (the
planner is never worse than a recipe when that FLOP count is at most the recipe's); ``none``'s
record carries the planner's frontier (predicted bytes and FLOPs at budgets from the least
to all of ``none``'s bytes), which :func:`plot` draws. ``--quick`` also records the compile
time of the decoder's training step against L, scanned and unrolled (``compile`` cases).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import harness
from benchmarks import records as rec
from benchmarks.records import Record
from jaxfuse import metrics, remat
from jaxfuse.models import Decoder, DecoderConfig, MLPStack, next_token_targets

SUITE = "remat"
IMPL, TORCH = "jaxfuse-xla", "torch-eager"
QUICK_LAYERS, LAYERS = (4, 36), (4, 12, 24, 36, 48)
COMPILE_LAYERS = (4, 12, 36)
PLAN_BUDGETS = (25, 50, 75)
DECODER_RECIPES = tuple(r for r in remat.RECIPES if r != "full")
SEED = 0

RESIDUAL_SOURCE = rec.JAX_RESIDUAL_SOURCE + ", device memory"
FLOPS_SOURCE = ("FLOPs of jax.value_and_grad of the loss, recomputation included, loops counted "
                "as they run (jaxfuse.metrics.flops)")
BUDGET_SOURCE = "the budget given to jaxfuse.remat.plan: a share of schedule=none's bytes"
GRAD_SOURCE = ("largest |difference| of any parameter gradient from schedule=none's, same "
               "parameters and batch")
COMPILE_SOURCE = ("wall time of jax.jit(...).lower(...).compile() of the training step "
                  "(value_and_grad), one compile")


def _decoder_cfg(layers: int) -> DecoderConfig:
  return DecoderConfig(vocab_size=256, d_model=128, num_layers=layers, num_heads=4,
                       num_kv_heads=2, mlp_dim=384)


def _decoder(ctx, layers: int, scan: bool = True):
  b, t = (2, 128) if ctx.quick else (4, 256)
  tokens = jax.random.randint(jax.random.key(SEED), (b, t), 0, 256)
  model = Decoder(_decoder_cfg(layers), implementation="xla", scan_layers=scan,
                  rngs=nnx.Rngs(SEED))
  return model, (tokens, next_token_targets(tokens))


MLP_FEATURES, MLP_HIDDEN_FACTOR = 256, 3


def _mlp(ctx, layers: int, features: int = MLP_FEATURES):
  rows = 256 if ctx.quick else 1024
  x = jax.random.normal(jax.random.key(SEED), (rows, features))
  y = jax.random.normal(jax.random.key(SEED + 1), (rows, features))
  model = MLPStack(features, MLP_HIDDEN_FACTOR * features, num_layers=layers, scan_layers=True,
                   implementation="xla", rngs=nnx.Rngs(SEED))
  return model, (x, y)


def _loss(model, batch):
  return model(*batch)


def _split_step(model, batch):
  """``(step, params)``: the jitted value-and-grad of the loss as the model is set, and its
  parameters."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(params):
    return _loss(nnx.merge(graphdef, params, rest), batch)

  return loss, params


def _measure(model, batch) -> dict:
  loss, params = _split_step(model, batch)
  rs = metrics.residuals(loss, params)
  return {"residual": sum(r.nbytes for r in rs if r.memory == "device"),
          "offloaded": sum(r.nbytes for r in rs if r.memory == "host"),
          "flops": metrics.flops(lambda p: jax.value_and_grad(loss)(p), params),
          "step": jax.jit(jax.value_and_grad(loss)), "params": params}


def _schedules(model_name: str) -> list[tuple[str, object, object]]:
  """``(schedule, remat, segments)``."""
  out = [("none", None, None), ("full", "nothing", None), ("sqrt", "everything", "sqrt")]
  if model_name == "decoder":
    out += [(r, r, None) for r in DECODER_RECIPES]
  return out


def _frontier(prof: remat.Profile, points: int = 24) -> dict[str, list]:
  """The planner's predicted (bytes, FLOPs) at budgets from the least to all of none's."""
  least = prof.base_bytes + sum(min(c.residual_bytes for c in layer.values()
                                    if not c.offloaded_bytes) for layer in prof.layers)
  budgets = np.unique(np.linspace(least, prof.no_remat_bytes, points).astype(int))
  frontier = {"bytes": [], "flops": []}
  for b in budgets:
    try:
      p = remat.plan(None, None, None, int(b), profiled=prof, measure=False)
    except remat.BudgetError:
      continue
    frontier["bytes"].append(p.predicted_bytes)
    frontier["flops"].append(p.predicted_flops)
  return frontier


def _case(model_name: str, layers: int, schedule: str) -> str:
  return f"{model_name} L={layers} schedule={schedule}"


def _jax_rows(ctx, model_name: str, layers: int) -> list[Record]:
  model, batch = (_decoder if model_name == "decoder" else _mlp)(ctx, layers)
  forward_flops = metrics.flops(*_split_step(model, batch))
  ctx.step(f"{model_name} L={layers}: profile")
  prof = remat.profile(_loss, model, batch)
  rows, steps = {}, {}
  for schedule, policy, segments in _schedules(model_name):
    ctx.step(f"{model_name} L={layers}: {schedule}")
    model.set_remat(policy, segments)
    rows[schedule] = _measure(model, batch)
  for pct in PLAN_BUDGETS:
    ctx.step(f"{model_name} L={layers}: plan{pct}")
    plan = remat.plan(_loss, model, batch, pct / 100, profiled=prof)
    model.set_remat(plan)
    rows[f"plan{pct}"] = {**_measure(model, batch), "plan": plan}
  model.set_remat(None)
  for name, row in rows.items():
    steps[name] = (lambda row=row: row["step"](row["params"]))
  ctx.step(f"{model_name} L={layers}: timing")
  times = ctx.time(steps)
  none = rows["none"]
  grads = {name: row["step"](row["params"])[1] for name, row in rows.items()}
  records = []
  for name, row in rows.items():
    r = Record(suite=SUITE, case=_case(model_name, layers, name), impl=IMPL,
               platform=ctx.platform, dtype="float32")
    r.set("residual_bytes", row["residual"], RESIDUAL_SOURCE)
    r.set("flops", row["flops"], FLOPS_SOURCE)
    r.set("time_ms", times[name], harness.time_source(times[name]))
    r.set("ratio", times[name]["median"] / times["none"]["median"],
          "median time over schedule=none's in the same interleaved rounds")
    r.ratio_to = "schedule=none"
    r.set("max_grad_err", _max_abs_diff(grads[name], grads["none"]), GRAD_SOURCE)
    r.reference = "schedule=none"
    extra = (row["flops"] - none["flops"]) / forward_flops
    r.add_note(f"{row['residual'] / none['residual']:.3f}× none's bytes; "
               f"{extra:+.2f} forward passes of FLOPs")
    if row["offloaded"]:
      r.add_note(f"{rec.format_bytes(row['offloaded'])} offloaded to host memory")
    if name == "sqrt":
      size = remat.segment_size(layers, "sqrt")
      inner = size * prof.layers[0]["none"].residual_bytes
      r.add_note(f"segments of {size} blocks; while one is recomputed its blocks keep "
                 f"{rec.format_bytes(inner)} more")
    if "plan" in row:
      plan = row["plan"]
      r.set("budget_bytes", plan.budget_bytes, BUDGET_SOURCE)
      r.add_note(f"choices: {_choices_text(plan)}")
    if name in remat.RECIPES and not row["offloaded"]:
      at = remat.plan(None, None, None, row["residual"], profiled=prof, measure=False)
      r.add_note(f"planner at these bytes: {at.predicted_flops / 1e9:.4g} GFLOP "
                 f"({at.predicted_flops / row['flops']:.3f}× this recipe's)")
    if name == "none":
      r.series = {"frontier_" + k: v for k, v in _frontier(prof).items()}
      r.add_note(f"forward pass {forward_flops / 1e9:.4g} GFLOP")
    records.append(r)
  return records


def _max_abs_diff(a, b) -> float:
  return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree_util.tree_leaves(a),
                                                           jax.tree_util.tree_leaves(b)))


def _choices_text(plan: remat.Plan) -> str:
  counts: dict[str, int] = {}
  for c in plan.choices:
    counts[c] = counts.get(c, 0) + 1
  return ", ".join(f"{n}×{c}" for c, n in counts.items())


# Torch twins ----------------------------------------------------------------------------------


def _torch_decoder(layers: int, checkpointing: bool):
  import torch
  import transformers

  torch.manual_seed(SEED)
  config = _decoder_cfg(layers).to_hf("llama")
  config._attn_implementation = "sdpa"
  config.use_cache = False
  model = transformers.LlamaForCausalLM(config).float()
  model.train()
  if checkpointing:
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):   # transformers >= 5.24
      model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
      model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
  return model


class _TorchMLPStack:
  """The torch twin of :class:`MLPStack`: ``h + down(silu(gate(n)) * up(n))``, n = RMSNorm(h)."""

  def __init__(self, layers: int, features: int, hidden: int):
    import torch

    torch.manual_seed(SEED)
    self.blocks = torch.nn.ModuleList([torch.nn.ModuleDict({
        "norm": torch.nn.RMSNorm(features, eps=1e-6),
        "gate": torch.nn.Linear(features, hidden, bias=False),
        "up": torch.nn.Linear(features, hidden, bias=False),
        "down": torch.nn.Linear(hidden, features, bias=False)}) for _ in range(layers)])
    self.norm = torch.nn.RMSNorm(features, eps=1e-6)

  @staticmethod
  def block(m, h):
    import torch

    n = m["norm"](h)
    return h + m["down"](torch.nn.functional.silu(m["gate"](n)) * m["up"](n))

  def loss(self, x, y, schedule: str):
    import torch
    from torch.utils.checkpoint import checkpoint, checkpoint_sequential

    fns = [lambda h, m=m: self.block(m, h) for m in self.blocks]
    if schedule == "sqrt":
      h = checkpoint_sequential(fns, max(1, round(math.sqrt(len(fns)))), x,
                                use_reentrant=False)
    else:
      h = x
      for fn in fns:
        h = checkpoint(fn, h, use_reentrant=False) if schedule == "full" else fn(h)
    return torch.mean(torch.square(self.norm(h) - y))

  def parameters(self):
    return list(self.blocks.parameters()) + list(self.norm.parameters())


def _torch_rows(ctx, model_name: str, layers: int, jax_batch) -> list[Record]:
  import torch

  records, steps = [], {}
  schedules = ("none", "full") if model_name == "decoder" else ("none", "full", "sqrt")
  saved = {}
  for schedule in schedules:
    ctx.step(f"{model_name} L={layers}: torch {schedule}")
    if model_name == "decoder":
      model = _torch_decoder(layers, schedule == "full")
      tokens = torch.from_numpy(np.array(jax_batch[0])).long()

      def loss(model=model, tokens=tokens):
        return model(input_ids=tokens, labels=tokens).loss

      params = list(model.parameters())
      inputs = [tokens]
    else:
      features = jax_batch[0].shape[-1]
      twin = _TorchMLPStack(layers, features, MLP_HIDDEN_FACTOR * features)
      x = torch.from_numpy(np.array(jax_batch[0]))
      y = torch.from_numpy(np.array(jax_batch[1]))

      def loss(twin=twin, x=x, y=y, schedule=schedule):
        return twin.loss(x, y, schedule)

      params = twin.parameters()
      inputs = [x, y]
    saved[schedule] = metrics.torch_residual_bytes(loss, exclude=params + inputs)

    def step(loss=loss, params=params):
      for p in params:
        p.grad = None
      loss().backward()

    steps[schedule] = step
  times = ctx.time(steps)
  for schedule in schedules:
    r = Record(suite=SUITE, case=_case(model_name, layers, schedule), impl=TORCH,
               platform=ctx.platform, dtype="float32")
    r.set("residual_bytes", saved[schedule], rec.TORCH_RESIDUAL_SOURCE)
    r.set("time_ms", times[schedule], harness.time_source(times[schedule]))
    r.set("ratio", times[schedule]["median"] / times["none"]["median"],
          "median time over torch's schedule=none in the same interleaved rounds")
    r.ratio_to = "schedule=none"
    how = {"none": "no checkpointing",
           "full": ("activation checkpointing of every layer" if model_name == "decoder"
                    else "torch.utils.checkpoint per block"),
           "sqrt": "checkpoint_sequential, √L segments"}[schedule]
    r.add_note(how)
    records.append(r)
  return records


# Compile time --------------------------------------------------------------------------------


def _compile_rows(ctx) -> list[Record]:
  records = []
  for layers in COMPILE_LAYERS:
    for scan in (True, False):
      ctx.step(f"compile L={layers} {'scanned' if scan else 'unrolled'}")
      model, batch = _decoder(ctx, layers, scan=scan)
      model.set_remat("nothing")
      loss, params = _split_step(model, batch)
      lowered = jax.jit(jax.value_and_grad(loss)).lower(params)
      t0 = time.perf_counter()
      lowered.compile()
      seconds = time.perf_counter() - t0
      r = Record(suite=SUITE, case=f"compile L={layers} layers={'scan' if scan else 'unrolled'}",
                 impl=IMPL, platform=ctx.platform, dtype="float32")
      r.set("time_ms", {"median": seconds * 1e3, "min": seconds * 1e3, "max": seconds * 1e3,
                        "runs": 1}, COMPILE_SOURCE)
      r.add_note("decoder training step, remat='nothing'")
      records.append(r)
  return records


def run(ctx) -> list[Record]:
  records = []
  for layers in (QUICK_LAYERS if ctx.quick else LAYERS):
    for model_name in ("decoder", "mlp"):
      jax_records = _jax_rows(ctx, model_name, layers)
      records += jax_records
      batch = (_decoder if model_name == "decoder" else _mlp)(ctx, layers)[1]
      records += _torch_rows(ctx, model_name, layers, batch)
  records += _compile_rows(ctx)
  return records


def headline(records: Sequence[Record]) -> list[Record]:
  """The largest decoder's none, full, sqrt, plan50 and two recipes, JAX and torch, and the
  compile times."""
  decoders = [r for r in records if r.case.startswith("decoder") and r.impl == IMPL]
  if not decoders:
    return []
  top = max(int(r.case.split("L=")[1].split()[0]) for r in decoders)
  keep = ("none", "full", "sqrt", "plan50", "minimal", "save_qkv_proj")
  return [r for r in records if (r.case.startswith(f"decoder L={top} ")
                                 and r.case.split("schedule=")[1] in keep)
          or r.case.startswith("compile")]


def plot(records: Sequence[Record], path: str) -> None:
  """One panel per model and L: residual bytes (log) against extra FLOPs over ``none``, the
  schedules as points and the planner's frontier as a line."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  mine = [r for r in records if r.impl == IMPL and "schedule=" in r.case]
  panels = list(dict.fromkeys(r.case.split(" schedule=")[0] for r in mine))
  cols = min(2, len(panels))
  rows = math.ceil(len(panels) / cols)
  fig, axes = plt.subplots(rows, cols, figsize=(7.5 * cols, 5 * rows), squeeze=False)
  for ax, panel in zip(axes.flat, panels):
    group = [r for r in mine if r.case.startswith(panel + " ")]
    none = next(r for r in group if r.case.endswith("schedule=none"))

    def extra(flops, none=none):
      return 100 * (flops / none.flops - 1)

    if none.series:
      ax.plot([extra(f) for f in none.series["frontier_flops"]],
              [b / 2**20 for b in none.series["frontier_bytes"]], "-", color="C0",
              label="planner frontier (predicted)")
    for r in group:
      schedule = r.case.split("schedule=")[1]
      kind = ("C3", "s") if schedule.startswith("plan") else (
          ("C2", "D") if schedule in ("none", "full", "sqrt") else ("C1", "o"))
      offloaded = "offloaded" in schedule
      ax.plot(extra(r.flops), r.residual_bytes / 2**20, kind[1], color=kind[0],
              markerfacecolor="none" if offloaded else kind[0])
      ax.annotate(schedule, (extra(r.flops), r.residual_bytes / 2**20), fontsize=6,
                  xytext=(3, 2), textcoords="offset points")
    torch_rows = [r for r in records if r.impl == TORCH and r.case.startswith(panel + " ")]
    for r in torch_rows:
      ax.axhline(r.residual_bytes / 2**20, color="C7", lw=0.6, ls=":")
      ax.annotate(f"torch {r.case.split('schedule=')[1]}", (ax.get_xlim()[1],
                  r.residual_bytes / 2**20), fontsize=6, ha="right", va="bottom", color="C7")
    ax.set_yscale("log")
    ax.set_xlabel("extra FLOPs over schedule=none (%)")
    ax.set_ylabel("residual bytes per step (MiB, log)")
    ax.set_title(panel, fontsize=9)
    ax.plot([], [], "D", color="C2", label="none / full / √L")
    ax.plot([], [], "o", color="C1", label="MaxText recipes")
    ax.plot([], [], "o", color="C1", markerfacecolor="none",
            label="recipes that offload (device bytes only)")
    ax.plot([], [], "s", color="C3", label="planner at 25/50/75% (measured)")
    ax.legend(fontsize=7)
  for ax in list(axes.flat)[len(panels):]:
    ax.axis("off")
  fig.suptitle("remat: memory against recomputation")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
