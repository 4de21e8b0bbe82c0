"""CPU kernels: C++ loops called through XLA's FFI, for the fusions XLA:CPU does not make.

XLA:CPU fuses an elementwise chain into one loop, but a loop writes one result: it has no
multi-output (sibling) fusion, so a backward pass with two gradients of the same inputs reads
them twice. These kernels compute such results in one pass, on XLA's intra-op thread pool.

Each ``<family>.cc`` is compiled on first use with the host's C++ compiler for the host's CPU
(``-march=native``) against jaxlib's FFI headers, cached under ``$JAXFUSE_CACHE_DIR`` (default
``~/.cache/jaxfuse``), and its handlers registered as FFI targets. :func:`available` says whether
that can happen here (a compiler and the headers, and ``JAXFUSE_CPU_KERNELS`` not ``0``); a
compiler error is raised with the compiler's output, never replaced by another implementation.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import threading

import jax
import jaxlib

SOURCE_DIR = pathlib.Path(__file__).parent
FLAGS = ("-O3", "-march=native", "-std=c++20", "-fno-trapping-math", "-fno-math-errno",
         "-fPIC", "-shared", "-w")
_lock = threading.Lock()


class CompileError(RuntimeError):
  """The C++ compiler rejected a CPU kernel source."""


def compiler() -> str | None:
  """The C++ compiler: ``$CXX``, else ``c++`` or ``g++`` on the PATH (None if there is none)."""
  for name in (os.environ.get("CXX"), "c++", "g++"):
    if name and shutil.which(name):
      return shutil.which(name)
  return None


def _include_dir() -> pathlib.Path:
  return pathlib.Path(jax.ffi.include_dir())


@functools.cache
def _headers_present() -> bool:
  return (_include_dir() / "xla" / "ffi" / "api" / "ffi.h").is_file()


def available() -> bool:
  """Whether the CPU kernels can be built and run here: enabled (``JAXFUSE_CPU_KERNELS`` is not
  ``0``), a C++ compiler and jaxlib's FFI headers."""
  if os.environ.get("JAXFUSE_CPU_KERNELS", "1").lower() in ("0", "false", "no"):
    return False
  return compiler() is not None and _headers_present()


def cache_dir() -> pathlib.Path:
  """Where the built libraries go: ``$JAXFUSE_CACHE_DIR/cpu-kernels``, by default under
  ``~/.cache/jaxfuse`` (or the temporary directory where the home folder is not writable)."""
  root = os.environ.get("JAXFUSE_CACHE_DIR")
  if not root:
    home = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    writable = os.access(home, os.W_OK) or not os.path.exists(home) and os.access(
        os.path.dirname(home) or os.curdir, os.W_OK)
    root = os.path.join(home if writable else tempfile.gettempdir(),
                        "jaxfuse" if writable else f"jaxfuse-{os.getuid()}")
  return pathlib.Path(root) / "cpu-kernels"


@functools.cache
def _host() -> str:
  """What ``-march=native`` depends on: the CPU's model and flags."""
  try:
    text = pathlib.Path("/proc/cpuinfo").read_text()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))
  except OSError:
    return platform.processor() or platform.machine()


def _key(source: pathlib.Path, cxx: str) -> str:
  version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
  h = hashlib.sha256()
  for part in (source.read_bytes(), (SOURCE_DIR / "common.h").read_bytes(), " ".join(FLAGS),
               version, jaxlib.__version__,
               _host()):
    h.update(part if isinstance(part, bytes) else part.encode())
  return h.hexdigest()[:16]


def build(family: str) -> pathlib.Path:
  """The shared library of ``<family>.cc``, compiled now unless the cache has it."""
  cxx = compiler()
  if cxx is None:
    raise CompileError("jaxfuse's CPU kernels need a C++ compiler (set CXX, or install g++); "
                       "JAXFUSE_CPU_KERNELS=0 runs XLA's formulas instead")
  source = SOURCE_DIR / f"{family}.cc"
  target = cache_dir() / f"{family}-{_key(source, cxx)}.so"
  if target.is_file():
    return target
  target.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
  os.close(fd)
  cmd = [cxx, *FLAGS, f"-I{_include_dir()}", f"-I{SOURCE_DIR}", str(source), "-o", tmp]
  done = subprocess.run(cmd, capture_output=True, text=True, check=False)
  if done.returncode != 0:
    os.unlink(tmp)
    raise CompileError(f"compiling jaxfuse's CPU kernels ({source.name}) failed:\n"
                       f"{' '.join(cmd)}\n{done.stderr[-4000:]}\n"
                       "JAXFUSE_CPU_KERNELS=0 runs XLA's formulas instead")
  os.replace(tmp, target)   # atomic: a process compiling the same source beside this one agrees
  return target


@functools.cache
def _registered(family: str, targets: tuple[str, ...]) -> ctypes.CDLL:
  library = ctypes.CDLL(str(build(family)))
  for name in targets:
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, name)), platform="cpu")
  return library


def register(family: str, targets: tuple[str, ...]) -> None:
  """Builds ``<family>.cc`` (once per process) and registers its FFI ``targets`` on the CPU."""
  with _lock:
    _registered(family, targets)
