"""``python -m jaxfuse.train`` with its defaults: how long it takes here and what it learns.

One row per run of :func:`jaxfuse.train.train` (the CLI's own function) with
:class:`jaxfuse.train.TrainConfig`'s defaults, in a temporary ``--out``: the fused decoder
(``jaxfuse-xla``) and, unless ``--quick``, the same run with ``--baseline`` (plain flax/jax
parts, ``jax-unfused``). ``--quick`` runs 60 steps instead of the default's.

Figures: ``final_loss`` is the validation loss at the end, in bits per byte (the CLI's
``final_val_loss_bits_per_byte``); the note gives the unigram entropy of the training bytes
(the loss of a model that ignores context), the wall time of the whole run (corpus, compile,
training, validation, checkpoints and sampling), the training tokens per second (steps after
the first), and the steps.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Sequence

from benchmarks.records import Record

SUITE = "train-cli"
QUICK_STEPS = 60


def _config(ctx, baseline: bool):
  from jaxfuse.train import TrainConfig

  defaults = TrainConfig()
  steps = QUICK_STEPS if ctx.quick else defaults.steps
  return dataclasses.replace(defaults, steps=steps, baseline=baseline, sample_tokens=0,
                             save_every=steps)


def _case(cfg) -> str:
  return (f"stdlib bytes d{cfg.d_model} L{cfg.layers} b{cfg.batch} seq={cfg.seq} "
          f"steps={cfg.steps}")


def run(ctx) -> list[Record]:
  from jaxfuse.train import train

  records = []
  for baseline in ((False,) if ctx.quick else (False, True)):
    cfg = _config(ctx, baseline)
    ctx.step(f"{_case(cfg)}: {'--baseline' if baseline else 'defaults'}")
    with tempfile.TemporaryDirectory() as out:
      result = train(dataclasses.replace(cfg, out=out), log=lambda *_: None)
    val = result["final_val_loss_bits_per_byte"]
    entropy = result["unigram_entropy_bits_per_byte"]
    record = Record(suite=SUITE, case=_case(cfg),
                    impl="jax-unfused" if baseline else "jaxfuse-xla",
                    platform=ctx.platform, dtype=cfg.dtype)
    record.set("final_loss", val, f"validation loss after {cfg.steps} steps, bits per byte "
               f"({cfg.eval_batches} batches of held-out files)")
    record.note = (f"unigram entropy {entropy:.3f} bits/byte; {result['seconds']:.0f} s in all; "
                   f"{result['tokens_per_second']:,.0f} tokens/s; train loss "
                   f"{result['final_loss_bits_per_byte']:.3f} bits/byte")
    records.append(record)
  return records


def headline(records: Sequence[Record]) -> list[Record]:
  return list(records)
