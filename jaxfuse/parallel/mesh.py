"""The device mesh: five named axes, from a ``data=2,fsdp=2,tensor=2`` string.

The axes, outermost first (the order of :data:`MESH_AXES`; devices of the innermost axis are
neighbours, so put the most communicating strategy there):

- ``data``: data parallel (the batch; gradients all-reduced). The axis to put across hosts: it
  communicates once a step.
- ``fsdp``: the batch, and every parameter and optimizer state sharded (all-gathered layer by
  layer, gradients reduce-scattered).
- ``expert``: the batch, and a Mixture-of-Experts layer's experts (each device holds
  ``E / expert`` of them); each token-expert pair travels to its expert's device by an
  all-to-all and back (:mod:`.experts`).
- ``context``: the sequence (ring attention passes key/value blocks between neighbours).
- ``tensor``: heads, MLP width and vocabulary (Megatron), with the sequence of the residual
  stream (sequence parallelism): two collectives per block each way, the most traffic.

Example:
  >>> from jaxfuse.parallel import make_mesh, parse_mesh
  >>> parse_mesh("data=2,tensor=4")
  {'data': 2, 'tensor': 4}
  >>> dict(make_mesh({"data": 1}).shape)
  {'data': 1, 'fsdp': 1, 'expert': 1, 'context': 1, 'tensor': 1}
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import AxisType

MESH_AXES = ("data", "fsdp", "expert", "context", "tensor")


def parse_mesh(text: str) -> dict[str, int]:
  """``{"data": 2, "tensor": 4}`` from ``"data=2,tensor=4"`` (axes of :data:`MESH_AXES`)."""
  shape = {}
  for part in (p.strip() for p in text.split(",")):
    if not part:
      continue
    name, sep, size = part.partition("=")
    name = name.strip()
    if not sep or name not in MESH_AXES or not size.strip().isdigit() or int(size) < 1:
      raise ValueError(f"--mesh: expected comma-separated AXIS=SIZE with AXIS in "
                       f"{', '.join(MESH_AXES)} and SIZE >= 1, got {part!r}")
    if name in shape:
      raise ValueError(f"--mesh: axis {name!r} given twice")
    shape[name] = int(size)
  return shape


def make_mesh(shape: str | Mapping[str, int], *, devices: Sequence | None = None,
              axis_types: AxisType = AxisType.Auto) -> jax.sharding.Mesh:
  """A mesh with every axis of :data:`MESH_AXES` (size 1 where ``shape`` omits it) over
  ``devices`` (default: all, across hosts after ``jax.distributed.initialize()``), whose count
  must be the product of the sizes. Auto axes by default: XLA partitions the program from the
  parameters' and activations' shardings."""
  if isinstance(shape, str):
    shape = parse_mesh(shape)
  unknown = sorted(set(shape) - set(MESH_AXES))
  if unknown:
    raise ValueError(f"make_mesh: unknown mesh axes {unknown}; the axes are {MESH_AXES}")
  devices = list(jax.devices() if devices is None else devices)
  sizes = tuple(int(shape.get(name, 1)) for name in MESH_AXES)
  if math.prod(sizes) != len(devices):
    raise ValueError(f"make_mesh: {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} "
                     f"devices, there are {len(devices)}")
  return jax.make_mesh(sizes, MESH_AXES, axis_types=(axis_types,) * len(MESH_AXES),
                       devices=devices)
