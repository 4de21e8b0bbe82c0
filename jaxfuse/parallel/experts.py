"""Expert parallelism: a Mixture-of-Experts layer's token-expert pairs sent to the devices that
hold their experts, and their outputs sent back, by all-to-all over one mesh axis.

The experts ``[E, ...]`` are split over the mesh axis of the logical axis ``"expert"``
(``expert`` by :data:`jaxfuse.parallel.RULES`): device ``i`` of its ``P`` holds experts
``i * E / P`` to ``(i + 1) * E / P - 1``. Inside ``jax.shard_map`` each device routes its own
tokens, sorts its pairs by expert (:func:`jaxfuse.blocks.moe.dispatch`), and then:

- :func:`send_to_experts`: the sorted rows go to their experts' devices, with the pairs per
  expert in a small all-to-all; the receiver sorts what arrived by its local expert, ready for
  grouped products over its ``E / P`` experts;
- :func:`return_from_experts`: the experts' outputs go back by the reverse exchange, to the
  sender's sorted order.

Two exchanges, the same result (the one device's exactly, nothing dropped):

- ragged (GPUs, TPUs): ``jax.lax.ragged_all_to_all`` sends each device only its rows, into a
  receive buffer of the dropless worst case (``P * C`` rows: every sender's pairs to one
  device); the senders learn where their rows land from an all-gather of the ``[P]`` row
  counts;
- padded (CPUs: XLA:CPU does not implement ``ragged_all_to_all``, jax 0.10.2: "HLO opcode
  ragged-all-to-all is not supported by XLA:CPU ThunkEmitter"): each device's share in one
  block of a ``jax.lax.all_to_all`` as large as the sender's pairs, ``P`` times the rows on
  the wire.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jaxfuse.parallel import make_mesh
  >>> from jaxfuse.parallel.experts import send_to_experts, return_from_experts
  >>> n = jax.device_count()
  >>> mesh = make_mesh({"expert": n})
  >>> def roundtrip(rows, sizes):   # each device: 3 rows, for experts 0, 0 and n - 1
  ...   got, local_sizes, plan = send_to_experts(rows, sizes, axis_name="expert")
  ...   return return_from_experts(got * 2, plan, axis_name="expert")
  >>> sizes = jnp.tile(jnp.zeros((n,), jnp.int32).at[0].add(2).at[n - 1].add(1), n)
  >>> f = jax.shard_map(roundtrip, mesh=mesh, in_specs=jax.P("expert"), out_specs=jax.P("expert"))
  >>> rows = jnp.arange(3.0 * n)[:, None]
  >>> bool((f(rows, sizes) == 2 * rows).all())
  True
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxfuse.ops import dispatch
from jaxfuse.parallel import rules


class Plan(NamedTuple):
  """What :func:`return_from_experts` needs of a :func:`send_to_experts`.

  Attributes:
    order: ``[P * C]`` int32, the received rows in the order of their local experts.
    sent: ``[P]`` int32, the rows sent to each device of the axis.
    ragged: the exchange was ragged (static).
    received: ``[P]`` int32, the rows received from each device (ragged only).
  """

  order: jax.Array
  sent: jax.Array
  ragged: bool = False
  received: jax.Array | None = None


def ragged_exchange() -> bool:
  """Whether :func:`send_to_experts` exchanges ragged (``jax.lax.ragged_all_to_all``) on the
  platform the program is traced for: not on CPUs."""
  return dispatch.platform() != "cpu"


def _ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                       *, axis_name):
  """``jax.lax.ragged_all_to_all``, or where :data:`EMULATE_RAGGED` is set (tests on CPUs) the
  same exchange built from an all-gather of every device's rows and offsets."""
  if not EMULATE_RAGGED:
    return lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                                 recv_sizes, axis_name=axis_name)
  me = lax.axis_index(axis_name)
  rows = lax.all_gather(operand, axis_name)                            # [P, n, d]
  starts, sizes, lands = (lax.all_gather(x, axis_name)[:, me]          # [P]: towards me
                          for x in (input_offsets, send_sizes, output_offsets))
  slot = jnp.arange(output.shape[0], dtype=jnp.int32)[:, None]
  inside = (slot >= lands[None, :]) & (slot < (lands + sizes)[None, :])   # [m, P]
  sender = jnp.argmax(inside, axis=1)
  source = jnp.clip(starts[sender] + slot[:, 0] - lands[sender], 0, operand.shape[0] - 1)
  return jnp.where(jnp.any(inside, axis=1)[:, None], rows[sender, source], output)


# Set by tests to run the ragged exchange where XLA has no ragged all-to-all (CPUs).
EMULATE_RAGGED = False


def expert_axis(num_experts: int, mesh=None) -> str | None:
  """The mesh axis the ``num_experts`` experts are split over in ``mesh`` (default: the mesh in
  context), by the logical axis ``"expert"``; None without a mesh or where that axis has one
  device. Raises ValueError where the experts do not divide evenly over it, or where the rules
  map them onto more than one mesh axis."""
  mesh = mesh if mesh is not None else rules._context_mesh()
  if mesh is None:
    return None
  axes = rules.logical_spec(("expert",), mesh)[0]
  if axes is None:
    return None
  if not isinstance(axes, str):
    raise ValueError(f"expert parallelism: the experts must be split over one mesh axis, the "
                     f"rules give {axes}")
  size = dict(mesh.shape)[axes]
  if num_experts % size:
    raise ValueError(f"expert parallelism: {num_experts} experts do not divide over the "
                     f"{size} devices of the mesh axis {axes!r}")
  return axes


