"""Where a run's arrays live: the ``--mesh`` over every device, the training state placed on it
by its logical axes, and each batch split over it.

:func:`place_batch` takes the whole (seeded) batch in every process, which contributes its
devices' slices, so the same code runs on one host and across hosts (``--coordinator``,
``--distributed``); :func:`place_batch_rows` asks each process only for the rows its devices
hold.
"""

from __future__ import annotations

import math
from collections.abc import Callable

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


def place_batch_rows(rows: Callable[[int, int], tuple[np.ndarray, ...]], shape: tuple[int, int],
                     mesh: jax.sharding.Mesh | None) -> tuple:
  """Global token arrays of ``shape`` ``[batch, seq]`` (or ``[batch, seq, ...]``: the trailing
  axes stay whole) split over ``mesh`` as
  :func:`place_batch` splits them, where ``rows(lo, hi)`` returns rows ``[lo, hi)`` of each
  (the same rows for the same bounds in every process). A process asks only for the rows its
  devices hold: once a contiguous run of them (once for all rows without a ``mesh``)."""
  if mesh is None:
    return tuple(rows(0, shape[0]))
  sharding = NamedSharding(mesh, parallel.logical_spec(("batch", "seq"), mesh, shape))
  index_map = sharding.addressable_devices_indices_map(shape)
  spans = []   # [lo, hi, arrays]: the rows this process holds, merged where they touch
  for lo, hi in sorted({index[0].indices(shape[0])[:2] for index in index_map.values()}):
    if spans and lo <= spans[-1][1]:
      spans[-1][1] = max(spans[-1][1], hi)
    else:
      spans.append([lo, hi])
  for span in spans:
    span.append(tuple(rows(span[0], span[1])))
    got = [a.shape[0] for a in span[2]]
    if got != [span[1] - span[0]] * len(got):
      raise ValueError(f"place_batch_rows: rows({span[0]}, {span[1]}) returned arrays of "
                       f"{got} rows, expected {span[1] - span[0]}")

  def shard(index, i):
    lo, hi = index[0].indices(shape[0])[:2]
    start, _, arrays = next(s for s in spans if s[0] <= lo and hi <= s[1])
    return arrays[i][(slice(lo - start, hi - start), *index[1:])]

  count = len(spans[0][2])
  # An array may have more axes than [batch, seq] (a teacher's top-k): those stay whole.
  return tuple(jax.make_array_from_callback(shape + spans[0][2][i].shape[2:], sharding,
                                            lambda index, i=i: shard(index, i))
               for i in range(count))
