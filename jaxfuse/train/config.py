"""What a ``python -m jaxfuse.train`` run does: :class:`TrainConfig` and its checks.

Every field of :class:`TrainConfig` is a command-line option (``--d-model`` for ``d_model``,
:mod:`jaxfuse.train.cli`); :func:`check_config` refuses a bad combination by the options' names
before anything is built or written.
"""

# The annotations stay strings: jaxfuse.train.cli reads each option's type from them.
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import jax.numpy as jnp

from jaxfuse import parallel, remat
from jaxfuse.models import DecoderConfig
from jaxfuse.ops.names import moe_products


@dataclasses.dataclass
class TrainConfig:
  """What a run does; every field is a command-line option (``--d-model`` for ``d_model``)."""

  steps: int = 600
  batch: int = 16
  seq: int = 128
  d_model: int = 128
  layers: int = 4
  heads: int = 4
  kv_heads: int = 2
  mlp: int = 384
  lr: float = 3e-3
  warmup: int = 50
  weight_decay: float = 0.01
  clip: float = 1.0
  eval_every: int = 100
  eval_batches: int = 8
  save_every: int = 200
  sample_tokens: int = 200
  prompt: str = "def "
  temperature: float = 0.8
  seed: int = 0
  dtype: str = "float32"
  baseline: bool = False
  remat: bool = False            # recompute each block but its input
  remat_policy: str | None = None   # a preset or MaxText recipe for every block
  remat_budget: str | None = None   # plan per block within this many residual bytes ("50%")
  remat_choices: str | None = None  # what the plan may choose, comma-separated
  segments: str | None = None       # "sqrt" or a number of blocks per checkpointed segment
  scan_layers: bool = False         # stacked blocks under one scan
  mesh: str | None = None           # "data=2,fsdp=2,tensor=2": train on a device mesh
  distributed: bool = False         # jax.distributed from the cluster's environment (SLURM, MPI)
  coordinator: str | None = None    # "HOST:PORT" of process 0: jax.distributed with the next two
  num_processes: int | None = None  # how many processes train together (one a host or GPU)
  process_id: int | None = None     # this process, in [0, --num-processes)
  init_from: str | None = None     # a Hugging Face checkpoint directory to fine-tune
  data: list[str] | None = None     # files, directories, globs: .txt, .jsonl, .parquet
  eval_data: list[str] | None = None  # evaluation files (else --eval-share of --data)
  eval_share: float = 0.0           # hold out this share of --data's documents for evaluation
  text_field: str = "text"          # the field of a text record in JSON lines and Parquet
  loss_on: str = "all"              # "completion": only completions and assistant turns (SFT)
  long_documents: str = "auto"      # "split" (pretraining) / "truncate" (SFT) / "auto"
  tokenizer: str | None = None      # a tokenizer directory (default: --init-from's own)
  train_tokenizer: int | None = None  # train a byte-level BPE of this many tokens on --data
  lora_rank: int | None = None      # train LoRA adapters of this rank; the base stays frozen
  lora_alpha: float | None = None   # adapters scaled by alpha / rank (default: 2 x rank)
  lora_targets: str = "q,k,v,o,gate,up,down"  # the projections that get adapters
  expert_keep: str | None = None    # MoE: keep the experts' "gate", "up" or "gate,up" products
  export_hf: str | None = None      # at the end, write a Hugging Face checkpoint here
  out: str = "runs/jaxfuse-train"
  resume: bool = False
  stop_at: int | None = None   # stop after this step (the schedule still spans --steps)

  def model_config(self, vocab_size: int = 256) -> DecoderConfig:
    """The decoder a run trains from scratch, over a vocabulary of ``vocab_size``."""
    return DecoderConfig(vocab_size=vocab_size, d_model=self.d_model, num_layers=self.layers,
                         num_heads=self.heads, num_kv_heads=self.kv_heads, mlp_dim=self.mlp,
                         max_seq_len=max(self.seq, len(self.prompt.encode()) + self.sample_tokens),
                         dtype=jnp.dtype(self.dtype))

  def as_dict(self) -> dict:
    """The fields, as the run's log and checkpoints record them."""
    return dataclasses.asdict(self)


