"""The kinds of implementation an op can have, where each runs, and how a call picks one.

Every op is ``implementation=None | "pallas" | "triton" | "cpu" | "xla"``. The kinds are one
table, :data:`KINDS`: the platforms each compiles for, what else it needs (jax-triton for the
Triton kernels, a C++ compiler for the CPU kernels), the package its kernel modules live in,
and whether it runs on CPU in interpret mode. An op declares which kinds it has and its ``None`` order once, in its
:class:`jaxfuse.ops.base.Op`; everything else (this module's :func:`resolve`, the lazy import
of its kernel modules, the benchmark rows, the parity tests, the kernel-resource report) reads
that declaration. An implementation asked for by name that cannot run here raises
:class:`ImplementationUnavailableError`, naming the ones that can; nothing falls back silently.

Pallas kernels need a GPU. On CPU they run only in interpret mode, which is correct but about a
thousand times slower than XLA, so it is for tests::

    with jaxfuse.pallas_interpret():
        y = jaxfuse.ops.add_act(a, b, "relu", implementation="pallas")

or set ``JAXFUSE_PALLAS_INTERPRET=1`` in the environment. The setting is read when a function is
traced: a function already jit-compiled outside the context keeps its compiled kernels.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import os
import threading
from collections.abc import Callable, Iterator, Sequence

import jax

_state = threading.local()


class ImplementationUnavailableError(RuntimeError):
  """An implementation asked for by name cannot run on this platform."""


@contextlib.contextmanager
def _setting(name: str, value) -> Iterator[None]:
  """This thread's setting ``name`` is ``value`` inside the block."""
  previous = getattr(_state, name, None)
  setattr(_state, name, value)
  try:
    yield
  finally:
    setattr(_state, name, previous)


def pallas_interpret(enabled: bool = True):
  """Runs Pallas kernels traced inside this context in interpret mode (for tests on CPU)."""
  return _setting("interpret", enabled)


def interpret_enabled() -> bool:
  """Whether Pallas kernels are traced in interpret mode (context first, then the env var)."""
  value = getattr(_state, "interpret", None)
  if value is not None:
    return value
  return os.environ.get("JAXFUSE_PALLAS_INTERPRET", "0").lower() in ("1", "true", "yes")


def target_platform(name: str):
  """Traces ops as if running on ``name`` (``"gpu"``), to lower GPU kernels on a CPU machine.

  Example (what the lowering tests do)::

      with target_platform("gpu"):
        jax.jit(f).trace(x).lower(lowering_platforms=("cuda",))
  """
  return _setting("platform", name)


def platform() -> str:
  """The backend ops are traced for: ``"cpu"``, ``"gpu"`` or ``"tpu"``."""
  return getattr(_state, "platform", None) or jax.default_backend()


def on_gpu() -> bool:
  """True when the default devices are GPUs (where Pallas lowers through Triton)."""
  return platform() == "gpu"


@functools.cache
def jax_triton_importable() -> bool:
  """Whether jax-triton is installed and imports (it raises ImportError without a GPU)."""
  if importlib.util.find_spec("jax_triton") is None:
    return False
  try:
    import jax_triton  # noqa: F401
  except Exception:  # noqa: BLE001 - any failure means it cannot be used here.
    return False
  return True


# JAX 0.11.0 deprecated Pallas' Triton backend ("migrate to the Mosaic GPU backend ... or switch
# to the official Triton bindings and jax_triton").
PALLAS_TRITON_DEPRECATED_IN = (0, 11, 0)


@functools.cache
def pallas_triton_current() -> bool:
  """Whether the installed jax has Pallas' Triton backend and has not deprecated it (jax older
  than 0.11.0). Where it has, ``implementation=None`` prefers the jax-triton kernels on GPUs."""
  try:
    from jax.experimental.pallas import triton  # noqa: F401
  except Exception:  # noqa: BLE001 - gone or broken: not current either way
    return False
  version = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())
  return version < PALLAS_TRITON_DEPRECATED_IN


# The kinds of implementation ---------------------------------------------------------------------


def _always() -> bool:
  return True


def _jax_triton() -> bool:
  # Looked up at call time, so that tests can stand jax-triton in
  # (jaxfuse/testing/triton_interpreter.py).
  return jax_triton_importable()


def _cpu_kernels() -> bool:
  from jaxfuse.kernels import cpu   # light, but imported only where asked

  return cpu.available()


