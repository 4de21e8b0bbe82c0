"""Ring attention: attention over a sequence split across the devices of one mesh axis.

Each device holds one block of the queries, keys and values. The key/value blocks travel
around the ring by ``ppermute``; each device attends its queries to every block in turn with
the flash kernels (:func:`jaxfuse.ops.flash_attention.op.forward_with_lse`), and merges the
partial outputs by their log-sum-exp. Nothing of ``[T, T]`` size, and no whole sequence,
exists on any device. The backward pass recomputes: the blocks go around the ring once more,
each device adds its share of the block's ``dk`` and ``dv`` to accumulators that travel with the
block and arrive home after the last step.

Causal attention is load-balanced by the **zig-zag** order (as in Megatron's context
parallelism): the sequence is cut into ``2 n`` chunks and device ``i`` holds chunks ``i`` and
``2n - 1 - i``, so that every device does the same work at every step: half its queries against
a whole block, or all its queries against half a block. :func:`zigzag_order` gives the
permutation of the positions; the caller lays the sequence out in it (the decoder permutes its
tokens and targets, and passes the permuted positions to the rotary embedding).

Two entry points:

- :func:`ring_attention` inside ``jax.shard_map`` (each array is the device's block);
- :func:`context_parallel_attention` on global arrays under a mesh: it maps
  :func:`ring_attention` over the mesh with the logical-axis rules of
  :mod:`jaxfuse.parallel.rules` (batch and heads stay split as the rules say).

Example:
  >>> import jax, jax.numpy as jnp, numpy as np
  >>> from jaxfuse.parallel import make_mesh, ring_attention, zigzag_order
  >>> from jaxfuse.ops import attention
  >>> mesh = make_mesh({"context": jax.device_count()})
  >>> q = k = v = jnp.asarray(np.random.default_rng(0).normal(size=(1, 16, 2, 8)), jnp.float32)
  >>> order = zigzag_order(16, jax.device_count())
  >>> ring = jax.shard_map(lambda q, k, v: ring_attention(q, k, v, axis_name="context"),
  ...                      mesh=mesh, in_specs=jax.P(None, "context"),
  ...                      out_specs=jax.P(None, "context"))
  >>> o = ring(q[:, order], k[:, order], v[:, order])
  >>> bool(jnp.allclose(o, attention(q, k, v, causal=True)[:, order], atol=1e-5))
  True
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jaxfuse.ops import names, partitioning
from jaxfuse.ops.flash_attention import arguments
from jaxfuse.ops.flash_attention import op as attention_op

OP = "ring_attention"
_LN2 = float(np.log(2.0))


def zigzag_order(length: int, parts: int) -> np.ndarray:
  """The positions of a sequence of ``length`` in zig-zag order over ``parts`` devices: the
  sequence cut into ``2 * parts`` equal chunks, device ``i`` holding chunks ``i`` and
  ``2 * parts - 1 - i`` (concatenated, device by device). ``x[:, order]`` lays a sequence out;
  ``y[:, np.argsort(order)]`` restores it.

  Example:
    >>> from jaxfuse.parallel import zigzag_order
    >>> zigzag_order(8, 2).tolist()
    [0, 1, 6, 7, 2, 3, 4, 5]
  """
  if length % (2 * parts):
    raise ValueError(f"zigzag_order: the length ({length}) must be a multiple of twice the "
                     f"devices ({2 * parts})")
  chunks = np.arange(length).reshape(2 * parts, length // (2 * parts))
  return np.concatenate([np.concatenate([chunks[i], chunks[2 * parts - 1 - i]])
                         for i in range(parts)])


@dataclasses.dataclass(frozen=True)
class _Ring:
  """The static plan of one ring: the mesh axis, its size, and the attention configurations
  of the three kinds of block pair (each device's own block, causal; all its queries against
  half a block; half its queries against a whole block)."""

  axis_name: str
  size: int
  causal: bool
  own: attention_op.Config
  half_keys: attention_op.Config | None
  half_queries: attention_op.Config | None
  full: attention_op.Config | None

  @property
  def base2(self) -> bool:
    return attention_op.lse_in_base2(self.own)


def _natural(lse, ring):
  """A block's log-sum-exp in natural log, ``-inf`` for rows that saw no key (the kernels
  give ``+inf`` there, which zeroes the probabilities of the backward pass)."""
  lse = jnp.where(lse == jnp.inf, -jnp.inf, lse)
  return lse * _LN2 if ring.base2 else lse


def _kernel_lse(lse, ring):
  """The inverse of :func:`_natural`."""
  lse = lse / _LN2 if ring.base2 else lse
  return jnp.where(lse == -jnp.inf, jnp.inf, lse)


def _merge(o, lse, o_part, lse_part):
  """Two partial attentions of the same queries merged by their (natural) log-sum-exp."""
  new = jnp.logaddexp(lse, lse_part)
  safe = jnp.where(new == -jnp.inf, 0.0, new)

  def weight(x):   # [b, h, t] -> [b, t, h, 1]
    return jnp.exp(x - safe).transpose(0, 2, 1)[..., None]

  merged = o * weight(lse) + o_part.astype(jnp.float32) * weight(lse_part)
  return merged, new


def _shift(tree, ring):
  """Every array of ``tree`` sent to the next device of the ring."""
  perm = [(i, (i + 1) % ring.size) for i in range(ring.size)]
  return jax.tree.map(lambda x: lax.ppermute(x, ring.axis_name, perm), tree)


def _halves(x, axis):
  n = x.shape[axis] // 2
  return lax.slice_in_dim(x, 0, n, axis=axis), lax.slice_in_dim(x, n, 2 * n, axis=axis)


def _forward(q, k, v, ring: _Ring):
  """``(o, lse)`` of the device's queries over the whole sequence; ``lse`` natural, float32."""
  me = lax.axis_index(ring.axis_name)
  o, lse = attention_op.forward_with_lse(q, k, v, ring.own)
  o, lse = o.astype(jnp.float32), _natural(lse, ring)
  for step in range(1, ring.size):
    k, v = _shift((k, v), ring)
    source = (me - step) % ring.size
    if not ring.causal:
      o_part, lse_part = attention_op.forward_with_lse(q, k, v, ring.full)
      o, lse = _merge(o, lse, o_part, _natural(lse_part, ring))
      continue

    def earlier(q, k, v):
      # The block's first chunk precedes both of this device's chunks; its second follows them.
      o_part, lse_part = attention_op.forward_with_lse(q, _halves(k, 1)[0], _halves(v, 1)[0],
                                                       ring.half_keys)
      return o_part.astype(jnp.float32), _natural(lse_part, ring)

    def later(q, k, v):
      # Both of the block's chunks precede this device's second chunk, and follow its first.
      o_part, lse_part = attention_op.forward_with_lse(_halves(q, 1)[1], k, v, ring.half_queries)
      none_o = jnp.zeros_like(o_part, jnp.float32)
      none_lse = jnp.full(lse_part.shape, -jnp.inf, jnp.float32)
      none_o, none_lse = partitioning.vary_like((none_o, none_lse), q, k, v)
      return (jnp.concatenate([none_o, o_part.astype(jnp.float32)], axis=1),
              jnp.concatenate([none_lse, _natural(lse_part, ring)], axis=2))

    o_part, lse_part = lax.cond(source < me, earlier, later, q, k, v)
    o, lse = _merge(o, lse, o_part, lse_part)
  return o.astype(q.dtype), lse


