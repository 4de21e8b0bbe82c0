"""Fine-tuning steps on packed rows: full fine-tuning and LoRA, against Hugging Face eager.

The decoder (:class:`jaxfuse.models.Decoder`, LLaMA-shaped, float32): d_model 512, 4 layers, 8
query heads and 4 key/value heads, a SwiGLU MLP of width 1536, a vocabulary of 32000, batch 4
at seq 512; ``--quick`` runs d_model 256, 2 layers, 4 / 2 heads, MLP 768, a vocabulary of 8000,
batch 2 at seq 256. Cases are named ``full-ft <decoder> packed`` and ``lora-r16 <decoder>
packed`` (the first word is the family the plot draws).

The batches are packed rows, as :mod:`jaxfuse.data` builds them for supervised fine-tuning
(:class:`jaxfuse.data.PackedRows` over a best-fit-decreasing plan): synthetic documents of
``seq / 8`` to ``seq / 2`` random tokens, each a prompt (its first 20-50%, no loss: target
``-100``) and a completion; positions restart at each document, segment ids keep attention
inside it. Every row of a case starts from the same weights and reads the same batches.

Goal: jaxfuse's fused decoder takes at most 1.0x Hugging Face eager's step time and keeps at
least 2x fewer residual bytes, in both families. The note of the ``jaxfuse-xla`` rows says
whether it is met.

Rows of ``full-ft`` (every parameter trained):

- ``jaxfuse-xla``: ``Decoder(cfg, fused=True, implementation="xla")`` with the recomputation
  ``python -m jaxfuse.train`` uses by default (none beyond what the fused ops recompute
  themselves): fused residual add + RMSNorm, attention that keeps its output and log-sum-exp,
  a gated MLP that recomputes its hidden activation, the fused linear cross-entropy head.
- ``jax-unfused``: ``Decoder(cfg, fused=False)``, the same parameters in plain flax/jax parts
  (the ``train`` suite's baseline).
- ``torch-eager``: ``transformers.LlamaForCausalLM`` with ``attn_implementation="eager"`` on
  the same weights (:func:`jaxfuse.interop.hf_state_dict`), the packed rows given as a
  block-diagonal causal 4D additive mask and ``position_ids``, the targets as ``shift_labels``.

Rows of ``lora-r16`` (rank 16, alpha 32 on q, k, v, o, gate, up and down; the base frozen):
the same three, ``jaxfuse-xla`` and ``jax-unfused`` with :func:`jaxfuse.nnx.apply_lora`,
``torch-eager`` with ``peft.get_peft_model`` holding the same adapters.

A JAX step is :func:`jaxfuse.train.loop.make_steps` (one jit of ``jax.value_and_grad`` over the
``nnx.Param`` variables, or only the ``nnx.LoRAParam`` ones, and the optimizer's update, its
state donated) with :func:`jaxfuse.train.model.optimizer`: global-norm clipping (1.0), then
AdamW (weight decay 0.01) on a warm-up + cosine schedule. torch's step is ``zero_grad``,
``backward``, ``clip_grad_norm_`` and ``torch.optim.AdamW`` over the trained parameters with
the same hyperparameters, its learning rate set from the same schedule each step.

Figures: ``time_ms`` (interleaved rounds, as every suite) and ``ratio`` (to ``torch-eager`` of
the same case); ``residual_bytes`` (JAX: the ``jax.vjp`` residuals of the loss w.r.t. the
trained variables; torch: the tensors autograd saves); ``temp_bytes`` (XLA's compiled temp
memory of the step); ``max_abs_err``: the step-0 loss against the Hugging Face model run in
float64 on the same weights and batch; ``final_loss``: the loss of the last step every row ran
(all rows run the same steps on the same batches). The note gives tokens per second, the
residual bytes over ``torch-eager``'s and the trained parameters; ``series["losses"]`` holds
each step's loss.
"""

from __future__ import annotations

