"""Every file and folder the contributor docs name exists (a path in backticks or in the layout
block; a ``<name>`` placeholder stands for any name)."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ["CONTRIBUTING.md", "docs/ops.md", "README.md"]
PATH = re.compile(r"^(?:jaxfuse|kernels|tests|benchmarks|docs)/[\w/.<>*-]*$")


def _paths(text: str) -> set[str]:
  found = set()
  for token in re.findall(r"`([^`\s]+)`", text) + re.findall(r"^(\S+/)\s", text, re.M):
    token = token.rstrip(".,:;)")
    if PATH.match(token):
      found.add(token)
  return found


@pytest.mark.parametrize("doc", DOCS)
def test_every_path_a_doc_names_exists(doc):
  missing = []
  for path in sorted(_paths((ROOT / doc).read_text())):
    pattern = re.sub(r"<[^>]+>", "*", path)
    if not list(ROOT.glob(pattern.rstrip("/"))):
      missing.append(path)
  assert not missing, f"{doc} names paths that do not exist: {missing}"


def test_the_check_finds_paths():
  assert {"jaxfuse/ops/base.py", "kernels/pallas/<name>.py"} <= _paths(
      (ROOT / "CONTRIBUTING.md").read_text())
