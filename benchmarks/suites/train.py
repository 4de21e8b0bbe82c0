"""One training step of a decoder: forward, backward and the AdamW update.

The decoder (:class:`jaxfuse.models.Decoder`): d_model 512, 8 query heads and 2 key/value heads,
4 layers, a SwiGLU MLP of width 1536, a vocabulary of 32000, float32. Cases are named
``decoder d512 L4 V32000 b<batch> seq=<length>``: ``--quick`` runs batch 4 at seq 1024; the
full run adds batch 2 at seq 2048 (the same 4096 tokens per step). The ``gemma2-like`` and
``qwen3-like`` cases are the same shape with those families' options (:data:`FAMILY_OPTIONS`);
the ``mixtral-like`` case replaces each block's MLP by a Mixture of Experts (8 SwiGLU experts of
width 768, half the dense MLP's, top 2, renormalized, dropless: about the dense case's active
MLP FLOPs per token). Rows:

- ``jaxfuse``: ``Decoder(cfg, fused=True)``, ``implementation=None``: each op's first choice
  on this platform, what a model gets by default (on CPUs the C++ kernels of attention and of
  the gated MLP's glu, XLA's formulas for the rest; on GPUs the Pallas kernels).
- ``jaxfuse-xla``: ``Decoder(cfg, fused=True, implementation="xla")``: fused residual add +
  RMSNorm, attention that keeps its output and log-sum-exp (never the scores), a gated MLP that
  recomputes its hidden activation, the fused linear cross-entropy head (no ``[tokens, V]``
  logits).
- ``jax-unfused``: ``Decoder(cfg, fused=False)``, the same parameters in plain flax/jax parts
  (``nnx.RMSNorm``, ``jax.nn.dot_product_attention``, full logits and optax's cross-entropy;
  experts over ``jax.lax.ragged_dot``, nothing recomputed). The timing baseline.
- ``torch-eager``: Hugging Face's model of the family (``transformers.LlamaForCausalLM``, SDPA
  attention; Gemma 2's with eager attention, which its soft-cap needs; Mixtral's
  ``MixtralForCausalLM`` with ``experts_implementation="eager"``, its loop over the experts)
  with the same weights (:func:`jaxfuse.interop.hf_state_dict`, :meth:`DecoderConfig.to_hf`).
- ``torch-compile``: the same, its loss (forward, and through AOTAutograd the backward)
  compiled with ``torch.compile``; the optimizer step runs eagerly. A compiler failure leaves
  the row with a note and no figures.

A step of the JAX rows is one ``jax.jit`` of ``nnx.value_and_grad`` and
``nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param).update`` over the split state, its
state donated (the pattern of ``jaxfuse.train``); torch's is ``zero_grad(set_to_none=True)``,
``loss.backward()`` and ``torch.optim.AdamW`` with optax's hyperparameters (lr 1e-4, betas
(0.9, 0.999), eps 1e-8, weight decay 1e-4 on every parameter). Every row starts from the same
weights and reads the same batches: windows of the standard library's ``.py`` bytes (token ids
0-255; :func:`jaxfuse.train.stdlib_corpus`), the next token as the target.

Every call of a step trains: step 0 (which compiles) gives the step-0 loss; the interleaved
timed rounds (after one warm-up call) are steps 2, 3, ...; the rows of the loss curve
(``jaxfuse-xla``, ``jax-unfused``, ``torch-eager``) then train on until ``CURVE_STEPS`` steps.
Step ``i`` reads batch ``i`` (modulo ``CURVE_STEPS``) in every row.

Figures: ``time_ms`` and ``ratio`` (to ``jax-unfused``; the ratio to ``torch-eager`` and the
tokens per second are in the note); ``residual_bytes`` (JAX: the ``jax.vjp`` residuals of the
loss with respect to the parameters; torch: the tensors autograd saves, compiled graphs
included, null with a note where the hooks see none);
``temp_bytes`` (XLA's compiled temp memory of the whole step); ``max_abs_err``: the step-0
loss against the Hugging Face model run in float64 on the same weights and batch (its loss
taken in float64 from its hidden states: ``transformers`` upcasts logits to float32 for its
own loss); ``final_loss``: the step-0 loss itself. The note gives the step-0 loss's relative
difference to the float64 reference and the loss of every step of the curve, which
:func:`plot` draws.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from benchmarks import harness
from benchmarks import records as rec
from benchmarks.records import Record
from jaxfuse import interop, metrics
from jaxfuse.models import IGNORE_INDEX, Decoder, DecoderConfig, next_token_targets

SUITE = "train"
BASELINE = "jax-unfused"
TORCH = "torch-eager"
REFERENCE = "hf-float64"
IMPLS = ("jaxfuse", "jaxfuse-xla", BASELINE, TORCH, "torch-compile")
# The fused decoder's rows: their ``implementation``.
FUSED = {"jaxfuse": None, "jaxfuse-xla": "xla"}
# The rows whose losses are drawn, over CURVE_STEPS steps on the same batches.
CURVE_IMPLS = ("jaxfuse-xla", BASELINE, TORCH)
CURVE_STEPS = 20
# optax.adamw(LR)'s defaults, given to torch.optim.AdamW too (its own weight decay is 1e-2).
LR, BETAS, EPS, WEIGHT_DECAY = 1e-4, (0.9, 0.999), 1e-8, 1e-4
SEED = 0
# Rows of the float64 reference's head computed at once (bounds its [rows, V] logits).
REFERENCE_CHUNK = 1024

STEP0_SOURCE = ("the step-0 loss (float32, before any update) against the family's "
                "transformers model in float64 on the same weights and batch, its loss taken in "
                "float64 from its hidden states")
NOTE_SOURCE = ("step-0 loss: the loss of the first step, before any update; its relative "
               "difference: |loss - reference| / |reference| against " + REFERENCE + "; "
               "losses: each step's loss on batches 0, 1, ... (the timed steps included); "
               "tokens/s: batch × seq over the median step time; time / torch-eager: median "
               "over torch-eager's, interleaved in the same rounds")
TEMP_SOURCE = ("XLA compiled memory analysis of the jitted step (forward, backward, AdamW "
               "update), temp bytes (compiled.memory_analysis(), as "
               "jaxfuse.metrics.compiled_memory)")
JAX_RESIDUAL_SOURCE = f"{rec.JAX_RESIDUAL_SOURCE}, of the loss w.r.t. the nnx.Param leaves"
TORCH_RESIDUAL_SOURCE = f"{rec.TORCH_RESIDUAL_SOURCE}, of model(tokens, labels=tokens).loss"


# The families' options on the same shape (jaxfuse.models.families): what each computes beyond
# LLaMA, at its published settings where a tiny model has them.
FAMILY_OPTIONS = {
    "llama": {},
    # Gemma 2: norms before and after each half (1 + w), GeLU-tanh, query_pre_attn_scalar =
    # head_dim, attention soft-cap 50 and final soft-cap 30, scaled and tied embeddings,
    # sliding-window (512) and global layers alternating.
    "gemma2": dict(norm_placement="sandwich", norm_scale_offset=1.0, activation="gelu_tanh",
                   embed_scale=True, tie_embeddings=True, attn_logit_softcap=50.0,
                   final_logit_softcap=30.0, sliding_window=512, model_type="gemma2"),
    # Qwen3: RMSNorm of each query and key head before the rotation.
    "qwen3": dict(qk_norm="head", model_type="qwen3"),
    # Mixtral: each block's MLP is a Mixture of Experts (the shape's mlp is each expert's
    # width), softmax top-2 routing renormalized, dropless; no auxiliary loss (transformers
    # adds none without output_router_logits).
    "mixtral": dict(num_experts=8, experts_per_token=2, model_type="mixtral"),
}


@dataclasses.dataclass(frozen=True)
class Shape:
  """A decoder and the batch of one step."""

  vocab: int
  d_model: int
  layers: int
  heads: int
  kv_heads: int
  mlp: int
  batch: int
  seq: int
  family: str = "llama"

  @property
  def name(self) -> str:
    prefix = "decoder" if self.family == "llama" else f"{self.family}-like"
    return (f"{prefix} d{self.d_model} L{self.layers} V{self.vocab} b{self.batch} "
            f"seq={self.seq}")

  @property
  def tokens(self) -> int:
    return self.batch * self.seq

  def config(self) -> DecoderConfig:
    options = dict(FAMILY_OPTIONS[self.family])
    if self.family == "gemma2":
      options["layer_types"] = ("sliding_attention", "full_attention") * (self.layers // 2)
      options["query_scale"] = (self.d_model // self.heads) ** -0.5
    return DecoderConfig(vocab_size=self.vocab, d_model=self.d_model, num_layers=self.layers,
                         num_heads=self.heads, num_kv_heads=self.kv_heads, mlp_dim=self.mlp,
                         max_seq_len=self.seq, **options)


QUICK = Shape(vocab=32000, d_model=512, layers=4, heads=8, kv_heads=2, mlp=1536, batch=4,
              seq=1024)
LONG = dataclasses.replace(QUICK, batch=2, seq=2048)


FAMILIES = [*(dataclasses.replace(QUICK, family=family) for family in ("gemma2", "qwen3")),
            dataclasses.replace(QUICK, family="mixtral", mlp=QUICK.mlp // 2)]


def _shapes(ctx) -> list[Shape]:
  return [QUICK, *FAMILIES] if ctx.quick else [QUICK, LONG, *FAMILIES]


def batches(shape: Shape, n: int, seed: int = SEED) -> list[np.ndarray]:
  """``n`` int32 token batches ``[batch, seq]``: windows of the standard library's bytes
  (ids modulo the vocabulary where it has fewer than 256 tokens)."""
  from jaxfuse.train import batch_at, stdlib_corpus

  data, _ = stdlib_corpus()
  return [batch_at(data, i, shape.batch, shape.seq, seed)[0] % shape.vocab for i in range(n)]


# Trainers: one object per row, whose step() trains on the next batch ----------------------------


class JaxTrainer:
  """A decoder and its AdamW state; :meth:`step` runs one jitted, donating training step."""

  def __init__(self, model: Decoder, data: Sequence[np.ndarray], *,
               compiler_options: dict | None = None):
    optimizer = nnx.Optimizer(model, optax.adamw(LR), wrt=nnx.Param)
    graphdef, self.state = nnx.split((model, optimizer))

    def train(state, tokens, targets):
      model, optimizer = nnx.merge(graphdef, state)
      loss, grads = nnx.value_and_grad(lambda m: m(tokens, targets))(model)
      optimizer.update(model, grads)
      return nnx.state((model, optimizer)), loss

    self.train = jax.jit(train, donate_argnums=0, compiler_options=compiler_options)
    self.data = [(jnp.asarray(b), next_token_targets(jnp.asarray(b))) for b in data]
    self.losses: list = []

  def temp_bytes(self) -> int:
    """XLA's compiled temp memory of the step (its first call then reuses the executable)."""
    compiled = self.train.lower(self.state, *self.data[0]).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)

  def step(self):
    tokens, targets = self.data[len(self.losses) % len(self.data)]
    self.state, loss = self.train(self.state, tokens, targets)
    self.losses.append(loss)
    return loss, self.state

  def loss_values(self) -> list[float]:
    return [float(x) for x in self.losses]


