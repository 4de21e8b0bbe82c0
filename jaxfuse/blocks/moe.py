"""Mixture-of-Experts over arrays: top-k routing, its auxiliary losses, and the experts' MLP.

A MoE layer replaces a block's gated MLP by ``E`` of them (the experts) and a router
``[d_model, E]``; each token goes to its ``k`` highest-scoring experts and gets their outputs
weighted by its routing weights. As Hugging Face ``transformers`` computes it (Mixtral,
Qwen3-MoE):

- :func:`route`: the float32 softmax of the router logits, then the top ``k`` of it (the same
  experts as the top ``k`` logits), optionally renormalized to sum to 1 (Mixtral always;
  Qwen3-MoE where ``norm_topk_prob``);
- :func:`router_stats` and :func:`load_balancing_loss`: Switch Transformer's auxiliary loss as
  ``transformers``' ``load_balancing_loss_func``: over the rows of every MoE layer together
  (padding left out by a mask), ``E * sum_e f_e * P_e``, where ``f_e`` is the fraction of
  token-expert assignments that go to expert ``e`` (summed over the ``k`` slots) and ``P_e``
  the mean router probability of ``e``; :func:`router_z_loss`, ST-MoE's ``mean(logsumexp(z)^2)``
  (not a ``transformers`` option);
- :func:`moe_mlp`: the experts' MLP. The ``tokens * k`` token-expert pairs are sorted by expert
  (a stable argsort of the flattened top-k expert ids), their rows gathered, and the gate, up
  and down projections computed as grouped products (one matrix per expert over its run of
  rows) with the gated activation between, as one op (:func:`jaxfuse.ops.grouped_mlp`: its
  kernels fuse the activation into the gate and up products); the outputs are put back in
  token order and summed
  with the routing weights. Dropless by default: every pair is computed. With a capacity
  factor ``c`` each expert takes at most ``ceil(c * tokens * k / E)`` pairs (the earliest
  tokens first); the others are dropped (they give zeros: the rows past the kept groups) and
  counted.

Expert kernels are stacked ``[E, in, out]`` (``gate``, ``up``: ``[E, d_model, f]``; ``down``:
``[E, f, d_model]``), the router ``[d_model, E]``. Every value a recomputation policy may keep
is named (``moe.*`` of :mod:`jaxfuse.ops.names`); the NNX module that holds the parameters
(:class:`jaxfuse.models.decoder_block.MoE`) chooses what to keep.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jaxfuse.blocks import moe
  >>> x = jax.random.normal(jax.random.key(0), (6, 8))
  >>> router = jax.random.normal(jax.random.key(1), (8, 4))
  >>> gate, up = (jax.random.normal(jax.random.key(i), (4, 8, 16)) for i in (2, 3))
  >>> down = jax.random.normal(jax.random.key(4), (4, 16, 8))
  >>> out, stats = moe.moe_mlp(x, router, gate, up, down, top_k=2)
  >>> out.shape, stats["counts"].sum()   # 6 tokens, 2 experts each
  ((6, 8), Array(12., dtype=float32))
  >>> float(moe.load_balancing_loss(stats)) > 0
  True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxfuse.ops import activations, names
from jaxfuse.ops import grouped_mlp as _grouped_mlp
from jaxfuse.parallel import experts as expert_parallel
from jaxfuse.parallel import rules

_HIGHEST = jax.lax.Precision.HIGHEST
# The statistics of one MoE layer that the auxiliary losses need (summed over layers).
STATS = ("counts", "probs", "rows", "z", "dropped")


class Routing(NamedTuple):
  """What :func:`route` chooses for each token.

  Attributes:
    weights: ``[tokens, k]`` float32, the routing weights of the chosen experts.
    experts: ``[tokens, k]`` int32, the chosen experts, highest probability first.
    probs: ``[tokens, E]`` float32, the router's softmax.
  """

  weights: jax.Array
  experts: jax.Array
  probs: jax.Array


def route(logits: jax.Array, top_k: int, *, renormalize: bool = True) -> Routing:
  """Softmax top-k routing of router ``logits`` ``[tokens, E]`` as ``transformers`` computes it:
  the softmax in float32, the top ``top_k`` probabilities, and, with ``renormalize``, those
  divided by their sum.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxfuse.blocks.moe import route
    >>> r = route(jnp.log(jnp.array([[0.1, 0.6, 0.3]])), 2)
    >>> r.experts.tolist(), [round(w, 3) for w in r.weights[0].tolist()]
    ([[1, 2]], [0.667, 0.333])
  """
  num_experts = logits.shape[-1]
  if not 1 <= top_k <= num_experts:
    raise ValueError(f"route: top_k must be in [1, {num_experts}] (the experts), got {top_k}")
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  weights, experts = jax.lax.top_k(probs, top_k)
  if renormalize:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return Routing(weights, experts.astype(jnp.int32), probs)


def router_stats(logits: jax.Array, routing: Routing, mask: jax.Array | None = None,
                 dropped: jax.Array | int = 0) -> dict[str, jax.Array]:
  """One layer's sums for the auxiliary losses, over the rows where ``mask`` (``[tokens]``,
  None: every row) is nonzero: ``counts`` ``[E]`` (token-expert assignments per expert),
  ``probs`` ``[E]`` (summed router probabilities), ``rows``, ``z`` (summed
  ``logsumexp(logits) ** 2``) and ``dropped`` (pairs dropped by the capacity), all float32.
  Sum them over layers (:func:`add_stats`) before :func:`load_balancing_loss`."""
  tokens, top_k = routing.experts.shape
  num_experts = routing.probs.shape[-1]
  m = (jnp.ones((tokens,), jnp.float32) if mask is None
       else jnp.reshape(mask, (tokens,)).astype(jnp.float32))
  counts = jnp.zeros((num_experts,), jnp.float32).at[routing.experts.reshape(-1)].add(
      jnp.repeat(m, top_k))
  lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
  return {"counts": jax.lax.stop_gradient(counts),
          "probs": jnp.sum(routing.probs * m[:, None], axis=0),
          "rows": jnp.sum(m), "z": jnp.sum(m * lse * lse),
          "dropped": jnp.asarray(dropped, jnp.float32)}


def empty_stats(num_experts: int) -> dict[str, jax.Array]:
  """Statistics of no rows (what :func:`add_stats` starts from)."""
  zero = jnp.zeros((), jnp.float32)
  return {"counts": jnp.zeros((num_experts,), jnp.float32),
          "probs": jnp.zeros((num_experts,), jnp.float32), "rows": zero, "z": zero,
          "dropped": zero}


def add_stats(a: Mapping[str, jax.Array], b: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
  """The statistics of two sets of rows (two layers) together."""
  return {k: a[k] + b[k] for k in STATS}


def load_balancing_loss(stats: Mapping[str, jax.Array]) -> jax.Array:
  """``E * sum_e (counts_e / rows) * (probs_e / rows)`` over summed statistics: the auxiliary
  loss of ``transformers``' ``load_balancing_loss_func`` (1 when the load is even, up to ``E``
  when every token goes to the same experts)."""
  rows = stats["rows"]
  num_experts = stats["counts"].shape[-1]
  return num_experts * jnp.sum((stats["counts"] / rows) * (stats["probs"] / rows))


def router_z_loss(stats: Mapping[str, jax.Array]) -> jax.Array:
  """ST-MoE's router z-loss: the mean over rows of ``logsumexp(router logits) ** 2``."""
  return stats["z"] / stats["rows"]


