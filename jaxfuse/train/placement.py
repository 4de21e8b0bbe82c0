"""Where a run's arrays live: the ``--mesh`` over every device, the training state placed on it
by its logical axes, and each batch split over it.

Every process holds the whole (seeded) batch and contributes its devices' slices, so the same
code runs on one host and across hosts (``--distributed``).
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxfuse import parallel
from jaxfuse.train.config import TrainConfig, mesh_shape


def make_mesh(cfg: TrainConfig) -> jax.sharding.Mesh | None:
  """The ``--mesh`` over every device (of every host), or None without one."""
  if cfg.mesh is None:
    return None
  shape = mesh_shape(cfg)
  devices = math.prod(shape.values())
  if devices != jax.device_count():
    hint = (f"; on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count={devices} simulates "
            f"them" if jax.default_backend() == "cpu" else "")
    raise ValueError(f"--mesh {cfg.mesh} needs {devices} devices, jax sees "
                     f"{jax.device_count()}{hint}")
  return parallel.make_mesh(shape)


def place_state(state, mesh: jax.sharding.Mesh):
  """``(state, shardings)``: ``state`` placed on ``mesh`` by its logical axes, and the sharding
  of each of its arrays (which a step that updates it keeps)."""
  state = parallel.place(state, mesh)
  return state, jax.tree.map(lambda x: x.sharding, state)


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
  """A value every device holds whole (the loss)."""
  return NamedSharding(mesh, P())


def place_batch(arrays: tuple[np.ndarray, ...], mesh: jax.sharding.Mesh | None) -> tuple:
  """Token arrays ``[batch, seq]`` split over ``mesh`` as the logical axes ``("batch", "seq")``
  say. Every process holds the whole (seeded) batch and contributes its devices' slices, so the
  same code runs on one host and across hosts."""
  if mesh is None:
    return arrays
  spec = parallel.logical_spec(("batch", "seq"), mesh, arrays[0].shape)
  sharding = NamedSharding(mesh, spec)
  return tuple(jax.make_array_from_callback(a.shape, sharding, lambda index, a=a: a[index])
               for a in arrays)
