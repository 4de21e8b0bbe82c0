"""Registers, spills, shared memory and occupancy of the GPU kernels, measured without a GPU.

A Pallas kernel lowered for CUDA (on any machine, under
``jaxfuse.ops.dispatch.target_platform("gpu")``) is a ``stablehlo.custom_call`` whose backend
config holds the kernel's Triton module (as MLIR bytecode), its name, ``num_warps``,
``num_stages`` and grid. :func:`pallas_kernels` reads those modules back with jaxlib's Triton
dialect and prints them as textual TTIR; :func:`compile_kernel` compiles that text with the
``triton`` package for a target arch (``sm_90a`` by default, ``sm_80`` too: a cubin needs no
GPU, only Triton's bundled ``ptxas``) and reads the figures ``ptxas -v`` reports: registers per
thread, spill stores and loads, the stack frame and static shared memory. The dynamic shared
memory is the compiled kernel's ``shared`` metadata. :func:`kernel_resources` does both for a
function and its arguments.

The ``@triton.jit`` kernels called through jax-triton are compiled the same way from their
Python source (:func:`triton_kernels`): an op with ``implementation="triton"`` (or a wrapper)
runs abstractly with a stand-in for ``jax_triton.triton_call`` that records the kernel, the
pointer dtypes, the constexprs, the grid, ``num_warps`` and ``num_stages`` it is called with,
what jax-triton would compile. Under ``TRITON_INTERPRET=1`` (the CPU tests) ``@triton.jit``
makes interpreter objects, Triton's own library included; those kernels are compiled in a
child process that imports triton without it.

The figures are those of the ``triton`` package on this machine. XLA compiles the same Triton
modules with the Triton it bundles, whose passes and ``ptxas`` may differ;
``bash benchmarks/gpu_check.sh kernels`` compares both on a GPU.

Example (with the ``triton`` package and its bundled ``ptxas`` installed)::

  import jax, jax.numpy as jnp
  from jaxfuse.metrics import kernel_resources
  from jaxfuse.ops import rms_norm

  x = jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16)
  for k in kernel_resources.kernel_resources(
      lambda x: rms_norm(x, implementation="pallas"), x):
    print(k.name, k.registers, k.spill_bytes, k.smem_bytes, k.blocks_per_sm, k.within_limits)
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import types
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp

from jaxfuse.ops import dispatch

_TRITON_CALL_TARGET = "__gpu$xla.gpu.triton"


# Targets ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Arch:
  """A GPU generation's per-block limits and per-SM resources (CUDA's occupancy tables).

  Attributes:
    name: the ``ptxas`` target, e.g. ``sm_90a``.
    capability: the compute capability Triton is given (``90`` compiles for ``sm_90a``).
    device: the GPU the per-SM figures are those of.
    regs_per_sm: 32-bit registers per SM.
    max_regs_per_thread: registers one thread may use.
    max_regs_per_block: registers one block may use.
    smem_per_sm: shared memory per SM, bytes.
    max_smem_per_block: shared memory one block may use (static + dynamic), bytes.
    reserved_smem_per_block: shared memory the system takes per resident block, bytes.
    max_threads_per_sm: resident threads per SM.
    max_threads_per_block: threads per block.
    max_blocks_per_sm: resident blocks per SM.
    reg_alloc_unit: registers are allocated per warp in multiples of this.
    smem_alloc_unit: shared memory is allocated per block in multiples of this many bytes.
  """

  name: str
  capability: int
  device: str
  regs_per_sm: int = 65536
  max_regs_per_thread: int = 255
  max_regs_per_block: int = 65536
  smem_per_sm: int = 233472
  max_smem_per_block: int = 232448
  reserved_smem_per_block: int = 1024
  max_threads_per_sm: int = 2048
  max_threads_per_block: int = 1024
  max_blocks_per_sm: int = 32
  reg_alloc_unit: int = 256
  smem_alloc_unit: int = 128


ARCHS: dict[str, Arch] = {
    # H100 / H200: 228 KiB of shared memory per SM, up to 227 KiB per block.
    "sm_90a": Arch("sm_90a", 90, "H100", smem_per_sm=228 * 1024,
                   max_smem_per_block=227 * 1024),
    # A100: 164 KiB per SM, up to 163 KiB per block.
    "sm_80": Arch("sm_80", 80, "A100", smem_per_sm=164 * 1024, max_smem_per_block=163 * 1024),
}
DEFAULT_ARCH = "sm_90a"


def arch(name: str | Arch) -> Arch:
  """The :class:`Arch` called ``name`` (``"sm_90a"`` or ``"sm_80"``; ``"sm_90"`` means
  ``"sm_90a"``)."""
  if isinstance(name, Arch):
    return name
  key = "sm_90a" if name == "sm_90" else name
  if key not in ARCHS:
    raise ValueError(f"kernel_resources: arch must be one of {sorted(ARCHS)}, got {name!r}")
  return ARCHS[key]


# Kernels and their figures ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KernelSource:
  """A kernel to compile: a Pallas kernel's textual TTIR, or a ``@triton.jit`` function.

  Attributes:
    name: the kernel's name (``pallas_call(name=...)`` or the function's).
    kind: ``"pallas"`` or ``"triton"``.
    num_warps: warps per block.
    num_stages: software-pipelining stages.
    grid: the launch grid, three entries.
    ttir: the Triton module as text (Pallas kernels).
    fn: the ``@triton.jit`` function (Triton kernels).
    signature: argument name -> Triton type (``"*fp32"``, ``"constexpr"``), Triton kernels.
    constexprs: argument name -> value of each compile-time constant, Triton kernels.
    launches: how many launches of this very kernel the function makes.
    fp_fusion: whether multiplies and adds may fuse (jax-triton's ``enable_fp_fusion``).
    error: why the module cannot be compiled, when the one the lowering wrote does not
      verify (XLA would reject it on a GPU too); ``ttir`` is then None.
  """

  name: str
  kind: str
  num_warps: int
  num_stages: int
  grid: tuple[int, ...]
  ttir: str | None = None
  fn: object = None
  signature: tuple[tuple[str, str], ...] = ()
  constexprs: tuple[tuple[str, object], ...] = ()
  launches: int = 1
  error: str | None = None
  fp_fusion: bool = True

  def key(self) -> str:
    """What makes two launches compile to the same binary."""
    if self.ttir is not None or self.error is not None:
      body = self.ttir or self.error
    else:
      body = f"{getattr(self.fn, '__qualname__', self.fn)}{self.signature}{self.constexprs}"
    digest = hashlib.sha256(body.encode()).hexdigest()[:16]
    return f"{self.kind}:{self.name}:{self.num_warps}:{self.num_stages}:{digest}"


@dataclasses.dataclass(frozen=True)
class KernelResources:
  """What one kernel takes of an SM, compiled for one arch.

  Attributes:
    name: the kernel's name.
    kind: ``"pallas"`` or ``"triton"``.
    arch: the target it was compiled for (``sm_90a``).
    num_warps: warps per block (threads = 32 x warps).
    num_stages: software-pipelining stages.
    grid: the launch grid.
    registers: registers per thread.
    spill_stores: bytes of registers spilled to local memory per thread, stored.
    spill_loads: bytes loaded back.
    stack_bytes: the stack frame per thread.
    dynamic_smem: dynamic shared memory per block (Triton's ``shared``), bytes.
    static_smem: static shared memory per block (from ``ptxas``), bytes.
    blocks_per_sm: resident blocks per SM that registers, shared memory, threads and the
      block limit allow (0: the kernel cannot launch).
    limited_by: which of ``registers``, ``shared memory``, ``threads`` and ``blocks`` sets
      ``blocks_per_sm``.
    problems: the limits the kernel breaks (empty when it is within them).
    launches: launches of this very kernel in the function measured.
  """

  name: str
  kind: str
  arch: str
  num_warps: int
  num_stages: int
  grid: tuple[int, ...]
  registers: int
  spill_stores: int
  spill_loads: int
  stack_bytes: int
  dynamic_smem: int
  static_smem: int
  blocks_per_sm: int
  limited_by: str
  problems: tuple[str, ...] = ()
  launches: int = 1

  @property
  def threads(self) -> int:
    return 32 * self.num_warps

  @property
  def spill_bytes(self) -> int:
    """Spill stores + spill loads, bytes per thread."""
    return self.spill_stores + self.spill_loads

  @property
  def smem_bytes(self) -> int:
    """Dynamic + static shared memory per block."""
    return self.dynamic_smem + self.static_smem

  @property
  def within_limits(self) -> bool:
    return not self.problems

  @property
  def occupancy(self) -> float:
    """Resident warps over the SM's maximum (``blocks_per_sm`` x warps / 64 on sm_90a)."""
    return self.blocks_per_sm * self.num_warps * 32 / arch(self.arch).max_threads_per_sm

  def as_dict(self) -> dict:
    return {**dataclasses.asdict(self), "spill_bytes": self.spill_bytes,
            "smem_bytes": self.smem_bytes, "within_limits": self.within_limits,
            "occupancy": self.occupancy}


def _round_up(n: int, unit: int) -> int:
  return -(-n // unit) * unit


def occupancy(target: Arch | str, *, registers: int, num_warps: int, smem_bytes: int
              ) -> tuple[int, str]:
  """``(blocks_per_sm, limited_by)``: resident blocks per SM, as CUDA's occupancy calculator
  counts them (registers allocated per warp in units of 256, shared memory per block rounded
  up to 128 bytes plus the 1 KiB the system reserves).

  Example:
    >>> occupancy("sm_90a", registers=128, num_warps=4, smem_bytes=65536)
    (3, 'shared memory')
  """
  target = arch(target)
  threads = 32 * num_warps
  limits = {"blocks": target.max_blocks_per_sm,
            "threads": target.max_threads_per_sm // threads if threads else 0}
  if registers:
    per_warp = _round_up(registers * 32, target.reg_alloc_unit)
    limits["registers"] = (target.regs_per_sm // per_warp) // num_warps
  per_block = _round_up(smem_bytes, target.smem_alloc_unit) + target.reserved_smem_per_block
  limits["shared memory"] = target.smem_per_sm // per_block
  limited_by = min(limits, key=lambda k: (limits[k], k != "registers"))
  return limits[limited_by], limited_by


def _problems(target: Arch, *, registers: int, num_warps: int, smem_bytes: int,
              blocks: int) -> tuple[str, ...]:
  threads = 32 * num_warps
  out = []
  if smem_bytes > target.max_smem_per_block:
    out.append(f"shared memory {smem_bytes} B > {target.max_smem_per_block} B per block")
  if registers > target.max_regs_per_thread:
    out.append(f"{registers} registers > {target.max_regs_per_thread} per thread")
  if registers * threads > target.max_regs_per_block:
    out.append(f"{registers} registers x {threads} threads > {target.max_regs_per_block} "
               f"per block")
  if threads > target.max_threads_per_block:
    out.append(f"{threads} threads > {target.max_threads_per_block} per block")
  if blocks < 1 and not out:
    out.append("no block fits on an SM")
  return tuple(out)


def resources_of(source: KernelSource, target: Arch | str, *, registers: int, spill_stores: int,
                 spill_loads: int, stack_bytes: int, dynamic_smem: int,
                 static_smem: int) -> KernelResources:
  """The :class:`KernelResources` of a kernel from what ``ptxas`` and Triton report: the
  occupancy and the limits are worked out here."""
  target = arch(target)
  smem = dynamic_smem + static_smem
  blocks, limited_by = occupancy(target, registers=registers, num_warps=source.num_warps,
                                 smem_bytes=smem)
  return KernelResources(
      name=source.name, kind=source.kind, arch=target.name, num_warps=source.num_warps,
      num_stages=source.num_stages, grid=tuple(source.grid), registers=registers,
      spill_stores=spill_stores, spill_loads=spill_loads, stack_bytes=stack_bytes,
      dynamic_smem=dynamic_smem, static_smem=static_smem, blocks_per_sm=blocks,
      limited_by=limited_by,
      problems=_problems(target, registers=registers, num_warps=source.num_warps,
                         smem_bytes=smem, blocks=blocks),
      launches=source.launches)


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
    path = _ptxas_path(target)
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


# Pallas kernels: lowering and extraction ----------------------------------------------------------


def lower_for_cuda(f: Callable, *args, **kwargs):
  """``jax.jit(f)`` lowered for CUDA with the ops traced as on a GPU (Pallas through Triton);
  ``args`` may be arrays or ``jax.ShapeDtypeStruct``s. Nothing runs."""
  with dispatch.target_platform("gpu"):
    return jax.jit(f).trace(*args, **kwargs).lower(lowering_platforms=("cuda",))


def _ir():
  from jax._src.interpreters import mlir as jax_mlir
  from jax._src.lib import triton as jax_triton_lib
  from jax._src.lib.mlir import ir

  context = jax_mlir.make_ir_context()
  jax_triton_lib.dialect.register_dialect(context)
  return ir, context


def kernels_in_hlo(hlo_text: str) -> list[KernelSource]:
  """The Pallas (Triton) kernels of lowered StableHLO text, one per distinct kernel, in the
  order they are first launched."""
  ir, context = _ir()
  found: dict[str, KernelSource] = {}
  with context:
    module = ir.Module.parse(hlo_text)
    calls = []

    def visit(op):
      if op.name == "stablehlo.custom_call":
        calls.append(op)
      return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    for call in calls:
      target = ir.StringAttr(call.attributes["call_target_name"]).value
      if target != _TRITON_CALL_TARGET:
        continue
      config = ir.DictAttr(call.attributes["mhlo.backend_config"])

      def integer(key, config=config):
        return ir.IntegerAttr(config[key]).value

      bytecode = ir.StringAttr(config["ir"]).value_bytes
      ttir = error = None
      try:
        ttir = ir.Module.parse(bytecode).operation.get_asm(enable_debug_info=False)
      except ir.MLIRError as e:  # Pallas writes the bytecode without verifying it
        error = _first_error(e)
      source = KernelSource(
          name=ir.StringAttr(config["name"]).value, kind="pallas",
          num_warps=integer("num_warps"), num_stages=integer("num_stages"),
          grid=(integer("grid_x"), integer("grid_y"), integer("grid_z")), ttir=ttir,
          error=error)
      key = source.key()
      if key in found:
        found[key] = dataclasses.replace(found[key], launches=found[key].launches + 1)
      else:
        found[key] = source
  return list(found.values())


def _first_error(e) -> str:
  """The verifier's complaint, without the location chain and the dump of the operation."""
  diagnostics = getattr(e, "error_diagnostics", None) or []
  text = diagnostics[0].message if diagnostics else str(e)
  return "the Triton module does not verify: " + " ".join(text.split())[:300]


def pallas_kernels(f: Callable, *args, **kwargs) -> list[KernelSource]:
  """The Pallas kernels ``f(*args)`` launches on a GPU, lowered on this machine."""
  return kernels_in_hlo(lower_for_cuda(f, *args, **kwargs).as_text())


# Triton kernels: the calls their jax-triton wrappers make -----------------------------------------

_TRITON_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64",
                 "int32": "i32", "int64": "i64", "int8": "i8", "uint8": "u8", "int16": "i16",
                 "uint32": "u32", "bool": "i1"}


def _pointer_type(x) -> str:
  return "*" + _TRITON_TYPES[jnp.dtype(x.dtype).name]


# Keyword arguments of ``jax_triton.triton_call`` (0.3) that are not the kernel's constexprs.
_TRITON_CALL_OPTIONS = ("name", "custom_call_target_name", "num_ctas", "compute_capability",
                        "input_output_aliases", "zeroed_outputs", "debug", "serialized_metadata")


@contextlib.contextmanager
def recording_triton_calls() -> Iterator[list[KernelSource]]:
  """Inside the block, ops and wrappers call a stand-in for ``jax_triton.triton_call`` that
  records each call as a :class:`KernelSource` (and returns zeros of its ``out_shape``), and
  ``implementation="triton"`` resolves as on a GPU machine with jax-triton, so that the Triton
  paths trace on any machine (best under ``jax.eval_shape`` and
  ``dispatch.target_platform("gpu")``). Signature, constexprs, ``num_warps`` (default 4) and
  ``num_stages`` (default 3) follow jax-triton 0.3: pointers for the array arguments then the
  outputs, every other keyword argument a constexpr."""
  calls: list[KernelSource] = []

  def triton_call(*args, kernel, out_shape, grid, num_warps=None, num_stages=None,
                  enable_fp_fusion=True, **params):
    for option in _TRITON_CALL_OPTIONS:
      params.pop(option, None)
    outs = list(out_shape) if isinstance(out_shape, (list, tuple)) else [out_shape]
    names = list(kernel.arg_names)
    pointers = [_pointer_type(x) for x in (*args, *outs)]
    signature = {names[i]: t for i, t in enumerate(pointers)}
    signature.update({name: "constexpr" for name in params})
    grid = tuple(grid(params) if callable(grid) else
                 (grid,) if isinstance(grid, int) else grid)
    calls.append(KernelSource(
        name=kernel.__name__, kind="triton", num_warps=4 if num_warps is None else num_warps,
        num_stages=3 if num_stages is None else num_stages,
        grid=grid + (1,) * (3 - len(grid)), fn=kernel,
        signature=tuple(signature.items()), constexprs=tuple(params.items()),
        fp_fusion=bool(enable_fp_fusion)))
    zeros = [jnp.zeros(o.shape, o.dtype) for o in outs]
    return zeros if isinstance(out_shape, (list, tuple)) else zeros[0]

  stand_in = types.ModuleType("jax_triton")
  stand_in.triton_call = triton_call
  previous = sys.modules.get("jax_triton")
  importable = dispatch.jax_triton_importable
  sys.modules["jax_triton"] = stand_in
  dispatch.jax_triton_importable = lambda: True
  try:
    yield calls
  finally:
    dispatch.jax_triton_importable = importable
    if previous is None:
      sys.modules.pop("jax_triton", None)
    else:
      sys.modules["jax_triton"] = previous


def triton_kernels(f: Callable, *args, **kwargs) -> list[KernelSource]:
  """The ``@triton.jit`` kernels ``f(*args)`` launches through jax-triton on a GPU: an op
  with ``implementation="triton"`` (its gradient too, under ``jax.grad``) or a wrapper of
  ``jaxfuse.kernels.triton``, with the constants it passes; ``args`` may be arrays or
  ``jax.ShapeDtypeStruct``s. Nothing runs.

  Example::

    x = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
    triton_kernels(jax.grad(lambda x: rms_norm(x, implementation="triton").sum()), x)
  """
  with dispatch.target_platform("gpu"), recording_triton_calls() as calls:
    jax.eval_shape(lambda *a: f(*a, **kwargs), *args)
  merged: dict[str, KernelSource] = {}
  for c in calls:
    key = c.key()
    merged[key] = (dataclasses.replace(merged[key], launches=merged[key].launches + 1)
                   if key in merged else c)
  return list(merged.values())


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


def _ptxas_path(target: Arch) -> str:
  """The ptxas Triton compiles ``target`` with (newer Triton picks one per arch)."""
  from triton.backends.nvidia import compiler as nvidia

  try:
    return nvidia.get_ptxas(target.capability).path
  except TypeError:  # Triton before 3.5 has one ptxas
    return nvidia.get_ptxas().path


def _ptxas_log(ptx: str, target: Arch) -> str:
  """``ptxas -v`` of ``ptx`` with the flags Triton compiles with."""
  ptxas = _ptxas_path(target)
  with tempfile.TemporaryDirectory(prefix="jaxfuse-ptxas-") as tmp:
    src = os.path.join(tmp, "kernel.ptx")
    with open(src, "w") as f:
      f.write(ptx)
    done = subprocess.run(
        [ptxas, "-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name={target.name}", src,
         "-o", os.path.join(tmp, "kernel.cubin")], capture_output=True, text=True, check=True)
  return done.stdout + done.stderr


def _compile(source: KernelSource, target: Arch):
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
  compiled, log = _compile(source, target)
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
  (``python -m jaxfuse.metrics.kernel_resources``), while this one goes on."""

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


def _figures_elsewhere(sources: Sequence[KernelSource], target: Arch) -> list:
  """:func:`_figures` of Triton kernels in another process (see :class:`_Elsewhere`)."""
  return _Elsewhere(sources, target).result()


def _serve(request_path: str, answer_path: str) -> None:
  """The subprocess of :func:`_figures_elsewhere`: compiles the kernels a request names."""
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


def _check(source: KernelSource, target: Arch) -> None:
  missing = missing_toolchain(target)
  if missing:
    raise RuntimeError(f"kernel_resources: cannot compile {source.name}: missing {missing}")
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
    return _resources(source, target, _figures_elsewhere([source], target)[0])
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
  missing = missing_toolchain(target)
  if missing:
    raise RuntimeError(f"kernel_resources: cannot compile kernels for {target.name}: missing "
                       f"{missing}")
  with triton_cache(cache_dir):
    elsewhere = [s for s in sources if s.error is None and _interpreted(s)]
    started = _Elsewhere(elsewhere, target) if elsewhere else None  # runs meanwhile
    out: dict[int, KernelResources | str] = {}
    for s in sources:
      if any(s is e for e in elsewhere):
        continue
      try:
        out[id(s)] = compile_kernel(s, target)
      except RuntimeError as e:
        out[id(s)] = str(e).removeprefix("kernel_resources: ")
    for s, figures in zip(elsewhere, started.result() if started else []):
      try:
        out[id(s)] = _resources(s, target, figures)
      except RuntimeError as e:
        out[id(s)] = str(e).removeprefix("kernel_resources: ")
    return [out[id(s)] for s in sources]


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


def kernel_resources(f: Callable, *args, arch: Arch | str = DEFAULT_ARCH,
                     cache_dir: str | None = None, **kwargs) -> list[KernelResources]:
  """Registers, spills, shared memory and occupancy of every Pallas kernel ``f(*args)``
  launches on a GPU, compiled here for ``arch`` (``"sm_90a"`` or ``"sm_80"``).

  Args:
    f: a function of JAX arrays (its ops traced as on a GPU: ``implementation=None`` picks
      what it would pick there).
    *args: arrays or ``jax.ShapeDtypeStruct``s.
    arch: the target.
    cache_dir: Triton's compile cache (default: a new temporary directory).
    **kwargs: keyword arguments of ``f``.

  Returns:
    One :class:`KernelResources` per distinct kernel, in launch order.
  """
  return compile_kernels(pallas_kernels(f, *args, **kwargs), arch, cache_dir=cache_dir)


def summary(resources: Sequence[KernelResources]) -> str:
  """A plain-text table of the figures, one kernel a line."""
  lines = [(f"{'kernel':<28} {'arch':<7} {'warps':>5} {'stages':>6} {'regs':>5} {'spill B':>8} "
            f"{'stack B':>8} {'smem B':>8} {'blk/SM':>6}  limits")]
  for r in resources:
    lines.append(f"{r.name:<28} {r.arch:<7} {r.num_warps:>5} {r.num_stages:>6} "
                 f"{r.registers:>5} {r.spill_bytes:>8} {r.stack_bytes:>8} {r.smem_bytes:>8} "
                 f"{r.blocks_per_sm:>6}  {'ok' if r.within_limits else '; '.join(r.problems)}")
  return "\n".join(lines)


if __name__ == "__main__":
  _serve(*sys.argv[1:3])
