"""Every GPU kernel compiles for sm_90a on this machine, within the H100's limits, and its
bfloat16 and float16 configurations spill no registers.

The kernels are compiled by :mod:`jaxfuse.metrics.kernel_resources` (the ``triton`` package and
its bundled ``ptxas``; no GPU) in the configurations of ``benchmarks.suites.kernels.core()``:
every Pallas kernel and every ``@triton.jit`` kernel an op of ``jaxfuse.ops`` launches, forward
and backward, at the tiles, warps and stages the heuristics choose on a GPU.
``python -m benchmarks kernels`` reports the same figures over more configurations (float32,
every head dim, the widest rows).
"""

from __future__ import annotations

import pathlib
import re

import pytest

from jaxfuse.metrics import kernel_resources as kr

ARCH = "sm_90a"
ROOT = pathlib.Path(__file__).resolve().parents[1]
MISSING = kr.missing_toolchain(ARCH)
needs_toolchain = pytest.mark.skipif(
    MISSING is not None, reason=f"compiling GPU kernels here needs {MISSING}")

# Kernels whose Triton module does not compile today: (kernel, configuration, dtype) -> why.
# test_known_broken_kernels_compile fails (strict xfail) once they compile.
KNOWN_BROKEN = {
    ("attention_bwd_dkdv", "d=64", "bfloat16"): (
        "non-causal dkdv: `jnp.where(live, nq, 0)` of two Python ints in _query_tiles lowers "
        "through Pallas' Triton lowering to an i1 select, and the loop bound to an i1: the "
        "module does not verify (XLA would reject it on a GPU)"),
}


@pytest.fixture(scope="module")
def compiled():
  """``(config, case, source, resources, error)`` for every kernel of the core set."""
  from benchmarks.suites import kernels as suite

  return suite.compile_all(suite.core(), ARCH)


def _describe(case, r: kr.KernelResources) -> str:
  return (f"{case}: {r.registers} registers, {r.spill_bytes} B spilled, {r.stack_bytes} B stack, "
          f"{r.smem_bytes} B shared memory, {r.blocks_per_sm} blocks/SM")


@needs_toolchain
def test_every_kernel_is_compiled(compiled):
  """The core set reaches every Pallas kernel (by the names jaxfuse.kernels.pallas gives them)
  and a kernel of every module of jaxfuse.kernels.triton."""
  names = {source.name for c, _, source, _, _ in compiled if c.kind == "pallas"}
  modules = {getattr(source.fn, "fn", source.fn).__module__.rsplit(".", 1)[-1]
             for c, _, source, _, _ in compiled if c.kind == "triton"}
  named = {m for p in (ROOT / "kernels" / "pallas").glob("*.py")
           for m in re.findall(r'name="(\w+)"', p.read_text(encoding="utf-8"))}
  jitted = {p.stem for p in (ROOT / "kernels" / "triton").glob("*.py")
            if "@triton.jit" in p.read_text(encoding="utf-8")}
  assert named and jitted
  assert named - names == set(), "Pallas kernels that no core configuration launches"
  assert jitted - modules == set(), "Triton kernel modules that no core configuration reaches"


@needs_toolchain
def test_kernels_compile_for_sm90(compiled):
  failed = [f"{case}: {error}" for _, case, _, _, error in compiled if error is not None]
  assert not failed, "\n".join(failed)


@needs_toolchain
def test_kernels_are_within_the_h100_limits(compiled):
  """At most 227 KiB of shared memory per block, 255 registers per thread, 64K registers per
  block, and at least one block per SM."""
  over = [f"{_describe(case, r)}: {'; '.join(r.problems)}"
          for _, case, _, r, _ in compiled if r is not None and not r.within_limits]
  assert not over, "\n".join(over)


@needs_toolchain
def test_low_precision_kernels_do_not_spill(compiled):
  spilling = [_describe(case, r) for c, case, _, r, _ in compiled
              if r is not None and c.dtype in ("bfloat16", "float16") and r.spill_bytes]
  assert not spilling, "\n".join(spilling)


@needs_toolchain
@pytest.mark.xfail(strict=True, reason="; ".join(KNOWN_BROKEN.values()))
def test_known_broken_kernels_compile():
  """The modules of the kernels in KNOWN_BROKEN verify (lowered only: nothing is compiled)."""
  from benchmarks.suites import kernels as suite

  errors = []
  for kernel, label, dtype in KNOWN_BROKEN:
    d = int(label.split("=")[1].split()[0])
    for config in suite.attention_configs(dtype, d, "causal" in label, "bias" in label):
      if config.kind == "pallas":
        errors += [f"{kernel} {label} {dtype}: {s.error}" for s in suite.sources(config)
                   if s.name == kernel and s.error is not None]
  assert not errors, "\n".join(errors)


# The arithmetic, without a toolchain ---------------------------------------------------------


def test_ptxas_log_is_read_per_function():
  log = """ptxas info    : Compiling entry function 'other' for 'sm_90a'
ptxas info    : Function properties for other
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 0 barriers, 400 bytes cmem[0]
ptxas info    : Compiling entry function 'attention_bwd_dkdv' for 'sm_90a'
ptxas info    : Function properties for attention_bwd_dkdv
    16 bytes stack frame, 284 bytes spill stores, 372 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 1024 bytes smem, 608 bytes cmem[0]"""
  assert kr.parse_ptxas_log(log, "attention_bwd_dkdv") == {
      "registers": 255, "stack_bytes": 16, "spill_stores": 284, "spill_loads": 372,
      "static_smem": 1024}
  assert kr.parse_ptxas_log(log)["registers"] == 40


def test_occupancy_and_limits():
  source = kr.KernelSource(name="k", kind="pallas", num_warps=8, num_stages=2, grid=(1, 1, 1))

  def figures(registers, smem):
    return kr.resources_of(source, "sm_90a", registers=registers, spill_stores=0, spill_loads=0,
                           stack_bytes=0, dynamic_smem=smem, static_smem=0)

  # 8 warps of 128 registers: 32 KiB of the 64K registers -> 2 blocks.
  assert (figures(128, 0).blocks_per_sm, figures(128, 0).limited_by) == (2, "registers")
  # 100 KiB of shared memory (+1 KiB reserved) of 228 KiB -> 2 blocks.
  assert (figures(64, 100 * 1024).blocks_per_sm, figures(64, 100 * 1024).limited_by) == (
      2, "shared memory")
  assert figures(64, 232448).within_limits                   # 227 KiB: the per-block limit
  assert not figures(64, 232449).within_limits
  assert figures(255, 0).within_limits                       # 255 x 256 threads < 64K
  assert kr.arch("sm_80").max_smem_per_block == 163 * 1024
  with pytest.raises(ValueError, match="arch must be one of"):
    kr.arch("sm_70")
