"""The experts' gated MLP as one op: a Mixture-of-Experts layer's grouped products.

``grouped_mlp(lhs, gate, up, down, group_sizes)`` is
``grouped_matmul(activation(lhs_e @ gate[e]) * (lhs_e @ up[e]), down)``: the rows of ``lhs``
``[M, K]``, sorted by group (expert), through each group's gated MLP (``gate``, ``up``
``[G, K, F]``, ``down`` ``[G, F, N]``). Rows past ``sum(group_sizes)`` come out as zeros.

One ``custom_vjp`` covers the three products and, by default, keeps only its inputs; the
backward recomputes the gate and up products once:

- forward: ``a = lhs_e @ gate[e]`` and ``b = lhs_e @ up[e]`` (float32), ``h = act(a) * b``
  rounded to the inputs' dtype, ``out = h_e @ down[e]``;
- backward: ``a`` and ``b`` recomputed, ``h`` from them, ``d h = g @ down[e]^T`` and
  ``d down[e] = h_e^T @ g_e``; ``d a = d h * b * act'(a)``, ``d b = d h * act(a)`` (rounded to
  the inputs' dtype); ``d lhs = d a @ gate[e]^T + d b @ up[e]^T``, ``d gate[e] = lhs_e^T @ d a``,
  ``d up[e] = lhs_e^T @ d b``: eight grouped products, eleven a step with the forward's three.
  On CPUs (XLA) one loop over each group's row tiles does all of them for a tile; elsewhere
  they are XLA's ragged products.

Composed of :func:`grouped_glu` and :func:`grouped_matmul` under ``jax.checkpoint`` instead,
the backward would run the gate and up products twice (once to recompute ``h`` for
``d down``, once in ``grouped_glu``'s own backward).

``keep`` trades memory for one of those products each: ``keep=("gate",)`` keeps ``a`` (in
the inputs' dtype, named ``moe.gate``; ``"up"``: ``b``, ``moe.up``), which the forward writes
and the backward reads instead of recomputing it: ten grouped products a step (nine with both)
for ``M·F`` more elements of residuals each.

With kernels (Pallas, Triton) the forward is :func:`jaxfuse.ops.grouped_glu`'s fused kernel
(the activation in the products' epilogue: ``a`` and ``b`` never reach memory) and the down
product's kernel. The backward (``grouped_mlp_backward`` of the kernel modules) takes
``d h = g @ down[e]^T`` first, then recomputes the gate and up products once in a kernel whose
epilogue writes ``d a``, ``d b`` and ``h`` (for ``d down``): the same eight products as the XLA
path, and ``a``, ``b`` never reach memory. Kept products are written by the forward's first
kernel and read by that backward kernel, whose K loop then computes only the others.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax.ad_checkpoint import checkpoint_name

from jaxfuse.ops import activation_grads, activations, base, checks, names, partitioning

# The modules (jaxfuse.ops binds these names to the ops themselves).
glu = importlib.import_module("jaxfuse.ops.grouped_glu")
gmm = importlib.import_module("jaxfuse.ops.grouped_matmul")

# Its kernels are grouped_glu's (gate, up and the activation) and grouped_matmul's (down).
GROUPED_MLP = base.Op("grouped_mlp", "grouped_glu", base.MATMUL_GPU_ORDER)


# Reference --------------------------------------------------------------------------------------


def grouped_mlp_reference(lhs: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
                          group_sizes: jax.Array, activation: str | Callable = "silu", *,
                          precision=None) -> jax.Array:
  """Plain-jnp ``(act(lhs_e @ gate[e]) * (lhs_e @ up[e])) @ down[e]`` (three
  :func:`jax.lax.ragged_dot`), the gated unit rounded once to lhs's dtype, the down product
  accumulated in float32 and rounded to lhs's dtype."""
  hidden = glu.grouped_glu_reference(lhs, gate, up, group_sizes, activation,
                                     precision=precision)
  return gmm.grouped_matmul_reference(hidden, down, group_sizes, precision=precision)


# Checks -----------------------------------------------------------------------------------------


def _check(op, lhs, gate, up, down, group_sizes):
  glu._check(op, lhs, gate, up, group_sizes)
  checks.floating(op, "down", down)
  checks.rank(op, "down", down, 3)
  checks.dim(op, "down", down, 0, gate.shape[0], "one down matrix per group of gate")
  checks.dim(op, "down", down, 1, gate.shape[2], "down is [groups, F, N]: gate is [groups, K, F]")
  checks.same_dtype(op, ("lhs", "down"), (lhs, down))


@dataclasses.dataclass(frozen=True)
class GroupedMlpConfig(activations.Config):
  precision: object = None
  keep: tuple[str, ...] = ()


