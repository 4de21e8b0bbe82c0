"""Kernels compiled for a GPU on any machine, with the ``triton`` package and its ``ptxas``.

:func:`compile_kernel` compiles a :class:`~jaxfuse.metrics.gpu_kernels.KernelSource` (a Pallas
kernel's textual TTIR, or a ``@triton.jit`` function with its signature and constexprs) for a
target arch (``sm_90a`` by default, ``sm_80`` too: a cubin needs no GPU, only Triton's bundled
``ptxas``) and reads the figures ``ptxas -v`` reports: registers per thread, spill stores and
loads, the stack frame and static shared memory. The dynamic shared memory is the compiled
kernel's ``shared`` metadata. Under ``TRITON_INTERPRET=1`` (the CPU tests) ``@triton.jit`` makes
interpreter objects, Triton's own library included; those kernels are compiled in a child
process (``python -m jaxfuse.metrics.kernel_compile``) that imports triton without it.

Part of :mod:`jaxfuse.metrics.kernel_resources`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence

from jaxfuse.metrics.gpu_kernels import KernelSource
from jaxfuse.metrics.gpu_occupancy import (DEFAULT_ARCH, Arch, KernelResources, arch,
                                           resources_of)


# The toolchain ------------------------------------------------------------------------------------


def missing_toolchain(target: Arch | str = DEFAULT_ARCH) -> str | None:
  """What is missing to compile kernels for ``target`` here, or None when nothing is.

  Needs: jaxlib's Triton dialect (to read the Pallas kernels' modules), the ``triton``
  package with its NVIDIA backend, and the ``ptxas`` it uses for ``target``.
  """
  target = arch(target)
  try:
    from jax._src.lib import triton as jax_triton_lib

    jax_triton_lib.dialect.register_dialect  # noqa: B018 - the attribute is what is needed
  except Exception as e:  # noqa: BLE001 - any failure means the dialect is unavailable
    return f"jaxlib's Triton MLIR dialect (jax._src.lib.triton.dialect): {e}"
  try:
    import triton  # noqa: F401
    from triton.backends.nvidia import compiler  # noqa: F401
  except Exception as e:  # noqa: BLE001 - any failure means triton is unusable here
    return f"the triton package with its NVIDIA backend (pip install triton): {e}"
  try:
    path = ptxas_path(target)
  except Exception as e:  # noqa: BLE001 - any failure means no ptxas
    return f"ptxas for {target.name} (Triton's bundled ptxas, or $TRITON_PTXAS_PATH): {e}"
  if not path or not os.access(path, os.X_OK):
    return f"ptxas for {target.name} at {path!r} (Triton's bundled ptxas, or $TRITON_PTXAS_PATH)"
  return None


@contextlib.contextmanager
def triton_cache(path: str | None = None) -> Iterator[str]:
  """Points Triton's compile cache at ``path`` (default: a new temporary directory, removed at
  the end) inside the block, so that measuring never reads or fills the user's cache."""
  import triton

  with contextlib.ExitStack() as stack:
    if path is None:
      path = stack.enter_context(tempfile.TemporaryDirectory(prefix="jaxfuse-triton-"))
    stack.enter_context(triton.knobs.cache.scope())
    triton.knobs.cache.dir = path
    yield path


# Compiling ----------------------------------------------------------------------------------------


_PROPERTIES = re.compile(
    r"Function properties for (\S+)\s*\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, "
    r"(\d+) bytes spill loads")
_USED = re.compile(r"Compiling entry function '([^']+)'.*?Used (\d+) registers([^\n]*)", re.DOTALL)
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas_log(log: str, name: str | None = None) -> dict[str, int]:
  """``registers``, ``stack_bytes``, ``spill_stores``, ``spill_loads`` and ``static_smem`` of
  the entry function ``name`` (default: the first) in ``ptxas -v`` output.

  Example:
    >>> log = '''ptxas info    : Compiling entry function 'k' for 'sm_90a'
    ... ptxas info    : Function properties for k
    ...     8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
    ... ptxas info    : Used 255 registers, used 1 barriers, 1024 bytes smem, 400 bytes cmem[0]'''
    >>> parse_ptxas_log(log)["registers"], parse_ptxas_log(log)["spill_stores"]
    (255, 4)
  """
  props = {m.group(1): m for m in _PROPERTIES.finditer(log)}
  used = {m.group(1): m for m in _USED.finditer(log)}
  if not used:
    raise ValueError(f"no 'Used N registers' line in the ptxas log:\n{log[-2000:]}")
  key = name if name in used else next(iter(used))
  u = used[key]
  p = props.get(key)
  smem = _SMEM.search(u.group(3))
  return {"registers": int(u.group(2)),
          "stack_bytes": int(p.group(2)) if p else 0,
          "spill_stores": int(p.group(3)) if p else 0,
          "spill_loads": int(p.group(4)) if p else 0,
          "static_smem": int(smem.group(1)) if smem else 0}


