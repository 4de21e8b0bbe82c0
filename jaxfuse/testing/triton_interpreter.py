"""Running jaxfuse's ``@triton.jit`` kernels on a CPU, for the Triton tests.

Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest before triton is imported) runs a
kernel program by program in numpy, on torch CPU tensors. Two of its shortcuts differ from a
GPU, and :func:`gpu_numerics` puts the GPU's behaviour back while a test runs:

- float32 -> bfloat16 casts (and stores) truncate; a GPU rounds to nearest even;
- ``tl.dot`` of bfloat16 tiles multiplies their raw 16-bit patterns as integers; a GPU's tensor
  cores multiply the values (exactly, into float32).

:func:`jax_triton_stand_in` replaces ``jax_triton`` with a module whose ``triton_call`` records
every launch (kernel, grid, constexprs, shapes) and, unless told not to, runs the kernel in the
interpreter through ``jax.pure_callback``, so that the jax-triton wrappers, and the ops'
``implementation="triton"`` under :func:`triton_ops`, run end to end on a CPU (also under
``jit`` and ``grad``). Outputs start as NaN, so an element a kernel fails to write shows. The
benchmark suites use the same stand-in for their Triton rows on a CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import threading
import types
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jaxfuse.ops import dispatch

_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64, "int8": torch.int8, "int32": torch.int32,
          "int64": torch.int64}


@contextlib.contextmanager
def gpu_numerics() -> Iterator[None]:
  """Inside the block, the interpreter rounds float32 -> bfloat16 to nearest even and takes
  ``tl.dot`` of bfloat16 tiles by value, as a GPU does."""
  import triton.language as tl
  from triton.runtime import interpreter

  builder = interpreter.interpreter_builder
  if "create_dot" in vars(builder):  # already active: nothing more to do
    yield
    return
  original_trunc = type(builder).create_fp_trunc
  original_dot = type(builder).create_dot

  def fp_trunc(src, dst_type):
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
      rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
      return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16),
                                      tl.bfloat16)
    return original_trunc(builder, src, dst_type)

  def as_float32(handle):
    if handle.dtype.scalar == tl.bfloat16:
      bits = np.asarray(handle.data, np.uint16).astype(np.uint32) << 16
      return interpreter.TensorHandle(bits.view(np.float32), tl.float32)
    return handle

  def dot(a, b, d, input_precision, max_num_imprecise_acc):
    return original_dot(builder, as_float32(a), as_float32(b), d, input_precision,
                        max_num_imprecise_acc)

  builder.create_fp_trunc = fp_trunc
  builder.create_dot = dot
  try:
    yield
  finally:
    del builder.create_fp_trunc
    del builder.create_dot


@dataclasses.dataclass
class Launch:
  """One ``jax_triton.triton_call``: what jax-triton would compile and launch."""

  kernel: str
  grid: tuple[int, ...]
  num_warps: int | None
  num_stages: int | None
  constexprs: dict
  inputs: list[jax.ShapeDtypeStruct]
  outputs: list[jax.ShapeDtypeStruct]


def to_torch(x: np.ndarray) -> torch.Tensor:
  """A torch CPU tensor of a numpy array (bfloat16 through float32, exactly)."""
  x = np.asarray(x)
  if x.dtype == jnp.bfloat16:
    return torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)
  return torch.from_numpy(np.ascontiguousarray(x).copy())


def to_numpy(t: torch.Tensor, dtype) -> np.ndarray:
  """A numpy array of ``dtype`` from a torch tensor (bfloat16 through float32, exactly)."""
  if t.dtype == torch.bfloat16:
    return t.to(torch.float32).numpy().astype(jnp.bfloat16)
  return t.numpy().astype(dtype)


# The interpreter keeps its state (the program being run, the patches of gpu_numerics) in one
# module-level builder: launches from callbacks XLA runs side by side take turns.
_INTERPRETER = threading.Lock()


def run_kernel(kernel, grid, constexprs, inputs, outputs):
  """Launches ``kernel`` in the interpreter on numpy ``inputs`` and new NaN-filled ``outputs``
  (shape-dtype structs), as jax-triton would: input pointers, then output pointers, then the
  constexprs by name. Returns the outputs as numpy arrays."""
  args = [to_torch(x) for x in inputs]
  outs = []
  for o in outputs:
    dtype = _TORCH[jnp.dtype(o.dtype).name]
    fill = float("nan") if dtype.is_floating_point else 0
    outs.append(torch.full(tuple(o.shape), fill, dtype=dtype))
  with _INTERPRETER, gpu_numerics():
    kernel[tuple(grid)](*args, *outs, **constexprs)
  return [to_numpy(t, o.dtype) for t, o in zip(outs, outputs)]


@contextlib.contextmanager
def jax_triton_stand_in(run: bool = True) -> Iterator[list[Launch]]:
  """``import jax_triton`` gives a stand-in inside the block; yields the launches it records.

  Args:
    run: run each kernel in the interpreter (through ``jax.pure_callback``); otherwise
      return zeros of ``out_shape``.
  """
  launches: list[Launch] = []

  def triton_call(*args, kernel, out_shape, grid, num_warps=None, num_stages=None, **params):
    listed = isinstance(out_shape, (list, tuple))
    outs = list(out_shape) if listed else [out_shape]
    grid = tuple(grid(params) if callable(grid) else (grid,) if isinstance(grid, int) else grid)
    launches.append(Launch(
        kernel=kernel.__name__, grid=grid, num_warps=num_warps, num_stages=num_stages,
        constexprs=dict(params), inputs=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args],
        outputs=[jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs]))
    if run:
      callback = functools.partial(run_kernel, kernel, grid, params, outputs=outs)
      results = jax.pure_callback(lambda *xs: callback(xs), outs, *args)
    else:
      results = [jnp.zeros(o.shape, o.dtype) for o in outs]
    return list(results) if listed else results[0]

  stand_in = types.ModuleType("jax_triton")
  stand_in.triton_call = triton_call
  previous = sys.modules.get("jax_triton")
  sys.modules["jax_triton"] = stand_in
  try:
    yield launches
  finally:
    if previous is None:
      sys.modules.pop("jax_triton", None)
    else:
      sys.modules["jax_triton"] = previous


@contextlib.contextmanager
def triton_ops(monkeypatch=None, run: bool = True) -> Iterator[list[Launch]]:
  """Ops traced inside the block take ``implementation="triton"`` as on a GPU with jax-triton,
  and launch their kernels through :func:`jax_triton_stand_in`.

  Args:
    monkeypatch: pytest's fixture, which undoes the patch of
      :func:`jaxfuse.ops.dispatch.jax_triton_importable` after the test; without it (the
      benchmarks) the patch is undone when the block ends.
    run: run each kernel in the interpreter; otherwise record the launches and return zeros.
  """
  original = dispatch.jax_triton_importable
  if monkeypatch is not None:
    monkeypatch.setattr(dispatch, "jax_triton_importable", lambda: True)
  else:
    dispatch.jax_triton_importable = lambda: True
  try:
    with dispatch.target_platform("gpu"), jax_triton_stand_in(run) as launches:
      yield launches
  finally:
    if monkeypatch is None:
      dispatch.jax_triton_importable = original
