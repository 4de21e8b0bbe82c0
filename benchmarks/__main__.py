"""``python -m benchmarks``: sets up the process, then runs the CLI (see ``benchmarks.cli``).

Before JAX or torch is loaded, the process is started again with these settings (unless they
are already there, or ``--system-env`` is given); they apply to every candidate alike:

- glibc malloc keeps freed memory for reuse (one arena, no ``mmap`` for large blocks, no
  trimming). By default each step that allocates large outputs gets fresh pages and pays page
  faults again: XLA allocates its outputs on its own threads, and page faults can take more
  time than its loops (compare a suite's times with ``--system-env``).
- except for the ``train`` and ``posttrain`` suites, whose rows hold gigabytes each: a heap
  that never shrinks grew past 22 GB in the first (one case's process holds four models' steps)
  and to 19 GB in the second at full size (six rows of full logits). There blocks of 64 MiB
  and more are mapped for themselves and given back when freed (``MALLOC_MMAP_THRESHOLD_``),
  as glibc does by default above 32 MiB; smaller ones are kept for reuse.
- ``OMP_WAIT_POLICY=PASSIVE``: torch's OpenMP threads otherwise spin after each torch call on
  the cores the next (JAX) candidate needs; torch's own times did not change with it.
- the ``shard`` suite gets 8 simulated CPU devices
  (``XLA_FLAGS=--xla_force_host_platform_device_count=8``), fixed when JAX starts.
"""

import os
import sys

SETTINGS = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1),
    "OMP_WAIT_POLICY": "PASSIVE",
}
# Suites whose settings differ: the names to leave out and those to set.
SUITE_SETTINGS = {
    "train": ({"MALLOC_MMAP_MAX_"}, {"MALLOC_MMAP_THRESHOLD_": str(64 << 20)}),
    "posttrain": ({"MALLOC_MMAP_MAX_"}, {"MALLOC_MMAP_THRESHOLD_": str(64 << 20)}),
}
# Every name a suite's settings may set (the records' time source lists those in force).
NAMES = tuple(dict.fromkeys([*SETTINGS, *(n for _, extra in SUITE_SETTINGS.values()
                                           for n in extra)]))


def settings(suite: str | None) -> dict[str, str]:
  """The process settings of ``suite``."""
  left_out, extra = SUITE_SETTINGS.get(suite, (set(), {}))
  return {**{k: v for k, v in SETTINGS.items() if k not in left_out}, **extra}


DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# Suites that run on several (simulated) devices, and how many.
SUITE_DEVICES = {"shard": 8}


def _device_flags() -> str | None:
  """XLA_FLAGS with the simulated device count of the suite asked for, or None if it needs none
  (or the flag is there already)."""
  count = next((n for name, n in SUITE_DEVICES.items() if name in sys.argv[1:2]), None)
  flags = os.environ.get("XLA_FLAGS", "")
  if count is None or DEVICE_COUNT_FLAG in flags:
    return None
  return f"{flags} {DEVICE_COUNT_FLAG}={count}".strip()


def _restart_with_settings() -> None:
  devices = _device_flags()
  wanted = settings(sys.argv[1] if len(sys.argv) > 1 else None)
  settings_missing = not all(k in os.environ for k in wanted)
  if "--system-env" in sys.argv:
    settings_missing = False
  if not settings_missing and devices is None:
    return
  env = dict(os.environ)
  if settings_missing:
    env = {**wanted, **env}
  if devices is not None:
    env["XLA_FLAGS"] = devices
  os.execve(sys.executable, [sys.executable, "-m", "benchmarks", *sys.argv[1:]], env)


if __name__ == "__main__":
  _restart_with_settings()
  from benchmarks.cli import main

  raise SystemExit(main())
