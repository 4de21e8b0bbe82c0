"""The training loop of ``python -m jaxfuse.train``: the jitted steps, the run's metrics and
log, preemption.

:func:`train` runs a :class:`~jaxfuse.train.config.TrainConfig`: it finds the tokenizer, builds
the model and its optimizer (:mod:`jaxfuse.train.model`), prepares the batches
(:mod:`jaxfuse.train.inputs`), plans recomputation for ``--remat-budget``, places the state on
the ``--mesh`` (:mod:`jaxfuse.train.placement`), resumes from a checkpoint
(:mod:`jaxfuse.train.checkpoint`), then trains:

- A step takes ``--batch`` x ``--grad-accum`` rows: with ``--grad-accum N`` the jitted step
  scans over N micro-batches of ``--batch`` rows, summing each one's gradient weighted by its
  share of the step's loss tokens, so that it equals one step on the whole batch (within
  float32 rounding) while holding one micro-batch's activations.
- A step whose loss or gradient is not finite is not applied (the state stays as it was);
  more than ``--skip-nonfinite`` of them stop the run, naming the step, with its checkpoints
  kept.
- The host reads the steps' metrics back every ``--log-every`` steps (and before evaluating,
  saving or stopping), so the steps in between run without waiting for it; it then writes them
  to TensorBoard, W&B and ``metrics.jsonl`` (:mod:`jaxfuse.train.writers`), with the tokens per
  second and the MFU over that span.
- SIGTERM and SIGINT save a checkpoint of the step reached, on every process at the same step,
  and raise :class:`~jaxfuse.train.preemption.Preempted` (:mod:`jaxfuse.train.preemption`).

At the end it samples text, writes ``train_log.json`` and ``loss_curve.png``
(:mod:`jaxfuse.train.plot`) and, with ``--export-hf``, a Hugging Face checkpoint
(:mod:`jaxfuse.train.export`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxfuse import remat
from jaxfuse.metrics.peak import peak_flops
from jaxfuse.models import IGNORE_INDEX, Decoder
from jaxfuse.posttrain.objectives import (GRPO, SFT, Distill, DistillTopK, Objective,
                                          make_objective, reference_log_probs)
from jaxfuse.train import checkpoint, config, distributed, export, placement
from jaxfuse.train import inputs as inputs_lib
from jaxfuse.train.config import TrainConfig
from jaxfuse.train.corpus import LN2
from jaxfuse.train.inputs import Inputs
from jaxfuse.train.model import build, build_teacher, learning_rate, sample_text, trained
from jaxfuse.train.plot import plot_losses
from jaxfuse.train.preemption import Preempted, StopSignals
from jaxfuse.posttrain.rewards import RewardError
from jaxfuse.train.rl import GRPOSteps, Prompts
from jaxfuse.train.writers import MetricWriters

__all__ = ["Preempted", "make_steps", "micro_batches", "reference_pass", "train"]


def micro_batches(batch: dict, count: int) -> dict:
  """``batch``'s ``[count * b, ...]`` arrays as ``[count, b, ...]``: micro-batch ``i`` holds rows
  ``i, count + i, 2 * count + i, ...``, so that rows split over a mesh's batch axes split every
  micro-batch alike (each device keeps its own rows)."""
  def split(x):
    rows = x.shape[0] // count
    return jnp.swapaxes(x.reshape(rows, count, *x.shape[1:]), 0, 1)
  return jax.tree.map(split, batch)


def _accumulated(loss_fn, params, batch: dict, count: int, *, grad: bool,
                 token_weighted: bool = True):
  """``((loss, metrics), grads)`` of ``loss_fn(params, batch) -> (loss, metrics)`` over
  ``count`` micro-batches in a scan; ``grads`` None without ``grad``.

  ``token_weighted`` (SFT: a decoder's mean loss over the batch's valid targets): each
  micro-batch's token losses are summed over the whole batch's valid targets (the decoder's
  ``total_targets``), so that every token weighs as in one pass and the sum is the whole batch's
  mean. Otherwise (a mean over the batch's rows, as the preference losses are) each
  micro-batch's loss and metrics weigh ``1 / count``."""
  micro = micro_batches(batch, count)
  total = jnp.maximum(jnp.sum(batch["targets"] != IGNORE_INDEX), 1).astype(jnp.float32)
  share = 1.0 if token_weighted else 1.0 / count

  def body(carry, mb):
    if token_weighted:
      mb = {**mb, "total_targets": total}
    out = (jax.value_and_grad(loss_fn, has_aux=True)(params, mb) if grad
           else (loss_fn(params, mb), None))
    out = jax.tree.map(lambda x: x * share, out)
    return jax.tree.map(jnp.add, carry, out), None

  shapes = jax.eval_shape(loss_fn, params, jax.tree.map(lambda x: x[0], micro))
  zero = (jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes),
          jax.tree.map(jnp.zeros_like, params) if grad else None)
  out, _ = jax.lax.scan(body, zero, micro)
  return out