# The products the op may keep for its backward, and their residual names.
_NAMES = names.MOE_PRODUCTS


def _keep(op, keep) -> tuple[str, ...]:
  """``keep`` as a tuple in the order of :data:`_NAMES`, checked."""
  return names.moe_products(keep, f"{op}: keep")


# The op -----------------------------------------------------------------------------------------


def grouped_mlp(lhs: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
                group_sizes: jax.Array, *, activation: str | Callable = "silu",
                implementation: str | None = None, precision=None,
                keep: str | tuple[str, ...] = ()) -> jax.Array:
  """The experts' gated MLP: ``(activation(lhs_e @ gate[e]) * (lhs_e @ up[e])) @ down[e]`` for
  the rows of each group ``e``, with one backward for the three products that keeps only the
  inputs (see the module docstring).

  Args:
    lhs: ``[M, K]``, rows sorted by group.
    gate, up: ``[G, K, F]``, each group's gate and up projections, lhs's dtype.
    down: ``[G, F, N]``, each group's down projection, lhs's dtype.
    group_sizes: ``[G]`` integers (int32), non-negative, summing to at most ``M``; rows past
      the sum give zeros. Checked when its value is known while tracing.
    activation: as :func:`jaxfuse.ops.grouped_glu` takes it (``"silu"``: SwiGLU experts).
    implementation: ``None``, ``"xla"`` (grouped products: a row-tile loop per group on CPUs,
      XLA's ragged products elsewhere), ``"pallas"`` or ``"triton"`` (the kernels of
      :func:`~jaxfuse.ops.grouped_glu` and :func:`~jaxfuse.ops.grouped_matmul`).
    precision: the XLA products' precision (``None``: HIGHEST for float32, as torch).
    keep: the products kept for the backward, among ``"gate"`` and ``"up"`` (``[M, F]`` in
      lhs's dtype, named ``moe.gate`` and ``moe.up``); the backward recomputes the others.
      ``()`` (the default) keeps only the inputs; ``"gate"`` saves one of the eight products
      of the backward for ``M·F`` elements.

  Returns:
    ``[M, N]`` in lhs's dtype.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxfuse.ops import grouped_mlp
    >>> lhs = jnp.ones((5, 2))
    >>> gate = jnp.stack([jnp.eye(2), -jnp.eye(2), 2 * jnp.eye(2)])
    >>> up, down = 3 * jnp.ones((3, 2, 2)), jnp.ones((3, 2, 1))
    >>> grouped_mlp(lhs, gate, up, down, jnp.array([2, 0, 2], jnp.int32), activation="relu")
    Array([[12.],
           [12.],
           [24.],
           [24.],
           [ 0.]], dtype=float32)
    >>> f = lambda w: grouped_mlp(lhs, gate, up, w, jnp.array([2, 0, 2]), activation="relu")
    >>> jax.grad(lambda w: f(w).sum())(down)[:, :, 0]
    Array([[12., 12.],
           [ 0.,  0.],
           [24., 24.]], dtype=float32)
  """
  op = GROUPED_MLP.name
  lhs, gate, up, down = (checks.as_array(x) for x in (lhs, gate, up, down))
  if not hasattr(group_sizes, "dtype"):
    group_sizes = np.asarray(group_sizes)
  _check(op, lhs, gate, up, down, group_sizes)
  activation = activations.canonical(activation, op=op)
  cfg = GROUPED_MLP.config(implementation, GroupedMlpConfig, facts={"activation": activation},
                           activation=activation, precision=precision, keep=_keep(op, keep))
  with jax.named_scope(activations.scope(GROUPED_MLP, cfg)):
    return _grouped_mlp(cfg, lhs, gate, up, down, jnp.asarray(group_sizes, jnp.int32))


# Forward and backward ---------------------------------------------------------------------------


def _xla_forward(lhs, gate, up, down, group_sizes, activation, precision=None, keep=()):
  """XLA's ragged products: the gated unit (:func:`grouped_glu_reference`'s rounding), then the
  down product; ``(out, *kept products)`` with ``keep`` (rounded to lhs's dtype)."""
  if not keep:
    hidden = glu._xla_forward(lhs, gate, up, group_sizes, activation, precision)
    return gmm._xla_forward(hidden, down, group_sizes, precision)
  products = dict(zip(("gate", "up"), glu._products(lhs, (gate, up), group_sizes, precision,
                                                    tiled=False)))
  hidden = (activation_grads.value(activation, products["gate"])
            * products["up"]).astype(lhs.dtype)
  return (gmm._xla_forward(hidden, down, group_sizes, precision),
          *(products[name].astype(lhs.dtype) for name in keep))