def load_balancing_loss_of(router_logits: Sequence[jax.Array] | jax.Array, top_k: int,
                           mask: jax.Array | None = None) -> jax.Array:
  """The auxiliary loss of every layer's router logits (a sequence of ``[tokens, E]``, or
  ``[layers, tokens, E]``), as ``transformers``' ``load_balancing_loss_func(router_logits, E,
  top_k, attention_mask)``; ``mask`` is the attention mask ``[batch, seq]`` (None: every
  row counts).

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxfuse.blocks.moe import load_balancing_loss_of
    >>> float(load_balancing_loss_of([jnp.zeros((4, 2))], 1))   # even: every prob 1/2
    1.0
  """
  stats = None
  for logits in router_logits:
    layer = router_stats(logits, route(logits, top_k, renormalize=False), mask)
    stats = layer if stats is None else add_stats(stats, layer)
  return load_balancing_loss(stats)


# The experts ---------------------------------------------------------------------------------


def capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float | None):
  """The most token-expert pairs an expert takes: ``ceil(capacity_factor * tokens * top_k /
  num_experts)``; None (dropless) without a factor."""
  if capacity_factor is None:
    return None
  if not capacity_factor > 0:
    raise ValueError(f"moe_mlp: capacity_factor must be None or > 0, got {capacity_factor!r}")
  return max(1, math.ceil(capacity_factor * tokens * top_k / num_experts))