class TorchTrainer:
  """A ``transformers`` model and its ``torch.optim.AdamW``; :meth:`step` trains one step."""

  def __init__(self, model, data: Sequence[np.ndarray], *, compiled: bool = False):
    import torch

    self.model = model
    self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS,
                                       weight_decay=WEIGHT_DECAY)
    self.data = [harness.to_torch(b, dtype=torch.long) for b in data]
    self.loss_fn = _hf_loss(model)
    if compiled:
      self.loss_fn = torch.compile(self.loss_fn)
    self.losses: list = []

  def step(self):
    tokens = self.data[len(self.losses) % len(self.data)]
    self.optimizer.zero_grad(set_to_none=True)
    loss = self.loss_fn(tokens)
    loss.backward()
    self.optimizer.step()
    self.losses.append(loss.detach())
    return loss

  def residual_bytes(self) -> int:
    """What autograd saves for the backward of the loss, beyond the parameters and tokens."""
    tokens = self.data[0]
    return metrics.torch_residual_bytes(lambda: self.loss_fn(tokens),
                                        exclude=[*self.model.parameters(), tokens])

  def loss_values(self) -> list[float]:
    return [float(x) for x in self.losses]


def _hf_loss(model):
  def loss(tokens):
    return model(input_ids=tokens, labels=tokens).loss

  return loss