def _backward(q, k, v, o, lse, do, ring: _Ring):
  """``(dq, dk, dv)``: the blocks go around once more; their ``dk``/``dv`` travel with them."""
  me = lax.axis_index(ring.axis_name)
  lse = _kernel_lse(lse, ring)
  dq, dk, dv = attention_op.backward_from_lse(q, k, v, o, lse, do, ring.own)
  dq, dk, dv = (x.astype(jnp.float32) for x in (dq, dk, dv))
  for step in range(1, ring.size):
    k, v, dk, dv = _shift((k, v, dk, dv), ring)
    source = (me - step) % ring.size
    if not ring.causal:
      dq_part, dk_part, dv_part = attention_op.backward_from_lse(q, k, v, o, lse, do, ring.full)
    else:
      def earlier(q, k, v, o, lse, do):
        k1, v1 = _halves(k, 1)[0], _halves(v, 1)[0]
        dq_part, dk1, dv1 = attention_op.backward_from_lse(q, k1, v1, o, lse, do,
                                                           ring.half_keys)
        pad = partitioning.vary_like(jnp.zeros_like(dk1), q, k, v, o, lse, do)
        return (dq_part, jnp.concatenate([dk1, pad], axis=1),
                jnp.concatenate([dv1, pad.astype(dv1.dtype)], axis=1))

      def later(q, k, v, o, lse, do):
        q2, o2, do2 = (_halves(x, 1)[1] for x in (q, o, do))
        dq2, dk_part, dv_part = attention_op.backward_from_lse(
            q2, k, v, o2, _halves(lse, 2)[1], do2, ring.half_queries)
        pad = partitioning.vary_like(jnp.zeros_like(dq2), q, k, v, o, lse, do)
        return jnp.concatenate([pad, dq2], axis=1), dk_part, dv_part

      dq_part, dk_part, dv_part = lax.cond(source < me, earlier, later, q, k, v, o, lse, do)
    dq = dq + dq_part.astype(jnp.float32)
    dk, dv = dk + dk_part.astype(jnp.float32), dv + dv_part.astype(jnp.float32)
  dk, dv = _shift((dk, dv), ring)   # home: each block's accumulators after its last visit
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@partitioning.matching_vma
@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ring(q, k, v, ring):
  return _forward(q, k, v, ring)[0]


