"""``python -m benchmarks SUITE [--quick] [--json PATH] [--plot PATH] [--readme PATH]``."""

from __future__ import annotations

import argparse
import importlib
import sys
import time

from benchmarks import records as rec
from benchmarks.harness import Context

# Suite name -> module with run(ctx) -> list[Record] and, optionally, plot(records, path).
SUITES = {
    "seed": "benchmarks.suites.seed",
    "norm": "benchmarks.suites.norm",
    "attention": "benchmarks.suites.attention",
    "xent": "benchmarks.suites.xent",
}


def _available() -> list[str]:
  return [name for name, module in SUITES.items() if importlib.util.find_spec(module)]


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
  parser.add_argument("suite", choices=_available())
  parser.add_argument("--quick", action="store_true", help="small shapes, few runs (< 2 min)")
  parser.add_argument("--json", metavar="PATH", help="write the records as JSON")
  parser.add_argument("--plot", metavar="PATH", help="draw a PNG with matplotlib")
  parser.add_argument("--readme", metavar="PATH",
                      help="replace the suite's table between its markers in this file")
  parser.add_argument("--runs", type=int, default=None, help="timed runs per candidate")
  parser.add_argument("--system-env", action="store_true",
                      help="run without the process settings of benchmarks/__main__.py")
  args = parser.parse_args(argv)

  suite = importlib.import_module(SUITES[args.suite])
  ctx = Context(suite=args.suite, quick=args.quick, runs=args.runs)
  started = time.perf_counter()
  with ctx.progress_bar():
    records = suite.run(ctx)
  elapsed = time.perf_counter() - started
  ctx.print_table(records, title=f"{args.suite} ({ctx.platform}, {elapsed:.0f} s)")
  if args.json:
    rec.write_json(records, args.json)
    print(f"wrote {args.json}")
  if args.plot:
    plot = getattr(suite, "plot", None) or ctx.default_plot
    plot(records, args.plot)
    print(f"wrote {args.plot}")
  if args.readme:
    command = "python -m benchmarks " + " ".join(a for a in (argv or sys.argv[1:])
                                                  if a and not a.startswith("--readme")
                                                  and a != args.readme)
    if not rec.update_readme(args.readme, args.suite, records, command.strip()):
      print(f"{args.readme} has no <!-- bench:{args.suite}:start/end --> markers", file=sys.stderr)
      return 1
    print(f"updated {args.readme}")
  return 0