def hf_model(cfg: DecoderConfig, state_dict: dict):
  """The family's ``transformers`` ``*ForCausalLM`` (float32) holding ``state_dict``: SDPA
  attention, or eager where the family soft-caps its attention scores (SDPA has no soft-cap:
  Gemma 2 trains with eager attention); a Mixture of Experts with
  ``experts_implementation="eager"``."""
  import torch
  import transformers

  config = cfg.to_hf()
  attention = "eager" if cfg.attn_logit_softcap is not None else "sdpa"
  config._attn_implementation = attention
  experts = "eager" if cfg.moe else None
  if experts:
    config._experts_implementation = experts
  torch.manual_seed(SEED)
  model = transformers.AutoModelForCausalLM.from_config(config).float()
  missing, unexpected = model.load_state_dict(state_dict, strict=False)
  tied = {"lm_head.weight"} if cfg.tie_embeddings else set()
  if set(missing) - tied or unexpected:
    raise RuntimeError(f"state dict: missing {missing}, unexpected {unexpected}")
  if model.config._attn_implementation != attention:
    raise RuntimeError(f"expected {attention} attention, got "
                       f"{model.config._attn_implementation}")
  if experts and model.config._experts_implementation != experts:
    raise RuntimeError(f"expected {experts} experts, got "
                       f"{model.config._experts_implementation}")
  return model.train()


