"""Pallas against jax-triton, side by side: per case, the median time of each kernel set, which
one is faster and by how much, read from the records the suites wrote.

    python -m benchmarks.compare_paths RESULTS... [--out PATH] [--json PATH]

``RESULTS`` are JSON files written by ``python -m benchmarks SUITE --json PATH``, or folders
whose ``*.json`` files are read. Each case (suite, case, dtype) that has a ``jaxfuse-pallas`` or a
``jaxfuse-triton`` record gives one row: the two median times in ms, the faster one, and
``triton / pallas``, the ratio of the medians (above 1: Pallas is faster). A side without a
record or without a time (on CPU the kernel rows are not timed) shows ``—``, and the row says
why; nothing is compared then. Files that are missing or are not records are skipped with a
warning, so that a run whose suites failed in part still gives its table.

``benchmarks/gpu_check.sh`` runs it after the benchmark suites, on their ``$OUT/*-gpu.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from benchmarks import records as rec
from benchmarks.records import Record

PALLAS, TRITON = "jaxfuse-pallas", "jaxfuse-triton"
COLUMNS = ("suite", "case", "dtype", "pallas ms", "triton ms", "faster", "triton / pallas")


@dataclasses.dataclass
class Row:
  """One case: the two kernel sets' median times and how they compare.

  Attributes:
    suite, case, dtype: the case, as its records name it.
    pallas_ms, triton_ms: median times in ms; None without a timed record.
    faster: ``"pallas"``, ``"triton"`` or ``"tie"``; None when a side has no time.
    ratio: ``triton_ms / pallas_ms``; None when a side has no time.
    note: why nothing is compared, when nothing is.
  """

  suite: str
  case: str
  dtype: str
  pallas_ms: float | None = None
  triton_ms: float | None = None
  faster: str | None = None
  ratio: float | None = None
  note: str | None = None


def _median(r: Record | None) -> float | None:
  t = r.time_ms if r is not None else None
  median = (t or {}).get("median")
  return float(median) if median is not None else None


def compare(records: Iterable[Record]) -> list[Row]:
  """One row per case with a Pallas or a Triton record, in the order the cases first appear."""
  groups: dict[tuple[str, str, str], dict[str, Record]] = {}
  for r in records:
    if r.impl in (PALLAS, TRITON):
      groups.setdefault((r.suite, r.case, r.dtype), {}).setdefault(r.impl, r)
  rows = []
  for (suite, case, dtype), found in groups.items():
    row = Row(suite, case, dtype, _median(found.get(PALLAS)), _median(found.get(TRITON)))
    missing = [f"no {name} record" if name not in found else f"{name} not timed"
               for name, ms in ((PALLAS, row.pallas_ms), (TRITON, row.triton_ms)) if ms is None]
    if missing:
      row.note = "; ".join(missing)
    elif row.pallas_ms > 0:
      row.ratio = row.triton_ms / row.pallas_ms
      row.faster = ("tie" if row.triton_ms == row.pallas_ms
                    else "triton" if row.triton_ms < row.pallas_ms else "pallas")
    else:
      row.note = "a zero median time"
    rows.append(row)
  return rows


def summary(rows: Sequence[Row]) -> str:
  """How many compared cases each kernel set wins."""
  compared = [r for r in rows if r.faster is not None]
  if not compared:
    return "no case has timed Pallas and Triton rows (they are timed on GPUs only)"
  wins = {name: sum(r.faster == name for r in compared) for name in ("pallas", "triton", "tie")}
  text = f"{len(compared)} cases compared: Pallas faster in {wins['pallas']}, Triton in " \
         f"{wins['triton']}"
  return text + (f", {wins['tie']} ties" if wins["tie"] else "")


def _cells(r: Row) -> list[str]:
  def ms(value):
    return "—" if value is None else f"{value:.3f}"
  ratio = "—" if r.ratio is None else f"{r.ratio:.2f}×"
  return [r.suite, r.case, r.dtype, ms(r.pallas_ms), ms(r.triton_ms), r.faster or "—",
          ratio if r.note is None else f"{ratio} ({r.note})"]


def markdown(rows: Sequence[Row]) -> str:
  """The rows as a markdown table, with the summary line under it."""
  lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
  lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
  return "\n".join(lines) + "\n\n" + summary(rows) + "\n"


def load(paths: Iterable[str | Path]) -> list[Record]:
  """The records of every readable JSON file among ``paths`` (folders: their ``*.json``)."""
  records: list[Record] = []
  for path in map(Path, paths):
    files = sorted(path.glob("*.json")) if path.is_dir() else [path]
    for file in files:
      try:
        records.extend(rec.read_json(file))
      except (OSError, ValueError, TypeError) as e:  # missing, not JSON, or not records
        print(f"compare_paths: skipped {file}: {type(e).__name__}: {e}", file=sys.stderr)
  return records


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.compare_paths",
                                   description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("results", nargs="+", help="suite JSON files, or folders of them")
  parser.add_argument("--out", metavar="PATH", help="also write the markdown table here")
  parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON here")
  args = parser.parse_args(argv)
  rows = compare(load(args.results))
  text = markdown(rows)
  print(text, end="")
  if args.out:
    Path(args.out).write_text(text, encoding="utf-8")
  if args.json:
    Path(args.json).write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1) + "\n",
                               encoding="utf-8")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
