"""The command line of ``python -m jaxfuse.train``: one option per field of
:class:`~jaxfuse.train.config.TrainConfig`; its help is :mod:`jaxfuse.train`'s docstring."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from jaxfuse.models import UnsupportedConfigError
from jaxfuse.data import DataError, TokenizerError
from jaxfuse.train.checkpoint import CheckpointError
from jaxfuse.train.config import TrainConfig
from jaxfuse.train.loop import train


def parse_args(argv=None) -> TrainConfig:
  """The :class:`TrainConfig` of command-line arguments (``sys.argv[1:]`` by default)."""
  parser = argparse.ArgumentParser(prog="python -m jaxfuse.train",
                                   description=sys.modules[__package__].__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  defaults = TrainConfig()
  for field in dataclasses.fields(TrainConfig):
    flag = "--" + field.name.replace("_", "-")
    default = getattr(defaults, field.name)
    if isinstance(default, bool):
      parser.add_argument(flag, action="store_true", help=f"(default: {default})")
    elif str(field.type).startswith("list["):   # --data a.jsonl b.jsonl: one or more
      parser.add_argument(flag, nargs="+", default=default, help=f"(default: {default})")
    else:
      # The annotation as written ("int | None" takes ints); anything else is a string.
      kind = {"int": int, "float": float}.get(str(field.type).split(" ")[0], str)
      parser.add_argument(flag, type=kind, default=default, help=f"(default: {default})")
  args = parser.parse_args(argv)
  return TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})


def main(argv=None) -> int:
  """Trains as the arguments say; 0 on success, 2 (with the error on stderr) for a
  configuration, checkpoint or divergence error."""
  cfg = parse_args(argv)
  try:
    train(cfg)
  except (ValueError, DataError, TokenizerError, UnsupportedConfigError, CheckpointError,
          FileExistsError, FileNotFoundError, FloatingPointError) as e:
    print(f"python -m jaxfuse.train: error: {e}", file=sys.stderr)
    return 2
  return 0