def reference_loss(model, tokens: np.ndarray) -> float:
  """The mean next-token loss of a float32 ``transformers`` model run in float64 (a copy).

  The loss is taken in float64 from the final hidden states, ``REFERENCE_CHUNK`` rows of
  logits at a time: ``transformers``' own loss upcasts logits to float32 only.
  """
  import torch
  import torch.nn.functional as F  # noqa: N812

  model = copy.deepcopy(model).double().eval()
  t = torch.from_numpy(np.asarray(tokens, np.int64))
  targets = torch.from_numpy(np.asarray(next_token_targets(jnp.asarray(tokens)), np.int64))
  cap = getattr(model.config, "final_logit_softcapping", None)
  with torch.no_grad():
    hidden = model.model(input_ids=t).last_hidden_state.reshape(-1, model.config.hidden_size)
    targets = targets.reshape(-1)
    weight = model.lm_head.weight
    total = torch.zeros((), dtype=torch.float64)
    for start in range(0, hidden.shape[0], REFERENCE_CHUNK):
      rows = slice(start, start + REFERENCE_CHUNK)
      logits = hidden[rows] @ weight.T
      if cap is not None:
        logits = cap * torch.tanh(logits / cap)
      total += F.cross_entropy(logits, targets[rows], ignore_index=IGNORE_INDEX,
                               reduction="sum")
    count = int((targets != IGNORE_INDEX).sum())
  return float(total) / count


def _sync(out):
  """Waits for a step's outputs: JAX arrays, or torch tensors (synchronous on CPU)."""
  if hasattr(out, "detach"):
    return harness.torch_sync(out)
  return jax.block_until_ready(out)


def _did_not_run(e: Exception) -> str:
  return f"did not run: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


# A case -----------------------------------------------------------------------------------------


