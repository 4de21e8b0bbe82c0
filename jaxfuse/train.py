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
``--distributed`` calls ``jax.distributed.initialize()`` first; every host runs the same command.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxfuse import parallel, remat
from jaxfuse.models import Decoder, DecoderConfig, UnsupportedConfigError, generate

LN2 = math.log(2.0)


# Data --------------------------------------------------------------------------------------------


def stdlib_corpus(max_files: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """``(train, validation)`` bytes of the standard library's top-level ``.py`` files, sorted by
  name; every tenth file (the 10th, 20th, ...) is validation."""
  root = Path(sysconfig.get_paths()["stdlib"])
  files = sorted(root.glob("*.py"))[:max_files]
  if len(files) < 10:
    raise RuntimeError(f"stdlib_corpus: found {len(files)} .py files under {root}; need 10")
  train, val = [], []
  for i, path in enumerate(files):
    (val if i % 10 == 9 else train).append(path.read_bytes())
  as_array = lambda parts: np.frombuffer(b"\n".join(parts), dtype=np.uint8)  # noqa: E731
  return as_array(train), as_array(val)


def unigram_entropy_bits(data: np.ndarray) -> float:
  """Bits per byte of the corpus' byte frequencies: what a model that ignores context gets."""
  counts = np.bincount(data, minlength=256).astype(np.float64)
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log2(p)).sum())


def batch_at(data: np.ndarray, step: int, batch: int, seq: int, seed: int, stream: int = 0):
  """``(tokens, targets)`` ``[batch, seq]`` int32 for this step: random windows of ``data``,
  targets shifted by one; the same for the same ``(seed, stream, step)`` (stream 0: training,
  1: validation)."""
  rng = np.random.default_rng([seed, stream, step])
  starts = rng.integers(0, len(data) - seq - 1, size=batch)
  windows = np.stack([data[s:s + seq + 1] for s in starts]).astype(np.int32)
  return windows[:, :-1], windows[:, 1:]


# Configuration -----------------------------------------------------------------------------------


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


def _check(cfg: TrainConfig) -> None:
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
    for choice in _choices(cfg):
      remat.choice_policy(choice)
  _segments(cfg)
  if cfg.mesh is not None:
    _mesh_shape(cfg)


def _mesh(cfg: TrainConfig) -> jax.sharding.Mesh | None:
  """The ``--mesh`` over every device (of every host), or None without one."""
  if cfg.mesh is None:
    return None
  shape = _mesh_shape(cfg)
  devices = math.prod(shape.values())
  if devices != jax.device_count():
    hint = (f"; on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count={devices} simulates "
            f"them" if jax.default_backend() == "cpu" else "")
    raise ValueError(f"--mesh {cfg.mesh} needs {devices} devices, jax sees "
                     f"{jax.device_count()}{hint}")
  return parallel.make_mesh(shape)


def _mesh_shape(cfg: TrainConfig) -> dict[str, int]:
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


def _segments(cfg: TrainConfig):
  if cfg.segments is None or cfg.segments == "sqrt":
    return cfg.segments
  if cfg.segments.isdigit() and int(cfg.segments) >= 1:
    return int(cfg.segments)
  raise ValueError(f"--segments must be 'sqrt' or a positive number of blocks, got "
                   f"{cfg.segments!r}")


def _int(text: str) -> int:
  try:
    return int(text)
  except ValueError:
    raise ValueError(f"--remat-budget must be a number of bytes or a percentage like '50%', "
                     f"got {text!r}") from None


def _choices(cfg: TrainConfig) -> tuple[str, ...]:
  if cfg.remat_choices is None:
    return remat.DEFAULT_CHOICES
  return tuple(c.strip() for c in cfg.remat_choices.split(",") if c.strip())


# Model and optimizer -----------------------------------------------------------------------------