def ptxas_path(target: Arch) -> str:
  """The ptxas Triton compiles ``target`` with (newer Triton picks one per arch)."""
  from triton.backends.nvidia import compiler as nvidia

  try:
    return nvidia.get_ptxas(target.capability).path
  except TypeError:  # Triton before 3.5 has one ptxas
    return nvidia.get_ptxas().path


def _ptxas_log(ptx: str, target: Arch) -> str:
  """``ptxas -v`` of ``ptx`` with the flags Triton compiles with."""
  ptxas = ptxas_path(target)
  with tempfile.TemporaryDirectory(prefix="jaxfuse-ptxas-") as tmp:
    src = os.path.join(tmp, "kernel.ptx")
    with open(src, "w") as f:
      f.write(ptx)
    done = subprocess.run(
        [ptxas, "-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name={target.name}", src,
         "-o", os.path.join(tmp, "kernel.cubin")], capture_output=True, text=True, check=True)
  return done.stdout + done.stderr


def triton_compile(source: KernelSource, target: Arch):
  """Triton's compiled kernel for ``source`` and the ``ptxas -v`` log it printed."""
  import triton
  from triton.backends.compiler import GPUTarget
  from triton.compiler import ASTSource

  options = {"num_warps": source.num_warps, "num_stages": source.num_stages,
             "enable_fp_fusion": source.fp_fusion}
  gpu = GPUTarget("cuda", target.capability, 32)
  log = io.StringIO()
  with contextlib.ExitStack() as stack:
    if source.ttir is not None:
      tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="jaxfuse-ttir-"))
      src = os.path.join(tmp, f"{source.name}.ttir")
      with open(src, "w") as f:
        f.write(source.ttir)
    else:
      signature = dict(source.signature)
      attrs = {(i,): [["tt.divisibility", 16]]
               for i, t in enumerate(signature.values()) if t.startswith("*")}
      src = ASTSource(source.fn, signature=signature, constexprs=dict(source.constexprs),
                      attrs=attrs)
    stack.enter_context(triton.knobs.nvidia.scope())
    if hasattr(triton.knobs.nvidia, "dump_ptxas_log"):  # else ptxas runs again below
      triton.knobs.nvidia.dump_ptxas_log = True
    stack.enter_context(contextlib.redirect_stdout(log))
    compiled = triton.compile(src, target=gpu, options=options)
  return compiled, log.getvalue()


def _figures(source: KernelSource, target: Arch) -> dict[str, int]:
  """What ``ptxas -v`` and Triton report for ``source``, compiled in this process."""
  compiled, log = triton_compile(source, target)
  if "Used" not in log:  # the cubin came from a cache: ask ptxas again
    log = _ptxas_log(compiled.asm["ptx"], target)
  figures = parse_ptxas_log(log, compiled.metadata.name)
  return {**figures, "dynamic_smem": int(compiled.metadata.shared)}


def _interpreted(source: KernelSource) -> bool:
  """Whether ``source`` is a Triton kernel that ``@triton.jit`` made for Triton's interpreter
  (``TRITON_INTERPRET=1`` when triton was imported, as the CPU tests set): Triton's own
  library is then interpreted too, and the kernel compiles only in another process."""
  if source.fn is None:
    return False
  from triton.runtime.jit import JITFunction

  return not isinstance(source.fn, JITFunction)


