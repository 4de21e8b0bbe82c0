"""CPU kernels: C++ loops called through XLA's FFI, for the fusions XLA:CPU does not make.

XLA:CPU fuses an elementwise chain into one loop, but a loop writes one result: it has no
multi-output (sibling) fusion, so a backward pass with two gradients of the same inputs reads
them twice. These kernels compute such results in one pass, on XLA's intra-op thread pool.

Each ``<family>.cc`` is compiled on first use with the host's C++ compiler for the host's CPU
against jaxlib's FFI headers, cached, and its handlers registered as FFI targets
(:class:`Library`). What can go wrong there never breaks a default run:

- ``implementation=None`` loads a family through :meth:`Library.ready`: any failure to build or
  load it (no compiler, a compiler that rejects the sources, an unwritable or unsafe cache)
  makes ``None`` run XLA's formulas, with one warning (:class:`CPUKernelWarning`) naming the
  cause; ``implementation="cpu"`` raises it (:class:`CompileError`, :class:`CacheError`).
- Before the first build, a probe compiles a small source that uses what the kernels need
  (C++20 template lambdas, ``_Float16``, vector extensions, the FFI header) with the same flags;
  the CPU flags are the first the compiler takes of ``-march=native``, ``-mcpu=native`` and
  none (Apple clang has no ``-march=native`` on arm64).
- The cache is ``$JAXFUSE_CACHE_DIR/cpu-kernels`` (default ``~/.cache/jaxfuse``; in the
  temporary directory, as ``jaxfuse-<uid>``, where the home folder is not writable). Its
  folders are created with mode 0700; a folder or library owned by another user, or writable by
  others, is refused before anything in it is loaded.
- A library's name holds a hash of its sources, the flags, the compiler (its version and what
  it expands ``-march=native`` into), jaxlib's version and the CPU (``/proc/cpuinfo``'s model,
  flags and, on aarch64, features), so another CPU or compiler gets its own build.
- Processes on one host build a library once: the first takes a file lock and compiles, the
  others wait for it and load its result.
- ``$CXX`` may carry arguments (``CXX="ccache g++"``). ``JAXFUSE_CPU_KERNELS=0`` turns the
  kernels off; ``python -m jaxfuse.kernels.cpu`` builds them all ahead of time (for images and
  clusters).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
import threading
import warnings

import jax
import jaxlib

SOURCE_DIR = pathlib.Path(__file__).parent
FLAGS = ("-O3", "-std=c++20", "-fno-trapping-math", "-fno-math-errno", "-fPIC", "-shared", "-w")
# The CPU flags tried in order; the first the compiler takes (in the probe) builds the kernels.
ARCH_FLAGS = (("-march=native",), ("-mcpu=native",), ())
OFF = ("0", "false", "no")
CPUINFO = pathlib.Path("/proc/cpuinfo")
_lock = threading.Lock()


class CompileError(RuntimeError):
  """The C++ compiler is missing, or rejected a CPU kernel source or the probe."""


class CacheError(RuntimeError):
  """The cache of built kernels cannot be written, or is not safe to load libraries from."""


class CPUKernelWarning(RuntimeWarning):
  """The CPU kernels could not be built or loaded: ``implementation=None`` runs XLA instead."""


def enabled() -> bool:
  """Whether ``JAXFUSE_CPU_KERNELS`` leaves the CPU kernels on (anything but 0/false/no)."""
  return os.environ.get("JAXFUSE_CPU_KERNELS", "1").strip().lower() not in OFF


def compiler_command() -> list[str] | None:
  """The C++ compiler as a command: ``$CXX`` split like a shell (``ccache g++``), else ``c++``
  or ``g++`` on the PATH; None if there is none."""
  given = os.environ.get("CXX", "").strip()
  candidates = [shlex.split(given)] if given else [["c++"], ["g++"]]
  for words in candidates:
    found = shutil.which(words[0]) if words else None
    if found:
      return [found, *words[1:]]
  return None


def compiler() -> str | None:
  """The compiler command as one string (None if there is none)."""
  command = compiler_command()
  return None if command is None else shlex.join(command)


def _include_dir() -> pathlib.Path:
  return pathlib.Path(jax.ffi.include_dir())


@functools.cache
def _headers_present() -> bool:
  return (_include_dir() / "xla" / "ffi" / "api" / "ffi.h").is_file()


def available() -> bool:
  """Whether the CPU kernels may be tried here: enabled (``JAXFUSE_CPU_KERNELS`` is not ``0``),
  a C++ compiler and jaxlib's FFI headers. Whether they build is known only by building them
  (:meth:`Library.ready`)."""
  return enabled() and compiler_command() is not None and _headers_present()


# The cache ----------------------------------------------------------------------------------------


def cache_dir() -> pathlib.Path:
  """Where the built libraries go: ``$JAXFUSE_CACHE_DIR/cpu-kernels``, by default under
  ``~/.cache/jaxfuse`` (or ``<tmp>/jaxfuse-<uid>`` where the home folder is not writable)."""
  root = os.environ.get("JAXFUSE_CACHE_DIR")
  if not root:
    home = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    writable = os.access(home, os.W_OK) or not os.path.exists(home) and os.access(
        os.path.dirname(home) or os.curdir, os.W_OK)
    root = os.path.join(home if writable else tempfile.gettempdir(),
                        "jaxfuse" if writable else f"jaxfuse-{os.getuid()}")
  return pathlib.Path(root) / "cpu-kernels"


def check_private(path: pathlib.Path) -> None:
  """Raises :class:`CacheError` unless ``path`` (a folder or library of the cache) belongs to
  this user and no one else can write it."""
  info = os.stat(path, follow_symlinks=False)
  if stat.S_ISLNK(info.st_mode):
    raise CacheError(f"{path} is a symbolic link: jaxfuse loads CPU kernels only from a folder "
                     f"of its own (set JAXFUSE_CACHE_DIR)")
  if info.st_uid != os.getuid():
    raise CacheError(f"{path} belongs to user {info.st_uid}, not to this user ({os.getuid()}): "
                     f"jaxfuse loads no CPU kernel from it (set JAXFUSE_CACHE_DIR to a folder "
                     f"of your own)")
  if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
    raise CacheError(f"{path} is writable by others (mode {stat.filemode(info.st_mode)}): "
                     f"jaxfuse loads no CPU kernel from it (chmod go-w it, or set "
                     f"JAXFUSE_CACHE_DIR)")


def private_cache_dir() -> pathlib.Path:
  """:func:`cache_dir`, created with mode 0700 where missing (its parent too), and checked
  (:func:`check_private`)."""
  directory = cache_dir()
  for folder in (directory.parent, directory):
    try:
      folder.mkdir(mode=0o700, parents=True)
      os.chmod(folder, 0o700)   # whatever the umask left
    except FileExistsError:
      pass
    except OSError as e:
      raise CacheError(f"cannot create the CPU kernels' cache {folder} ({e.strerror or e}); set "
                       f"JAXFUSE_CACHE_DIR to a writable folder") from e
    check_private(folder)
  return directory


@contextlib.contextmanager
def _file_lock(path: pathlib.Path):
  """Holds an exclusive lock on ``path`` (created if missing) across processes of this host."""
  try:
    import fcntl
  except ImportError:   # no flock (Windows): builds race, each ends in an atomic rename
    yield
    return
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)
    yield
  finally:
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


# The compiler -------------------------------------------------------------------------------------

# What the sources need, in a few lines: the probe compiles it before the first build.
PROBE = r"""
#include <cstdint>
#include "xla/ffi/api/ffi.h"
static_assert(__cplusplus >= 202002L, "jaxfuse's CPU kernels are C++20");
typedef float lanes __attribute__((vector_size(32)));
template <typename Fn> float call(Fn&& fn) { return fn.template operator()<_Float16>(); }
extern "C" float jaxfuse_probe(float x) {
  lanes v = {x, x, x, x, x, x, x, x};
  v = v * v + v;
  return call([&]<typename T>() { return static_cast<float>(static_cast<T>(v[3])); });
}
"""


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
  try:
    return subprocess.run(command, capture_output=True, text=True, check=False, **kwargs)
  except OSError as e:
    raise CompileError(f"cannot run the C++ compiler {shlex.join(command[:1])}: {e}") from e


@functools.cache
def _identity(command: tuple[str, ...]) -> str:
  """The compiler's version and what it makes of ``-march=native`` (for the cache key)."""
  version = _run([*command, "--version"]).stdout
  expanded = _run([*command, "-march=native", "-###", "-E", "-x", "c++", os.devnull])
  return version + expanded.stderr