def build(cfg: TrainConfig) -> tuple[Decoder, nnx.Optimizer]:
  """The model (from scratch or ``--init-from`` a Hugging Face directory) and its optimizer."""
  fused = not cfg.baseline
  policy = "block" if cfg.remat else cfg.remat_policy
  if cfg.init_from:
    from jaxfuse import interop

    model = interop.from_pretrained(cfg.init_from, dtype=jnp.dtype(cfg.dtype), fused=fused,
                                    remat=policy, scan_layers=cfg.scan_layers)
    if model.cfg.vocab_size < 256:
      raise ValueError(f"--init-from: the model's vocabulary ({model.cfg.vocab_size}) cannot "
                       f"hold the 256 byte tokens")
  else:
    model = Decoder(cfg.model_config(), fused=fused, scan_layers=cfg.scan_layers,
                    rngs=nnx.Rngs(cfg.seed))
  model.set_remat(policy, _segments(cfg))
  schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup, cfg.steps,
                                                end_value=cfg.lr * 0.1)
  tx = optax.chain(optax.clip_by_global_norm(cfg.clip),
                   optax.adamw(schedule, weight_decay=cfg.weight_decay))
  return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def _steps(model: Decoder, optimizer: nnx.Optimizer, mesh: jax.sharding.Mesh | None = None):
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
  state = parallel.place(state, mesh)
  loss = NamedSharding(mesh, P())
  shardings = jax.tree.map(lambda x: x.sharding, state)
  return (graphdef, state, jax.jit(train, donate_argnums=0, out_shardings=(shardings, loss)),
          jax.jit(evaluate, out_shardings=loss))


def place_batch(arrays: tuple[np.ndarray, ...], mesh: jax.sharding.Mesh | None) -> tuple:
  """Token arrays ``[batch, seq]`` split over ``mesh`` as the logical axes ``("batch", "seq")``
  say. Every process holds the whole (seeded) batch and contributes its devices' slices, so the
  same code runs on one host and across hosts."""
  if mesh is None:
    return arrays
  spec = parallel.logical_spec(("batch", "seq"), mesh, arrays[0].shape)
  sharding = NamedSharding(mesh, spec)
  return tuple(jax.make_array_from_callback(a.shape, sharding, lambda index, a=a: a[index])
               for a in arrays)


# Checkpoints -------------------------------------------------------------------------------------


class CheckpointError(RuntimeError):
  """A checkpoint cannot be read back (corrupt, or from another model)."""


def _manager(directory: Path):
  import orbax.checkpoint as ocp

  options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
  return ocp.CheckpointManager(directory.absolute(), options=options,
                               item_names=("state", "meta"))


def save_checkpoint(manager, step: int, state, meta: dict) -> None:
  """Writes ``state`` and ``meta`` for ``step``; orbax writes to a temporary directory and
  renames it when complete, so an interrupted save leaves the last good checkpoint as it was."""
  import orbax.checkpoint as ocp

  manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                             meta=ocp.args.JsonSave(meta)))
  manager.wait_until_finished()


def restore_checkpoint(manager, abstract_state):
  """``(step, state, meta)`` of the latest complete checkpoint, or None if there is none."""
  import orbax.checkpoint as ocp

  step = manager.latest_step()
  if step is None:
    return None
  try:
    restored = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
  except Exception as e:  # noqa: BLE001 - orbax raises many kinds; all mean "unreadable"
    raise CheckpointError(f"the checkpoint of step {step} in {manager.directory} cannot be "
                          f"read ({type(e).__name__}: {e}); remove it or start without "
                          f"--resume in another --out directory") from e
  return step, restored["state"], restored["meta"]


# The run -----------------------------------------------------------------------------------------


def _progress():
  try:
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeRemainingColumn)
  except ImportError:
    return None
  return Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[status]}"), TimeRemainingColumn(), transient=False)


