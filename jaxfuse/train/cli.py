"""The command line of ``python -m jaxfuse.train``: one option per field of
:class:`~jaxfuse.train.config.TrainConfig`, in the groups of :data:`~jaxfuse.train.config.GROUPS`,
and ``--config FILE`` holding any of them (the command line overrides the file)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from jaxfuse.data import DataError, TokenizerError
from jaxfuse.models import UnsupportedConfigError
from jaxfuse.train import config as config_lib
from jaxfuse.train.checkpoint import CheckpointError
from jaxfuse.train.config import TrainConfig
from jaxfuse.train.loop import Preempted, train

DESCRIPTION = """\
Trains a jaxfuse decoder: from scratch on the standard library's bytes (no download) or on your
--data files, or --init-from a Hugging Face checkpoint (full fine-tuning, or --lora-rank), with
checkpoints, resume, gradient accumulation, TensorBoard logs and a device mesh across hosts.

Any option can be written in a configuration file (YAML, TOML or JSON; flat, or in sections
named by the groups below); options on the command line override it. Each run writes its
resolved configuration to OUT/config.yaml, which --config reads back."""

EPILOG = """\
examples:
  python -m jaxfuse.train --steps 200 --out runs/small
  python -m jaxfuse.train --steps 400 --out runs/small --resume      # continues at step 200
  python -m jaxfuse.train --config run.yaml --lr 1e-3                 # the file, one override
  python -m jaxfuse.train --init-from DIR --data chats.jsonl --loss-on completion \\
      --lora-rank 8 --batch 4 --grad-accum 8 --out runs/sft
  tensorboard --logdir runs/                                         # the runs' curves

a configuration file (run.yaml):
  model:
    d_model: 256
    layers: 8
  optimisation:
    steps: 2000
    batch: 8
    grad_accum: 4

SIGTERM or SIGINT (Ctrl-C) saves a checkpoint of the current step and exits (status 128 +
the signal's number); --resume continues with the losses the uninterrupted run would have had."""


def _flag(name: str) -> str:
  return "--" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
  """The parser of every option, in groups, each with its help line and default."""
  parser = argparse.ArgumentParser(prog="python -m jaxfuse.train", description=DESCRIPTION,
                                   epilog=EPILOG, usage="%(prog)s [--config FILE] [OPTION ...]",
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", metavar="FILE",
                      help="read options from this YAML, TOML or JSON file; the command line "
                           "overrides them")
  defaults = TrainConfig()
  for group, fields in config_lib.fields_by_group().items():
    section = parser.add_argument_group(group, config_lib.GROUPS[group])
    for field in fields:
      default = getattr(defaults, field.name)
      choices = field.metadata.get("choices")
      text = field.metadata["help"].replace("%", "%%")
      if choices and len(choices) > 6:
        text += f"; one of {', '.join(choices)}"
      text += f" (default: {default})"
      kind = str(field.type)
      if kind == "bool":
        section.add_argument(_flag(field.name), action=argparse.BooleanOptionalAction,
                             default=default, help=text)
      elif kind.startswith("list["):   # --data a.jsonl b.jsonl: one or more
        section.add_argument(_flag(field.name), nargs="+", default=default, metavar="PATH",
                             help=text)
      else:
        # The annotation as written ("int | None" takes ints); anything else is a string.
        convert = {"int": int, "float": float}.get(kind.split(" ")[0], str)
        section.add_argument(_flag(field.name), type=convert, default=default, help=text,
                             choices=choices if choices and len(choices) <= 6 else None,
                             metavar=None if choices and len(choices) <= 6 else
                             field.name.upper())
  return parser


def parse_args(argv=None) -> TrainConfig:
  """The :class:`TrainConfig` of command-line arguments (``sys.argv[1:]`` by default): the
  defaults, then a ``--config`` file's options, then the command line's.

  Raises:
    SystemExit: as argparse does for a malformed command line.
    ValueError: the ``--config`` file cannot be read, or holds an unknown option or a value of
      the wrong type (naming it).
  """
  parser = build_parser()
  first, _ = parser.parse_known_args(argv)
  if first.config is not None:
    parser.set_defaults(**config_lib.read_config_file(first.config))
  args = parser.parse_args(argv)
  return TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})


def main(argv=None) -> int:
  """Trains as the arguments say; 0 on success, 2 (with the error on stderr) for a
  configuration, data, checkpoint or divergence error, 128 + the signal's number for a run
  stopped by SIGTERM or SIGINT (after saving its checkpoint)."""
  try:
    cfg = parse_args(argv)
    train(cfg)
  except Preempted as e:
    print(f"python -m jaxfuse.train: {e}", file=sys.stderr)
    return 128 + e.signal
  except (ValueError, DataError, TokenizerError, UnsupportedConfigError, CheckpointError,
          FileExistsError, FileNotFoundError, FloatingPointError) as e:
    print(f"python -m jaxfuse.train: error: {e}", file=sys.stderr)
    return 2
  return 0