def _xla_backward(lhs, gate, up, down, group_sizes, *kept_and_g, activation, precision=None,
                  keep=()):
  """``(d lhs, d gate, d up, d down)`` from XLA's ragged products: the gate and up products
  that are not kept recomputed, the gated unit from them, ``(d hidden, d down)`` by
  ``grouped_matmul``'s backward, then ``grouped_glu``'s backward from the products."""
  *kept, g = kept_and_g
  products = {name: a.astype(jnp.float32) for name, a in zip(keep, kept)}
  weights = {"gate": gate, "up": up}
  missing = [name for name in weights if name not in products]
  products.update(zip(missing, glu._products(lhs, [weights[name] for name in missing],
                                              group_sizes, precision, tiled=False)))
  gate_out, up_out = products["gate"], products["up"]
  hidden = (activation_grads.value(activation, gate_out) * up_out).astype(lhs.dtype)
  d_hidden, d_down = gmm._xla_backward(hidden, down, group_sizes, g, precision)
  dlhs, d_gate, d_up = glu._xla_backward(lhs, gate, up, group_sizes, d_hidden, activation,
                                         precision, products=(gate_out, up_out))
  return dlhs, d_gate, d_up, d_down


def _tiled_forward(lhs, gate, up, down, group_sizes, activation, precision=None, keep=()):
  """The forward on CPUs: per group, per row tile (:func:`grouped_matmul._visit_rows`), the
  three products of the tile with the gated unit between them, so that the tile's
  intermediates stay in cache; ``(out, *kept products)``."""
  rows = lhs.shape[0]
  outs = tuple(partitioning.vary_like(jnp.zeros((rows, n), lhs.dtype), lhs, gate, up, down,
                                      group_sizes)
               for n in (down.shape[2],) + (gate.shape[2],) * len(keep))
  if 0 in (rows, *gate.shape[1:], down.shape[2]):
    return outs if keep else outs[0]
  starts, ends = gmm.pallas_gmm.group_bounds(group_sizes, rows)
  dot = functools.partial(_dot, precision=gmm._precision(lhs.dtype, precision))

  def group(e, outs):
    w_gate, w_up, w_down = (jax.lax.dynamic_index_in_dim(w, e, 0, keepdims=False)
                            for w in (gate, up, down))

    def body(size, first, mine):
      del mine  # rows that are not the group's are not written
      x = jax.lax.dynamic_slice_in_dim(lhs, first, size, 0)
      products = {"gate": dot(x, w_gate, 1, 0), "up": dot(x, w_up, 1, 0)}
      hidden = (activation_grads.value(activation, products["gate"])
                * products["up"]).astype(lhs.dtype)
      return (dot(hidden, w_down, 1, 0), *(products[name] for name in keep)), ()

    return gmm._visit_rows(starts[e], ends[e], rows, body, outs, ())[0]

  outs = jax.lax.fori_loop(0, group_sizes.shape[0], group, outs)
  return outs if keep else outs[0]


def _tiled_backward(lhs, gate, up, down, group_sizes, *kept_and_g, activation, precision=None,
                    keep=()):
  """The backward on CPUs: per group, per row tile, the products not kept recomputed and the
  six products of the backward, the weight gradients summed over the group's tiles in
  float32 (a tail's rows that are not the group's are zeroed)."""
  *kept, g = kept_and_g
  rows = lhs.shape[0]
  outs = tuple(partitioning.vary_like(jnp.zeros(shape, dtype), lhs, gate, up, down, group_sizes,
                                      g)
               for shape, dtype in ((lhs.shape, lhs.dtype), (gate.shape, jnp.float32),
                                    (up.shape, jnp.float32), (down.shape, jnp.float32)))
  if 0 in (rows, *gate.shape[1:], down.shape[2]):
    return _cast(outs, lhs, gate, up, down)
  starts, ends = gmm.pallas_gmm.group_bounds(group_sizes, rows)
  dot = functools.partial(_dot, precision=gmm._precision(lhs.dtype, precision))

  def group(e, outs):
    dlhs, d_gate, d_up, d_down = outs
    w_gate, w_up, w_down = (jax.lax.dynamic_index_in_dim(w, e, 0, keepdims=False)
                            for w in (gate, up, down))
    weights = {"gate": w_gate, "up": w_up}

    def body(size, first, mine):
      rows_of = lambda a: jax.lax.dynamic_slice_in_dim(a, first, size, 0)
      x, dy = rows_of(lhs), rows_of(g)
      products = {name: rows_of(a).astype(jnp.float32) for name, a in zip(keep, kept)}
      if mine is not None:
        x, dy = jnp.where(mine, x, 0), jnp.where(mine, dy, 0)
        products = {name: jnp.where(mine, a, 0) for name, a in products.items()}
      for name in ("gate", "up"):
        if name not in products:
          products[name] = dot(x, weights[name], 1, 0)
      gate_out, up_out = products["gate"], products["up"]
      act, grad = activation_grads.value_and_grad(activation, gate_out)
      hidden = (act * up_out).astype(lhs.dtype)
      d_hidden = dot(dy, w_down, 1, 1)
      d_gate_out = (d_hidden * up_out * grad).astype(lhs.dtype)
      d_up_out = (d_hidden * act).astype(lhs.dtype)
      dx = dot(d_gate_out, w_gate, 1, 1) + dot(d_up_out, w_up, 1, 1)
      return (dx,), (dot(x, d_gate_out, 0, 0), dot(x, d_up_out, 0, 0), dot(hidden, dy, 0, 0))

    zeros = tuple(partitioning.vary_like(jnp.zeros(w.shape[1:], jnp.float32), lhs, gate, up,
                                         down, group_sizes, g) for w in (gate, up, down))
    (dlhs,), accs = gmm._visit_rows(starts[e], ends[e], rows, body, (dlhs,), zeros)
    return (dlhs, *(jax.lax.dynamic_update_index_in_dim(d, acc, e, 0)
                    for d, acc in zip((d_gate, d_up, d_down), accs)))

  outs = jax.lax.fori_loop(0, group_sizes.shape[0], group, outs)
  return _cast(outs, lhs, gate, up, down)


