"""``python -m jaxfuse.train``: how long its steps take here, what the host's logging costs, what
gradient accumulation costs and saves, and what a run with the defaults learns.

One row per run of :func:`jaxfuse.train.train` (the CLI's own function), one after another in
this process, each in a temporary ``--out``, over :class:`jaxfuse.train.TrainConfig`'s defaults
(the fused decoder with ``implementation=None``, 16 rows of 128 bytes a step):

- ``defaults``: the host reads the metrics back every 10 steps (``--log-every 10``);
- ``log-every=1``: it reads them after every step (a host sync per step, as a loop that prints
  each loss has);
- ``batch 4 x grad-accum 4``: the same 16 rows a step, as 4 micro-batches scanned in the step;
- ``--baseline`` (plain flax/jax parts), unless ``--quick``.

And, timed interleaved in this process on the same model and batches: one optimizer step of 4
micro-batches of 4 rows as the trainer takes it (a scan inside the jitted step) against
``optax.MultiSteps`` (4 jitted calls of one micro-batch each, the optimizer applying every
fourth), the other way to accumulate gradients.

``--quick`` runs 60 steps instead of the default's 600.

Figures: ``time_ms`` is one optimizer step (median, min and max over the spans between the host's
read-backs, from ``metrics.jsonl``'s tokens per second; the first, compiling, step is not in
them); ``temp_bytes`` is XLA's compiled temp memory of the training step (activations and
gradients; on CPU recomputation is merged away, not accumulation); ``final_loss`` the validation
loss at the end, in bits per byte. The note gives the unigram entropy of the training bytes (the
loss of a model that ignores context), tokens per second, the wall time of the whole run (corpus,
compile, training, validation, checkpoints), and each variant's step time over the defaults'.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path

from benchmarks.records import TEMP_BYTES_SOURCE, Record

SUITE = "train-cli"
QUICK_STEPS = 60
# (label, changes to the defaults, impl): the variants, the defaults first.
VARIANTS = (
    ("defaults", {}, "jaxfuse"),
    ("log-every=1", {"log_every": 1}, "jaxfuse"),
    ("batch 4 x grad-accum 4", {"batch": 4, "grad_accum": 4}, "jaxfuse"),
    ("--baseline", {"baseline": True}, "jax-unfused"),
)


def _config(ctx, **changes):
  from jaxfuse.train import TrainConfig

  defaults = TrainConfig()
  steps = QUICK_STEPS if ctx.quick else defaults.steps
  return dataclasses.replace(defaults, steps=steps, sample_tokens=0, save_every=steps,
                             tensorboard=False, **changes)


def _case(cfg, label: str) -> str:
  return (f"stdlib bytes d{cfg.d_model} L{cfg.layers} {cfg.global_batch}x{cfg.seq} "
          f"steps={cfg.steps}: {label}")


def step_times_ms(metrics_jsonl: Path, tokens_per_step: int) -> list[float]:
  """One step's milliseconds over each span between read-backs (``perf/tokens_per_second``
  in ``metrics.jsonl``)."""
  rates = [json.loads(line).get("perf/tokens_per_second")
           for line in metrics_jsonl.read_text().splitlines()]
  return [1e3 * tokens_per_step / r for r in rates if r]


def step_temp_bytes(cfg) -> int:
  """XLA's compiled temp bytes of ``cfg``'s training step."""
  import jax
  import numpy as np

  from jaxfuse.train import loop, model

  graphdef, state, train_step, _ = loop.make_steps(*model.build(cfg), wrt=model.trained(cfg),
                                                   grad_accum=cfg.grad_accum)
  rows = np.zeros((cfg.global_batch, cfg.seq), np.int32)
  compiled = train_step.lower(state, {"tokens": rows, "targets": rows}).compile()
  del graphdef, state
  return int(compiled.memory_analysis().temp_size_in_bytes)


def accumulation_records(ctx) -> list[Record]:
  """A step of 4 x 4 rows: the trainer's scan against ``optax.MultiSteps``, interleaved."""
  import jax
  import optax
  from flax import nnx

  from jaxfuse.train import corpus, loop, model

  cfg = _config(ctx, batch=4, grad_accum=4)
  data = corpus.stdlib_corpus()[0]
  batches = [dict(zip(("tokens", "targets"), corpus.batch_at(data, i, 16, cfg.seq, 0)))
             for i in range(4)]
  scan_model, scan_optimizer = model.build(cfg)
  _, scan_state, scan_step, _ = loop.make_steps(scan_model, scan_optimizer, grad_accum=4)
  multi_model, _ = model.build(cfg)
  multi_optimizer = nnx.Optimizer(multi_model, optax.MultiSteps(model.optimizer(cfg), 4),
                                  wrt=nnx.Param)
  _, multi_state, multi_step, _ = loop.make_steps(multi_model, multi_optimizer)
  held = {"scan": scan_state, "multi": multi_state, "i": 0}

  def scan():
    held["i"] += 1
    held["scan"], out = scan_step(held["scan"], batches[held["i"] % 4])
    return out

  def multi():
    held["i"] += 1
    batch = batches[held["i"] % 4]
    for k in range(4):   # rows k, k + 4, ...: the trainer's micro-batches
      held["multi"], out = multi_step(held["multi"], jax.tree.map(lambda x: x[k::4], batch))
    return out

  ctx.step("grad-accum: scan in the step against optax.MultiSteps")
  times = ctx.time({"jaxfuse": scan, "optax": multi})
  case = (f"one step of 4 micro-batches x 4 rows x {cfg.seq} (d{cfg.d_model} L{cfg.layers})")
  records = []
  for impl, note in (("jaxfuse", "the trainer's --grad-accum 4: a scan inside one jitted step"),
                     ("optax", "optax.MultiSteps(every_k_schedule=4): 4 jitted calls, the "
                               "update applied on the 4th")):
    record = Record(suite=SUITE, case=case, impl=impl, platform=ctx.platform, dtype=cfg.dtype,
                    ratio_to="jaxfuse", ratio=times[impl]["median"] / times["jaxfuse"]["median"],
                    note=note)
    record.set("time_ms", times[impl], "interleaved rounds in one process")
    records.append(record)
  return records