def _ring_fwd(q, k, v, ring):
  # Residuals: the device's own blocks (inputs), its output and one float32 per query row and
  # head, under the attention op's names; the backward recomputes every block pair.
  q, k, v = (checkpoint_name(x, n) for x, n in ((q, names.ATTN_Q), (k, names.ATTN_K),
                                               (v, names.ATTN_V)))
  o, lse = _forward(q, k, v, ring)
  o, lse = checkpoint_name(o, names.ATTN_OUT), checkpoint_name(lse, names.ATTN_LSE)
  return o, (q, k, v, o, lse)


def _ring_bwd(ring, residuals, do):
  return _backward(*residuals, do, ring)


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, axis_name: str,
                   causal: bool = True, scale: float | None = None,
                   implementation: str | None = None) -> jax.Array:
  """Attention of this device's query block over a sequence split across ``axis_name``.

  Call it inside ``jax.shard_map`` (``check_vma=True`` works), with ``q``, ``k`` and ``v``
  this device's blocks ``[batch, block, heads, head_dim]`` (grouped-query ``k``/``v`` heads
  as :func:`jaxfuse.ops.attention` takes them). With ``causal=True`` the sequence must be laid
  out in :func:`zigzag_order` over the axis's devices; without, in any order.

  Args:
    q, k, v: the device's blocks.
    axis_name: the mesh axis the sequence is split over.
    causal: a causal mask over the whole sequence (in zig-zag order).
    scale: multiplies ``q kᵀ``; default ``1 / sqrt(head_dim)``.
    implementation: the attention kernels' (as :func:`jaxfuse.ops.attention`).

  Returns:
    This device's output block, in ``q``'s dtype.
  """
  arguments.check(OP, q, k, v, None, None, None)
  if causal and q.shape[1] % 2:
    raise ValueError(f"{OP}: a causal ring needs an even block length (two zig-zag chunks), "
                     f"got {q.shape[1]}")
  if q.shape[1] != k.shape[1]:
    raise ValueError(f"{OP}: q and k blocks must have one length, got {q.shape[1]} and "
                     f"{k.shape[1]}")
  size = lax.axis_size(axis_name)
  scale = arguments.default_scale(scale, q.shape[-1])
  config = functools.partial(attention_op.make_config, scale=scale,
                             implementation=implementation)
  q1, k1 = _halves(q, 1)[1], _halves(k, 1)[0]
  ring = _Ring(axis_name, size, bool(causal),
               own=config(q, k, causal="top_left" if causal else None),
               half_keys=config(q, k1, causal=None) if causal else None,
               half_queries=config(q1, k, causal=None) if causal else None,
               full=None if causal else config(q, k, causal=None))
  with jax.named_scope(f"jaxfuse.{OP}[{ring.own.impl}]"):
    return _ring(q, k, v, ring)


def context_parallel_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
                               scale: float | None = None,
                               implementation: str | None = None) -> jax.Array:
  """:func:`ring_attention` on global ``[batch, seq, heads, head_dim]`` arrays under the mesh
  in context, the sequence split over the mesh axes of the logical axis ``"seq"`` (one axis,
  ``context`` by :data:`jaxfuse.parallel.RULES`), the batch and heads as the rules split them
  (``"batch"``, ``"act_heads"``). With ``causal`` the sequence is in :func:`zigzag_order`.

  Without a mesh, or with the sequence on one device, it is :func:`jaxfuse.ops.attention`
  (the order then does not matter only when not causal: pass positions in order there).
  """
  from jaxfuse.ops.flash_attention import attention
  from jaxfuse.parallel import rules

  mesh = rules._context_mesh()
  seq_spec = None if mesh is None else rules.logical_spec(("seq",), mesh, q.shape[1:2])[0]
  if seq_spec is None:
    return attention(q, k, v, causal=causal, scale=scale, implementation=implementation)
  if not isinstance(seq_spec, str):
    raise ValueError(f"{OP}: the sequence must be split over one mesh axis, got {seq_spec}")
  batch = rules.logical_spec(("batch",), mesh, q.shape[:1])[0]
  heads = rules.logical_spec(("act_kv_heads",), mesh, k.shape[2:3])[0]
  spec = jax.P(batch, seq_spec, heads, None)
  ring = functools.partial(ring_attention, axis_name=seq_spec, causal=causal, scale=scale,
                           implementation=implementation)
  return jax.shard_map(ring, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)(q, k, v)