import copy
import math
import tempfile
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from benchmarks import harness
from benchmarks import records as rec
from benchmarks.records import Record
from benchmarks.suites import train as train_suite
from benchmarks.suites.train import Shape
from jaxfuse import interop, metrics
from jaxfuse.data import IGNORE_INDEX, PackedRows, plan_packing
from jaxfuse.models import Decoder
from jaxfuse.nnx import apply_lora, save_peft_adapter
from jaxfuse.train import config as train_config
from jaxfuse.train.config import TrainConfig
from jaxfuse.train.loop import make_steps
from jaxfuse.train.model import optimizer as train_optimizer

SUITE = "finetune"
JAXFUSE = "jaxfuse-xla"
BASELINE = "jax-unfused"
TORCH = "torch-eager"
REFERENCE = "hf-float64"
IMPLS = (JAXFUSE, BASELINE, TORCH)
FULL, LORA = "full", "lora"
MODES = (FULL, LORA)
SEED = 0
# Distinct batches every row cycles through.
BATCHES = 4
# The optimizer of the steps (jaxfuse.train.model.optimizer reads these fields).
TRAIN = TrainConfig(lr=1e-4, warmup=2, steps=100, lora_rank=16)
LORA_RANK = TRAIN.lora_rank
# The goal on the headline shape: step time over torch-eager's at most this, residual bytes
# over torch-eager's at most 1 / RESIDUAL_GOAL.
TIME_GOAL, RESIDUAL_GOAL = 1.0, 2.0

FULL_SHAPE = Shape(vocab=32000, d_model=512, layers=4, heads=8, kv_heads=4, mlp=1536, batch=4,
                   seq=512)
QUICK = Shape(vocab=8000, d_model=256, layers=2, heads=4, kv_heads=2, mlp=768, batch=2, seq=256)

NOTE_SOURCE = ("tokens/s: batch × seq (padding included) over the median step time; residual "
               "/ torch-eager: residual bytes over torch-eager's in the same case; trained "
               "parameters: the elements the optimizer updates; goal: time / torch-eager <= "
               f"{TIME_GOAL} and residual / torch-eager <= 1/{RESIDUAL_GOAL:g}")
STEP0_SOURCE = ("the step-0 loss (float32, before any update) against transformers' "
                "LlamaForCausalLM in float64 on the same weights, packed batch and 4D mask, its "
                "loss taken in float64 from its hidden states")
FINAL_SOURCE = ("the loss of the last step the row ran (every row runs the same steps on the "
                "same batches: step 0, warm-up, timed rounds)")
TEMP_SOURCE = ("XLA compiled memory analysis of the jitted step (forward, backward, clipping, "
               "AdamW update), temp bytes")
JAX_RESIDUAL_SOURCE = (f"{rec.JAX_RESIDUAL_SOURCE}, of the loss w.r.t. the trained variables "
                       "(nnx.Param; nnx.LoRAParam with LoRA)")
TORCH_RESIDUAL_SOURCE = (f"{rec.TORCH_RESIDUAL_SOURCE}, of the loss of model(input_ids, 4D "
                         "mask, position_ids, shift_labels); parameters (frozen ones included) "
                         "and inputs excluded")


def _shapes(ctx) -> list[Shape]:
  return [QUICK] if ctx.quick else [FULL_SHAPE]


def case_name(mode: str, shape: Shape) -> str:
  """``full-ft <decoder> packed`` or ``lora-r16 <decoder> packed``."""
  family = "full-ft" if mode == FULL else f"lora-r{LORA_RANK}"
  return f"{family} {shape.name.removeprefix('decoder ')} packed"


# Packed batches ---------------------------------------------------------------------------------