def make_steps(model: Decoder, optimizer: nnx.Optimizer,
               mesh: jax.sharding.Mesh | None = None, wrt=nnx.Param, grad_accum: int = 1,
               objective: Objective | None = None):
  """``(graphdef, state, train, evaluate)``: jitted ``train(state, batch) -> (state, metrics)``
  and ``evaluate(state, batch) -> loss`` over the split state of ``(model, optimizer)``, where
  ``batch`` is a dict of the model's arguments (``tokens``, ``targets``, and ``positions`` and
  ``segment_ids`` for packed rows, and what the objective reads besides); the gradient is taken
  of the ``wrt`` variables only (the optimizer's).

  ``objective`` (default :class:`~jaxfuse.posttrain.objectives.SFT`) gives the loss:
  ``objective.loss(model, batch) -> (loss, metrics)``. ``metrics`` holds the step's ``loss``,
  the objective's metrics, the gradient's global norm ``grad_norm`` (before clipping), its
  ``loss_tokens`` and whether it was ``applied``: a step whose loss or gradient is not finite
  leaves the model as it was (with :func:`jaxfuse.train.model.optimizer`, whose
  ``optax.apply_if_finite`` rejects it). With ``grad_accum`` N the batch's rows are N
  micro-batches (:func:`micro_batches`), scanned in the step and in ``evaluate``. With a
  ``mesh``, the state is placed there by its logical axes (and kept so by ``train``). Call them
  under ``jax.set_mesh(mesh)``: the model reads the mesh as it traces."""
  objective = SFT() if objective is None else objective
  # Arrays the objective reads besides the model (a teacher's variables): arguments of the
  # jitted steps, placed on the mesh as the model is, never constants of their programs.
  constants = getattr(objective, "constants", None)
  graphdef, state = nnx.split((model, optimizer))

  def loss_fn(params, rest, batch, constants):
    # Variables of this trace (copies), which nnx.remat inside the model may update.
    model = nnx.merge(module_def, params, rest, copy=True)
    if constants is None:
      return objective.loss(model, batch)
    return objective.loss(model, batch, constants)

  module_def, _, _ = nnx.split(model, wrt, ...)

  def objective_loss(params, rest, batch, constants, grad):
    if grad_accum == 1:
      if grad:
        return jax.value_and_grad(loss_fn, has_aux=True)(params, rest, batch, constants)
      return loss_fn(params, rest, batch, constants), None
    return _accumulated(lambda p, b: loss_fn(p, rest, b, constants), params, batch,
                        grad_accum, grad=grad, token_weighted=objective.token_weighted)

  def train(state, batch, constants=None):
    model, optimizer = nnx.merge(graphdef, state)
    _, params, rest = nnx.split(model, wrt, ...)
    (loss, extra), grads = objective_loss(params, rest, batch, constants, True)
    grad_norm = optax.tree.norm(grads)
    # The optimizer rejects a gradient that is not finite everywhere (optax.apply_if_finite:
    # the state stays as it was); a loss that is not finite rejects the step as well.
    grads = jax.tree.map(lambda g: jnp.where(jnp.isfinite(loss), g, jnp.nan), grads)
    applied = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    optimizer.update(model, grads)
    tokens = jnp.sum(batch["targets"] != IGNORE_INDEX)
    return nnx.state((model, optimizer)), {**extra, "loss": loss, "grad_norm": grad_norm,
                                           "loss_tokens": tokens, "applied": applied}

  def evaluate(state, batch, constants=None):
    model, _ = nnx.merge(graphdef, state)
    _, params, rest = nnx.split(model, wrt, ...)
    return objective_loss(params, rest, batch, constants, False)[0][0]

  if mesh is None:
    train_step, eval_step = jax.jit(train, donate_argnums=0), jax.jit(evaluate)
  else:
    state, shardings = placement.place_state(state, mesh)
    if constants is not None:
      constants, _ = placement.place_state(constants, mesh)
    one = placement.replicated(mesh)
    train_step = jax.jit(train, donate_argnums=0, out_shardings=(shardings, one))
    eval_step = jax.jit(evaluate, out_shardings=one)
  if constants is None:
    return graphdef, state, train_step, eval_step
  return graphdef, state, _Bound(train_step, constants), _Bound(eval_step, constants)


