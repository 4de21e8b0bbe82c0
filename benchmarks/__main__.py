"""``python -m benchmarks``: sets up the process, then runs the CLI (see ``benchmarks.cli``).

Before JAX or torch is loaded, the process is started again with these settings (unless they
are already there, or ``--system-env`` is given); they apply to every candidate alike:

- glibc malloc keeps freed memory for reuse (one arena, no ``mmap`` for large blocks, no
  trimming). By default each step that allocates large outputs gets fresh pages and pays page
  faults again: XLA, which allocates its outputs on its own threads, spent more time in the
  kernel than in its loops (norm suite, quick: 15 s of system time in 45 s, 2.8 s with these
  settings; a 4096x1024 SwiGLU step went from 26 ms to 6.3 ms).
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