class _Elsewhere:
  """Triton kernels compiling in a Python process that imports triton for compiling
  (``python -m jaxfuse.metrics.kernel_compile``), while this one goes on."""

  def __init__(self, sources: Sequence[KernelSource], target: Arch):
    import triton

    jobs = []
    for s in sources:
      fn = getattr(s.fn, "fn", s.fn)
      jobs.append({"module": fn.__module__, "function": fn.__name__, "name": s.name,
                   "num_warps": s.num_warps, "num_stages": s.num_stages, "grid": list(s.grid),
                   "signature": list(s.signature), "constexprs": list(s.constexprs),
                   "fp_fusion": s.fp_fusion})
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": triton.knobs.cache.dir}
    self._tmp = tempfile.TemporaryDirectory(prefix="jaxfuse-kernels-")
    request = os.path.join(self._tmp.name, "request.json")
    self._answer = os.path.join(self._tmp.name, "answer.json")
    with open(request, "w") as f:
      json.dump({"arch": target.name, "jobs": jobs}, f)
    self._process = subprocess.Popen(
        [sys.executable, "-m", __name__, request, self._answer], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

  def result(self) -> list:
    """Per kernel, :func:`_figures` or the error it raised (a str)."""
    try:
      output, _ = self._process.communicate()
      if self._process.returncode or not os.path.exists(self._answer):
        raise RuntimeError(f"kernel_resources: compiling the Triton kernels in a subprocess "
                           f"failed:\n{output[-3000:]}")
      with open(self._answer) as f:
        return json.load(f)
    finally:
      self._tmp.cleanup()


def _serve(request_path: str, answer_path: str) -> None:
  """The subprocess of :class:`_Elsewhere`: compiles the kernels a request names."""
  import importlib

  with open(request_path) as f:
    request = json.load(f)
  target = arch(request["arch"])
  answers = []
  for job in request["jobs"]:
    fn = getattr(importlib.import_module(job["module"]), job["function"])
    source = KernelSource(
        name=job["name"], kind="triton", num_warps=job["num_warps"],
        num_stages=job["num_stages"], grid=tuple(job["grid"]), fn=fn,
        signature=tuple(map(tuple, job["signature"])),
        constexprs=tuple(map(tuple, job["constexprs"])), fp_fusion=job["fp_fusion"])
    try:
      answers.append(_figures(source, target))
    except Exception as e:  # noqa: BLE001 - reported to the parent, kernel by kernel
      answers.append(f"{type(e).__name__}: {str(e)[:2000]}")
  with open(answer_path, "w") as f:
    json.dump(answers, f)


def _resources(source: KernelSource, target: Arch, figures: dict | str) -> KernelResources:
  """The resources of a kernel from its figures, or the error they are (a str)."""
  if isinstance(figures, dict):
    return resources_of(source, target, **figures)
  raise RuntimeError(f"kernel_resources: {source.kind} kernel {source.name} "
                     f"(warps={source.num_warps}, stages={source.num_stages}) did not compile "
                     f"for {target.name}: {figures}")


def _require_toolchain(target: Arch, what: str) -> None:
  missing = missing_toolchain(target)
  if missing:
    raise RuntimeError(f"kernel_resources: cannot compile {what}: missing {missing}")


def _check(source: KernelSource, target: Arch) -> None:
  _require_toolchain(target, source.name)
  if source.error is not None:
    raise RuntimeError(f"kernel_resources: {source.kind} kernel {source.name}: {source.error}")


def compile_kernel(source: KernelSource, target: Arch | str = DEFAULT_ARCH) -> KernelResources:
  """Compiles one kernel for ``target`` with the ``triton`` package and reads its figures.

  Raises:
    RuntimeError: the toolchain is missing (the message names what), or Triton or ``ptxas``
      rejected the kernel (the message names the kernel).
  """
  target = arch(target)
  _check(source, target)
  if _interpreted(source):
    return _resources(source, target, _Elsewhere([source], target).result()[0])
  try:
    figures = _figures(source, target)
  except Exception as e:  # noqa: BLE001 - any compile failure is reported with the kernel
    figures = f"{type(e).__name__}: {str(e)[:2000]}"
  return _resources(source, target, figures)


def compile_each(sources: Sequence[KernelSource], target: Arch | str = DEFAULT_ARCH, *,
                 cache_dir: str | None = None) -> list[KernelResources | str]:
  """:func:`compile_kernel` of each kernel, going on past those that fail: their entries are
  why they did not compile. Triton's cache is ``cache_dir`` (default: a temporary directory);
  Triton kernels that need another process share one.

  Raises:
    RuntimeError: the toolchain is missing (the message names what).
  """
  target = arch(target)
  _require_toolchain(target, f"kernels for {target.name}")
  with triton_cache(cache_dir):
    elsewhere = [s for s in sources if s.error is None and _interpreted(s)]
    started = _Elsewhere(elsewhere, target) if elsewhere else None  # runs meanwhile
    out: dict[int, KernelResources | str] = {}
    for s in sources:
      if any(s is e for e in elsewhere):
        continue
      out[id(s)] = _or_why(compile_kernel, s, target)
    for s, figures in zip(elsewhere, started.result() if started else []):
      out[id(s)] = _or_why(_resources, s, target, figures)
    return [out[id(s)] for s in sources]


def _or_why(compile: Callable[..., KernelResources], *args) -> KernelResources | str:
  """``compile(*args)``, or why it failed (its error's message)."""
  try:
    return compile(*args)
  except RuntimeError as e:
    return str(e).removeprefix("kernel_resources: ")


def compile_kernels(sources: Sequence[KernelSource], target: Arch | str = DEFAULT_ARCH, *,
                    cache_dir: str | None = None) -> list[KernelResources]:
  """:func:`compile_kernel` of each (see :func:`compile_each`).

  Raises:
    RuntimeError: the toolchain is missing, or a kernel did not compile (the first one).
  """
  results = compile_each(sources, target, cache_dir=cache_dir)
  failed = [r for r in results if not isinstance(r, KernelResources)]
  if failed:
    raise RuntimeError(f"kernel_resources: {failed[0]}")
  return results


if __name__ == "__main__":
  _serve(*sys.argv[1:3])
