"""Grouped gated linear unit kernels for Mixture-of-Experts: the experts' first layer,
``out[rows of e] = act(lhs[rows of e] @ gate[e]) * (lhs[rows of e] @ up[e])``.

The forward walks the visits of :mod:`jaxfuse.kernels.pallas.grouped_matmul` (a row tile once
per group it holds, listed on the device by :func:`~.grouped_matmul.group_metadata`) on a
``(visits, N tiles)`` grid. Each program accumulates both products of its tile, ``lhs @ gate[e]``
and ``lhs @ up[e]``, in float32 over one K loop (each ``lhs`` tile is loaded once for both), and
applies the activation and the product in the epilogue: one ``[M, N]`` write in place of the two
``[M, N]`` products and the gated unit's pass over them.

The backward recomputes the two products in the same kernel with another epilogue
(:func:`grouped_glu_dproducts`): it reads the output gradient ``g`` and writes the gradients of
the two products, ``g * up_product * act'(gate_product)`` and ``g * act(gate_product)``, in
the inputs' dtype (zeros past the groups). The rest is the grouped matmul's kernels: ``d lhs``
is two launches of :func:`~.grouped_matmul.gmm` reading the weights transposed (float32, summed
by XLA and rounded once), ``d gate`` and ``d up`` two of :func:`~.grouped_matmul.tgmm`.

The experts' whole MLP (``jaxfuse.ops.grouped_mlp``) adds the down product:
:func:`grouped_mlp_backward` computes ``d hidden = g @ down[e]^T`` first, so that one
recomputation of the products serves both halves: the same kernel's epilogue also writes the
gated unit, which ``d down = hidden^T @ g`` reads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from .. import activations
from . import common, gated_linear
from .grouped_matmul import _fit, _precision, gmm, group_metadata, tgmm


def _kernel(meta_ref, lhs_ref, gate_ref, up_ref, *refs, fn, rows, size_k, size_n, bm, bk, bn,
            precision, backward, hidden, keep):
  """One visit times one column tile: both products, then the forward's or the backward's
  epilogue (the backward's with ``hidden`` also writes the gated unit). ``keep``: the forward
  also writes these products (``"gate"``, ``"up"``); the backward reads them instead of
  computing them."""
  v, j = pl.program_id(0), pl.program_id(1)
  tile, group, lo, hi, read_hi = (meta_ref[i, v] for i in range(5))
  row0, col0 = tile * bm, j * bn
  row = row0 + jax.lax.broadcasted_iota(jnp.int32, (bm,), 0)
  read = (row >= lo) & (row < read_hi) & (row < rows)
  write = (row >= lo) & (row < hi) & (row < rows)
  cols = col0 + jax.lax.broadcasted_iota(jnp.int32, (bn,), 0) < size_n
  dims = (((1,), (0,)), ((), ()))
  tile_at = lambda ref: ref.at[pl.ds(row0, bm), pl.ds(col0, bn)]
  mask = write[:, None] & cols[None, :]
  weights = {"gate": gate_ref, "up": up_ref}
  given = dict(zip(keep, refs)) if backward else {}
  refs = refs[len(given):]
  computed = [name for name in ("gate", "up") if name not in given]

  def body(step, accs):
    k0 = step * bk
    k_ok = k0 + jax.lax.broadcasted_iota(jnp.int32, (bk,), 0) < size_k
    a = pl_triton.load(lhs_ref.at[pl.ds(row0, bm), pl.ds(k0, bk)],
                       mask=read[:, None] & k_ok[None, :], other=0)
    w_mask = k_ok[:, None] & cols[None, :]
    dot = functools.partial(jax.lax.dot_general, dimension_numbers=dims, precision=precision,
                            preferred_element_type=jnp.float32)
    return tuple(acc + dot(a, pl_triton.load(weights[name].at[group, pl.ds(k0, bk),
                                                                pl.ds(col0, bn)],
                                             mask=w_mask, other=0))
                 for acc, name in zip(accs, computed))

  # Visits of the pseudo-group (rows past the sum) and unused visits run no K step: their
  # products are zeros (and act(0) * 0 = 0).
  steps = jnp.where(read_hi > lo, jnp.int32(pl.cdiv(size_k, bk)), jnp.int32(0))
  zeros = jnp.zeros((bm, bn), jnp.float32)
  products = dict(zip(computed, jax.lax.fori_loop(0, steps, body, (zeros,) * len(computed))
                      if computed else ()))
  for name, ref in given.items():
    products[name] = pl_triton.load(tile_at(ref), mask=read[:, None] & cols[None, :],
                                    other=0).astype(jnp.float32)
  h_gate, h_up = products["gate"], products["up"]
  if not backward:
    out_ref, *kept_refs = refs
    out = gated_linear._glu(fn, h_gate, h_up)
    pl_triton.store(tile_at(out_ref), out.astype(out_ref.dtype), mask=mask)
    for name, ref in zip(keep, kept_refs):
      pl_triton.store(tile_at(ref), products[name].astype(ref.dtype), mask=mask)
    return
  g_ref, d_gate_ref, d_up_ref, *hidden_ref = refs
  if hidden:
    pl_triton.store(tile_at(hidden_ref[0]),
                    gated_linear._glu(fn, h_gate, h_up).astype(hidden_ref[0].dtype), mask=mask)
  g = pl_triton.load(tile_at(g_ref), mask=mask, other=0).astype(jnp.float32)
  d_gate, d_up = gated_linear._glu_vjp(fn, h_gate, h_up, g)
  mine = read[:, None]
  pl_triton.store(tile_at(d_gate_ref), jnp.where(mine, d_gate, 0).astype(d_gate_ref.dtype),
                  mask=mask)
  pl_triton.store(tile_at(d_up_ref), jnp.where(mine, d_up, 0).astype(d_up_ref.dtype), mask=mask)


def _call(lhs, gate, up, group_sizes, g, activation, *, interpret, blocks, name, num_warps,
          hidden=False, keep=(), kept=()):
  """The forward (``g`` None: ``[M, N]``, then the products ``keep`` names) or the products'
  gradients (two ``[M, N]``; three with ``hidden``, the gated unit last), reading the
  products ``keep`` names from ``kept`` (in lhs's dtype) instead of computing them."""
  fn = activations.get(activation)
  rows, size_k = lhs.shape
  groups, _, size_n = gate.shape
  backward = g is not None
  out = jax.ShapeDtypeStruct((rows, size_n), lhs.dtype)
  n_out = 2 + hidden if backward else 1 + len(keep)
  out_shape = [out] * n_out
  if 0 in (rows, size_k, size_n, groups):
    zeros = jnp.zeros((rows, size_n), lhs.dtype)
    return (zeros,) * n_out if backward or keep else zeros
  bm, bk, bn = _fit(blocks, interpret, rows, size_k, size_n)
  meta = group_metadata(group_sizes, rows, bm)
  kernel = functools.partial(_kernel, fn=fn, rows=rows, size_k=size_k, size_n=size_n, bm=bm,
                             bk=bk, bn=bn, precision=_precision(lhs.dtype), backward=backward,
                             hidden=hidden, keep=keep)
  grid = (meta.shape[1], pl.cdiv(size_n, bn))
  whole = lambda shape: pl.BlockSpec(shape, lambda v, j: (0,) * len(shape))
  operands = [meta, lhs, gate, up] + ([*kept, g] if backward else [])
  elementwise = (functools.partial(gated_linear._glu_vjp, fn) if backward
                 else functools.partial(gated_linear._glu, fn))
  computed = 2 - len(kept)
  result = common.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=grid,
      in_specs=[whole(x.shape) for x in operands],
      out_specs=[whole(out.shape)] * n_out,
      interpret=interpret,
      compiler_params=common.triton_params(num_warps=num_warps),
      cost_estimate=common.cost(operands[1:], out_shape,
                                flops=2 * computed * rows * size_k * size_n,
                                fun=elementwise, args=[out] * (3 if backward else 2)),
      name=name,
  )(*operands)
  return tuple(result) if backward or keep else result[0]


def grouped_glu_forward(lhs: jax.Array, gate: jax.Array, up: jax.Array, group_sizes: jax.Array,
                        *, activation: str | Callable, interpret: bool = False,
                        blocks: tuple[int, int, int] | None = None,
                        num_warps: int = 4) -> jax.Array:
  """``[M, N]``: ``act(lhs_e @ gate[e]) * (lhs_e @ up[e])`` for each group's rows, zeros past
  the groups, in lhs's dtype (both products in float32, rounded once)."""
  return _call(lhs, gate, up, group_sizes, None, activation, interpret=interpret,
               blocks=blocks, name="grouped_glu_fwd", num_warps=num_warps)


def grouped_glu_dproducts(lhs: jax.Array, gate: jax.Array, up: jax.Array,
                          group_sizes: jax.Array, g: jax.Array, *, activation: str | Callable,
                          interpret: bool = False, blocks: tuple[int, int, int] | None = None,
                          num_warps: int = 4) -> tuple[jax.Array, jax.Array]:
  """The gradients of the two products for the output gradient ``g``, the products recomputed
  in the kernel: ``(g * up_e * act'(gate_e), g * act(gate_e))`` in lhs's dtype, zeros past the
  groups."""
  return tuple(_call(lhs, gate, up, group_sizes, g, activation, interpret=interpret,
                     blocks=blocks, name="grouped_glu_dproducts", num_warps=num_warps))


def grouped_glu_backward(lhs: jax.Array, gate: jax.Array, up: jax.Array,
                         group_sizes: jax.Array, g: jax.Array, *, activation: str | Callable,
                         interpret: bool = False):
  """``(d lhs, d gate, d up)`` of :func:`grouped_glu_forward` for the output gradient ``g``:
  :func:`grouped_glu_dproducts`, then the grouped matmul's kernels (two ``d lhs`` products in
  float32, summed and rounded once; two transposed grouped products)."""
  d_gate_out, d_up_out = grouped_glu_dproducts(lhs, gate, up, group_sizes, g,
                                               activation=activation, interpret=interpret)
  return _products_backward(lhs, gate, up, group_sizes, d_gate_out, d_up_out, interpret)


def grouped_mlp_forward(lhs: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
                        group_sizes: jax.Array, *, activation: str | Callable,
                        interpret: bool = False, keep: tuple[str, ...] = ()):
  """``[M, N]``: the experts' MLP, :func:`grouped_glu_forward`'s kernel then each group's down
  product (:func:`~.grouped_matmul.gmm`), zeros past the groups. With ``keep``
  (``"gate"``, ``"up"``): ``(out, *products)``, the kept products ``[M, F]`` in lhs's dtype,
  written by the first kernel's epilogue."""
  first = _call(lhs, gate, up, group_sizes, None, activation, interpret=interpret, blocks=None,
                name="grouped_mlp_fwd" if keep else "grouped_glu_fwd", num_warps=4, keep=keep)
  hidden, *kept = first if keep else (first,)
  out = gmm(hidden, down, group_sizes, interpret=interpret, name="grouped_mlp_down")
  return (out, *kept) if keep else out


def grouped_mlp_backward(lhs: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
                         group_sizes: jax.Array, *kept_and_g: jax.Array,
                         activation: str | Callable, interpret: bool = False,
                         keep: tuple[str, ...] = ()):
  """``(d lhs, d gate, d up, d down)`` of the experts' MLP ``grouped_glu_forward(...) @
  down[e]`` for the output gradient ``g`` (the last array), with one recomputation of the gate
  and up products that ``keep`` does not name (those it names come before ``g``, as
  :func:`grouped_mlp_forward` wrote them):

  ``d hidden = g @ down[e]^T`` (:func:`~.grouped_matmul.gmm`, rounded to lhs's dtype, as the
  composed ops round it); the products' gradients for it, the products recomputed or read,
  with the gated unit ``hidden`` written by the same kernel; ``d down = hidden^T @ g``
  (``tgmm``); then :func:`grouped_glu_backward`'s products.
  """
  *kept, g = kept_and_g
  d_hidden = gmm(g, down, group_sizes, transpose_rhs=True, out_dtype=lhs.dtype,
                 interpret=interpret, name="grouped_mlp_dhidden")
  d_gate_out, d_up_out, hidden = _call(lhs, gate, up, group_sizes, d_hidden, activation,
                                       interpret=interpret, blocks=None,
                                       name="grouped_mlp_dproducts", num_warps=4, hidden=True,
                                       keep=keep, kept=tuple(kept))
  d_down = tgmm(hidden, g, group_sizes, out_dtype=down.dtype, interpret=interpret,
                name="grouped_mlp_ddown")
  return (*_products_backward(lhs, gate, up, group_sizes, d_gate_out, d_up_out, interpret),
          d_down)


def _products_backward(lhs, gate, up, group_sizes, d_gate_out, d_up_out, interpret):
  """``(d lhs, d gate, d up)`` from the two products' gradients."""
  dlhs = (gmm(d_gate_out, gate, group_sizes, transpose_rhs=True, out_dtype=jnp.float32,
              interpret=interpret, name="grouped_glu_dlhs_gate")
          + gmm(d_up_out, up, group_sizes, transpose_rhs=True, out_dtype=jnp.float32,
                interpret=interpret, name="grouped_glu_dlhs_up"))
  d_gate = tgmm(lhs, d_gate_out, group_sizes, out_dtype=gate.dtype, interpret=interpret,
                name="grouped_glu_dgate")
  d_up = tgmm(lhs, d_up_out, group_sizes, out_dtype=up.dtype, interpret=interpret,
              name="grouped_glu_dup")
  return dlhs.astype(lhs.dtype), d_gate, d_up
