"""The training loop of ``python -m jaxfuse.train``: the jitted steps, progress, the run's log.

:func:`train` runs a :class:`~jaxfuse.train.config.TrainConfig`: it finds the tokenizer, builds
the model and its optimizer (:mod:`jaxfuse.train.model`), prepares the batches
(:mod:`jaxfuse.train.inputs`), plans recomputation for ``--remat-budget``, places the state on
the ``--mesh`` (:mod:`jaxfuse.train.placement`), resumes from a checkpoint
(:mod:`jaxfuse.train.checkpoint`), then trains, measuring the evaluation loss every
``--eval-every`` steps and saving every ``--save-every``. At the end it samples text, writes
``train_log.json`` and ``loss_curve.png`` (:mod:`jaxfuse.train.plot`) and, with
``--export-hf``, a Hugging Face checkpoint (:mod:`jaxfuse.train.export`).
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
from jaxfuse.train import checkpoint, config, distributed, export, placement
from jaxfuse.train import inputs as inputs_lib
from jaxfuse.train.config import TrainConfig
from jaxfuse.train.corpus import LN2
from jaxfuse.train.inputs import Inputs
from jaxfuse.train.model import build, sample_text, trained
from jaxfuse.train.plot import plot_losses


def make_steps(model: Decoder, optimizer: nnx.Optimizer,
               mesh: jax.sharding.Mesh | None = None, wrt=nnx.Param):
  """``(graphdef, state, train, evaluate)``: jitted ``train(state, batch) -> (state, loss)``
  and ``evaluate(state, batch) -> loss`` over the split state of ``(model, optimizer)``, where
  ``batch`` is a dict of the model's arguments (``tokens``, ``targets``, and ``positions`` and
  ``segment_ids`` for packed rows); the gradient is taken of the ``wrt`` variables only (the
  optimizer's). With a ``mesh``, the state is placed there by its logical axes (and kept so by
  ``train``). Call them under ``jax.set_mesh(mesh)``: the model reads the mesh as it traces."""
  graphdef, state = nnx.split((model, optimizer))

  def train(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(lambda m: m(**batch),
                                     argnums=nnx.DiffState(0, wrt))(model)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss

  def evaluate(state, batch):
    model, _ = nnx.merge(graphdef, state)
    return model(**batch)

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


def _plan_remat(cfg: TrainConfig, model: Decoder, inputs: Inputs):
  """The recomputation plan of ``--remat-budget``, set on ``model``; planned on the first
  training batch (the same for a resumed run)."""
  first = tuple(jnp.asarray(x) for x in inputs.first_batch())
  plan = remat.plan(lambda m, b: m(*b), model, first, config.remat_budget(cfg),
                    choices=config.remat_choices(cfg))
  model.set_remat(plan, config.segments(cfg))
  return plan


def train(cfg: TrainConfig, *, log=print) -> dict:
  """Runs training as configured; returns (and writes to ``cfg.out``) the run's log. Only
  process 0 prints and writes the log, the plot and the export (every process saves its
  shards of each checkpoint)."""
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
  inputs = Inputs.load(cfg, tokenizer, model.cfg.vocab_size, log=log)
  plan = None
  if cfg.remat_budget:
    plan = _plan_remat(cfg, model, inputs)
    log(str(plan))
  graphdef, state, train_step, eval_step = make_steps(model, optimizer, mesh,
                                                      wrt=trained(cfg))
  on_mesh = contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)
  start, state, meta = checkpoint.resume(manager, out / "checkpoints", state,
                                         resume=cfg.resume, log=log)
  if meta is not None:
    inputs.check_resume(meta.get("data"))
  # Checked: what the export and generation read back goes into the run.
  inputs_lib.save_tokenizer(cfg, tokenizer)
  if lead:
    export.write_model_config(model, out)
  history = (meta["history"] if meta is not None
             else {"step": [], "loss": [], "val_step": [], "val_loss": []})
  eval_batches = inputs.evaluation(mesh)

  def validate(state):
    return float(np.mean([eval_step(state, b) for b in eval_batches]))

  # Bits per byte for the byte corpus (a token is a byte); nats per token otherwise.
  unit, per = (LN2, "bits/byte") if inputs.corpus is not None else (1.0, "nats/token")
  tokens_per_step = cfg.batch * cfg.seq
  progress = _progress() if lead else None
  started = time.perf_counter()
  timed_steps, timed_seconds = 0, 0.0
  with on_mesh, progress or contextlib.nullcontext():
    task = progress.add_task("train", total=cfg.steps, completed=start, status="") \
        if progress else None
    for step in range(start, cfg.stop_at or cfg.steps):
      batch = inputs.train(step, mesh)
      t0 = time.perf_counter()
      state, loss = train_step(state, batch)
      loss = float(loss)
      if step > start:  # the first step compiles
        timed_steps += 1
        timed_seconds += time.perf_counter() - t0
      if not math.isfinite(loss):
        raise FloatingPointError(f"step {step}: the loss is {loss}; lower --lr")
      history["step"].append(step + 1)
      history["loss"].append(loss)
      done = step + 1
      if eval_batches and (done % cfg.eval_every == 0 or done in (cfg.steps, cfg.stop_at)):
        history["val_step"].append(done)
        history["val_loss"].append(validate(state))
      if done % cfg.save_every == 0 or done in (cfg.steps, cfg.stop_at):
        checkpoint.save_checkpoint(manager, done, state, {
            "history": history, "config": cfg.as_dict(), "data": inputs.fingerprint})
      if progress:
        rate = tokens_per_step * timed_steps / timed_seconds if timed_seconds else 0.0
        val = (f" val {history['val_loss'][-1] / unit:.3f}" if history["val_loss"] else "")
        progress.update(task, completed=done,
                        status=f"loss {loss / unit:.3f}{val} {per} {rate:,.0f} tok/s")
  elapsed = time.perf_counter() - started
  model, _ = nnx.merge(graphdef, state)
  result = _result(cfg, model, inputs, history, mesh, plan, elapsed, unit,
                   tokens_per_step * timed_steps / timed_seconds if timed_seconds else None)
  finished = (cfg.stop_at or cfg.steps) == cfg.steps
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
      f"{(val if val is not None else result['final_loss'] or math.nan) / unit:.3f} {per}"
      + (f" (unigram entropy {inputs.entropy_bits:.3f})" if inputs.entropy_bits else "")
      + f"; {elapsed:.0f} s; wrote {out / 'train_log.json'} and {out / 'loss_curve.png'}")
  if result.get("sample"):
    log("sample:\n" + result["sample"])
  return result


def _quiet(*args, **kwargs):
  """The log of a process other than 0: nothing."""


def _result(cfg, model, inputs, history, mesh, plan, elapsed, unit, rate) -> dict:
  """The run's log (``train_log.json``)."""
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
      "tokens_per_second": rate,
      "seconds": elapsed,
      "history": history,
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
  return result