def run(ctx) -> list[Record]:
  from jaxfuse.train import train

  records, base_ms = [], None
  for label, changes, impl in VARIANTS:
    if ctx.quick and changes.get("baseline"):
      continue
    cfg = _config(ctx, **changes)
    ctx.step(_case(cfg, label))
    with tempfile.TemporaryDirectory() as out:
      result = train(dataclasses.replace(cfg, out=out), log=lambda *_: None)
      times = step_times_ms(Path(out) / "metrics.jsonl", cfg.global_batch * cfg.seq)
    record = Record(suite=SUITE, case=_case(cfg, label), impl=impl, platform=ctx.platform,
                    dtype=cfg.dtype)
    median = statistics.median(times)
    record.set("time_ms", {"median": median, "min": min(times), "max": max(times),
                           "runs": len(times)},
               f"one step: {cfg.global_batch * cfg.seq} tokens over the tokens/s of each span "
               f"between the host's read-backs (metrics.jsonl), first step excluded")
    record.set("temp_bytes", step_temp_bytes(cfg), TEMP_BYTES_SOURCE)
    record.set("final_loss", result["final_val_loss_bits_per_byte"],
               f"validation loss after {cfg.steps} steps, bits per byte ({cfg.eval_batches} "
               "batches of held-out files)")
    base_ms = median if base_ms is None else base_ms
    record.note = (f"unigram entropy {result['unigram_entropy_bits_per_byte']:.3f} bits/byte; "
                   f"{result['tokens_per_second']:,.0f} tokens/s; {result['seconds']:.0f} s in "
                   f"all; train loss {result['final_loss_bits_per_byte']:.3f} bits/byte")
    if label != "defaults":
      record.add_note(f"step {median / base_ms:.2f}x the defaults' (runs one after another)")
    records.append(record)
  return records + accumulation_records(ctx)


def headline(records: Sequence[Record]) -> list[Record]:
  return list(records)