def train(cfg: TrainConfig, *, log=print) -> dict:
  """Runs training as configured; returns (and writes to ``cfg.out``) the run's log."""
  if cfg.distributed:
    jax.distributed.initialize()   # coordinator and process ids from the cluster's environment
  _check(cfg)
  mesh = _mesh(cfg)
  out = Path(cfg.out)
  out.mkdir(parents=True, exist_ok=True)
  train_data, val_data = stdlib_corpus()
  entropy = unigram_entropy_bits(train_data)
  model, optimizer = build(cfg)
  plan = None
  if cfg.remat_budget:
    # Planned on the first training batch (the same for a resumed run).
    first = tuple(jnp.asarray(x) for x in batch_at(train_data, 0, cfg.batch, cfg.seq, cfg.seed))
    budget = cfg.remat_budget if cfg.remat_budget.endswith("%") else _int(cfg.remat_budget)
    plan = remat.plan(lambda m, b: m(*b), model, first, budget, choices=_choices(cfg))
    model.set_remat(plan, _segments(cfg))
    log(str(plan))
  graphdef, state, train_step, eval_step = _steps(model, optimizer, mesh)
  on_mesh = contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)
  manager = _manager(out / "checkpoints")
  history = {"step": [], "loss": [], "val_step": [], "val_loss": []}
  start = 0
  if cfg.resume:
    restored = restore_checkpoint(manager, jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state))
    if restored is None:
      log(f"--resume: no checkpoint in {out / 'checkpoints'}; starting at step 0")
    else:
      start, state, meta = restored
      history = meta["history"]
      log(f"resumed at step {start}")
  elif manager.latest_step() is not None:
    raise FileExistsError(f"{out / 'checkpoints'} holds checkpoints of another run: pass "
                          f"--resume to continue it, or another --out")
  val_batches = [place_batch(batch_at(val_data, i, cfg.batch, cfg.seq, cfg.seed, stream=1), mesh)
                 for i in range(cfg.eval_batches)]

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
      tokens, targets = place_batch(batch_at(train_data, step, cfg.batch, cfg.seq, cfg.seed),
                                    mesh)
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
        save_checkpoint(manager, done, state, {"history": history, "config": _as_json(cfg)})
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
      "config": _as_json(cfg),
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


def sample_text(model: Decoder, cfg: TrainConfig) -> str:
  """``cfg.sample_tokens`` bytes after ``cfg.prompt``, sampled with the KV cache."""
  prompt = jnp.asarray(np.frombuffer(cfg.prompt.encode(), np.uint8).astype(np.int32))[None]
  tokens = generate(model, prompt, cfg.sample_tokens, jax.random.key(cfg.seed),
                    temperature=cfg.temperature)
  return bytes(np.asarray(tokens[0], np.uint8).tolist()).decode("utf-8", errors="replace")


def plot_losses(history: dict, entropy: float, path: Path) -> None:
  """Training and validation loss in bits/byte against the step, with the unigram entropy."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4))
  ax.plot(history["step"], np.asarray(history["loss"]) / LN2, label="train", lw=1)
  if history["val_loss"]:
    ax.plot(history["val_step"], np.asarray(history["val_loss"]) / LN2, "o-", label="validation")
  ax.axhline(entropy, color="gray", ls="--", label=f"unigram entropy ({entropy:.2f})")
  ax.set_xlabel("step")
  ax.set_ylabel("loss (bits/byte)")
  ax.legend()
  ax.set_title("jaxfuse.train: byte-level decoder on the Python standard library")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _as_json(cfg: TrainConfig) -> dict:
  return dataclasses.asdict(cfg)


# Command line ------------------------------------------------------------------------------------


def parse_args(argv=None) -> TrainConfig:
  parser = argparse.ArgumentParser(prog="python -m jaxfuse.train", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  defaults = TrainConfig()
  for field in dataclasses.fields(TrainConfig):
    flag = "--" + field.name.replace("_", "-")
    default = getattr(defaults, field.name)
    if isinstance(default, bool):
      parser.add_argument(flag, action="store_true", help=f"(default: {default})")
    else:
      kind = {"int": int, "float": float}.get(str(field.type).split(" ")[0], str)
      parser.add_argument(flag, type=kind, default=default, help=f"(default: {default})")
  args = parser.parse_args(argv)
  return TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})


def main(argv=None) -> int:
  cfg = parse_args(argv)
  try:
    train(cfg)
  except (ValueError, UnsupportedConfigError, CheckpointError, FileExistsError,
          FloatingPointError) as e:
    print(f"python -m jaxfuse.train: error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