@dataclasses.dataclass(frozen=True)
class Kind:
  """A kind of implementation: where it compiles and where its kernels live.

  Attributes:
    name: ``"xla"``, ``"pallas"``, ``"triton"`` or ``"cpu"``: the value of ``implementation=``.
    platforms: the platforms it compiles for natively.
    requires: what else it needs, as a check (``jax_triton`` importable for Triton).
    package: the package of its kernel modules (None: the op's own jnp formulas).
    interpretable: whether it runs on CPU in interpret mode (:func:`pallas_interpret`),
      passing ``interpret=`` to its kernels.
    missing: what to do when ``requires`` fails, for the error message.
    label: its name in messages.
  """

  name: str
  platforms: tuple[str, ...]
  requires: Callable[[], bool] = _always
  package: str | None = None
  interpretable: bool = False
  missing: str = ""
  label: str = ""

  def has_module(self, module: str) -> bool:
    """Whether its kernel package holds ``module`` (looked up without importing it)."""
    if self.package is None:
      return False
    root = importlib.util.find_spec("jaxfuse.kernels").submodule_search_locations[0]
    relative = self.package.removeprefix("jaxfuse.kernels").strip(".").replace(".", os.sep)
    return os.path.isfile(os.path.join(root, relative, f"{module}.py"))

  def runs_natively(self) -> bool:
    return platform() in self.platforms and self.requires()

  def why_not(self) -> str:
    if platform() not in self.platforms:
      how = ("; on CPU enable interpret mode with `with jaxfuse.pallas_interpret():` or "
             "JAXFUSE_PALLAS_INTERPRET=1 (slow, for tests)") if self.interpretable else ""
      where = " or ".join(p.upper() for p in self.platforms)
      return f"{self.label or self.name.capitalize()} kernels need a {where}{how}"
    return self.missing


KINDS: dict[str, Kind] = {kind.name: kind for kind in (
    Kind("pallas", ("gpu",), package="jaxfuse.kernels.pallas", interpretable=True),
    Kind("triton", ("gpu",), _jax_triton, package="jaxfuse.kernels.triton",
         missing="Triton kernels need jax-triton (pip install 'jaxfuse[gpu]')"),
    Kind("cpu", ("cpu",), _cpu_kernels, package="jaxfuse.kernels.cpu", label="CPU",
         missing="CPU kernels need a C++ compiler (set CXX or install g++) and are off where "
                 "JAXFUSE_CPU_KERNELS=0"),
    Kind("xla", ("cpu", "gpu", "tpu")),
)}
IMPLEMENTATIONS = tuple(KINDS)


def runs_natively(implementation: str) -> bool:
  """Whether ``implementation`` compiles for the current platform (interpret mode aside)."""
  kind = KINDS.get(implementation)
  return kind is not None and kind.runs_natively()


def can_run(implementation: str) -> bool:
  """Whether ``implementation`` can run here, counting Pallas interpret mode."""
  kind = KINDS.get(implementation)
  if kind is not None and kind.interpretable and interpret_enabled():
    return True
  return runs_natively(implementation)


def interprets(implementation: str) -> bool:
  """Whether ``implementation``'s kernels are traced in interpret mode here."""
  return KINDS[implementation].interpretable and not runs_natively(implementation)


def resolve(op: str, implementation: str | None, supported: Sequence[str],
            preference: dict[str, Sequence[str]] | None = None,
            refuses: Callable[[str], str | None] | None = None,
            ready: Callable[[str], bool] | None = None) -> str:
  """Returns the implementation ``op`` runs with.

  Args:
    op: the op's name, for error messages.
    implementation: what the caller asked for; ``None`` picks the first entry of
      ``preference[platform()]`` that runs natively and does not refuse the call (default:
      ``supported`` in the order of :data:`KINDS`, XLA last).
    supported: the implementations the op has.
    preference: per platform, the order ``None`` tries (see :mod:`jaxfuse.ops.base` for the
      rule the ops follow).
    refuses: for an implementation, why it cannot take this call's arguments (None: it can):
      the limits of its kernels (a row too wide for their tiles, an activation they lack).
    ready: for an implementation ``None`` would take, whether its kernels load here (the CPU
      kernels are built on first use: where that fails, ``None`` goes on down its order, and
      the kernels warn once); one asked for by name raises its own error when called.

  Raises:
    ValueError: ``implementation`` is not a known name, the op does not have it, or its
      kernels refuse the arguments.
    ImplementationUnavailableError: the op has it but it cannot run here.
  """
  refuses = refuses or (lambda name: None)
  ready = ready or (lambda name: True)
  if implementation is None:
    order = (preference or {}).get(platform(), None) or _default_order(supported)
    for name in order:
      if (name in supported and runs_natively(name) and refuses(name) is None
          and ready(name)):
        return name
    return "xla"
  if not isinstance(implementation, str) or implementation not in IMPLEMENTATIONS:
    raise ValueError(f"{op}: implementation must be None or one of {IMPLEMENTATIONS}, "
                     f"got {implementation!r}")
  if implementation not in supported:
    raise ValueError(f"{op}: implementation={implementation!r} is not provided; "
                     f"{op} has {tuple(supported)}")
  if not can_run(implementation):
    here = [name for name in supported if can_run(name)]
    raise ImplementationUnavailableError(
        f"{op}: implementation={implementation!r} cannot run on platform "
        f"{platform()!r}: {KINDS[implementation].why_not()}. Available here: {here}")
  reason = refuses(implementation)
  if reason is not None:
    others = [name for name in supported if name != implementation and refuses(name) is None]
    use = " or ".join(repr(name) for name in others)
    raise ValueError(f"{op}: implementation={implementation!r} {reason}"
                     + (f"; use {use}" if use else ""))
  return implementation


def _default_order(supported: Sequence[str]) -> list[str]:
  return [name for name in IMPLEMENTATIONS if name in supported and KINDS[name].runs_natively()]
