"""The training loop of ``python -m jaxfuse.train``: the jitted steps, progress, the run's log.

:func:`train` runs a :class:`~jaxfuse.train.config.TrainConfig`: it builds the model and its
optimizer (:mod:`jaxfuse.train.model`), plans recomputation for ``--remat-budget``, places the
state on the ``--mesh`` (:mod:`jaxfuse.train.placement`), resumes from a checkpoint
(:mod:`jaxfuse.train.checkpoint`), then trains on batches of the byte corpus
(:mod:`jaxfuse.train.corpus`), measuring the validation loss every ``--eval-every`` steps and
saving every ``--save-every``. At the end it samples text and writes ``train_log.json`` and
``loss_curve.png`` (:mod:`jaxfuse.train.plot`).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxfuse import remat
from jaxfuse.models import Decoder
from jaxfuse.train import checkpoint, config, placement
from jaxfuse.train.config import TrainConfig
from jaxfuse.train.corpus import LN2, batch_at, stdlib_corpus, unigram_entropy_bits
from jaxfuse.train.model import build, sample_text
from jaxfuse.train.plot import plot_losses


def make_steps(model: Decoder, optimizer: nnx.Optimizer,
               mesh: jax.sharding.Mesh | None = None):
  """``(graphdef, state, train, evaluate)``: jitted ``train(state, tokens, targets) -> (state,
  loss)`` and ``evaluate(state, tokens, targets) -> loss`` over the split state of ``(model,
  optimizer)``; with a ``mesh``, the state placed there by its logical axes (and kept so by
  ``train``). Call them under ``jax.set_mesh(mesh)``: the model reads the mesh as it traces."""
  graphdef, state = nnx.split((model, optimizer))

  def train(state, tokens, targets):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(lambda m: m(tokens, targets))(model)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss

  def evaluate(state, tokens, targets):
    model, _ = nnx.merge(graphdef, state)
    return model(tokens, targets)

  if mesh is None:
    return graphdef, state, jax.jit(train, donate_argnums=0), jax.jit(evaluate)
  state, shardings = placement.place_state(state, mesh)
  loss = placement.replicated(mesh)
  return (graphdef, state, jax.jit(train, donate_argnums=0, out_shardings=(shardings, loss)),
          jax.jit(evaluate, out_shardings=loss))


def _progress():
  """A rich progress bar, or None without rich."""
  try:
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeRemainingColumn)
  except ImportError:
    return None
  return Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[status]}"), TimeRemainingColumn(), transient=False)


def _plan_remat(cfg: TrainConfig, model: Decoder, train_data: np.ndarray):
  """The recomputation plan of ``--remat-budget``, set on ``model``; planned on the first
  training batch (the same for a resumed run)."""
  first = tuple(jnp.asarray(x) for x in batch_at(train_data, 0, cfg.batch, cfg.seq, cfg.seed))
  plan = remat.plan(lambda m, b: m(*b), model, first, config.remat_budget(cfg),
                    choices=config.remat_choices(cfg))
  model.set_remat(plan, config.segments(cfg))
  return plan


def train(cfg: TrainConfig, *, log=print) -> dict:
  """Runs training as configured; returns (and writes to ``cfg.out``) the run's log."""
  if cfg.distributed:
    jax.distributed.initialize()   # coordinator and process ids from the cluster's environment
  config.check_config(cfg)
  mesh = placement.make_mesh(cfg)
  out = Path(cfg.out)
  out.mkdir(parents=True, exist_ok=True)
  train_data, val_data = stdlib_corpus()
  entropy = unigram_entropy_bits(train_data)
  model, optimizer = build(cfg)
  plan = None
  if cfg.remat_budget:
    plan = _plan_remat(cfg, model, train_data)
    log(str(plan))
  graphdef, state, train_step, eval_step = make_steps(model, optimizer, mesh)
  on_mesh = contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)
  manager = checkpoint.checkpoint_manager(out / "checkpoints")
  start, state, meta = checkpoint.resume(manager, out / "checkpoints", state,
                                         resume=cfg.resume, log=log)
  history = (meta["history"] if meta is not None
             else {"step": [], "loss": [], "val_step": [], "val_loss": []})

  def batch(data, step, stream=0):
    return placement.place_batch(batch_at(data, step, cfg.batch, cfg.seq, cfg.seed, stream),
                                 mesh)

  val_batches = [batch(val_data, i, stream=1) for i in range(cfg.eval_batches)]

  def validate(state):
    return float(np.mean([eval_step(state, *b) for b in val_batches]))

  tokens_per_step = cfg.batch * cfg.seq
  progress = _progress()
  started = time.perf_counter()
  timed_steps, timed_seconds = 0, 0.0
  with on_mesh, progress or contextlib.nullcontext():
    task = progress.add_task("train", total=cfg.steps, completed=start, status="") \
        if progress else None
    for step in range(start, cfg.stop_at or cfg.steps):
      tokens, targets = batch(train_data, step)
      t0 = time.perf_counter()
      state, loss = train_step(state, tokens, targets)
      loss = float(loss)
      if step > start:  # the first step compiles
        timed_steps += 1
        timed_seconds += time.perf_counter() - t0
      if not math.isfinite(loss):
        raise FloatingPointError(f"step {step}: the loss is {loss}; lower --lr")
      history["step"].append(step + 1)
      history["loss"].append(loss)
      done = step + 1
      if done % cfg.eval_every == 0 or done in (cfg.steps, cfg.stop_at):
        history["val_step"].append(done)
        history["val_loss"].append(validate(state))
      if done % cfg.save_every == 0 or done in (cfg.steps, cfg.stop_at):
        checkpoint.save_checkpoint(manager, done, state,
                                   {"history": history, "config": cfg.as_dict()})
      if progress:
        rate = tokens_per_step * timed_steps / timed_seconds if timed_seconds else 0.0
        val = (f" val {history['val_loss'][-1] / LN2:.3f} bits/byte"
               if history["val_loss"] else "")
        progress.update(task, completed=done,
                        status=f"loss {loss / LN2:.3f} bits/byte{val} {rate:,.0f} tok/s")
  elapsed = time.perf_counter() - started
  model, _ = nnx.merge(graphdef, state)
  sample = sample_text(model, cfg) if cfg.sample_tokens else ""
  result = {
      "config": cfg.as_dict(),
      "model": model.cfg.as_dict(),
      "mesh": None if mesh is None else dict(mesh.shape),
      "unigram_entropy_bits_per_byte": entropy,
      "final_loss_bits_per_byte": history["loss"][-1] / LN2 if history["loss"] else None,
      "final_val_loss_bits_per_byte": (history["val_loss"][-1] / LN2
                                       if history["val_loss"] else None),
      "tokens_per_second": tokens_per_step * timed_steps / timed_seconds if timed_seconds else None,
      "seconds": elapsed,
      "history": history,
      "sample": sample,
      "remat_plan": None if plan is None else {
          "choices": list(plan.choices), "budget_bytes": plan.budget_bytes,
          "measured_bytes": plan.measured_bytes, "no_remat_bytes": plan.no_remat_bytes,
          "extra_flops": plan.extra_flops},
  }
  (out / "train_log.json").write_text(json.dumps(result, indent=1) + "\n")
  plot_losses(history, entropy, out / "loss_curve.png")
  log(f"validation {result['final_val_loss_bits_per_byte']:.3f} bits/byte (unigram entropy "
      f"{entropy:.3f}); {elapsed:.0f} s; wrote {out / 'train_log.json'} and "
      f"{out / 'loss_curve.png'}")
  if sample:
    log("sample:\n" + sample)
  return result