def send_to_experts(rows: jax.Array, group_sizes: jax.Array, *, axis_name: str):
  """Rows sorted by expert sent to the devices that hold their experts (inside ``shard_map``).

  Args:
    rows: ``[C, d]``, this device's token-expert pairs sorted by (global) expert; rows past
      ``sum(group_sizes)`` are not sent.
    group_sizes: ``[E]`` int32, the rows per expert.
    axis_name: the mesh axis the experts are split over (``P`` devices, ``E / P`` experts each).

  Returns:
    ``(received, local_sizes, plan)``: ``received`` ``[P * C, d]``, the rows that arrived for
    this device's experts sorted by its local expert (and, within one, by sender), the padding
    after them; ``local_sizes`` ``[E / P]`` int32, the rows per local expert; ``plan``, what
    :func:`return_from_experts` needs.
  """
  parts = lax.axis_size(axis_name)
  capacity, width = rows.shape
  num_experts = group_sizes.shape[0]
  if num_experts % parts:
    raise ValueError(f"send_to_experts: {num_experts} experts do not divide over the {parts} "
                     f"devices of {axis_name!r}")
  per_device = group_sizes.reshape(parts, num_experts // parts)
  sent = jnp.sum(per_device, axis=1)                            # [P]
  starts = jnp.cumsum(sent) - sent
  counts = lax.all_to_all(per_device, axis_name, 0, 0, tiled=True)   # [P, E / P]: per sender
  local_sizes = jnp.sum(counts, axis=0).astype(jnp.int32)
  if ragged_exchange() or EMULATE_RAGGED:
    received = jnp.sum(counts, axis=1).astype(jnp.int32)       # [P]: from each sender
    # Where my rows land on device j: after the rows of the senders before me.
    every = lax.all_gather(sent, axis_name)                    # [sender, receiver]
    me = lax.axis_index(axis_name)
    landed = jnp.sum(jnp.where(jnp.arange(parts)[:, None] < me, every, 0), axis=0)
    arrived = _ragged_all_to_all(rows, jnp.zeros((parts * capacity, width), rows.dtype),
                                 starts.astype(jnp.int32), sent.astype(jnp.int32),
                                 landed.astype(jnp.int32), received, axis_name=axis_name)
    # The senders' rows are consecutive: sender s's start, then its counts per local expert.
    first = jnp.cumsum(received) - received
    slot = jnp.arange(parts * capacity, dtype=jnp.int32)
    sender = jnp.sum(slot[:, None] >= jnp.cumsum(received)[None, :], axis=-1)   # P: padding
    within = slot - first[jnp.minimum(sender, parts - 1)]
    ends = jnp.cumsum(counts, axis=1)[jnp.minimum(sender, parts - 1)]           # [P*C, E/P]
    local_expert = jnp.where(sender < parts, jnp.sum(within[:, None] >= ends, axis=-1),
                             num_experts // parts)
    order = jnp.argsort(local_expert, stable=True).astype(jnp.int32)
    return arrived[order], local_sizes, Plan(order, sent, True, received)
  slot = jnp.arange(capacity, dtype=jnp.int32)
  index = jnp.minimum(starts[:, None] + slot[None, :], capacity - 1)
  valid = slot[None, :] < sent[:, None]                         # [P, C]
  blocks = jnp.where(valid[..., None], rows[index], jnp.zeros((), rows.dtype))   # [P, C, d]
  arrived = lax.all_to_all(blocks, axis_name, 0, 0, tiled=True)  # [P, C, d]: one per sender
  # The local expert of each arrived row (E / P for the padding, which sorts last).
  ends = jnp.cumsum(counts, axis=1)
  local_expert = jnp.sum(slot[None, :, None] >= ends[:, None, :], axis=-1)   # [P, C]
  order = jnp.argsort(local_expert.reshape(-1), stable=True).astype(jnp.int32)
  received = arrived.reshape(parts * capacity, width)[order]
  return received, local_sizes, Plan(order, sent)


def return_from_experts(out: jax.Array, plan: Plan, *, axis_name: str) -> jax.Array:
  """The experts' outputs ``out`` ``[P * C, d]`` (rows in the order of ``received`` of
  :func:`send_to_experts`) back on the devices that sent them: ``[C, d]``, in the sender's
  sorted order, zeros for the rows it did not send."""
  parts = lax.axis_size(axis_name)
  capacity = out.shape[0] // parts
  arrived = jnp.zeros_like(out).at[plan.order].set(out, unique_indices=True)
  if plan.ragged:
    # The reverse exchange: to sender s the rows it sent, back where they were in its order.
    first = jnp.cumsum(plan.received) - plan.received
    starts = jnp.cumsum(plan.sent) - plan.sent
    home_at = lax.all_to_all(starts.astype(jnp.int32)[:, None], axis_name, 0, 0,
                             tiled=True)[:, 0]
    return _ragged_all_to_all(arrived, jnp.zeros((capacity, out.shape[1]), out.dtype),
                              first.astype(jnp.int32), plan.received, home_at,
                              plan.sent.astype(jnp.int32), axis_name=axis_name)
  home = lax.all_to_all(arrived.reshape(parts, capacity, -1), axis_name, 0, 0, tiled=True)
  starts = jnp.cumsum(plan.sent) - plan.sent
  pair = jnp.arange(capacity, dtype=jnp.int32)
  device = jnp.sum(pair[:, None] >= jnp.cumsum(plan.sent)[None, :], axis=-1)   # P: not sent
  kept = device < parts
  device = jnp.minimum(device, parts - 1)
  rows = home[device, jnp.clip(pair - starts[device], 0, capacity - 1)]
  return jnp.where(kept[:, None], rows, jnp.zeros((), rows.dtype))