class _Bound:
  """A jitted ``fn(state, batch, constants)`` called as ``fn(state, batch)`` (and lowered so)."""

  def __init__(self, fn, constants):
    self.fn, self.constants = fn, constants

  def __call__(self, state, batch):
    return self.fn(state, batch, self.constants)

  def lower(self, state, batch):
    return self.fn.lower(state, batch, self.constants)


def reference_pass(cfg: TrainConfig, graphdef, state, inputs: Inputs, mesh, *, log
                   ) -> np.ndarray:
  """The reference model's per-token log-probabilities of every preference row ``[pairs,
  seq]``: the model of ``state`` as built, before any step (with LoRA the adapters add zero: the
  base), computed once a batch at a time and cached in ``<out>/reference`` under a fingerprint
  of the rows and the model's source, where a resumed run reads them back."""
  source = {"rows": inputs.pairs.fingerprint, "dtype": cfg.dtype, "baseline": cfg.baseline,
            "model": _model_source(cfg)}
  key = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()[:20]
  path = Path(cfg.out) / "reference" / f"{key}.npy"
  if path.is_file():
    log(f"reference: reading the reference log-probabilities from {path}")
    return np.load(path)
  rows = len(inputs.pairs)
  size = cfg.global_batch

  def run(state, batch):
    model, _ = nnx.merge(graphdef, state)
    return reference_log_probs(model, batch)

  step = jax.jit(run) if mesh is None else jax.jit(
      run, out_shardings=placement.replicated(mesh))
  started = time.perf_counter()
  out = np.zeros(inputs.pairs.tokens.shape, np.float32)
  for first in range(0, rows, size):
    indices = np.arange(first, first + size) % rows   # the last batch padded by wrapping round
    batch = inputs._place(lambda lo, hi, i=indices: inputs.pair_rows(i[lo:hi]), mesh)
    values = np.asarray(jax.device_get(step(state, batch)))
    take = min(size, rows - first)
    out[first:first + take] = values[:take]
  log(f"reference: the reference log-probabilities of {rows} pairs in "
      f"{time.perf_counter() - started:.1f} s, cached in {path}")
  if jax.process_index() == 0:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npy")
    np.save(tmp, out)
    os.replace(tmp, path)
  return out