def case_records(ctx, shape: Shape, *, impls: Sequence[str] = IMPLS,
                 curve_steps: int = CURVE_STEPS, warmup: int = 1,
                 compiler_options: dict | None = None) -> list[Record]:
  """The records of one shape.

  Builds every row on the same weights and batches, runs step 0, times the interleaved rounds
  (``ctx.time``), trains the curve rows on to ``curve_steps`` steps, and sets each figure with
  its source.

  Args:
    ctx: the run's :class:`benchmarks.harness.Context`.
    shape: the decoder and batch.
    impls: the rows, a subset of :data:`IMPLS` in the order of the records.
    curve_steps: the steps of the loss curve (and the batches every row cycles through).
    warmup: untimed calls of each row between step 0 and the timed rounds.
    compiler_options: XLA options of the JAX rows' jitted steps (tests lower the optimization
      level to compile faster; the suite passes none).
  """
  case = shape.name
  cfg = shape.config()
  data = batches(shape, curve_steps)
  ctx.step(f"{case}: models")
  model = Decoder(cfg, fused=True, implementation="xla", rngs=nnx.Rngs(SEED))
  params = nnx.state(model, nnx.Param)
  state_dict = interop.hf_state_dict(model, as_torch=True)
  notes: dict[str, list[str]] = {name: [] for name in impls}
  residual: dict[str, int | None] = {}
  temp: dict[str, int] = {}
  trainers: dict = {}

  for name in impls:
    if name.startswith("torch"):
      trainers[name] = TorchTrainer(hf_model(cfg, state_dict), data,
                                    compiled=name == "torch-compile")
      continue
    if name == "jaxfuse-xla":
      jax_model = model
    elif name in FUSED:
      jax_model = nnx.eval_shape(lambda name=name: Decoder(
          cfg, fused=True, implementation=FUSED[name], rngs=nnx.Rngs(SEED)))
    elif name == BASELINE:
      jax_model = nnx.eval_shape(lambda: Decoder(cfg, fused=False, rngs=nnx.Rngs(SEED)))
    else:
      raise ValueError(f"train suite: unknown impl {name!r}; known: {IMPLS}")
    # Each row owns its arrays: the step donates them.
    nnx.update(jax_model, jax.tree.map(jnp.copy, params))
    graphdef, p, rest = nnx.split(jax_model, nnx.Param, ...)
    tokens, targets = jnp.asarray(data[0]), next_token_targets(jnp.asarray(data[0]))
    ctx.step(f"{case}: {name} residuals")
    residual[name] = metrics.residual_bytes(
        lambda p, g=graphdef, r=rest, x=tokens, y=targets: nnx.merge(g, p, r)(x, y), p)
    trainers[name] = JaxTrainer(jax_model, data, compiler_options=compiler_options)
    ctx.step(f"{case}: {name} compiles")
    temp[name] = trainers[name].temp_bytes()
  del model, params

  ctx.step(f"{case}: float64 reference")
  reference = reference_loss(trainers[TORCH].model if TORCH in trainers
                             else hf_model(cfg, state_dict), data[0])
  del state_dict

  for name, trainer in list(trainers.items()):
    ctx.step(f"{case}: {name} step 0")
    try:
      _sync(trainer.step())
    except Exception as e:  # noqa: BLE001 - a compiler that fails here: a note, no figures.
      if name != "torch-compile":
        raise
      notes[name].append(_did_not_run(e))
      del trainers[name]
  ctx.step(f"{case}: timing")
  times = ctx.time({name: trainer.step for name, trainer in trainers.items()}, warmup=warmup)
  for name in CURVE_IMPLS:
    if name in trainers:
      while len(trainers[name].losses) < curve_steps:
        ctx.step(f"{case}: {name} step {len(trainers[name].losses)} of the curve")
        _sync(trainers[name].step())
  for name, trainer in trainers.items():
    if name.startswith("torch"):
      ctx.step(f"{case}: {name} residuals")
      residual[name] = _torch_residual(trainer, name, notes[name])

  records = []
  torch_ms = (times.get(TORCH) or {}).get("median")
  for name in impls:
    r = Record(SUITE, case, name, ctx.platform, "float32")
    records.append(r)
    trainer = trainers.get(name)
    r.set("time_ms", times.get(name), harness.time_source(times.get(name)))
    source = TORCH_RESIDUAL_SOURCE if name.startswith("torch") else JAX_RESIDUAL_SOURCE
    r.set("residual_bytes", residual.get(name), source)
    r.set("temp_bytes", temp.get(name), TEMP_SOURCE)
    if trainer is not None:
      losses = trainer.loss_values()
      r.set("max_abs_err", abs(losses[0] - reference), STEP0_SOURCE)
      r.set("final_loss", losses[0], "the step-0 loss (before any update), float32")
      r.reference = REFERENCE
      median = (times.get(name) or {}).get("median")
      if median:
        notes[name].append(f"{shape.tokens / (median / 1e3):.0f} tokens/s "
                           f"({shape.tokens} tokens/step)")
        if torch_ms and name != TORCH:
          notes[name].append(f"time / torch-eager = {median / torch_ms:.2f}")
      notes[name].append(f"step-0 loss {losses[0]:.6f}, relative difference to {REFERENCE} "
                         f"{abs(losses[0] - reference) / abs(reference):.1e}")
      notes[name].append(format_losses(losses[:curve_steps]))
    for text in notes[name]:
      r.add_note(text)
    if r.note:
      r.sources = {**(r.sources or {}), "note": NOTE_SOURCE}
  harness.ratio_to_fastest(records, (BASELINE,))
  return records


