"""One run over several processes (one a host, or one a GPU): JAX's own distributed runtime.

:func:`initialize` starts ``jax.distributed`` before anything else touches jax: with
``--coordinator HOST:PORT --num-processes N --process-id I`` (or the variables
``JAXFUSE_COORDINATOR``, ``JAXFUSE_NUM_PROCESSES``, ``JAXFUSE_PROCESS_ID``), or with
``--distributed`` from the cluster's environment (SLURM, Open MPI, TPU pods, as
``jax.distributed.initialize()`` detects them). CPU collectives across processes go over gloo.
Every process then sees the devices of all; :func:`is_primary` tells process 0, the one to
report, from the others.
"""

from __future__ import annotations

import jax

from jaxfuse.train import config
from jaxfuse.train.config import TrainConfig


def initialize(cfg: TrainConfig) -> bool:
  """Joins the processes of a multi-process run as ``cfg`` (and the environment) say; True if
  this process is part of one (also when ``jax.distributed`` was initialized already), False
  for a run in one process.

  Raises:
    ValueError: a partial or inconsistent ``--coordinator``, ``--num-processes``,
      ``--process-id``, or ``jax.distributed`` failed to start (naming the option).
  """
  explicit = config.processes(cfg)
  if jax.distributed.is_initialized():
    if explicit is not None and (jax.process_count(), jax.process_index()) != explicit[1:]:
      raise ValueError(f"--num-processes {explicit[1]} --process-id {explicit[2]}: this process "
                       f"already joined a run as process {jax.process_index()} of "
                       f"{jax.process_count()}")
    return True
  if explicit is None and not cfg.distributed:
    return False
  if jax.config.jax_cpu_collectives_implementation is None:
    # Unset (older jax), a CPU backend has no collectives across processes.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  how = ("--distributed" if explicit is None else
         f"--coordinator {explicit[0]} --num-processes {explicit[1]} --process-id {explicit[2]}")
  try:
    if explicit is None:
      jax.distributed.initialize()   # coordinator and process ids from the cluster's environment
    else:
      coordinator, count, index = explicit
      jax.distributed.initialize(coordinator_address=coordinator, num_processes=count,
                                 process_id=index)
  except (RuntimeError, ValueError) as e:
    raise ValueError(f"{how}: jax.distributed.initialize failed ({type(e).__name__}: {e})") from e
  return True


def is_primary() -> bool:
  """Whether this is process 0: the one to print and write a run's log, plot and sample (every
  process trains and saves)."""
  return jax.process_index() == 0
