"""``python -m jaxfuse.train``: train a byte-level decoder on the Python standard library's source.

The corpus is built at run time from the ``.py`` files of the running Python's standard library
(no download): files sorted by name, every tenth one held out for validation. Tokens are bytes
(a vocabulary of 256). Batches are random windows drawn from a generator seeded by the run's seed
and the step, so a resumed run sees exactly the batches the uninterrupted run would have.

Training is optax AdamW with linear warm-up, cosine decay and global-norm gradient clipping, in
an ``nnx.Optimizer``. A progress bar shows the loss and tokens per second; the validation loss is
measured every ``--eval-every`` steps. Orbax checkpoints every ``--save-every`` steps (each is
written to a temporary directory and renamed when complete, so a failed save never replaces the
last good checkpoint); ``--resume`` continues from the latest. At the end it samples text with
the KV cache, and writes ``train_log.json`` and ``loss_curve.png`` to ``--out``.

Example::

    python -m jaxfuse.train --steps 200 --out runs/small
    python -m jaxfuse.train --steps 400 --out runs/small --resume     # continues at step 200
    python -m jaxfuse.train --baseline --steps 50                      # plain flax/jax parts
    python -m jaxfuse.train --remat-budget 50% --scan-layers           # planned recomputation

Recomputation: ``--remat`` keeps only each block's input; ``--remat-policy NAME`` applies a
preset or MaxText recipe (:mod:`jaxfuse.remat.policies`) to every block; ``--remat-budget 50%``
(or a number of bytes) profiles the model on the first batch and plans, per block, what to keep
within that share of the residual bytes without recomputation (:func:`jaxfuse.remat.plan`;
``--remat-choices`` narrows what it may choose) and prints the plan; ``--segments sqrt`` adds
√L segment checkpointing; ``--scan-layers`` runs the blocks as one scan.

Parallelism: ``--mesh data=2,fsdp=2,tensor=2`` (any of the axes ``data``, ``fsdp``,
``context``, ``tensor`` of :mod:`jaxfuse.parallel`, whose sizes multiply to the device count)
trains on a device mesh: parameters and optimizer state placed by their logical axes, each batch
split over ``data`` and ``fsdp`` (and its sequence over ``context``). On a CPU,
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` gives 8 simulated devices. Across hosts,
one process a host runs the same command and JAX's distributed runtime joins them
(:mod:`jaxfuse.train.distributed`), the ``--mesh`` spanning the devices of all:
``--coordinator HOST:PORT --num-processes N --process-id I`` (process 0's host and a free port;
or the variables ``JAXFUSE_COORDINATOR``, ``JAXFUSE_NUM_PROCESSES``, ``JAXFUSE_PROCESS_ID``), or
``--distributed`` to read them from the cluster's environment (SLURM, where each process gets
one GPU; Open MPI; TPU pods). On CPUs the collectives go over gloo. Every process writes its
shards of each checkpoint: ``--out`` must be a directory all hosts share.
"""

# One job a module; data flows down this list (a module imports only those below it):
#   cli         argparse: the options of TrainConfig, main()
#   loop        the jitted steps, the loop, progress, the run's log: train()
#   model       the Decoder and its optax optimizer (build), text samples
#   checkpoint  orbax save / restore / resume
#   placement   the --mesh, the state and batches placed on it
#   plot        the loss curve
#   corpus      the standard library's bytes, seeded batches
#   distributed jax.distributed across hosts: initialize()
#   config      TrainConfig and its checks

from jaxfuse.train import (checkpoint, cli, config, corpus, distributed, loop, model, placement,
                           plot)
from jaxfuse.train.checkpoint import (CheckpointError, checkpoint_manager, restore_checkpoint,
                                      save_checkpoint)
from jaxfuse.train.cli import main, parse_args
from jaxfuse.train.config import TrainConfig, check_config
from jaxfuse.train.corpus import LN2, batch_at, stdlib_corpus, unigram_entropy_bits
from jaxfuse.train.loop import train
from jaxfuse.train.model import build, sample_text
from jaxfuse.train.placement import place_batch, place_batch_rows
from jaxfuse.train.plot import plot_losses

# The names these had when jaxfuse.train was one module (the tests use them).
_check = check_config
_manager = checkpoint_manager

__all__ = [
    "LN2",
    "CheckpointError",
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
    "restore_checkpoint",
    "sample_text",
    "save_checkpoint",
    "stdlib_corpus",
    "train",
    "unigram_entropy_bits",
]