def _torch_residual(trainer: TorchTrainer, name: str, notes: list[str]) -> int | None:
  """torch-eager's saved tensors; for torch-compile, only where the hooks see its graph."""
  try:
    nbytes = trainer.residual_bytes()
  except Exception as e:  # noqa: BLE001 - a figure that cannot be taken here is null.
    notes.append(f"residual bytes: {_did_not_run(e)}")
    return None
  if name == "torch-compile" and nbytes == 0:
    notes.append("residual bytes: saved_tensors_hooks see nothing of the compiled graph")
    return None
  return nbytes


# The losses in a note, and back -----------------------------------------------------------------

_LOSSES = re.compile(r"losses of steps 0-(\d+): ([^;]+)")


def format_losses(losses: Sequence[float]) -> str:
  """``losses of steps 0-N: l0 l1 ...`` (the note's form, which :func:`losses_of` reads)."""
  return f"losses of steps 0-{len(losses) - 1}: " + " ".join(f"{x:.6f}" for x in losses)


def losses_of(r: Record) -> list[float] | None:
  """The per-step losses a record's note carries, or None."""
  match = _LOSSES.search(r.note or "")
  if not match:
    return None
  return [float(x) for x in match.group(2).split()]


# Suite entry points -----------------------------------------------------------------------------


def run(ctx) -> list[Record]:
  records = []
  for shape in _shapes(ctx):
    # One process a case: a case's compiled programs and allocator pools do not add up with the
    # next one's (the three cases together outgrow a 24 GB machine otherwise).
    # The families' cases compare with HF eager and the baseline (torch.compile of each family
    # would hold its compiled graphs beside three more models).
    impls = IMPLS if shape.family == QUICK.family else ("jaxfuse", *CURVE_IMPLS)
    records += harness.in_fresh_process(case_records, ctx, shape, impls=impls)
  return records


def headline(records) -> list[Record]:
  """One row per impl of the quick case and of each family's."""
  return [r for r in records if r.case in {QUICK.name, *(s.name for s in FAMILIES)}]


# One hatch a case in the bar panels (the colour is the row's).
HATCHES = ("", "//", "..", "xx", "\\\\", "++")


def _case_label(case: str) -> str:
  """``decoder seq=1024``, ``gemma2-like seq=1024``: the family and sequence of a case."""
  words = case.split(" ")
  return f"{words[0]} {words[-1]}"


