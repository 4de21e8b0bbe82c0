"""Every GPU kernel compiles for sm_90a on this machine, within the H100's limits, and its
bfloat16 and float16 configurations spill no registers.

The kernels are compiled by :mod:`jaxfuse.metrics.kernel_resources` (the ``triton`` package and
its bundled ``ptxas``; no GPU) in the configurations of ``benchmarks.suites.kernels.core()``:
every Pallas kernel and every ``@triton.jit`` kernel an op of ``jaxfuse.ops`` launches, forward
and backward, at the tiles, warps and stages the heuristics choose on a GPU.
``python -m benchmarks kernels`` reports the same figures over more configurations (float32,
every head dim, the widest rows). The Pallas attention kernels are also lowered with every
kind of mask, whose loop bounds differ, and their Triton modules must verify.
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
  # Modules that define a launched kernel (``*_kernel``), not only jitted helpers.
  jitted = {p.stem for p in (ROOT / "kernels" / "triton").glob("*.py")
            if re.search(r"@triton\.jit\ndef \w+_kernel\(", p.read_text(encoding="utf-8"))}
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


# Every mask the Pallas attention kernels take: (label, attention keyword arguments, with the
# [batch] kv_lengths, with [batch, seq] segment ids). Each changes the kernels' loop bounds.
MASKS = [
    ("non-causal", {}, False, False),
    ("causal", {"causal": True}, False, False),
    ("bottom-right window softcap", {"causal": "bottom_right", "sliding_window": 100,
                                     "logit_softcap": 30.0}, True, False),
    ("non-causal kv_lengths segments", {}, True, True),
]


@needs_toolchain
@pytest.mark.parametrize("label,kwargs,lengths,segments", MASKS, ids=[m[0] for m in MASKS])
def test_attention_modules_verify_with_every_mask(label, kwargs, lengths, segments):
  """The Triton modules of the Pallas attention kernels verify with every mask (bfloat16,
  grouped-query heads, forward and backward; lowered only). The loop bounds stay int32: a
  select of two Python ints lowered to an i1 bound in the non-causal dk/dv kernel once."""
  import jax
  import jax.numpy as jnp

  from jaxfuse import ops

  b, t, d = 2, 256, 64
  q = jax.ShapeDtypeStruct((b, t, 4, d), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((b, t, 2, d), jnp.bfloat16)
  extra = ([jax.ShapeDtypeStruct((b,), jnp.int32)] if lengths else []) + (
      [jax.ShapeDtypeStruct((b, t), jnp.int32)] if segments else [])

  def loss(q, k, v, *rest):
    rest = list(rest)
    opts = dict(kwargs, kv_lengths=rest.pop(0) if lengths else None,
                segment_ids=rest.pop(0) if segments else None)
    return jnp.sum(ops.attention(q, k, v, implementation="pallas", **opts).astype(jnp.float32))

  found = kr.pallas_kernels(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv, *extra)
  assert {s.name for s in found} >= {"attention_fwd_res", "attention_bwd_dq",
                                     "attention_bwd_dkdv"}
  errors = [f"{s.name}: {s.error}" for s in found if s.error is not None]
  assert not errors, f"{label}:\n" + "\n".join(errors)
  if label == "non-causal":  # the kernel whose module did not verify compiles, without spills
    (r,) = kr.compile_kernels([s for s in found if s.name == "attention_bwd_dkdv"], ARCH)
    assert r.within_limits and not r.spill_bytes, _describe(label, r)


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


def test_spills_are_noted_with_their_reason():
  from benchmarks.suites import kernels as suite

  source = kr.KernelSource(name="norm_bwd_kernel", kind="triton", num_warps=16, num_stages=3,
                           grid=(1024, 1, 1))
  r = kr.resources_of(source, ARCH, registers=128, spill_stores=28, spill_loads=28,
                      stack_bytes=32, dynamic_smem=64, static_smem=0)
  config = suite.Config("norm", "add_layer_norm H=8192", "float32", "triton", build=None)
  note = suite.record(config, "norm_bwd_kernel add_layer_norm", r, ARCH, "cpu").note
  assert "spills 28 B stored + 28 B loaded a thread (float32: a whole float32 row" in note
  assert suite.spill_note("norm_bwd_kernel", "bfloat16", r) == (
      "spills 28 B stored + 28 B loaded a thread")


def test_kernel_sets_come_from_the_registry():
  """The report's kernel implementations of an op are its registry entry's, and every kernel
  kind has a way to find its kernels."""
  from benchmarks.suites import kernels as suite
  from jaxfuse.ops import base, dispatch

  assert set(kr.FINDERS) == {name for name, kind in dispatch.KINDS.items()
                             if kind.package and "gpu" in kind.platforms}
  for name, op in base.REGISTRY.items():
    assert suite.implementations(name) == tuple(k for k in op.kinds if k in kr.FINDERS), name
  with pytest.raises(ValueError, match="kernels_of: implementation must be one of"):
    kr.kernels_of("xla", lambda: None)


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
