"""``python -m jaxfuse.kernels.cpu``: builds every family of CPU kernels now, into the cache.

For images and clusters: run it once where the kernels will run (the same CPU, compiler and
jaxlib; ``JAXFUSE_CACHE_DIR`` on a folder the jobs read), so that no job compiles at first
use. Prints each library and its build time; exits 1 with the compiler's message if one fails.
"""

from __future__ import annotations

import argparse
import sys
import time

from jaxfuse.kernels import cpu


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jaxfuse.kernels.cpu", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("families", nargs="*", help="the families to build (default: all of "
                      "them)")
  args = parser.parse_args(argv)
  libraries = cpu.families()
  unknown = sorted(set(args.families) - set(libraries))
  if unknown:
    parser.error(f"no CPU kernel family {', '.join(unknown)}; there are "
                 f"{', '.join(sorted(libraries))}")
  if not cpu.enabled():
    print("JAXFUSE_CPU_KERNELS turns the CPU kernels off: nothing to build", file=sys.stderr)
    return 1
  for family in args.families or sorted(libraries):
    started = time.perf_counter()
    try:
      path = cpu.build(family)
    except (cpu.CompileError, cpu.CacheError) as e:
      print(f"{family}: {e}", file=sys.stderr)
      return 1
    print(f"{family}: {path} ({time.perf_counter() - started:.1f} s)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
