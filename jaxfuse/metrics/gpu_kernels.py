"""The GPU kernels a function launches, found on any machine: what to compile and measure.

A Pallas kernel lowered for CUDA (on any machine, under
``jaxfuse.ops.dispatch.target_platform("gpu")``) is a ``stablehlo.custom_call`` whose backend
config holds the kernel's Triton module (as MLIR bytecode), its name, ``num_warps``,
``num_stages`` and grid. :func:`pallas_kernels` reads those modules back with jaxlib's Triton
dialect and prints them as textual TTIR.

The ``@triton.jit`` kernels called through jax-triton are found by running the function
abstractly with a stand-in for ``jax_triton.triton_call`` that records the kernel, the pointer
dtypes, the constexprs, the grid, ``num_warps`` and ``num_stages`` it is called with, what
jax-triton would compile (:func:`triton_kernels`).

Either gives one :class:`KernelSource` per distinct kernel, with the number of its launches.
Part of :mod:`jaxfuse.metrics.kernel_resources`, which compiles them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import sys
import types
from collections.abc import Callable, Iterable, Iterator

import jax
import jax.numpy as jnp

from jaxfuse.ops import dispatch

_TRITON_CALL_TARGET = "__gpu$xla.gpu.triton"


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


def count_launches(sources: Iterable[KernelSource]) -> list[KernelSource]:
  """One source per distinct kernel (:meth:`KernelSource.key`), in the order of its first
  launch, with ``launches`` the number of times it is launched."""
  merged: dict[str, KernelSource] = {}
  for s in sources:
    key = s.key()
    merged[key] = (dataclasses.replace(merged[key], launches=merged[key].launches + 1)
                   if key in merged else s)
  return list(merged.values())


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
  found: list[KernelSource] = []
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
      found.append(KernelSource(
          name=ir.StringAttr(config["name"]).value, kind="pallas",
          num_warps=integer("num_warps"), num_stages=integer("num_stages"),
          grid=(integer("grid_x"), integer("grid_y"), integer("grid_z")), ttir=ttir,
          error=error))
  return count_launches(found)


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
  return count_launches(calls)


def gpu_kinds(op) -> tuple[str, ...]:
  """The kernel kinds of ``op`` (a :class:`jaxfuse.ops.base.Op`) that compile for GPUs."""
  return tuple(k for k in op.kinds if "gpu" in dispatch.KINDS[k].platforms)


# Each kind of GPU kernel implementation (a kind of ``dispatch.KINDS`` with a kernel package
# that compiles for GPUs), and how the kernels of a call with it are found.
FINDERS: dict[str, Callable[..., list[KernelSource]]] = {
    "pallas": pallas_kernels,
    "triton": triton_kernels,
}


def kernels_of(implementation: str, f: Callable, *args, **kwargs) -> list[KernelSource]:
  """The kernels ``f(*args)`` launches on a GPU, where ``f`` calls ops with
  ``implementation=implementation``: a kernel kind, ``"pallas"`` (:func:`pallas_kernels`) or
  ``"triton"`` (:func:`triton_kernels`). Nothing runs."""
  finder = FINDERS.get(implementation)
  if finder is None:
    raise ValueError(f"kernels_of: implementation must be one of {tuple(FINDERS)}, "
                     f"got {implementation!r}")
  return finder(f, *args, **kwargs)