def teacher_topk_pass(cfg: TrainConfig, teacher: Decoder, inputs: Inputs, *, log
                      ) -> tuple[np.ndarray, np.ndarray]:
  """The teacher's top ``--teacher-topk`` word ids and log-probabilities ``[rows, seq, k]`` at
  every position of every packed training row, computed once (a few rows at a time, at most
  2**26 logits) and stored in ``<out>/teacher/<fingerprint>/`` (memory-mapped when read back),
  so that training holds no teacher."""
  k = cfg.teacher_topk
  packed = inputs.prepared.train.packed
  source = {"rows": packed.fingerprint, "k": k, "dtype": cfg.dtype,
            "teacher": _model_source(cfg, cfg.teacher)}
  key = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()[:20]
  where = Path(cfg.out) / "teacher" / key
  if (where / "logps.npy").is_file():
    log(f"teacher: reading its top-{k} log-probabilities from {where}")
    return (np.load(where / "ids.npy", mmap_mode="r"), np.load(where / "logps.npy", mmap_mode="r"))
  graphdef, state = nnx.split(teacher)

  @jax.jit
  def top(state, tokens, positions, segment_ids):
    logits = nnx.merge(graphdef, state).logits(tokens, positions, segment_ids)
    values, ids = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), k)
    return ids.astype(jnp.int32), values

  rows, seq = packed.num_rows, cfg.seq
  size = max(1, min(rows, 2**26 // (seq * teacher.cfg.vocab_size)))
  ids = np.zeros((rows, seq, k), np.int32)
  logps = np.zeros((rows, seq, k), np.float32)
  started = time.perf_counter()
  for first in range(0, rows, size):
    indices = np.arange(first, first + size) % rows
    batch = packed.rows(indices)
    got = jax.device_get(top(state, batch["tokens"], batch["positions"], batch["segment_ids"]))
    take = min(size, rows - first)
    ids[first:first + take], logps[first:first + take] = (g[:take] for g in got)
  log(f"teacher: its top-{k} log-probabilities of {rows} rows in "
      f"{time.perf_counter() - started:.1f} s, stored in {where}")
  if jax.process_index() == 0:
    tmp = where.with_name(where.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    np.save(tmp / "ids.npy", ids)
    np.save(tmp / "logps.npy", logps)
    os.replace(tmp, where)
  return ids, logps


def _model_source(cfg: TrainConfig, directory: str | None = None) -> dict:
  """What the initial model is built from: the checkpoint's files (path, size, time), or the
  configuration and seed of a model from scratch."""
  directory = directory or cfg.init_from
  if directory:
    files = sorted(p for p in Path(directory).iterdir() if p.is_file())
    return {"init_from": str(Path(directory).resolve()),
            "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]}
  return {"scratch": [cfg.d_model, cfg.layers, cfg.heads, cfg.kv_heads, cfg.mlp, cfg.seed]}


def _progress():
  """A rich progress bar, or None without rich."""
  try:
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeRemainingColumn)
  except ImportError:
    return None
  return Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[status]}"), TimeRemainingColumn(), transient=False)


def _plan_remat(cfg: TrainConfig, model: Decoder, inputs: Inputs):
  """The recomputation plan of ``--remat-budget``, set on ``model``; planned on the first
  micro-batch of the first training batch (the same for a resumed run)."""
  first = tuple(jnp.asarray(x)[:cfg.batch] for x in inputs.first_batch())
  plan = remat.plan(lambda m, b: m(*b), model, first, config.remat_budget(cfg),
                    choices=config.remat_choices(cfg))
  model.set_remat(plan, config.segments(cfg))
  return plan


# What every step's metrics hold; the objective adds its own.
STEP_METRICS = ("loss", "grad_norm", "loss_tokens", "applied")


class _Metrics:
  """The steps' metrics on their way from the device to the run's history and writers: kept as
  device values until :meth:`flush` reads them all at once."""

  def __init__(self, cfg: TrainConfig, history: dict, writers: MetricWriters | None,
               flops_per_token: float, peak: float | None, log, checkpoints: Path):
    self.cfg, self.history, self.writers, self.log = cfg, history, writers, log
    self.flops_per_token, self.peak, self.checkpoints = flops_per_token, peak, checkpoints
    self.pending: list[tuple[int, dict]] = []
    self.tokens_per_step = cfg.global_batch * cfg.seq
    self.timed_steps, self.timed_seconds = 0, 0.0
    self.clock: float | None = None   # when the last flush ended (None: before the first step)
    self.untimed = 0                  # pending steps the clock did not see (the first: compiled)
    self.rate: float | None = None
    self.mfu: float | None = None

  def add(self, step: int, metrics: dict) -> None:
    if self.clock is None:   # the first step compiles: start the clock when it is done
      jax.block_until_ready(metrics)
      self.clock, self.untimed = time.perf_counter(), 1
    self.pending.append((step, metrics))

  def flush(self) -> None:
    """Reads the pending steps' metrics back (one wait for all), records them and raises
    FloatingPointError for a non-finite step beyond ``--skip-nonfinite``."""
    if not self.pending:
      return
    values = jax.device_get([m for _, m in self.pending])
    steps = [s for s, _ in self.pending]
    self.pending = []
    now = time.perf_counter()
    timed, self.untimed = len(steps) - self.untimed, 0
    if self.clock is not None and timed > 0:
      span = now - self.clock
      self.timed_steps += timed
      self.timed_seconds += span
      self.rate = self.tokens_per_step * timed / span
      self.mfu = (self.rate * self.flops_per_token / (self.peak * jax.device_count())
                  if self.peak else None)
    for step, m in zip(steps, values):
      loss = float(m["loss"])
      if not bool(m["applied"]):
        self.history["skipped"].append(step)
        skipped = len(self.history["skipped"])
        if skipped > self.cfg.skip_nonfinite:
          raise FloatingPointError(
              f"step {step}: the loss is {loss} and the gradient norm {float(m['grad_norm'])}; "
              f"the step was not applied and the run stops (the checkpoints in "
              f"{self.checkpoints} are kept): lower --lr, check the data, or let "
              f"--skip-nonfinite N skip up to N such steps")
        self.log(f"step {step}: the loss is {loss}: skipped ({skipped} of at most "
                 f"{self.cfg.skip_nonfinite})")
        continue
      self.history["step"].append(step)
      self.history["loss"].append(loss)
      extra = {k: float(v) for k, v in m.items() if k not in STEP_METRICS}
      for name, value in extra.items():   # the objective's own (reward margins, accuracies)
        self.history.setdefault("metrics", {}).setdefault(name, []).append(value)
      if self.writers is not None:
        self.writers.write(step, {
            "train/loss": loss, "train/grad_norm": float(m["grad_norm"]),
            "train/learning_rate": float(learning_rate(self.cfg, step - 1)),
            "train/loss_tokens": int(m["loss_tokens"]),
            **{f"train/{k}": v for k, v in extra.items()}})
    if self.writers is not None:
      self.writers.write(steps[-1], {"perf/tokens_per_second": self.rate, "perf/mfu": self.mfu,
                                     "train/skipped_steps": len(self.history["skipped"])})
      self.writers.flush()

  def restart_clock(self) -> None:
    """After evaluation or a checkpoint: their time is not the steps'."""
    if self.clock is not None:
      self.clock = time.perf_counter()

  @property
  def tokens_per_second(self) -> float | None:
    return (self.tokens_per_step * self.timed_steps / self.timed_seconds
            if self.timed_seconds else None)


def train(cfg: TrainConfig, *, log=print) -> dict:
  """Runs training as configured; returns (and writes to ``cfg.out``) the run's log. Only
  process 0 prints and writes the log, the metrics, the plot and the export (every process
  saves its shards of each checkpoint).

  Raises:
    Preempted: SIGTERM or SIGINT stopped the run, after saving a checkpoint of its step.
    FloatingPointError: more than ``--skip-nonfinite`` steps had a non-finite loss.
  """
  distributed.initialize(cfg)   # first: --coordinator, --distributed (else nothing)
  config.check_config(cfg)
  lead = jax.process_index() == 0
  if not lead:
    log = _quiet
  mesh = placement.make_mesh(cfg)
  out = Path(cfg.out)
  out.mkdir(parents=True, exist_ok=True)
  manager = checkpoint.checkpoint_manager(out / "checkpoints")
  checkpoint.refuse_other_run(manager, out / "checkpoints", resume=cfg.resume)
  tokenizer = inputs_lib.resolve_tokenizer(cfg, log=log)
  model, optimizer = build(cfg, tokenizer)
  objective = make_objective(cfg.objective, **config.objective_options(cfg))
  teacher = None
  if isinstance(objective, Distill):   # checked before the run's directory is written to
    teacher = build_teacher(cfg)
    objective = Distill.of(teacher, beta=objective.beta, temperature=objective.temperature)
    objective.check_models(model, f"--teacher {cfg.teacher}")
    if cfg.teacher_topk:   # the teacher's top-k stored once: no teacher while training
      objective = DistillTopK(temperature=objective.temperature)
  grpo = isinstance(objective, GRPO)
  if grpo:   # its rows come from the rollouts of each step
    objective = dataclasses.replace(
        objective, max_completion_length=config.rollout_options(cfg)["max_new_tokens"])
    inputs = Prompts.load(cfg, tokenizer, model.cfg.vocab_size, log=log)
  else:
    inputs = Inputs.load(cfg, tokenizer, model.cfg.vocab_size, log=log)
  if teacher is not None and cfg.teacher_topk:
    inputs.set_teacher_topk(*teacher_topk_pass(cfg, teacher, inputs, log=log))
  del teacher
  plan = None
  if cfg.remat_budget:
    plan = _plan_remat(cfg, model, inputs)
    log(str(plan))
  graphdef, state, train_step, eval_step = make_steps(model, optimizer, mesh,
                                                      wrt=trained(cfg),
                                                      grad_accum=cfg.grad_accum,
                                                      objective=objective)
  on_mesh = contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)
  if objective.needs_reference:   # before resuming: the initial model is the reference
    with on_mesh:
      inputs.set_reference(reference_pass(cfg, graphdef, state, inputs, mesh, log=log))
  rollouts = (GRPOSteps(cfg, inputs, graphdef, state, train_step, mesh, objective, log=log)
              if grpo else None)
  start, state, meta, manager = checkpoint.resume(manager, out / "checkpoints", state,
                                                  resume=cfg.resume, log=log)
  if meta is not None:
    inputs.check_resume(meta.get("data"))
  # Checked: what the export and generation read back goes into the run.
  inputs_lib.save_tokenizer(cfg, tokenizer)
  peak = cfg.peak_tflops * 1e12 if cfg.peak_tflops else peak_flops()
  if lead:
    export.write_model_config(model, out)
    config.write_config_file(cfg, out / "config.yaml")
    log(f"configuration (written to {out / 'config.yaml'}):\n{config.config_text(cfg)}")
    if peak is None:
      log(f"MFU: no peak FLOP/s known for {jax.devices()[0].device_kind}; --peak-tflops gives "
          f"one")
  history = (meta["history"] if meta is not None
             else {"step": [], "loss": [], "val_step": [], "val_loss": [], "skipped": []})
  history.setdefault("skipped", [])
  eval_batches = inputs.evaluation(mesh)
  writers = (MetricWriters(out, tensorboard=cfg.tensorboard, wandb=cfg.wandb,
                           config=cfg.as_dict(), log=log) if lead else None)
  metrics = _Metrics(cfg, history, writers, model.cfg.flops_per_token(cfg.seq), peak, log,
                     out / "checkpoints")

  def validate(state):
    return float(np.mean(jax.device_get([eval_step(state, b) for b in eval_batches])))

  def save(step):
    checkpoint.save_checkpoint(manager, step, state, {
        "history": history, "config": cfg.as_dict(), "data": inputs.fingerprint})

  # Bits per byte for the byte corpus (a token is a byte); nats per token otherwise.
  unit, per = ((LN2, "bits/byte") if inputs.corpus is not None
               else (1.0, "nats/token" if objective.token_weighted else f"({objective.name})"))
  end = cfg.stop_at or cfg.steps
  progress = _progress() if lead else None
  started = time.perf_counter()
  try:
    with on_mesh, progress or contextlib.nullcontext(), StopSignals() as stop:
      task = progress.add_task("train", total=cfg.steps, completed=start, status="") \
          if progress else None
      for step in range(start, end):
        if rollouts is None:
          state, step_metrics = train_step(state, inputs.train(step, mesh))
        else:
          try:
            state, step_metrics = rollouts(step, state)
          except RewardError:   # the steps done are saved before the run stops
            if step > start and step % cfg.save_every:
              metrics.flush()
              save(step)
            raise
        done = step + 1
        metrics.add(done, step_metrics)
        evaluate_now = bool(eval_batches) and (done % cfg.eval_every == 0 or done == end)
        save_now = done % cfg.save_every == 0 or done == end
        single_stop = jax.process_count() == 1 and stop.received is not None
        if not (done % cfg.log_every == 0 or evaluate_now or save_now or single_stop):
          continue
        metrics.flush()
        if evaluate_now:
          history["val_step"].append(done)
          history["val_loss"].append(validate(state))
          if writers is not None:
            writers.write(done, {"eval/loss": history["val_loss"][-1]})
        if save_now:
          save(done)
        signum = stop.agreed()
        if signum is not None and done < end:
          save(done)
          _write_log(cfg, out, model, inputs, history, mesh, plan,
                     time.perf_counter() - started, unit, metrics, preempted=done)
          raise Preempted(done, signum, str(out / "checkpoints"))
        metrics.restart_clock()
        if progress:
          val = (f" val {history['val_loss'][-1] / unit:.3f}" if history["val_loss"] else "")
          last = history["loss"][-1] / unit if history["loss"] else math.nan
          rate = f" {metrics.rate:,.0f} tok/s" if metrics.rate else ""
          mfu = f" MFU {metrics.mfu:.1%}" if metrics.mfu is not None else ""
          shown = "".join(f" {name.split('/')[-1]} {history['metrics'][name][-1]:.3f}"
                          for name in objective.progress_metrics
                          if history.get("metrics", {}).get(name))
          progress.update(task, completed=done,
                          status=f"loss {last:.3f}{shown}{val} {per}{rate}{mfu}")
  finally:
    if writers is not None:
      writers.close()
  elapsed = time.perf_counter() - started
  model, _ = nnx.merge(graphdef, state)
  result = _write_log(cfg, out, model, inputs, history, mesh, plan, elapsed, unit, metrics,
                      write=False)
  finished = end == cfg.steps
  if cfg.sample_tokens:
    with on_mesh:
      result["sample"] = sample_text(model, cfg, inputs.sample_tokenizer)
  if cfg.export_hf and finished:
    with on_mesh:
      export.export_hf(model, inputs.tokenizer, cfg.export_hf, dtype=cfg.dtype)
    log(f"exported a Hugging Face checkpoint to {cfg.export_hf}")
  if not lead:
    return result
  (out / "train_log.json").write_text(json.dumps(result, indent=1) + "\n")
  plot_losses(history, inputs.entropy_bits, out / "loss_curve.png", unit=unit, per=per)
  val = result["final_val_loss"]
  log(f"{'validation' if val is not None else 'training'} loss "
      f"{(val if val is not None else _or_nan(result['final_loss'])) / unit:.3f} {per}"
      + (f" (unigram entropy {inputs.entropy_bits:.3f})" if inputs.entropy_bits else "")
      + f"; {elapsed:.0f} s; wrote {out / 'train_log.json'} and {out / 'loss_curve.png'}")
  if result.get("sample"):
    log("sample:\n" + result["sample"])
  return result


def _or_nan(value: float | None) -> float:
  """A loss for the log: NaN where there is none (a loss of exactly 0 stays 0)."""
  return math.nan if value is None else value


def _quiet(*args, **kwargs):
  """The log of a process other than 0: nothing."""


def _write_log(cfg, out, model, inputs, history, mesh, plan, elapsed, unit, metrics, *,
               preempted: int | None = None, write: bool = True) -> dict:
  """The run's log (``train_log.json``), written by process 0 where ``write``."""
  final = history["loss"][-1] if history["loss"] else None
  final_val = history["val_loss"][-1] if history["val_loss"] else None
  result = {
      "config": cfg.as_dict(),
      "model": model.cfg.as_dict(),
      "mesh": None if mesh is None else dict(mesh.shape),
      "processes": jax.process_count(),
      "data": inputs.report or "the standard library's bytes",
      "final_loss": final,
      "final_val_loss": final_val,
      "tokens_per_second": metrics.tokens_per_second,
      "mfu": metrics.mfu,
      "model_flops_per_token": metrics.flops_per_token,
      "peak_flops_per_device": metrics.peak,
      "seconds": elapsed,
      "history": history,
      "preempted_at": preempted,
      "sample": "",
      "remat_plan": None if plan is None else {
          "choices": list(plan.choices), "budget_bytes": plan.budget_bytes,
          "measured_bytes": plan.measured_bytes, "no_remat_bytes": plan.no_remat_bytes,
          "extra_flops": plan.extra_flops},
  }
  if inputs.corpus is not None:   # a token is a byte: the losses in bits per byte too
    result["unigram_entropy_bits_per_byte"] = inputs.entropy_bits
    result["final_loss_bits_per_byte"] = None if final is None else final / unit
    result["final_val_loss_bits_per_byte"] = None if final_val is None else final_val / unit
  if write and jax.process_index() == 0:
    (Path(out) / "train_log.json").write_text(json.dumps(result, indent=1) + "\n")
  return result