def dispatch(experts: jax.Array, num_experts: int, limit: int | None = None):
  """The token-expert pairs (``experts.reshape(-1)``, token-major) sorted by expert.

  Returns ``(order, group_sizes, dropped)``: ``order`` ``[pairs]`` int32, the pairs in the
  order the experts take them (a stable sort, so each expert's pairs stay in token order; with
  a ``limit``, the pairs past an expert's first ``limit`` follow all kept ones);
  ``group_sizes`` ``[E]`` int32, the kept pairs per expert; ``dropped``, how many were not kept.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxfuse.blocks.moe import dispatch
    >>> order, sizes, dropped = dispatch(jnp.array([[1, 0], [1, 2], [1, 0]]), 3, limit=2)
    >>> order.tolist(), sizes.tolist(), int(dropped)
    ([1, 5, 0, 2, 3, 4], [2, 2, 1], 1)
  """
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True).astype(jnp.int32)
  sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
  if limit is None:
    return order, sizes, jnp.zeros((), jnp.int32)
  expert_of = flat[order]
  starts = jnp.cumsum(sizes) - sizes
  kept = jnp.arange(flat.shape[0], dtype=jnp.int32) - starts[expert_of] < limit
  # Dropped pairs sort after every kept one, in their order.
  order = order[jnp.argsort(jnp.where(kept, expert_of, num_experts), stable=True)]
  kept_sizes = jnp.minimum(sizes, limit)
  return order, kept_sizes, flat.shape[0] - jnp.sum(kept_sizes)


def _plain_grouped(lhs, rhs, group_sizes):
  precision = _HIGHEST if lhs.dtype == jnp.float32 else None
  return jax.lax.ragged_dot(lhs, rhs, group_sizes, precision=precision)


def _plain_glu(gate, up, activation):
  act = activations.get(activation) if isinstance(activation, str) else activation
  return act(gate) * up


def _products(rows, sizes, gate_kernel, up_kernel, down_kernel, activation, fused,
              implementation, keep):
  """The experts' gated MLP of ``rows`` sorted by expert, ``sizes`` rows per expert. Fused, one
  op (:func:`jaxfuse.ops.grouped_mlp`: one backward for the three products, which keeps the
  products named in ``keep`` and recomputes the others);
  unfused, :func:`jax.lax.ragged_dot` and the activation in jnp, every value named
  (``moe.gate``, ``moe.up``, ``moe.hidden``)."""
  dtype = rows.dtype
  gate_kernel, up_kernel, down_kernel = (w.astype(dtype)
                                         for w in (gate_kernel, up_kernel, down_kernel))
  if fused:
    down = _grouped_mlp(rows, gate_kernel, up_kernel, down_kernel, sizes, activation=activation,
                        implementation=implementation, keep=keep)
  else:
    gate = checkpoint_name(_plain_grouped(rows, gate_kernel, sizes), names.MOE_GATE)
    up = checkpoint_name(_plain_grouped(rows, up_kernel, sizes), names.MOE_UP)
    hidden = checkpoint_name(_plain_glu(gate, up, activation), names.MOE_HIDDEN)
    down = _plain_grouped(hidden, down_kernel, sizes)
  return down


def _combine(down, order, routing, dtype):
  """The pairs' outputs ``down`` (sorted as ``order``) back in token order (a dropped pair's
  row is zero), weighted and summed over the k slots."""
  tokens, top_k = routing.experts.shape
  pairs = down[jnp.argsort(order)].reshape(tokens, top_k, -1)
  out = jnp.sum(pairs.astype(jnp.float32) * routing.weights[..., None], axis=1)
  return out.astype(dtype)


