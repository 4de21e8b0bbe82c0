"""Bytes a raw Triton kernel's loads and stores touch, counted while Triton's interpreter runs it.

Under ``TRITON_INTERPRET=1`` (what the CPU tests use) Triton runs a ``@triton.jit`` kernel program
by program in numpy, and every ``tl.load`` and ``tl.store`` goes through the interpreter's
``create_masked_load`` / ``create_masked_store``. Inside :func:`counting` these are wrapped:
each one adds the number of elements its mask keeps times the element size, and every launch
gets its own record. The figure is the same quantity as :mod:`jaxfuse.metrics.traffic` derives
for Pallas kernels: what the kernel body asks for, before any cache.

Example (with ``TRITON_INTERPRET=1`` set before triton is imported)::

  import torch
  from jaxfuse.ops import base
  from jaxfuse.metrics import triton_traffic

  kernels = base.REGISTRY["add_act"].module("triton")   # its Triton kernel module

  a, out = torch.ones(1000), torch.empty(1000)
  with triton_traffic.counting() as counted:
    kernels.add_act_fwd_kernel[kernels.grid_for(1000)](a, a, out, N=1000,
                                                       BLOCK=kernels.BLOCK, ACT="relu")
  [(launch.name, launch.reads, launch.writes) for launch in counted.launches]
  # [('add_act_fwd_kernel', 8000, 4000)]
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import numpy as np


@dataclasses.dataclass
class LaunchTraffic:
  """One kernel launch: its name, grid and the bytes its loads read and its stores wrote."""

  name: str
  grid: tuple[int, ...]
  reads: int = 0
  writes: int = 0

  @property
  def bytes(self) -> int:
    return self.reads + self.writes


@dataclasses.dataclass
class TritonTraffic:
  """The launches counted inside one :func:`counting` block, in order."""

  launches: list[LaunchTraffic] = dataclasses.field(default_factory=list)

  @property
  def reads(self) -> int:
    return sum(launch.reads for launch in self.launches)

  @property
  def writes(self) -> int:
    return sum(launch.writes for launch in self.launches)

  @property
  def bytes(self) -> int:
    """Bytes read + written by every launch."""
    return self.reads + self.writes


def _itemsize(pointers) -> int:
  return max(1, pointers.get_element_ty().primitive_bitwidth // 8)


def _kept(pointers, mask) -> int:
  data = np.asarray(mask.data, dtype=bool)
  if data.shape != np.shape(pointers.data):
    data = np.broadcast_to(data, np.shape(pointers.data))
  return int(np.count_nonzero(data))


@contextlib.contextmanager
def counting() -> Iterator[TritonTraffic]:
  """Counts the bytes Triton kernels launched inside the block load and store.

  The kernels must run under Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is
  imported, torch CPU tensors); compiled launches do not pass through it.

  Yields:
    A :class:`TritonTraffic` that fills in as kernels run.

  Raises:
    RuntimeError: if counting is already active (blocks do not nest).
  """
  from triton.runtime import interpreter

  builder = interpreter.interpreter_builder
  if "create_masked_load" in vars(builder):
    raise RuntimeError("triton_traffic.counting() blocks do not nest")
  counted = TritonTraffic()
  executor = interpreter.GridExecutor
  original_call = executor.__call__
  original_load = type(builder).create_masked_load
  original_store = type(builder).create_masked_store

  def current() -> LaunchTraffic:
    if not counted.launches:  # a load outside a launch: should not happen, but count it
      counted.launches.append(LaunchTraffic("?", ()))
    return counted.launches[-1]

  def call(self, *args, **kwargs):
    grid = self.grid if not callable(self.grid) else ()
    counted.launches.append(LaunchTraffic(getattr(self.fn, "__name__", "kernel"), tuple(grid)))
    return original_call(self, *args, **kwargs)

  def masked_load(pointers, mask, other, cache_policy, is_volatile):
    current().reads += _kept(pointers, mask) * _itemsize(pointers)
    return original_load(builder, pointers, mask, other, cache_policy, is_volatile)

  def masked_store(pointers, value, mask, cache_policy):
    current().writes += _kept(pointers, mask) * _itemsize(pointers)
    return original_store(builder, pointers, value, mask, cache_policy)

  executor.__call__ = call
  builder.create_masked_load = masked_load
  builder.create_masked_store = masked_store
  try:
    yield counted
  finally:
    executor.__call__ = original_call
    del builder.create_masked_load
    del builder.create_masked_store
