"""Choosing an implementation for an op: ``implementation=None | "pallas" | "triton" | "xla"``.

Every op declares which implementations it has and, per platform, the order in which
``implementation=None`` tries them (:class:`jaxfuse.ops.base.Op`; on CPUs always XLA, on GPUs
by one rule: XLA first for elementwise ops and matmuls, the kernels first for the rest). An implementation asked for by name that cannot run here
raises :class:`ImplementationUnavailableError`, naming the ones that can; nothing falls back
silently.

Pallas kernels need a GPU. On CPU they run only in interpret mode, which is correct but about a
thousand times slower than XLA, so it is for tests::

    with jaxfuse.pallas_interpret():
        y = jaxfuse.ops.add_act(a, b, "relu", implementation="pallas")

or set ``JAXFUSE_PALLAS_INTERPRET=1`` in the environment. The setting is read when a function is
traced: a function already jit-compiled outside the context keeps its compiled kernels.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import threading
from collections.abc import Iterator, Sequence

import jax

IMPLEMENTATIONS = ("pallas", "triton", "xla")

_state = threading.local()


class ImplementationUnavailableError(RuntimeError):
  """An implementation asked for by name cannot run on this platform."""


@contextlib.contextmanager
def pallas_interpret(enabled: bool = True) -> Iterator[None]:
  """Runs Pallas kernels traced inside this context in interpret mode (for tests on CPU)."""
  previous = getattr(_state, "interpret", None)
  _state.interpret = enabled
  try:
    yield
  finally:
    _state.interpret = previous


def interpret_enabled() -> bool:
  """Whether Pallas kernels are traced in interpret mode (context first, then the env var)."""
  value = getattr(_state, "interpret", None)
  if value is not None:
    return value
  return os.environ.get("JAXFUSE_PALLAS_INTERPRET", "0").lower() in ("1", "true", "yes")


@contextlib.contextmanager
def target_platform(name: str) -> Iterator[None]:
  """Traces ops as if running on ``name`` (``"gpu"``), to lower GPU kernels on a CPU machine.

  Example (what the lowering tests do)::

      with target_platform("gpu"):
        jax.jit(f).trace(x).lower(lowering_platforms=("cuda",))
  """
  previous = getattr(_state, "platform", None)
  _state.platform = name
  try:
    yield
  finally:
    _state.platform = previous


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


def runs_natively(implementation: str) -> bool:
  """Whether ``implementation`` compiles for the current platform (interpret mode aside)."""
  if implementation == "xla":
    return True
  if implementation == "pallas":
    return on_gpu()
  if implementation == "triton":
    return on_gpu() and jax_triton_importable()
  return False


def can_run(implementation: str) -> bool:
  """Whether ``implementation`` can run here, counting Pallas interpret mode."""
  if implementation == "pallas" and interpret_enabled():
    return True
  return runs_natively(implementation)


def _why_not(implementation: str) -> str:
  if implementation == "pallas":
    return ("Pallas kernels need a GPU; on CPU enable interpret mode with "
            "`with jaxfuse.pallas_interpret():` or JAXFUSE_PALLAS_INTERPRET=1 (slow, for tests)")
  if implementation == "triton":
    if not on_gpu():
      return "Triton kernels need a GPU"
    return "Triton kernels need jax-triton (pip install 'jaxfuse[gpu]')"
  return "unknown reason"


def resolve(op: str, implementation: str | None, supported: Sequence[str],
            preference: dict[str, Sequence[str]] | None = None) -> str:
  """Returns the implementation ``op`` runs with.

  Args:
    op: the op's name, for error messages.
    implementation: what the caller asked for; ``None`` picks the first runnable entry of
      ``preference[platform()]`` (default: ``supported`` in order, XLA last).
    supported: the implementations the op has.
    preference: per platform, the order ``None`` tries (see :mod:`jaxfuse.ops.base` for the
      rule the ops follow).

  Raises:
    ValueError: ``implementation`` is not a known name or the op does not have it.
    ImplementationUnavailableError: the op has it but it cannot run here.
  """
  if implementation is None:
    order = (preference or {}).get(platform(), None) or _default_order(supported)
    for name in order:
      if name in supported and runs_natively(name):
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
        f"{platform()!r}: {_why_not(implementation)}. Available here: {here}")
  return implementation


def _default_order(supported: Sequence[str]) -> list[str]:
  if on_gpu():
    return [name for name in ("pallas", "triton", "xla") if name in supported]
  return ["xla"]
