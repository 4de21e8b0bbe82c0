"""``python -m jaxfuse.train``: train or fine-tune a decoder, for minutes or for days.

It trains :class:`jaxfuse.models.Decoder` from scratch on the Python standard library's source
as bytes (no download: files sorted by name, every tenth one held out for validation), on your
``--data`` files (text, prompt/completion and chat records in JSON lines or Parquet, tokenized
once and packed with segment ids: :mod:`jaxfuse.data`), or ``--init-from`` a Hugging Face
checkpoint, fully or with LoRA adapters (``--lora-rank``), and exports the result
(``--export-hf``). The batch of a step is a function of the step, so a resumed run sees exactly
the batches the uninterrupted run would have.

- Configuration: every option has a help line in a group of ``--help``; ``--config run.yaml``
  (or TOML, JSON) holds any of them, the command line overrides it, and each run writes the
  resolved configuration to ``<out>/config.yaml`` (:mod:`jaxfuse.train.config`).
- Objectives: ``--objective sft`` (the default: next tokens), ``dpo``, ``cpo``, ``simpo``,
  ``orpo`` (prompt/chosen/rejected records), ``kto`` (prompt/completion/label) and ``distill``
  (``--teacher DIR``): objects of :mod:`jaxfuse.posttrain.objectives` the loop calls; DPO's and
  KTO's reference log-probabilities are computed once before training and cached in the run.
  ``grpo`` (prompt records and ``--reward`` functions): each step samples completions of the
  current policy and trains on their rewards (:mod:`jaxfuse.train.rl`).
- Optimisation: optax AdamW with linear warm-up, cosine decay and global-norm clipping;
  ``--grad-accum N`` sums N micro-batches' gradients inside the jitted step; a step whose loss
  is not finite is not applied, and stops the run unless ``--skip-nonfinite`` allows it.
- Logging: a progress bar, TensorBoard event files and ``metrics.jsonl`` in ``--out``
  (``--wandb PROJECT`` for Weights & Biases): loss, learning rate, gradient norm, tokens per
  second, MFU, validation loss; the host reads the metrics every ``--log-every`` steps, so the
  device never waits for it (:mod:`jaxfuse.train.writers`).
- Checkpoints: orbax, every ``--save-every`` steps, written to a temporary directory and renamed
  when complete; ``--resume`` continues from the latest readable one (an unreadable latest one
  is reported and set aside). SIGTERM and SIGINT save the current step and exit
  (:mod:`jaxfuse.train.preemption`).
- Recomputation: ``--remat``, ``--remat-policy NAME`` (:mod:`jaxfuse.remat.policies`),
  ``--remat-budget 50%`` (a plan per block, :func:`jaxfuse.remat.plan`), ``--segments``,
  ``--scan-layers``.
- Parallelism: ``--mesh data=2,fsdp=2,tensor=2`` (the axes of :mod:`jaxfuse.parallel`); across
  hosts, one process a host joins with ``--coordinator HOST:PORT --num-processes N
  --process-id I`` (or ``JAXFUSE_COORDINATOR``, ``JAXFUSE_NUM_PROCESSES``,
  ``JAXFUSE_PROCESS_ID``), or ``--distributed`` from the cluster's environment (SLURM, Open MPI,
  TPU pods); ``--out`` must then be a directory every host sees.

At the end it samples text with the KV cache and writes ``train_log.json`` and
``loss_curve.png``.

Example::

    python -m jaxfuse.train --steps 200 --out runs/small
    python -m jaxfuse.train --steps 400 --out runs/small --resume     # continues at step 200
    python -m jaxfuse.train --config runs/small/config.yaml --lr 1e-3 --out runs/other
"""

# One job a module; data flows down this list (a module imports only those below it):
#   cli         argparse: the options of TrainConfig in groups, --config, main()
#   loop        the jitted steps, the loop, progress, the run's log: train()
#   rl          --objective grpo: its prompts and the step that samples, scores and trains
#   writers     TensorBoard, W&B and metrics.jsonl
#   preemption  SIGTERM/SIGINT: stop at a step every process agrees on
#   model       the Decoder and its optax optimizer (build), text samples
#   checkpoint  orbax save / restore / resume
#   placement   the --mesh, the state and batches placed on it
#   plot        the loss curve
#   corpus      the standard library's bytes, seeded batches
#   distributed jax.distributed across hosts: initialize()
#   config      TrainConfig, its checks and its configuration files

from jaxfuse.train import (checkpoint, cli, config, corpus, distributed, loop, model, placement,
                           plot, preemption, rl, writers)
from jaxfuse.train.checkpoint import (CheckpointError, checkpoint_manager, restore_checkpoint,
                                      save_checkpoint)
from jaxfuse.train.cli import main, parse_args
from jaxfuse.train.config import TrainConfig, check_config, read_config_file, write_config_file
from jaxfuse.train.corpus import LN2, batch_at, stdlib_corpus, unigram_entropy_bits
from jaxfuse.train.loop import train
from jaxfuse.train.preemption import Preempted
from jaxfuse.train.writers import MetricWriters, read_scalars
from jaxfuse.train.model import build, sample_text
from jaxfuse.train.placement import place_batch, place_batch_rows
from jaxfuse.train.plot import plot_losses

# The names these had when jaxfuse.train was one module (the tests use them).
_check = check_config
_manager = checkpoint_manager

__all__ = [
    "LN2",
    "CheckpointError",
    "MetricWriters",
    "Preempted",
    "TrainConfig",
    "batch_at",
    "build",
    "check_config",
    "checkpoint_manager",
    "main",
    "parse_args",
    "place_batch",
    "place_batch_rows",
    "plot_losses",
    "read_config_file",
    "read_scalars",
    "restore_checkpoint",
    "sample_text",
    "save_checkpoint",
    "stdlib_corpus",
    "train",
    "unigram_entropy_bits",
    "write_config_file",
]