def _dot(a, b, contract_a, contract_b, *, precision):
  return jax.lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())),
                             precision=precision, preferred_element_type=jnp.float32)


def _cast(grads, *primals):
  return tuple(d.astype(p.dtype) for d, p in zip(grads, primals))


def _rule(*, backward: bool, kept: int = 0):
  """The partitioning of the kernels and of the XLA formulas alike: over the experts' width
  ``f`` (Megatron's MLP: each device the gate and up columns and down rows of its share, the
  output summed over them) and the output features ``n``; the contraction ``k`` stays whole
  (the activation of a partial sum is not a partial sum), and so do the rows and the groups
  (the groups' row offsets are global). ``kept``: the kept products ``[m, f]`` after the
  output (forward) or before ``g`` (backward)."""
  lhs, w_in, w_out, sizes, out = ("m", "k"), ("g", "k", "f"), ("g", "f", "n"), ("g",), ("m", "n")
  products = (("m", "f"),) * kept
  if backward:
    operands = (lhs, w_in, w_in, w_out, sizes, *products, out)
    results = (lhs, w_in, w_in, w_out)
  else:
    operands, results = (lhs, w_in, w_in, w_out, sizes), (out, *products)
  return partitioning.Rule(operands, results, whole=("m", "g", "k"))


def _fwd(cfg, lhs, gate, up, down, group_sizes):
  # Residuals: the inputs and the kept products (named, so that a policy may drop them: then
  # the forward runs again for them); the backward recomputes the others once.
  inputs = (lhs, gate, up, down, group_sizes)
  keep = cfg.keep
  xla = functools.partial(_xla_forward, activation=cfg.activation, precision=cfg.precision,
                          keep=keep)
  kernel = (functools.partial(_tiled_forward, activation=cfg.activation,
                              precision=cfg.precision, keep=keep)
            if gmm._tiles_rows() else xla)
  out = cfg.run("grouped_mlp_forward", xla, *inputs, rule=_rule(backward=False, kept=len(keep)),
                xla_kernel=kernel, activation=cfg.activation, keep=keep)
  if not keep:
    return out, inputs
  out, *kept = out
  kept = [checkpoint_name(a, _NAMES[name]) for name, a in zip(keep, kept)]
  return out, (*inputs, *kept)


def _bwd(cfg, residuals, g):
  keep = cfg.keep
  xla = functools.partial(_xla_backward, activation=cfg.activation, precision=cfg.precision,
                          keep=keep)
  kernel = (functools.partial(_tiled_backward, activation=cfg.activation,
                              precision=cfg.precision, keep=keep)
            if gmm._tiles_rows() else xla)
  grads = cfg.run("grouped_mlp_backward", xla, *residuals, g,
                  rule=_rule(backward=True, kept=len(keep)), xla_kernel=kernel,
                  activation=cfg.activation, keep=keep)
  return (*grads, None)


# The custom VJP ---------------------------------------------------------------------------------


@partitioning.matching_vma
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _grouped_mlp(cfg, lhs, gate, up, down, group_sizes):
  # Not differentiated: nothing is kept, so no product is written.
  return _fwd(dataclasses.replace(cfg, keep=()), lhs, gate, up, down, group_sizes)[0]


_grouped_mlp.defvjp(_fwd, _bwd)