def experts_mlp(x: jax.Array, routing: Routing, gate_kernel: jax.Array, up_kernel: jax.Array,
                down_kernel: jax.Array, *, activation: str | Callable = "silu",
                capacity_factor: float | None = None, fused: bool = True,
                implementation: str | None = None, keep: str | Sequence[str] = (),
                axis_name: str | None = None):
  """The experts' MLP of tokens ``x`` ``[tokens, d]`` routed by ``routing``: ``(out
  [tokens, d] in x's dtype, dropped pairs)``; see the module docstring. ``fused``: jaxfuse's
  :func:`~jaxfuse.ops.grouped_mlp`, else
  :func:`jax.lax.ragged_dot` and the activation in jnp (the unfused baseline). ``keep``: the
  fused op's kept products (:func:`jaxfuse.ops.grouped_mlp`'s ``keep``).

  With ``axis_name`` (inside ``jax.shard_map``), the experts are split over that mesh axis
  (the kernels are this device's ``E / P``) and the pairs travel to them and back by
  all-to-all (:mod:`jaxfuse.parallel.experts`); a capacity then counts this device's tokens.
  """
  tokens, top_k = routing.experts.shape
  parts = 1 if axis_name is None else jax.lax.axis_size(axis_name)
  num_experts = gate_kernel.shape[0] * parts
  limit = capacity(tokens, top_k, num_experts, capacity_factor)
  order, sizes, dropped = dispatch(routing.experts, num_experts, limit)
  order = checkpoint_name(order, names.MOE_ROUTING)
  rows = x[order // top_k]
  kernels = (gate_kernel, up_kernel, down_kernel, activation, fused, implementation, keep)
  if axis_name is None:
    down = _products(checkpoint_name(rows, names.MOE_ROUTED), sizes, *kernels)
  else:
    received, local_sizes, plan = expert_parallel.send_to_experts(rows, sizes,
                                                                  axis_name=axis_name)
    down = _products(checkpoint_name(received, names.MOE_ROUTED), local_sizes, *kernels)
    down = expert_parallel.return_from_experts(down, plan, axis_name=axis_name)
  # Named as they reach their tokens (after the exchange back, under expert parallelism): the
  # routing weights' gradient reads them.
  down = checkpoint_name(down, names.MOE_DOWN)
  return _combine(down, order, routing, x.dtype), dropped


def moe_mlp(x: jax.Array, router_kernel: jax.Array, gate_kernel: jax.Array,
            up_kernel: jax.Array, down_kernel: jax.Array, *, top_k: int,
            renormalize: bool = True, activation: str | Callable = "silu",
            capacity_factor: float | None = None, mask: jax.Array | None = None,
            precision=_HIGHEST, fused: bool = True, implementation: str | None = None,
            keep: str | Sequence[str] = (), token_axes: Sequence[str | None] | None = None):
  """A MoE layer of ``x`` ``[..., d]``: ``(out [..., d], stats)``, the statistics of
  :func:`router_stats` (``mask`` ``[...]`` leaves rows out of them, not out of the output).

  Under a mesh whose ``expert`` axis (the logical axis ``"expert"``'s) has more than one
  device, the layer is expert parallel (:func:`expert_parallel_moe_mlp`).

  Args:
    x: the tokens, ``[..., d]``.
    router_kernel: ``[d, E]``.
    gate_kernel, up_kernel: ``[E, d, f]``; down_kernel: ``[E, f, d]``.
    top_k: experts per token.
    renormalize: the top-k weights divided by their sum.
    activation: the experts' gated activation, as :func:`jaxfuse.ops.grouped_glu` takes it.
    capacity_factor: None (dropless) or the factor of :func:`capacity`.
    mask: rows that count in the statistics (None: all).
    precision: the router product's precision.
    fused: jaxfuse's grouped products and gated activation, or XLA's (see
      :func:`experts_mlp`).
    implementation: passed to :func:`jaxfuse.ops.grouped_mlp`.
    keep: the experts' products the fused op keeps for the backward (``"gate"``, ``"up"``;
      :func:`jaxfuse.ops.grouped_mlp`): each saves one grouped product of the backward for
      ``[tokens * k, f]`` residuals. A policy around the layer must keep their names
      (``moe.gate``, ``moe.up``), or the op's forward runs again for them.
    token_axes: the logical axes of ``x``'s leading axes on a mesh (default: the residual
      stream's, ``("batch", "residual_seq")``, for ``[batch, seq, d]``; ``("batch",)`` for
      ``[tokens, d]``); only expert parallelism reads them.
  """
  settings = dict(top_k=top_k, renormalize=renormalize, activation=activation,
                  capacity_factor=capacity_factor, precision=precision, fused=fused,
                  implementation=implementation, keep=keep)
  axis_name = expert_parallel.expert_axis(gate_kernel.shape[0])
  if axis_name is not None:
    return expert_parallel_moe_mlp(x, router_kernel, gate_kernel, up_kernel, down_kernel,
                                   mask=mask, axis_name=axis_name, token_axes=token_axes,
                                   **settings)
  return _local_moe_mlp(x, router_kernel, gate_kernel, up_kernel, down_kernel, mask=mask,
                        **settings)


def _local_moe_mlp(x, router_kernel, gate_kernel, up_kernel, down_kernel, *, top_k,
                   renormalize, activation, capacity_factor, mask, precision, fused,
                   implementation, keep=(), axis_name=None):
  """:func:`moe_mlp` on one device, or on this device's tokens and experts inside
  ``shard_map`` (``axis_name``: the experts' mesh axis)."""
  shape = x.shape
  flat = x.reshape(-1, shape[-1])
  logits = checkpoint_name(jnp.dot(flat, router_kernel.astype(x.dtype), precision=precision),
                           names.MOE_ROUTER)
  routing = route(logits, top_k, renormalize=renormalize)
  routing = Routing(checkpoint_name(routing.weights, names.MOE_ROUTING), routing.experts,
                    routing.probs)
  out, dropped = experts_mlp(flat, routing, gate_kernel, up_kernel, down_kernel,
                             activation=activation, capacity_factor=capacity_factor,
                             fused=fused, implementation=implementation, keep=keep,
                             axis_name=axis_name)
  mask = None if mask is None else mask.reshape(-1)
  return out.reshape(shape), router_stats(logits, routing, mask, dropped)


# The logical axes of the kernels (those of jaxfuse.models.axes.PARAM_AXES).
ROUTER_AXES = ("embed", None)
EXPERT_IN_AXES = ("expert", "embed", "mlp")     # gate_proj, up_proj [E, d, f]
EXPERT_OUT_AXES = ("expert", "mlp", "embed")    # down_proj [E, f, d]


def _spec_axes(spec) -> tuple[str, ...]:
  return tuple(a for entry in spec if entry is not None
               for a in ((entry,) if isinstance(entry, str) else entry))


def _gather(w, spec, keep):
  """``w``'s shard all-gathered over every mesh axis of ``spec`` but ``keep``."""
  for dim, entry in enumerate(spec):
    axes = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ())
                 if a != keep)
    if axes:
      w = jax.lax.all_gather(w, axes, axis=dim, tiled=True)
  return w