_probed: dict[tuple[str, ...], tuple[str, ...] | CompileError] = {}


def _arch_flags(command: tuple[str, ...]) -> tuple[str, ...]:
  """The CPU flags the compiler takes with everything the kernels need (the probe, once per
  process and compiler), or :class:`CompileError` with what it said of the first candidate."""
  if command not in _probed:
    _probed[command] = _probe(command)
  result = _probed[command]
  if isinstance(result, CompileError):
    raise result
  return result


def _probe(command: tuple[str, ...]) -> tuple[str, ...] | CompileError:
  failures = []
  with tempfile.TemporaryDirectory(prefix="jaxfuse-probe-") as tmp:
    source = pathlib.Path(tmp) / "probe.cc"
    source.write_text(PROBE)
    for arch in ARCH_FLAGS:
      cmd = [*command, *FLAGS, *arch, f"-I{_include_dir()}", "probe.cc", "-o", "probe.so"]
      done = _run(cmd, cwd=tmp)
      if done.returncode == 0:
        return arch
      failures.append((cmd, (done.stderr or done.stdout).strip()))
  cmd, said = failures[0]
  return CompileError(f"the C++ compiler cannot build jaxfuse's CPU kernels (they need C++20 "
                      f"template lambdas, _Float16 and vector extensions): the probe\n"
                      f"{shlex.join(cmd)}\nfailed:\n{said[-4000:]}\n"
                      "JAXFUSE_CPU_KERNELS=0 runs XLA's formulas instead")


