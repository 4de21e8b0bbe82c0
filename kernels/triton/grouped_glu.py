"""Triton grouped gated linear unit kernels for Mixture-of-Experts, called from JAX through
jax-triton: the same functions as :mod:`jaxfuse.kernels.pallas.grouped_glu`, on the grouped
matmul's visits (:func:`jaxfuse.kernels.pallas.grouped_matmul.group_metadata`).

- :func:`grouped_glu_fwd_kernel`: ``out[rows of e] = act(lhs_e @ gate[e]) * (lhs_e @ up[e])``;
  one program per (visit, ``BLOCK_N`` column tile) accumulates both products over one K loop
  (each ``lhs`` tile loaded once for both) and writes the gated unit, not the products.
- :func:`grouped_glu_dproducts_kernel`: the same products recomputed, and the epilogue writes
  their gradients for the output gradient ``g``: ``g * up_e * act'(gate_e)`` and
  ``g * act(gate_e)`` (zeros past the groups).

``d lhs``, ``d gate`` and ``d up`` are then the grouped matmul's kernels
(:mod:`jaxfuse.kernels.triton.grouped_matmul`). Accumulation is float32; float32 operands
multiply in full precision (``input_precision="ieee"``), bfloat16 and float16 on the tensor
cores. The kernels also run under Triton's interpreter in tests.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from .elementwise import ACTIVATIONS, activation, activation_grad, refuses  # noqa: F401
from .grouped_matmul import (BLOCKS, NUM_STAGES, NUM_WARPS, _ieee, blocks_for, dot_accumulate, gmm,
                             tgmm)


@triton.jit
def _products(meta_ptr, lhs_ptr, gate_ptr, up_ptr, gate_kept_ptr, up_kept_ptr,
              ROWS: tl.constexpr, SIZE_K: tl.constexpr, SIZE_N: tl.constexpr,
              VISITS: tl.constexpr, IEEE: tl.constexpr, GIVEN_GATE: tl.constexpr,
              GIVEN_UP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
              BLOCK_N: tl.constexpr):
  """This program's visit: ``(lhs @ gate[e], lhs @ up[e])`` of its tile in float32 (a product
  that is ``GIVEN`` read from its kept ``[ROWS, SIZE_N]`` array instead), its output offsets,
  the rows it reads and the mask of what it writes."""
  v = tl.program_id(0)
  tile = tl.load(meta_ptr + v)
  group = tl.load(meta_ptr + VISITS + v)
  lo = tl.load(meta_ptr + 2 * VISITS + v)
  hi = tl.load(meta_ptr + 3 * VISITS + v)
  read_hi = tl.load(meta_ptr + 4 * VISITS + v)
  rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
  cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
  read = (rows >= lo) & (rows < read_hi) & (rows < ROWS)
  write = (rows >= lo) & (rows < hi) & (rows < ROWS)
  cols_ok = cols < SIZE_N
  base = group.to(tl.int64) * SIZE_K * SIZE_N
  acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
  acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
  # The pseudo-group's visits (rows past the groups) run no K step: zeros, and act(0) * 0 = 0.
  steps = tl.where(read_hi > lo, (SIZE_K + BLOCK_K - 1) // BLOCK_K, 0)
  if GIVEN_GATE and GIVEN_UP:
    steps = 0
  for step in range(steps):
    ks = step * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = ks < SIZE_K
    a = tl.load(lhs_ptr + rows[:, None].to(tl.int64) * SIZE_K + ks[None, :],
                mask=read[:, None] & k_ok[None, :], other=0.0)
    offsets = base + ks[:, None].to(tl.int64) * SIZE_N + cols[None, :]
    w_mask = k_ok[:, None] & cols_ok[None, :]
    if not GIVEN_GATE:
      b_gate = tl.load(gate_ptr + offsets, mask=w_mask, other=0.0)
      acc_gate = dot_accumulate(a, b_gate, acc_gate, IEEE)
    if not GIVEN_UP:
      b_up = tl.load(up_ptr + offsets, mask=w_mask, other=0.0)
      acc_up = dot_accumulate(a, b_up, acc_up, IEEE)
  out = rows[:, None].to(tl.int64) * SIZE_N + cols[None, :]
  given_mask = read[:, None] & cols_ok[None, :]
  if GIVEN_GATE:
    acc_gate = tl.load(gate_kept_ptr + out, mask=given_mask, other=0.0).to(tl.float32)
  if GIVEN_UP:
    acc_up = tl.load(up_kept_ptr + out, mask=given_mask, other=0.0).to(tl.float32)
  return acc_gate, acc_up, out, read, write[:, None] & cols_ok[None, :]


@triton.jit
def _forward(meta_ptr, lhs_ptr, gate_ptr, up_ptr, out_ptr, gate_kept_ptr, up_kept_ptr,
             ROWS: tl.constexpr, SIZE_K: tl.constexpr, SIZE_N: tl.constexpr,
             VISITS: tl.constexpr, IEEE: tl.constexpr, ACT: tl.constexpr,
             KEEP_GATE: tl.constexpr, KEEP_UP: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
  h_gate, h_up, out, _, mask = _products(meta_ptr, lhs_ptr, gate_ptr, up_ptr, lhs_ptr, lhs_ptr,
                                         ROWS, SIZE_K, SIZE_N, VISITS, IEEE, False, False,
                                         BLOCK_M, BLOCK_K, BLOCK_N)
  y = activation(h_gate, ACT) * h_up
  tl.store(out_ptr + out, y.to(out_ptr.dtype.element_ty), mask=mask)
  if KEEP_GATE:
    tl.store(gate_kept_ptr + out, h_gate.to(gate_kept_ptr.dtype.element_ty), mask=mask)
  if KEEP_UP:
    tl.store(up_kept_ptr + out, h_up.to(up_kept_ptr.dtype.element_ty), mask=mask)


@triton.jit
def grouped_glu_fwd_kernel(meta_ptr, lhs_ptr, gate_ptr, up_ptr, out_ptr, ROWS: tl.constexpr,
                           SIZE_K: tl.constexpr, SIZE_N: tl.constexpr, VISITS: tl.constexpr,
                           IEEE: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
  """``act(lhs_e @ gate[e]) * (lhs_e @ up[e])`` of one visit and column tile; ``meta_ptr``:
  int32 ``[5, VISITS]`` (see ``group_metadata``)."""
  _forward(meta_ptr, lhs_ptr, gate_ptr, up_ptr, out_ptr, out_ptr, out_ptr, ROWS, SIZE_K, SIZE_N,
           VISITS, IEEE, ACT, False, False, BLOCK_M, BLOCK_K, BLOCK_N)


@triton.jit
def grouped_mlp_fwd_kernel(meta_ptr, lhs_ptr, gate_ptr, up_ptr, out_ptr, first_kept_ptr,
                           second_kept_ptr, ROWS: tl.constexpr, SIZE_K: tl.constexpr,
                           SIZE_N: tl.constexpr, VISITS: tl.constexpr, IEEE: tl.constexpr,
                           ACT: tl.constexpr, KEEP_GATE: tl.constexpr, KEEP_UP: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                           BLOCK_N: tl.constexpr):
  """:func:`grouped_glu_fwd_kernel` that also writes the products it keeps (float32
  accumulators rounded to the arrays' dtype): the kept ones in the order gate, up, from
  ``first_kept_ptr`` (``second_kept_ptr``: a ``[1, 1]`` array not written when one is
  kept)."""
  if KEEP_GATE:
    _forward(meta_ptr, lhs_ptr, gate_ptr, up_ptr, out_ptr, first_kept_ptr, second_kept_ptr,
             ROWS, SIZE_K, SIZE_N, VISITS, IEEE, ACT, True, KEEP_UP, BLOCK_M, BLOCK_K,
             BLOCK_N)
  else:
    _forward(meta_ptr, lhs_ptr, gate_ptr, up_ptr, out_ptr, second_kept_ptr, first_kept_ptr,
             ROWS, SIZE_K, SIZE_N, VISITS, IEEE, ACT, False, KEEP_UP, BLOCK_M, BLOCK_K,
             BLOCK_N)


@triton.jit
def _dproducts(meta_ptr, lhs_ptr, gate_ptr, up_ptr, gate_kept_ptr, up_kept_ptr, g_ptr,
               d_gate_ptr, d_up_ptr, hidden_ptr, ROWS: tl.constexpr, SIZE_K: tl.constexpr,
               SIZE_N: tl.constexpr, VISITS: tl.constexpr, IEEE: tl.constexpr,
               ACT: tl.constexpr, HIDDEN: tl.constexpr, GIVEN_GATE: tl.constexpr,
               GIVEN_UP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
               BLOCK_N: tl.constexpr):
  h_gate, h_up, out, read, mask = _products(meta_ptr, lhs_ptr, gate_ptr, up_ptr, gate_kept_ptr,
                                            up_kept_ptr, ROWS, SIZE_K, SIZE_N, VISITS, IEEE,
                                            GIVEN_GATE, GIVEN_UP, BLOCK_M, BLOCK_K, BLOCK_N)
  act = activation(h_gate, ACT)
  if HIDDEN:
    tl.store(hidden_ptr + out, (act * h_up).to(hidden_ptr.dtype.element_ty), mask=mask)
  g = tl.load(g_ptr + out, mask=mask, other=0.0).to(tl.float32)
  g = tl.where(read[:, None], g, 0.0)
  tl.store(d_gate_ptr + out, (g * h_up * activation_grad(h_gate, ACT)).to(
      d_gate_ptr.dtype.element_ty), mask=mask)
  tl.store(d_up_ptr + out, (g * act).to(d_up_ptr.dtype.element_ty), mask=mask)


@triton.jit
def grouped_glu_dproducts_kernel(meta_ptr, lhs_ptr, gate_ptr, up_ptr, g_ptr, d_gate_ptr,
                                 d_up_ptr, ROWS: tl.constexpr, SIZE_K: tl.constexpr,
                                 SIZE_N: tl.constexpr, VISITS: tl.constexpr, IEEE: tl.constexpr,
                                 ACT: tl.constexpr, BLOCK_M: tl.constexpr,
                                 BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
  """The products' gradients of one visit and column tile: ``g * up_e * act'(gate_e)`` and
  ``g * act(gate_e)``, the products recomputed; zeros past the groups."""
  _dproducts(meta_ptr, lhs_ptr, gate_ptr, up_ptr, lhs_ptr, lhs_ptr, g_ptr, d_gate_ptr,
             d_up_ptr, d_up_ptr, ROWS, SIZE_K, SIZE_N, VISITS, IEEE, ACT, False, False, False,
             BLOCK_M, BLOCK_K, BLOCK_N)


@triton.jit
def grouped_mlp_dproducts_kernel(meta_ptr, lhs_ptr, gate_ptr, up_ptr, gate_kept_ptr,
                                 up_kept_ptr, g_ptr, d_gate_ptr, d_up_ptr, hidden_ptr,
                                 ROWS: tl.constexpr, SIZE_K: tl.constexpr,
                                 SIZE_N: tl.constexpr, VISITS: tl.constexpr, IEEE: tl.constexpr,
                                 ACT: tl.constexpr, GIVEN_GATE: tl.constexpr,
                                 GIVEN_UP: tl.constexpr, BLOCK_M: tl.constexpr,
                                 BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
  """:func:`grouped_glu_dproducts_kernel` for the gradient ``g`` of the gated unit, which it
  also writes: ``act(gate_e) * up_e``, for the down projection's weight gradient. A product
  that is ``GIVEN`` is read from its kept array (the forward's) instead of recomputed; one that
  is not is passed as any array and not read."""
  _dproducts(meta_ptr, lhs_ptr, gate_ptr, up_ptr, gate_kept_ptr, up_kept_ptr, g_ptr,
             d_gate_ptr, d_up_ptr, hidden_ptr, ROWS, SIZE_K, SIZE_N, VISITS, IEEE, ACT, True,
             GIVEN_GATE, GIVEN_UP, BLOCK_M, BLOCK_K, BLOCK_N)


def _launch(kernel, lhs, gate, up, group_sizes, extra, n_out, activation: str, blocks,
            flags=None, dummies=0):
  """One launch over the visits and column tiles: ``n_out`` ``[M, N]`` outputs in lhs's dtype,
  then ``dummies`` ``[1, 1]`` ones that the kernel does not write; ``flags``: its other
  constexpr arguments."""
  import jax
  import jax.numpy as jnp

  from ..pallas.grouped_matmul import group_metadata

  rows, size_k = lhs.shape
  groups, _, size_n = gate.shape
  out = jax.ShapeDtypeStruct((rows, size_n), lhs.dtype)
  if 0 in (rows, size_k, size_n, groups):
    zeros = jnp.zeros((rows, size_n), lhs.dtype)
    return zeros if n_out == 1 else (zeros,) * n_out
  block_m, block_k, block_n = blocks_for(rows, size_k, size_n, blocks)
  meta = group_metadata(group_sizes, rows, block_m)
  import jax_triton  # after the checks: without a GPU it raises ImportError

  shapes = [out] * n_out + [jax.ShapeDtypeStruct((1, 1), lhs.dtype)] * dummies
  result = jax_triton.triton_call(
      meta, lhs, gate, up, *extra, kernel=kernel,
      out_shape=shapes[0] if len(shapes) == 1 else shapes,
      grid=(meta.shape[1], math.ceil(size_n / block_n)), num_warps=NUM_WARPS,
      num_stages=NUM_STAGES, ROWS=rows, SIZE_K=size_k, SIZE_N=size_n, VISITS=meta.shape[1],
      IEEE=_ieee(lhs, gate, up), ACT=activation, **(flags or {}), BLOCK_M=block_m,
      BLOCK_K=block_k, BLOCK_N=block_n)
  return result if len(shapes) == 1 else tuple(result)[:n_out]


def grouped_glu_forward(lhs, gate, up, group_sizes, *, activation: str,
                        blocks: tuple[int, int, int] = BLOCKS):
  """``[M, N]``: ``act(lhs_e @ gate[e]) * (lhs_e @ up[e])`` for each group's rows, zeros past
  the groups (GPU)."""
  return _launch(grouped_glu_fwd_kernel, lhs, gate, up, group_sizes, (), 1, activation, blocks)


def grouped_glu_dproducts(lhs, gate, up, group_sizes, g, *, activation: str,
                          blocks: tuple[int, int, int] = BLOCKS):
  """The two products' gradients for the output gradient ``g``, the products recomputed
  (GPU)."""
  return _launch(grouped_glu_dproducts_kernel, lhs, gate, up, group_sizes, (g,), 2, activation,
                 blocks)


def grouped_glu_backward(lhs, gate, up, group_sizes, g, *, activation: str):
  """``(d lhs, d gate, d up)`` of :func:`grouped_glu_forward` for the output gradient ``g``:
  :func:`grouped_glu_dproducts_kernel`, two launches of the grouped matmul's ``gmm_kernel``
  reading the weights transposed (float32, summed by XLA and rounded once) and two of its
  ``tgmm_kernel``."""
  d_gate_out, d_up_out = grouped_glu_dproducts(lhs, gate, up, group_sizes, g,
                                               activation=activation)
  return _products_backward(lhs, gate, up, group_sizes, d_gate_out, d_up_out)


def _keep_flags(keep, prefix):
  return {f"{prefix}_GATE": "gate" in keep, f"{prefix}_UP": "up" in keep}


def grouped_mlp_forward(lhs, gate, up, down, group_sizes, *, activation: str,
                        keep: tuple[str, ...] = ()):
  """``[M, N]``: the experts' MLP, :func:`grouped_glu_fwd_kernel` then each group's down
  product (``gmm_kernel``), zeros past the groups (GPU). With ``keep`` (``"gate"``,
  ``"up"``): ``(out, *products)``, the kept products ``[M, F]`` in lhs's dtype written by
  :func:`grouped_mlp_fwd_kernel`."""
  if not keep:
    hidden = grouped_glu_forward(lhs, gate, up, group_sizes, activation=activation)
    return gmm(hidden, down, group_sizes)
  hidden, *kept = _launch(grouped_mlp_fwd_kernel, lhs, gate, up, group_sizes, (),
                          1 + len(keep), activation, BLOCKS, _keep_flags(keep, "KEEP"),
                          dummies=2 - len(keep))
  return (gmm(hidden, down, group_sizes), *kept)


def grouped_mlp_backward(lhs, gate, up, down, group_sizes, *kept_and_g, activation: str,
                         keep: tuple[str, ...] = ()):
  """``(d lhs, d gate, d up, d down)`` of the experts' MLP (``grouped_glu_forward`` then the
  down product) for the output gradient ``g`` (the last array), the gate and up products that
  ``keep`` does not name recomputed once (those it names come before ``g``):
  ``d hidden = g @ down[e]^T`` (``gmm_kernel``, rounded to lhs's dtype);
  :func:`grouped_mlp_dproducts_kernel`, which also writes the gated unit; ``d down`` from it
  (``tgmm_kernel``); then :func:`grouped_glu_backward`'s products."""
  *kept, g = kept_and_g
  given = dict(zip(keep, kept))
  d_hidden = gmm(g, down, group_sizes, transpose_rhs=True, out_dtype=lhs.dtype)
  d_gate_out, d_up_out, hidden = _launch(
      grouped_mlp_dproducts_kernel, lhs, gate, up, group_sizes,
      (given.get("gate", lhs), given.get("up", lhs), d_hidden), 3, activation, BLOCKS,
      _keep_flags(keep, "GIVEN"))
  d_down = tgmm(hidden, g, group_sizes, out_dtype=down.dtype)
  return (*_products_backward(lhs, gate, up, group_sizes, d_gate_out, d_up_out), d_down)


def _products_backward(lhs, gate, up, group_sizes, d_gate_out, d_up_out):
  """``(d lhs, d gate, d up)`` from the two products' gradients."""
  import jax.numpy as jnp

  dlhs = sum(gmm(d, w, group_sizes, transpose_rhs=True, out_dtype=jnp.float32)
             for d, w in ((d_gate_out, gate), (d_up_out, up)))
  d_gate = tgmm(lhs, d_gate_out, group_sizes, out_dtype=gate.dtype)
  d_up = tgmm(lhs, d_up_out, group_sizes, out_dtype=up.dtype)
  return dlhs.astype(lhs.dtype), d_gate, d_up