def packed_batches(shape: Shape, n: int = BATCHES, seed: int = SEED) -> list[dict]:
  """``n`` batches of packed rows ``{"tokens", "targets", "positions", "segment_ids"}``, each
  ``[batch, seq]`` int32: synthetic prompt + completion documents (the prompt has no loss)
  packed by :func:`jaxfuse.data.plan_packing` and built by :class:`jaxfuse.data.PackedRows`."""
  rng = np.random.default_rng(seed)
  rows_needed = n * shape.batch
  lengths: list[int] = []
  # Enough documents for the rows, and a few more so that the rows taken are well filled.
  while sum(lengths) < 1.1 * rows_needed * shape.seq + shape.seq:
    lengths.append(int(rng.integers(max(2, shape.seq // 8), shape.seq // 2 + 1)))
  offsets = np.concatenate([[0], np.cumsum(lengths)])
  ids = rng.integers(0, shape.vocab, offsets[-1], dtype=np.int32)
  mask = np.ones(offsets[-1], np.uint8)
  for start, length in zip(offsets[:-1], lengths):
    mask[start:start + int(length * rng.uniform(0.2, 0.5))] = 0   # the prompt: no loss
  rows = PackedRows(ids, mask, offsets, plan_packing(np.asarray(lengths), shape.seq,
                                                     long_documents="truncate"))
  if rows.num_rows < rows_needed:
    raise ValueError(f"packed {rows.num_rows} rows, need {rows_needed}")
  out = []
  for i in range(n):
    row = rows.rows(range(i * shape.batch, (i + 1) * shape.batch))
    out.append({name: row[name] for name in ("tokens", "targets", "positions", "segment_ids")})
  return out


def block_causal_mask(segment_ids, dtype=None):
  """The additive ``[batch, 1, seq, seq]`` torch mask of packed rows: 0 where a query may see a
  key (same segment, not later), the dtype's lowest value elsewhere."""
  import torch

  dtype = dtype or torch.float32
  seg = torch.as_tensor(np.asarray(segment_ids))
  seq = seg.shape[-1]
  causal = torch.ones(seq, seq, dtype=torch.bool).tril()
  allowed = (seg[:, :, None] == seg[:, None, :]) & causal
  mask = torch.zeros(allowed.shape, dtype=dtype)
  return mask.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


def _torch_batch(batch: dict, dtype=None) -> dict:
  """A packed batch as the keyword arguments of a ``transformers`` causal LM."""
  import torch

  targets = torch.as_tensor(np.asarray(batch["targets"], np.int64))
  return {"input_ids": torch.as_tensor(np.asarray(batch["tokens"], np.int64)),
          "position_ids": torch.as_tensor(np.asarray(batch["positions"], np.int64)),
          "attention_mask": block_causal_mask(batch["segment_ids"], dtype),
          "labels": targets, "shift_labels": targets}


# Models -----------------------------------------------------------------------------------------


def hf_eager(cfg, state_dict: dict):
  """The ``transformers`` model of the train suite (:func:`benchmarks.suites.train.hf_model`)
  with eager attention, which takes the packed rows' 4D mask as it is."""
  model = train_suite.hf_model(cfg, state_dict)
  model.set_attn_implementation("eager")
  if model.config._attn_implementation != "eager":
    raise RuntimeError(f"expected eager attention, got {model.config._attn_implementation}")
  return model.train()


def peft_twin(hf, lora_model: Decoder):
  """``peft.get_peft_model`` of ``hf`` with the adapters of ``lora_model`` (saved by
  :func:`jaxfuse.nnx.save_peft_adapter` and loaded back)."""
  import peft
  import safetensors.torch

  lora_config = peft.LoraConfig(r=LORA_RANK, lora_alpha=train_config.lora_alpha(TRAIN),
                                target_modules=[f"{t}_proj" for t in
                                                train_config.lora_targets(TRAIN)],
                                lora_dropout=0.0)
  twin = peft.get_peft_model(hf, lora_config)
  with tempfile.TemporaryDirectory() as directory:
    save_peft_adapter(lora_model, directory)
    adapters = safetensors.torch.load_file(f"{directory}/adapter_model.safetensors")
  result = peft.set_peft_model_state_dict(twin, adapters)
  if result.unexpected_keys or any("lora_" in k for k in result.missing_keys):
    raise RuntimeError(f"adapters: missing {result.missing_keys}, unexpected "
                       f"{result.unexpected_keys}")
  return twin.train()


def with_lora(model: Decoder) -> Decoder:
  """``model`` with the suite's adapters (:func:`jaxfuse.nnx.apply_lora`, as
  ``python -m jaxfuse.train --lora-rank 16``)."""
  return apply_lora(model, rank=LORA_RANK, alpha=train_config.lora_alpha(TRAIN),
                    targets=train_config.lora_targets(TRAIN), rngs=nnx.Rngs(SEED + 1))


# Trainers: one object per row, whose step() trains on the next batch ----------------------------


class JaxTrainer:
  """A decoder and its optimizer in :func:`jaxfuse.train.loop.make_steps`' jitted, donating
  step, compiled once (with ``compiler_options``)."""

  def __init__(self, model: Decoder, data: Sequence[dict], wrt, *,
               compiler_options: dict | None = None):
    optimizer = nnx.Optimizer(model, train_optimizer(TRAIN), wrt=wrt)
    _, self.state, train, _ = make_steps(model, optimizer, wrt=wrt)
    self.data = [{k: jnp.asarray(v) for k, v in b.items()} for b in data]
    self.train = train.lower(self.state, self.data[0]).compile(compiler_options)
    self.losses: list = []

  def temp_bytes(self) -> int:
    return int(self.train.memory_analysis().temp_size_in_bytes)

  def step(self):
    batch = self.data[len(self.losses) % len(self.data)]
    self.state, metrics = self.train(self.state, batch)
    self.losses.append(metrics["loss"])
    return metrics["loss"], self.state

  def loss_values(self) -> list[float]:
    return [float(x) for x in self.losses]


class TorchTrainer:
  """A ``transformers`` (or peft) model and ``torch.optim.AdamW`` over its trained parameters,
  with the JAX rows' clipping and schedule; :meth:`step` trains one step."""

  def __init__(self, model, data: Sequence[dict]):
    import torch

    self.model = model
    self.trained = [p for p in model.parameters() if p.requires_grad]
    self.schedule = train_optimizer_schedule()
    self.optimizer = torch.optim.AdamW(self.trained, lr=TRAIN.lr, betas=(0.9, 0.999), eps=1e-8,
                                       weight_decay=TRAIN.weight_decay)
    self.data = [_torch_batch(b) for b in data]
    self.losses: list = []

  def loss(self, batch: dict):
    return self.model(**batch).loss

  def step(self):
    import torch

    batch = self.data[len(self.losses) % len(self.data)]
    for group in self.optimizer.param_groups:
      group["lr"] = float(self.schedule(len(self.losses)))
    self.optimizer.zero_grad(set_to_none=True)
    loss = self.loss(batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(self.trained, TRAIN.clip)
    self.optimizer.step()
    self.losses.append(loss.detach())
    return loss

  def residual_bytes(self) -> int:
    """What autograd saves for the backward of the loss, beyond the parameters and inputs."""
    batch = self.data[0]
    return metrics.torch_residual_bytes(lambda: self.loss(batch),
                                        exclude=[*self.model.parameters(), *batch.values()])

  def loss_values(self) -> list[float]:
    return [float(x) for x in self.losses]


def train_optimizer_schedule():
  """The learning rate of :func:`jaxfuse.train.model.optimizer` at each step."""
  return optax.warmup_cosine_decay_schedule(0.0, TRAIN.lr, TRAIN.warmup, TRAIN.steps,
                                            end_value=TRAIN.lr * 0.1)


def reference_loss(model, batch: dict) -> float:
  """The mean loss of a float32 ``transformers`` model run in float64 (a copy) on a packed
  batch, taken in float64 from its hidden states (``transformers``' own loss upcasts logits to
  float32 only)."""
  import torch
  import torch.nn.functional as F

  model = copy.deepcopy(model).double().eval()
  inputs = _torch_batch(batch, torch.float64)
  targets = inputs.pop("labels").reshape(-1)
  inputs.pop("shift_labels")
  with torch.no_grad():
    hidden = model.model(**inputs).last_hidden_state.reshape(-1, model.config.hidden_size)
    weight = model.lm_head.weight
    total = torch.zeros((), dtype=torch.float64)
    for start in range(0, hidden.shape[0], train_suite.REFERENCE_CHUNK):
      rows = slice(start, start + train_suite.REFERENCE_CHUNK)
      total += F.cross_entropy(hidden[rows] @ weight.T, targets[rows],
                               ignore_index=IGNORE_INDEX, reduction="sum")
  return float(total) / int((targets != IGNORE_INDEX).sum())


def _jax_residual_bytes(model: Decoder, wrt, batch: dict) -> int:
  graphdef, trained, rest = nnx.split(model, wrt, ...)
  batch = {k: jnp.asarray(v) for k, v in batch.items()}
  return metrics.residual_bytes(lambda p: nnx.merge(graphdef, p, rest)(**batch), trained)


def _count(state) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))


# A case -----------------------------------------------------------------------------------------


def case_records(ctx, shape: Shape, *, modes: Sequence[str] = MODES, warmup: int = 1,
                 compiler_options: dict | None = None) -> list[Record]:
  """The records of one shape: per mode (full fine-tuning, LoRA), one per row of
  :data:`IMPLS`, on the same weights and packed batches.

  Args:
    ctx: the run's :class:`benchmarks.harness.Context`.
    shape: the decoder and batch (:class:`benchmarks.suites.train.Shape`, LLaMA).
    modes: :data:`FULL` and / or :data:`LORA`.
    warmup: untimed calls of each row between step 0 and the timed rounds.
    compiler_options: XLA options of the JAX rows' steps (tests lower the optimization level
      to compile faster; the suite passes none).
  """
  cfg = shape.config()
  data = packed_batches(shape)
  ctx.step(f"{shape.name}: base model")
  base = Decoder(cfg, fused=True, implementation="xla", rngs=nnx.Rngs(SEED))
  params = nnx.state(base, nnx.Param)
  state_dict = interop.hf_state_dict(base, as_torch=True)
  del base
  ctx.step(f"{shape.name}: float64 reference")
  reference = reference_loss(hf_eager(cfg, state_dict), data[0])
  records = []
  for mode in modes:
    records += _mode_records(ctx, shape, mode, cfg, params, state_dict, data, reference,
                             warmup=warmup, compiler_options=compiler_options)
  return records


def _jax_models(mode: str, cfg, params) -> dict[str, tuple[Decoder, type]]:
  """The JAX rows' models on copies of ``params`` (a step donates its arrays), with the
  variables each trains."""
  models = {}
  lora_params = None
  for name, fused in ((JAXFUSE, True), (BASELINE, False)):
    implementation = "xla" if fused else None
    model = nnx.eval_shape(lambda f=fused, i=implementation: Decoder(
        cfg, fused=f, implementation=i, rngs=nnx.Rngs(SEED)))
    nnx.update(model, jax.tree.map(jnp.copy, params))
    if mode == LORA:
      with_lora(model)
      if lora_params is None:   # the same adapters in every row
        lora_params = nnx.state(model, nnx.LoRAParam)
      nnx.update(model, jax.tree.map(jnp.copy, lora_params))
    models[name] = (model, nnx.LoRAParam if mode == LORA else nnx.Param)
  return models


def _mode_records(ctx, shape, mode, cfg, params, state_dict, data, reference, *, warmup,
                  compiler_options) -> list[Record]:
  case = case_name(mode, shape)
  residual: dict[str, int | None] = {}
  temp: dict[str, int] = {}
  trained: dict[str, int] = {}
  notes: dict[str, list[str]] = {name: [] for name in IMPLS}
  trainers: dict = {}
  lora_model = None
  for name, (model, wrt) in _jax_models(mode, cfg, params).items():
    ctx.step(f"{case}: {name} residuals")
    residual[name] = _jax_residual_bytes(model, wrt, data[0])
    trained[name] = _count(nnx.state(model, wrt))
    if name == JAXFUSE and mode == LORA:
      lora_model = model   # read by peft_twin before any step donates its arrays
    ctx.step(f"{case}: {name} compiles")
    trainers[name] = JaxTrainer(model, data, wrt, compiler_options=compiler_options)
    temp[name] = trainers[name].temp_bytes()
  ctx.step(f"{case}: {TORCH}")
  hf = hf_eager(cfg, state_dict)
  if mode == LORA:
    hf = peft_twin(hf, lora_model)
  trainers[TORCH] = TorchTrainer(hf, data)
  trained[TORCH] = sum(p.numel() for p in trainers[TORCH].trained)

  for name, trainer in trainers.items():
    ctx.step(f"{case}: {name} step 0")
    train_suite._sync(trainer.step())
  ctx.step(f"{case}: timing")
  times = ctx.time({name: trainer.step for name, trainer in trainers.items()}, warmup=warmup)
  ctx.step(f"{case}: {TORCH} residuals")
  residual[TORCH] = train_suite._torch_residual(trainers[TORCH], TORCH, notes[TORCH])

  records = []
  torch_ms = (times.get(TORCH) or {}).get("median")
  torch_residual = residual.get(TORCH)
  for name in IMPLS:
    r = Record(SUITE, case, name, ctx.platform, "float32")
    records.append(r)
    trainer = trainers[name]
    r.set("time_ms", times.get(name), harness.time_source(times.get(name)))
    source = TORCH_RESIDUAL_SOURCE if name == TORCH else JAX_RESIDUAL_SOURCE
    r.set("residual_bytes", residual.get(name), source)
    r.set("temp_bytes", temp.get(name), TEMP_SOURCE)
    losses = trainer.loss_values()
    r.set("max_abs_err", abs(losses[0] - reference), STEP0_SOURCE)
    r.reference = REFERENCE
    r.set("final_loss", losses[-1], FINAL_SOURCE)
    r.series = {"losses": losses}
    median = (times.get(name) or {}).get("median")
    if median:
      notes[name].append(f"{shape.tokens / (median / 1e3):,.0f} tokens/s")
    time_ratio = median / torch_ms if median and torch_ms else None
    residual_ratio = (residual[name] / torch_residual
                      if residual.get(name) is not None and torch_residual else None)
    if name != TORCH and residual_ratio is not None:
      notes[name].append(f"residual / torch-eager = {residual_ratio:.2f}")
    notes[name].append(f"{trained[name]:,} trained parameters")
    if name == JAXFUSE and time_ratio is not None and residual_ratio is not None:
      met = time_ratio <= TIME_GOAL and residual_ratio <= 1 / RESIDUAL_GOAL
      notes[name].append(f"goal {'met' if met else 'not met'}")
    for text in notes[name]:
      r.add_note(text)
    r.sources = {**(r.sources or {}), "note": NOTE_SOURCE}
  harness.ratio_to_fastest(records, (TORCH,))
  return records


# Suite entry points -----------------------------------------------------------------------------


def run(ctx) -> list[Record]:
  records = []
  for shape in _shapes(ctx):
    records += case_records(ctx, shape)
  return records


def headline(records) -> list[Record]:
  """Every row of both families (one shape per run)."""
  return list(records)


def _ratios(records: Sequence[Record], impl: str) -> tuple[float, float]:
  """``(time, residual)`` of ``impl``'s record over torch-eager's in its case (NaN where
  missing)."""
  (r,) = [x for x in records if x.impl == impl]
  torch_rows = [x for x in records if x.impl == TORCH]
  t = torch_rows[0] if torch_rows else None
  time = (r.time_ms["median"] / t.time_ms["median"]
          if r.time_ms and t is not None and t.time_ms else math.nan)
  residual = (r.residual_bytes / t.residual_bytes
              if r.residual_bytes is not None and t is not None and t.residual_bytes
              else math.nan)
  return time, residual


def plot(records: Sequence[Record], path: str) -> None:
  """One panel per family (full fine-tuning, LoRA): each row's step time and residual bytes
  over torch-eager's in the same case, as bars from 1 on a log axis, with the goal's lines."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib import ticker

  cases = list(dict.fromkeys(r.case for r in records))
  impls = [i for i in IMPLS if any(r.impl == i for r in records)]
  colors = {impl: f"C{i}" for i, impl in enumerate(impls)}
  ratios = {case: {impl: _ratios([r for r in records if r.case == case], impl)
                   for impl in impls if any(r.case == case and r.impl == impl for r in records)}
            for case in cases}
  finite = [v for by_impl in ratios.values() for pair in by_impl.values() for v in pair
            if math.isfinite(v)]
  low = min([*finite, 1 / RESIDUAL_GOAL, 1.0]) / 1.35
  high = max([*finite, TIME_GOAL, 1.0]) * 1.35
  fig, axes = plt.subplots(1, len(cases), figsize=(6.2 * len(cases), 4.8), squeeze=False,
                           sharey=True)
  width = 0.8 / max(1, len(impls))
  goals = (TIME_GOAL, 1 / RESIDUAL_GOAL)
  for ax, case in zip(axes[0], cases):
    torch_row = next((r for r in records if r.case == case and r.impl == TORCH), None)
    for k, impl in enumerate(impls):
      if impl not in ratios[case]:
        continue
      values = ratios[case][impl]
      xs = np.arange(len(goals)) + (k - (len(impls) - 1) / 2) * width
      heights = [v - 1 if math.isfinite(v) else 0 for v in values]
      ax.bar(xs, heights, width, bottom=1.0, color=colors[impl], label=impl)
      for x, v in zip(xs, values):
        text = "n/a" if not math.isfinite(v) else f"{v:.2f}×"
        y = v if math.isfinite(v) else 1.0
        ax.annotate(text, (x, y), ha="center", va="bottom" if y >= 1 else "top", fontsize=8,
                    xytext=(0, 2 if y >= 1 else -2), textcoords="offset points")
    for i, goal in enumerate(goals):
      ax.hlines(goal, i - 0.45, i + 0.45, colors="C3", lw=1.3, linestyles="--",
                label="goal: jaxfuse-xla at or below" if i == 0 else None)
    ax.axhline(1.0, color="k", lw=0.7)
    ax.set_yscale("log")
    ax.set_ylim(low, high)
    ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_minor_locator(ticker.LogLocator(subs=np.arange(1, 10)))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda y, _: f"{y:g}×"))
    ax.yaxis.set_minor_formatter(ticker.NullFormatter())
    labels = ["step time", "residual bytes"]
    if torch_row is not None:
      labels = [f"step time\n(torch-eager: {rec.format_median(torch_row.time_ms)} ms)",
                f"residual bytes\n(torch-eager: {rec.format_bytes(torch_row.residual_bytes)})"]
    ax.set_xticks(np.arange(len(goals)))
    ax.set_xticklabels(labels, fontsize=9)
    ax.set_xlim(-0.5, len(goals) - 0.5)
    ax.set_title(case, fontsize=10)
    ax.grid(axis="y", alpha=0.3, which="both")
  axes[0][0].set_ylabel("over torch-eager (Hugging Face eager), log")
  axes[0][0].legend(fontsize=8, loc="upper left")
  platform = records[0].platform if records else "?"
  fig.suptitle(f"finetune: one step on packed rows (forward, backward, clipping, AdamW) on "
               f"{platform}, float32")
  fig.tight_layout()
  fig.savefig(path, dpi=120, bbox_inches="tight")
  plt.close(fig)


__all__ = ["FULL_SHAPE", "IMPLS", "MODES", "QUICK", "block_causal_mask", "case_name",
           "case_records", "headline", "packed_batches", "peft_twin", "plot", "reference_loss",
           "run"]