def expert_parallel_moe_mlp(x, router_kernel, gate_kernel, up_kernel, down_kernel, *,
                            axis_name: str, top_k: int, mask=None,
                            token_axes: Sequence[str | None] | None = None, **settings):
  """:func:`moe_mlp` with its experts split over the mesh axis ``axis_name``, under the mesh in
  context: one ``jax.shard_map`` over the whole mesh in which each device routes its own
  tokens, sends each token-expert pair to the device of its expert by all-to-all
  (:func:`jaxfuse.parallel.experts.send_to_experts`), computes the grouped products of its
  ``E / P`` experts, and gets its pairs' outputs back by the reverse all-to-all. The
  statistics are summed over every mesh axis the tokens are split over (``psum``), so the
  auxiliary losses are the one device's.

  The tokens must be split over ``axis_name`` (through ``token_axes``: the batch, by
  :data:`jaxfuse.parallel.RULES`). The kernels arrive split as the rules say; each device
  gathers its experts' ``d_model`` and ``f`` splits (FSDP and tensor axes, as FSDP gathers a
  layer's weights: their gradients are reduce-scattered) and the router's. Weights are never
  gathered over axes the tokens are not split over: those splits are undone on the way in.
  """
  mesh = rules._context_mesh()
  if token_axes is None:
    token_axes = ("batch", "residual_seq")[:x.ndim - 1] if x.ndim <= 3 else None
  if token_axes is None or len(token_axes) != x.ndim - 1:
    raise ValueError(f"moe_mlp: token_axes must name the {x.ndim - 1} leading axes of x "
                     f"{x.shape} under expert parallelism, got {token_axes}")
  x_spec = rules.logical_spec((*token_axes, None), mesh, x.shape)
  split = set(_spec_axes(x_spec))
  if axis_name not in split:
    raise ValueError(f"moe_mlp: expert parallelism over {axis_name!r} needs the tokens split "
                     f"over it (their axes {tuple(token_axes)} of x {x.shape} give {x_spec})")

  def weight_spec(axes, shape):
    spec = rules.logical_spec(axes, mesh, shape)
    return jax.P(*(_only(entry, split) for entry in spec))

  specs = (x_spec, weight_spec(ROUTER_AXES, router_kernel.shape),
           weight_spec(EXPERT_IN_AXES, gate_kernel.shape),
           weight_spec(EXPERT_IN_AXES, up_kernel.shape),
           weight_spec(EXPERT_OUT_AXES, down_kernel.shape))
  if specs[2][0] != axis_name or specs[4][0] != axis_name:
    raise ValueError(f"moe_mlp: the experts must be split over {axis_name!r} first, the rules "
                     f"give {specs[2]} and {specs[4]}")
  args = [x, router_kernel, gate_kernel, up_kernel, down_kernel]
  if mask is not None:
    specs += (jax.P(*x_spec[:-1]),)
    args.append(mask)
  if mesh.explicit_axes:
    args = [jax.sharding.reshard(a, s) for a, s in zip(args, specs)]
  token_mesh_axes = tuple(a for a in mesh.axis_names if a in split)

  def local(x, router, gate, up, down, mask=None):
    router = _gather(router, specs[1], None)
    gate, up, down = (_gather(w, s, axis_name) for w, s in zip((gate, up, down), specs[2:5]))
    out, stats = _local_moe_mlp(x, router, gate, up, down, top_k=top_k, mask=mask,
                                axis_name=axis_name, **settings)
    return out, jax.lax.psum(stats, token_mesh_axes)

  with jax.named_scope("jaxfuse.moe_expert_parallel"):
    return jax.shard_map(local, mesh=mesh, in_specs=specs,
                         out_specs=(x_spec, jax.P()))(*args)


