"""A run's model as a Hugging Face checkpoint, and a run's model read back from its directory.

A run keeps what it needs to be read back without its sources: ``<out>/model_config.json``
(the model's Hugging Face config, written when the run starts), ``<out>/tokenizer`` and the
checkpoints, whose ``meta`` holds the run's options. :func:`load_run` rebuilds the model (and
its LoRA adapters) from these and restores a checkpoint; :func:`export_hf` folds the adapters
into the weights and writes ``config.json``, ``model.safetensors`` and the tokenizer's files,
which ``transformers.AutoModelForCausalLM`` and ``AutoTokenizer`` load.

``python -m jaxfuse.export RUN_DIR DIR [--step N]`` exports a run's latest (or step ``N``'s)
checkpoint; ``python -m jaxfuse.train ... --export-hf DIR`` exports at the end of training.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfuse import data
from jaxfuse.models import Decoder, DecoderConfig
from jaxfuse.nnx import apply_lora, merge_lora
from jaxfuse.train import checkpoint, config
from jaxfuse.train.config import TrainConfig
from jaxfuse.train.model import optimizer, trained

MODEL_CONFIG = "model_config.json"


def write_model_config(model: Decoder, out: str | Path) -> None:
  """Writes the model's Hugging Face config into the run (``<out>/model_config.json``)."""
  hf_config = model.cfg.to_hf()
  (Path(out) / MODEL_CONFIG).write_text(hf_config.to_json_string())


def export_hf(model: Decoder, tokenizer: Any, directory: str | Path, *,
              dtype: str | None = None) -> None:
  """Writes ``model`` (its LoRA adapters folded into the weights; the model itself is left as
  it is) and ``tokenizer`` as a Hugging Face checkpoint in ``directory``. ``dtype``: the
  parameters' dtype in the files (default: as they are). Across processes every process calls
  it (the parameters are gathered) and process 0 writes."""
  from jax.experimental import multihost_utils

  from jaxfuse import interop

  graphdef, state = nnx.split(model)
  if jax.process_count() > 1:
    state = jax.tree.map(lambda x: multihost_utils.process_allgather(x, tiled=True), state)
  else:
    state = jax.tree.map(jnp.copy, state)
  copy = merge_lora(nnx.merge(graphdef, state))
  if dtype is not None and jnp.dtype(dtype) != jnp.dtype(copy.cfg.param_dtype):
    params = nnx.state(copy, nnx.Param)
    nnx.update(copy, jax.tree.map(lambda x: x.astype(dtype), params))
    copy.cfg = copy.cfg.replace(param_dtype=jnp.dtype(dtype))
  if jax.process_index() != 0:
    return
  interop.save_pretrained(copy, directory)
  data.save_tokenizer(tokenizer, directory)


def load_run(run_dir: str | Path, step: int | None = None) -> tuple[Decoder, Any, TrainConfig]:
  """``(model, tokenizer, options)`` of a ``python -m jaxfuse.train`` run: the model of its
  latest checkpoint (or of ``step``), on one device.

  Raises:
    FileNotFoundError: ``run_dir`` is not a run's directory, or has no such checkpoint.
  """
  run = Path(run_dir)
  config_file = run / MODEL_CONFIG
  if not config_file.is_file():
    raise FileNotFoundError(f"{run}: no {MODEL_CONFIG}: not the directory of a "
                            "python -m jaxfuse.train run")
  manager = checkpoint.checkpoint_manager(run / "checkpoints")
  step = manager.latest_step() if step is None else step
  if step is None or step not in manager.all_steps():
    raise FileNotFoundError(f"{run / 'checkpoints'}: no checkpoint"
                            + ("" if step is None else f" of step {step}; it has "
                               f"{sorted(manager.all_steps())}"))
  meta = checkpoint.read_meta(manager, step)
  fields = {f.name for f in dataclasses.fields(TrainConfig)}
  cfg = TrainConfig(**{k: v for k, v in meta["config"].items() if k in fields})
  model_cfg = DecoderConfig.from_hf(json.loads(config_file.read_text()),
                                    dtype=jnp.dtype(cfg.dtype))

  def abstract():
    model = Decoder(model_cfg, fused=not cfg.baseline, scan_layers=cfg.scan_layers,
                    rngs=nnx.Rngs(0))
    if cfg.lora_rank is not None:
      apply_lora(model, rank=cfg.lora_rank, alpha=config.lora_alpha(cfg),
                 targets=config.lora_targets(cfg), rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optimizer(cfg), wrt=trained(cfg))

  graphdef, state = nnx.split(nnx.eval_shape(abstract))
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), state)
  _, state, _ = checkpoint.restore_checkpoint(manager, shapes, step=step)
  model, _ = nnx.merge(graphdef, state)
  tokenizer_path = run / "tokenizer"
  tokenizer = (data.load_tokenizer(tokenizer_path) if data.has_tokenizer(tokenizer_path)
               else data.ByteTokenizer())
  return model, tokenizer, cfg


def main(argv=None) -> int:
  """``python -m jaxfuse.export RUN_DIR DIR [--step N] [--dtype D]``."""
  parser = argparse.ArgumentParser(prog="python -m jaxfuse.export",
                                   description="Writes a python -m jaxfuse.train run's model "
                                   "(LoRA adapters folded in) and tokenizer as a Hugging Face "
                                   "checkpoint.")
  parser.add_argument("run_dir", help="the run's --out directory")
  parser.add_argument("directory", help="where to write the Hugging Face checkpoint")
  parser.add_argument("--step", type=int, default=None, help="(default: the latest)")
  parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                      help="the parameters' dtype in the files (default: as trained)")
  args = parser.parse_args(argv)
  try:
    model, tokenizer, _ = load_run(args.run_dir, args.step)
    export_hf(model, tokenizer, args.directory, dtype=args.dtype)
  except (FileNotFoundError, ValueError, checkpoint.CheckpointError) as e:
    print(f"python -m jaxfuse.export: error: {e}", file=sys.stderr)
    return 2
  print(f"wrote {args.directory}")
  return 0