def check_config(cfg: TrainConfig) -> None:
  """Raises ValueError, naming the option, for a configuration that cannot run."""
  if cfg.sample_tokens < 0:
    raise ValueError(f"--sample-tokens must be >= 0, got {cfg.sample_tokens}")
  for name in ("steps", "batch", "seq", "eval_every", "eval_batches", "save_every"):
    if getattr(cfg, name) < 1:
      raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
  if cfg.dtype not in ("float32", "bfloat16", "float16"):
    raise ValueError(f"--dtype must be float32, bfloat16 or float16, got {cfg.dtype!r}")
  if cfg.warmup < 0 or cfg.warmup >= cfg.steps:
    raise ValueError(f"--warmup must be in [0, --steps), got {cfg.warmup} with {cfg.steps} steps")
  if cfg.stop_at is not None and not 1 <= cfg.stop_at <= cfg.steps:
    raise ValueError(f"--stop-at must be in [1, --steps], got {cfg.stop_at}")
  if cfg.lr <= 0 or cfg.clip <= 0:
    raise ValueError(f"--lr and --clip must be > 0, got {cfg.lr} and {cfg.clip}")
  chosen = [f for f in ("remat", "remat_policy", "remat_budget") if getattr(cfg, f)]
  if len(chosen) > 1:
    raise ValueError(f"give at most one of --remat, --remat-policy and --remat-budget, got "
                     f"{', '.join('--' + f.replace('_', '-') for f in chosen)}")
  if cfg.remat_policy is not None:
    remat.resolve_policy(cfg.remat_policy)
  if cfg.remat_choices is not None:
    for choice in remat_choices(cfg):
      remat.choice_policy(choice)
  segments(cfg)
  if cfg.mesh is not None:
    mesh_shape(cfg)
  _check_data(cfg)
  _check_lora(cfg)
  expert_keep(cfg)
  joined = processes(cfg)
  if cfg.mesh is None and (cfg.distributed or (joined and joined[1] > 1)):
    raise ValueError(f"{'--distributed' if cfg.distributed else '--coordinator'} trains on the "
                     f"devices of every process: give --mesh over all of them (e.g. --mesh "
                     f"data=N, N devices in all)")


# The environment variables that stand in for --coordinator, --num-processes and --process-id.
PROCESS_ENV = {"coordinator": "JAXFUSE_COORDINATOR", "num_processes": "JAXFUSE_NUM_PROCESSES",
               "process_id": "JAXFUSE_PROCESS_ID"}


def processes(cfg: TrainConfig,
              environ: Mapping[str, str] | None = None) -> tuple[str, int, int] | None:
  """``(coordinator, num_processes, process_id)`` of ``--coordinator``, ``--num-processes`` and
  ``--process-id``, each else from its variable of :data:`PROCESS_ENV` (``os.environ`` by
  default); None when none is given. Refuses a partial or inconsistent combination, and any
  of them with ``--distributed`` (which reads all three from the cluster's environment)."""
  environ = os.environ if environ is None else environ
  values, names = {}, {}
  for field, variable in PROCESS_ENV.items():
    values[field], names[field] = getattr(cfg, field), "--" + field.replace("_", "-")
    if values[field] is None and environ.get(variable, "").strip():
      values[field], names[field] = environ[variable].strip(), variable
      if field != "coordinator":
        try:
          values[field] = int(values[field])
        except ValueError:
          raise ValueError(f"{variable} must be an integer, got {environ[variable]!r}") from None
  given = " and ".join(names[f] for f in PROCESS_ENV if values[f] is not None)
  missing = " and ".join(names[f] for f in PROCESS_ENV if values[f] is None)
  if not given:
    return None
  if cfg.distributed:
    raise ValueError(f"--distributed reads the coordinator, process count and process id from "
                     f"the cluster's environment: drop {given}, or drop --distributed")
  if missing:
    raise ValueError(f"{given} without {missing}: give all three (or --distributed, which reads "
                     f"them from the cluster's environment)")
  coordinator, count, index = (values[f] for f in PROCESS_ENV)
  host, sep, port = coordinator.rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ValueError(f"{names['coordinator']} must be HOST:PORT (process 0's address and a free "
                     f"port), got {coordinator!r}")
  if count < 1:
    raise ValueError(f"{names['num_processes']} must be >= 1, got {count}")
  if not 0 <= index < count:
    raise ValueError(f"{names['process_id']} must be in [0, {count}) ({names['num_processes']} "
                     f"{count}), got {index}")
  return coordinator, count, index


def mesh_shape(cfg: TrainConfig) -> dict[str, int]:
  """The ``--mesh`` axes, checked against the batch's shape."""
  shape = parallel.parse_mesh(cfg.mesh)
  rows = shape.get("data", 1) * shape.get("fsdp", 1) * shape.get("expert", 1)
  if cfg.batch % rows:
    raise ValueError(f"--batch {cfg.batch} must be a multiple of data x fsdp x expert = {rows}")
  parts = shape.get("context", 1)
  if parts > 1 and cfg.seq % (2 * parts):
    raise ValueError(f"--seq {cfg.seq} must be a multiple of 2 x context = {2 * parts} (the "
                     f"zig-zag order of ring attention)")
  if cfg.baseline and parts > 1:
    raise ValueError("--baseline cannot run context parallel (its attention is not a ring): "
                     "drop context= from --mesh")
  return shape


