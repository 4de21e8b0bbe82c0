"""What a GPU kernel takes of a streaming multiprocessor, and how many of its blocks fit there.

:class:`Arch` holds a GPU generation's per-block limits and per-SM resources (CUDA's occupancy
tables: ``sm_90a`` for H100 / H200, ``sm_80`` for A100); :func:`occupancy` counts the resident
blocks per SM that registers, shared memory, threads and the block limit allow, as CUDA's
occupancy calculator does; :func:`resources_of` turns what ``ptxas`` and Triton report for a
compiled kernel into its :class:`KernelResources`. Part of
:mod:`jaxfuse.metrics.kernel_resources`, which compiles the kernels.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
  from jaxfuse.metrics.gpu_kernels import KernelSource


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