def _only(entry, axes):
  """A spec entry with only the mesh axes in ``axes``."""
  if entry is None:
    return None
  kept = tuple(a for a in ((entry,) if isinstance(entry, str) else entry) if a in axes)
  return None if not kept else kept[0] if len(kept) == 1 else kept


def moe_mlp_dense(x: jax.Array, router_kernel: jax.Array, gate_kernel: jax.Array,
                  up_kernel: jax.Array, down_kernel: jax.Array, *, top_k: int,
                  renormalize: bool = True, activation: str | Callable = "silu",
                  precision=_HIGHEST) -> jax.Array:
  """The same layer computed densely (every expert on every token, weighted by routing
  weights that are zero outside each token's top k): the reference of :func:`moe_mlp`."""
  shape = x.shape
  flat = x.reshape(-1, shape[-1])
  logits = jnp.dot(flat, router_kernel, precision=precision)
  routing = route(logits, top_k, renormalize=renormalize)
  dense = jnp.zeros(routing.probs.shape, jnp.float32).at[
      jnp.arange(flat.shape[0])[:, None], routing.experts].set(routing.weights)
  act = activations.get(activation) if isinstance(activation, str) else activation
  gate = jnp.einsum("td,edf->etf", flat, gate_kernel, precision=precision)
  up = jnp.einsum("td,edf->etf", flat, up_kernel, precision=precision)
  out = jnp.einsum("etf,efd->etd", act(gate) * up, down_kernel, precision=precision)
  return jnp.einsum("etd,te->td", out, dense).astype(x.dtype).reshape(shape)


def torch_params(prefix: str = "", *, shared_expert: bool = False) -> dict:
  """The MoE layer's parameters as ``transformers`` 5 holds them live: the router ``gate``
  (``[E, d]``, an ``nn.Linear`` weight) and the experts' stacked ``gate_proj``, ``up_proj``
  ``[E, f, d]`` and ``down_proj`` ``[E, d, f]`` (each expert's weight transposed), before
  ``gate_proj`` and ``up_proj`` are fused into ``experts.gate_up_proj``; with
  ``shared_expert``, Qwen2-MoE's ``shared_expert`` (a gated MLP's ``gate_proj``, ``up_proj``,
  ``down_proj``) and ``shared_expert_gate`` (``[1, d]``)."""
  out = {("router", "kernel"): (f"{prefix}gate.weight", True),
         ("experts", "gate_proj"): (f"{prefix}experts.gate_proj", True),
         ("experts", "up_proj"): (f"{prefix}experts.up_proj", True),
         ("experts", "down_proj"): (f"{prefix}experts.down_proj", True)}
  if shared_expert:
    for name in ("gate_proj", "up_proj", "down_proj"):
      out[("shared_expert", name, "kernel")] = (f"{prefix}shared_expert.{name}.weight", True)
    out[("shared_expert_gate", "kernel")] = (f"{prefix}shared_expert_gate.weight", True)
  return out