def plot(records: Sequence[Record], path: str) -> None:
  """Left: the loss curves of the rows that train over the same batches (the quick case, or
  the first with curves). Right: median step time and residual bytes per impl and case."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib import ticker

  cases = list(dict.fromkeys(r.case for r in records))
  impls = list(dict.fromkeys(r.impl for r in records))
  colors = {impl: f"C{i}" for i, impl in enumerate(impls)}
  fig = plt.figure(figsize=(14, 6.5))
  grid = fig.add_gridspec(2, 2, width_ratios=(1.35, 1), hspace=0.45, wspace=0.25)
  ax = fig.add_subplot(grid[:, 0])
  curved = [c for c in cases if any(losses_of(r) for r in records if r.case == c)]
  main = QUICK.name if QUICK.name in curved else (curved[0] if curved else None)
  styles = iter([("-", "o", 7), ("--", "s", 5), (":", "^", 4), ("-.", "x", 4)] * 4)
  curves = {r.impl: losses_of(r) for r in records
            if r.case == main and r.impl in CURVE_IMPLS and losses_of(r)}
  for impl, losses in curves.items():
    line, marker, size = next(styles)
    ax.plot(range(len(losses)), losses, line, marker=marker, markersize=size, lw=1.6,
            color=colors[impl], label=impl, markerfacecolor="none")
  title = f"loss curves, {main}" if main else "no loss curves recorded"
  if TORCH in curves and len(curves) > 1:
    ref = np.asarray(curves[TORCH])
    worst = max(float(np.max(np.abs(np.asarray(v[:len(ref)]) - ref[:len(v)]) / ref[:len(v)]))
                for k, v in curves.items() if k != TORCH)
    title += f"\nlargest |loss − torch-eager| / loss over the steps: {worst:.1e}"
  ax.set_xlabel("step (the same batches in every row)")
  ax.set_ylabel("training loss (nats/token)")
  ax.set_title(title, fontsize=10)
  ax.grid(alpha=0.3)
  if curves:
    ax.legend(loc="upper right", fontsize=9)
    ax.xaxis.get_major_locator().set_params(integer=True)

  width = 0.8 / max(1, len(cases))
  for row, (field, label) in enumerate((("time", "median step time (s)"),
                                        ("residual", "residual bytes (MiB, log)"))):
    bar_ax = fig.add_subplot(grid[row, 1])
    for k, case in enumerate(cases):
      values = []
      for impl in impls:
        match = [r for r in records if r.case == case and r.impl == impl]
        r = match[0] if match else None
        if r is None:
          values.append(math.nan)
        elif field == "time":
          values.append(r.time_ms["median"] / 1e3 if r.time_ms else math.nan)
        else:
          values.append(r.residual_bytes / 2**20 if r.residual_bytes else math.nan)
      xs = np.arange(len(impls)) + (k - (len(cases) - 1) / 2) * width
      bar_ax.bar(xs, values, width, color=[colors[i] for i in impls], edgecolor="white",
                 hatch=HATCHES[k % len(HATCHES)], alpha=1.0 if k == 0 else 0.7)
      for x, value in zip(xs, values):
        if math.isnan(value):  # at the foot of the axes, which a log scale has no 0 for
          bar_ax.annotate("n/a", (x, 0.02), xycoords=("data", "axes fraction"), ha="center",
                          va="bottom", fontsize=8)
        else:
          text = f"{value:,.0f}" if value >= 100 else f"{value:.3g}"
          bar_ax.annotate(text, (x, value), ha="center", va="bottom", fontsize=8,
                          xytext=(0, 2), textcoords="offset points")
    if field == "residual":
      bar_ax.set_yscale("log")
      bar_ax.yaxis.set_major_formatter(ticker.LogFormatter())
      bar_ax.yaxis.set_minor_formatter(ticker.LogFormatter(labelOnlyBase=False))
    bar_ax.set_xticks(np.arange(len(impls)))
    bar_ax.set_xticklabels(impls, fontsize=8)
    bar_ax.set_ylabel(label, fontsize=9)
    bar_ax.margins(y=0.15)
    if len(cases) > 1:
      from matplotlib.patches import Patch
      bar_ax.legend(handles=[Patch(facecolor="lightgray", edgecolor="dimgray",
                                   hatch=HATCHES[k % len(HATCHES)], label=_case_label(case))
                             for k, case in enumerate(cases)], fontsize=7)
  platform = records[0].platform if records else "?"
  fig.suptitle(f"train: one step (forward, backward, AdamW) on {platform}, float32")
  fig.savefig(path, dpi=120, bbox_inches="tight")
  plt.close(fig)


__all__ = ["CURVE_STEPS", "IMPLS", "LONG", "QUICK", "JaxTrainer", "Shape", "TorchTrainer",
           "batches", "case_records", "format_losses", "headline", "hf_model", "losses_of",
           "plot", "reference_loss", "run"]
