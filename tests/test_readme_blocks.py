"""Every Python block of the README and of docs/ops.md runs as written (in order, one namespace
per file, as a reader would paste them), and every `python -m jaxfuse.train` command line in
them parses."""

import re
import shlex
from pathlib import Path

import pytest

from jaxfuse import train

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md", "docs/ops.md"]


def _blocks(path: Path, language: str) -> list[str]:
  return re.findall(rf"```{language}\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.parametrize("doc", DOCS)
def test_python_blocks_run_as_written(doc, tmp_path, monkeypatch, capsys):
  blocks = _blocks(ROOT / doc, "python")
  assert blocks, f"{doc} has no python blocks"
  monkeypatch.chdir(tmp_path)
  namespace = {"__name__": "__readme__"}
  for i, block in enumerate(blocks):
    try:
      exec(compile(block, f"{doc} block {i + 1}", "exec"), namespace)  # noqa: S102
    except Exception as e:  # noqa: BLE001 - name the block that failed
      raise AssertionError(f"{doc}, python block {i + 1} failed: {type(e).__name__}: {e}") from e


def test_training_command_lines_parse():
  commands = [line.split("#")[0].strip() for doc in DOCS
              for block in _blocks(ROOT / doc, "bash") for line in block.splitlines()
              if line.strip().startswith("python -m jaxfuse.train")]
  assert commands
  for command in commands:
    argv = shlex.split(command)[3:]
    cfg = train.parse_args(argv)
    train._check(cfg)
