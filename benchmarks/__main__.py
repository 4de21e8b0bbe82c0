"""``python -m benchmarks``: sets up the process, then runs the CLI (see ``benchmarks.cli``).

Before JAX or torch is loaded, the process is started again with these settings (unless they
are already there, or ``--system-env`` is given); they apply to every candidate alike:

- glibc malloc keeps freed memory for reuse (one arena, no ``mmap`` for large blocks, no
  trimming). By default each step that allocates large outputs gets fresh pages and pays page
  faults again: XLA allocates its outputs on its own threads, and page faults can take more
  time than its loops (compare a suite's times with ``--system-env``).
- ``OMP_WAIT_POLICY=PASSIVE``: torch's OpenMP threads otherwise spin after each torch call on
  the cores the next (JAX) candidate needs; torch's own times did not change with it.
"""

import os
import sys

SETTINGS = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1),
    "OMP_WAIT_POLICY": "PASSIVE",
}


def _restart_with_settings() -> None:
  if "--system-env" in sys.argv or all(k in os.environ for k in SETTINGS):
    return
  env = {**SETTINGS, **os.environ}
  os.execve(sys.executable, [sys.executable, "-m", "benchmarks", *sys.argv[1:]], env)


if __name__ == "__main__":
  _restart_with_settings()
  from benchmarks.cli import main

  raise SystemExit(main())
