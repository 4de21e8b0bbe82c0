"""What a ``python -m jaxfuse.train`` run does: :class:`TrainConfig` and its checks.

Every field of :class:`TrainConfig` is a command-line option (``--d-model`` for ``d_model``,
:mod:`jaxfuse.train.cli`); :func:`check_config` refuses a bad combination by the options' names
before anything is built or written.
"""

# The annotations stay strings: jaxfuse.train.cli reads each option's type from them.
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxfuse import parallel, remat
from jaxfuse.models import DecoderConfig


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
  distributed: bool = False         # jax.distributed.initialize() first (one process a host)
  init_from: str | None = None
  out: str = "runs/jaxfuse-train"
  resume: bool = False
  stop_at: int | None = None   # stop after this step (the schedule still spans --steps)

  def model_config(self) -> DecoderConfig:
    return DecoderConfig(vocab_size=256, d_model=self.d_model, num_layers=self.layers,
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


def mesh_shape(cfg: TrainConfig) -> dict[str, int]:
  """The ``--mesh`` axes, checked against the batch's shape."""
  shape = parallel.parse_mesh(cfg.mesh)
  rows = shape.get("data", 1) * shape.get("fsdp", 1)
  if cfg.batch % rows:
    raise ValueError(f"--batch {cfg.batch} must be a multiple of data x fsdp = {rows}")
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