def segments(cfg: TrainConfig) -> str | int | None:
  """``--segments``: None, ``"sqrt"`` or a number of blocks per checkpointed segment."""
  if cfg.segments is None or cfg.segments == "sqrt":
    return cfg.segments
  if cfg.segments.isdigit() and int(cfg.segments) >= 1:
    return int(cfg.segments)
  raise ValueError(f"--segments must be 'sqrt' or a positive number of blocks, got "
                   f"{cfg.segments!r}")


def remat_budget(cfg: TrainConfig) -> str | int:
  """``--remat-budget``: a percentage (``"50%"``, as given) or a number of bytes."""
  text = cfg.remat_budget
  if text.endswith("%"):
    return text
  try:
    return int(text)
  except ValueError:
    raise ValueError(f"--remat-budget must be a number of bytes or a percentage like '50%', "
                     f"got {text!r}") from None


def remat_choices(cfg: TrainConfig) -> tuple[str, ...]:
  """``--remat-choices``: what the recomputation plan may choose for a block."""
  if cfg.remat_choices is None:
    return remat.DEFAULT_CHOICES
  return tuple(c.strip() for c in cfg.remat_choices.split(",") if c.strip())


LOSS_ON = ("all", "completion")
LONG_DOCUMENTS = ("auto", "split", "truncate")
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


def _check_data(cfg: TrainConfig) -> None:
  """The data options: where they need ``--data`` and what values they take."""
  if cfg.data is None:
    given = [f for f in ("eval_data", "train_tokenizer") if getattr(cfg, f) is not None]
    given += ["eval_share"] if cfg.eval_share else []
    given += ["loss_on"] if cfg.loss_on != "all" else []
    if given:
      raise ValueError(f"--{given[0].replace('_', '-')} needs --data (the standard library's "
                       "bytes, the default corpus, take none)")
  if cfg.loss_on not in LOSS_ON:
    raise ValueError(f"--loss-on must be one of {', '.join(LOSS_ON)}, got {cfg.loss_on!r}")
  if cfg.long_documents not in LONG_DOCUMENTS:
    raise ValueError(f"--long-documents must be one of {', '.join(LONG_DOCUMENTS)}, got "
                     f"{cfg.long_documents!r}")
  if not 0 <= cfg.eval_share < 1:
    raise ValueError(f"--eval-share must be in [0, 1), got {cfg.eval_share}")
  if cfg.eval_share and cfg.eval_data:
    raise ValueError("give --eval-data or --eval-share, not both")
  if cfg.train_tokenizer is not None:
    if cfg.init_from or cfg.tokenizer:
      raise ValueError("--train-tokenizer trains a model's vocabulary from scratch: it cannot "
                       "go with --init-from or --tokenizer (a checkpoint has its own)")
    if cfg.train_tokenizer < 257:
      raise ValueError(f"--train-tokenizer must be at least 257 tokens (the 256 bytes and an "
                       f"end-of-text token), got {cfg.train_tokenizer}")


def _check_lora(cfg: TrainConfig) -> None:
  """The LoRA options."""
  if cfg.lora_rank is None:
    if cfg.lora_alpha is not None:
      raise ValueError("--lora-alpha needs --lora-rank")
    return
  if cfg.lora_rank < 1:
    raise ValueError(f"--lora-rank must be >= 1, got {cfg.lora_rank}")
  if cfg.lora_alpha is not None and cfg.lora_alpha <= 0:
    raise ValueError(f"--lora-alpha must be > 0, got {cfg.lora_alpha}")
  lora_targets(cfg)


def lora_targets(cfg: TrainConfig) -> tuple[str, ...]:
  """``--lora-targets`` as a tuple of projection names."""
  targets = tuple(t.strip() for t in cfg.lora_targets.split(",") if t.strip())
  unknown = [t for t in targets if t not in LORA_TARGETS]
  if unknown or not targets:
    raise ValueError(f"--lora-targets takes a comma-separated subset of "
                     f"{','.join(LORA_TARGETS)}, got {cfg.lora_targets!r}")
  return targets


def expert_keep(cfg: TrainConfig) -> tuple[str, ...]:
  """``--expert-keep`` as a tuple of product names (``DecoderConfig.expert_keep``)."""
  if cfg.expert_keep is None:
    return ()
  if not cfg.init_from:
    raise ValueError("--expert-keep needs --init-from a Mixture-of-Experts checkpoint")
  given = tuple(t.strip() for t in cfg.expert_keep.split(",") if t.strip())
  if not given:
    raise ValueError(f"--expert-keep takes gate, up or gate,up, got {cfg.expert_keep!r}")
  return moe_products(given, "--expert-keep")


def lora_alpha(cfg: TrainConfig) -> float:
  """``--lora-alpha``, by default twice the rank."""
  return float(2 * cfg.lora_rank if cfg.lora_alpha is None else cfg.lora_alpha)