@functools.cache
def _host() -> str:
  """What ``-march=native`` depends on: the CPU's model and flags (x86) or features (arm)."""
  keys = ("model name", "flags", "Features", "CPU implementer", "CPU architecture", "CPU variant",
          "CPU part")
  try:
    text = CPUINFO.read_text()
    lines = [line for line in text.splitlines() if line.startswith(keys)]
    if lines:
      return "\n".join(sorted(set(lines)))
  except OSError:
    pass
  return f"{platform.machine()} {platform.processor()} {platform.platform()}"


def _key(source: pathlib.Path, command: list[str]) -> str:
  h = hashlib.sha256()
  for part in (source.read_bytes(), (SOURCE_DIR / "common.h").read_bytes(), " ".join(FLAGS),
               repr(ARCH_FLAGS), PROBE, shlex.join(command), _identity(tuple(command)),
               jaxlib.__version__, _host()):
    h.update(part if isinstance(part, bytes) else part.encode())
  return h.hexdigest()[:16]


def build(family: str) -> pathlib.Path:
  """The shared library of ``<family>.cc``, compiled now unless the cache has it.

  Raises:
    CompileError: no compiler, or it rejects the probe or the source (with its output).
    CacheError: the cache cannot be created, or is not this user's alone.
  """
  command = compiler_command()
  if command is None:
    raise CompileError("jaxfuse's CPU kernels need a C++ compiler (set CXX, or install g++); "
                       "JAXFUSE_CPU_KERNELS=0 runs XLA's formulas instead")
  source = SOURCE_DIR / f"{family}.cc"
  directory = private_cache_dir()
  target = directory / f"{family}-{_key(source, command)}.so"
  if not target.is_file():
    with _file_lock(directory / f"{target.stem}.lock"):
      if not target.is_file():   # else another process built it while this one waited
        _compile(command, source, target)
  check_private(target)
  return target


def _compile(command: list[str], source: pathlib.Path, target: pathlib.Path) -> None:
  arch = _arch_flags(tuple(command))
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
  os.close(fd)
  cmd = [*command, *FLAGS, *arch, f"-I{_include_dir()}", f"-I{SOURCE_DIR}", str(source), "-o",
         tmp]
  try:
    done = _run(cmd)
    if done.returncode != 0:
      raise CompileError(f"compiling jaxfuse's CPU kernels ({source.name}) failed:\n"
                         f"{shlex.join(cmd)}\n{(done.stderr or done.stdout)[-4000:]}\n"
                         "JAXFUSE_CPU_KERNELS=0 runs XLA's formulas instead")
    os.chmod(tmp, 0o700)
    os.replace(tmp, target)   # atomic: a reader sees the old state or the whole library
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)


# Loading ------------------------------------------------------------------------------------------

_warned: set[str] = set()


def _warn_once(cause: str) -> None:
  if cause in _warned:
    return
  _warned.add(cause)
  warnings.warn(f"jaxfuse's CPU kernels are not used: {cause}\nOps run XLA's formulas instead; "
                "set JAXFUSE_CPU_KERNELS=0 to skip the CPU kernels (and this warning), or ask "
                "for implementation='cpu' to get this as an error.", CPUKernelWarning,
                stacklevel=4)


class Library:
  """The CPU kernels of one family: ``<family>.cc``, its FFI ``targets``.

  :meth:`load` builds and registers them (once per process), raising what went wrong;
  :meth:`ready` is the same for ``implementation=None``: False, with one warning naming the
  cause, where they cannot be had.
  """

  def __init__(self, family: str, targets: tuple[str, ...]):
    self.family, self.targets = family, targets
    self._loaded = False
    self._failure: Exception | None = None

  def load(self) -> None:
    """Builds the family (unless cached) and registers its targets on the CPU; raises
    :class:`CompileError`, :class:`CacheError` or the loader's OSError."""
    with _lock:
      if self._loaded:
        return
      try:
        library = ctypes.CDLL(str(build(self.family)))
        for name in self.targets:
          jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, name)),
                                      platform="cpu")
      except Exception as e:
        self._failure = e
        raise
      self._loaded = True

  def ready(self) -> bool:
    """Whether the kernels are loaded (loading them now): False, with one warning naming the
    cause, where they cannot be built or loaded. The answer is kept for the process."""
    if self._loaded:
      return True
    if self._failure is None:
      try:
        self.load()
        return True
      except Exception as e:  # noqa: BLE001 - any failure to build or load means "not here"
        self._failure = e
    _warn_once(f"{type(self._failure).__name__}: {self._failure}")
    return False


def families() -> dict[str, Library]:
  """Every family's :class:`Library`, by family (from the modules of this package)."""
  import importlib
  import pkgutil

  found = {}
  for info in pkgutil.iter_modules([str(SOURCE_DIR)]):
    if info.name.startswith("_"):
      continue
    module = importlib.import_module(f"{__name__}.{info.name}")
    library = getattr(module, "LIBRARY", None)
    if isinstance(library, Library):
      found[library.family] = library
  return found
