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

This module gathers the pieces: finding the kernels (:mod:`jaxfuse.metrics.gpu_kernels`),
compiling them (:mod:`jaxfuse.metrics.kernel_compile`) and what they take of an SM
(:mod:`jaxfuse.metrics.gpu_occupancy`).

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

from collections.abc import Callable, Sequence

from jaxfuse.metrics.gpu_kernels import (FINDERS, KernelSource, gpu_kinds, kernels_in_hlo,
                                         kernels_of, lower_for_cuda, pallas_kernels, recording_triton_calls,
                                         triton_kernels)
from jaxfuse.metrics.gpu_occupancy import (ARCHS, DEFAULT_ARCH, Arch, KernelResources, arch,
                                           occupancy, resources_of)
from jaxfuse.metrics.kernel_compile import (compile_each, compile_kernel, compile_kernels,
                                            missing_toolchain, parse_ptxas_log, ptxas_path,
                                            triton_cache, triton_compile)

__all__ = [
    "ARCHS",
    "DEFAULT_ARCH",
    "FINDERS",
    "Arch",
    "KernelResources",
    "KernelSource",
    "arch",
    "compile_each",
    "compile_kernel",
    "compile_kernels",
    "gpu_kinds",
    "kernel_resources",
    "kernels_in_hlo",
    "kernels_of",
    "lower_for_cuda",
    "missing_toolchain",
    "occupancy",
    "pallas_kernels",
    "parse_ptxas_log",
    "ptxas_path",
    "recording_triton_calls",
    "resources_of",
    "summary",
    "triton_cache",
    "triton_compile",
    "triton_kernels",
]


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
