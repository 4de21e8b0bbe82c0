"""Elementwise Pallas kernels: the seed's fused ``fn(a + b)`` and its unfused two-kernel chain.

All of them flatten their same-shaped inputs to one dimension (free for contiguous arrays) and
walk it in power-of-2 blocks; the last block may run past the end, and its loads and stores are
masked there (Pallas' Triton lowering does not mask block reads on its own), so any size works.
Low-precision inputs are computed in float32 and rounded once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from .. import activations
from . import common

# Elements per program: big enough to stream, small enough for registers on a GPU. Interpret
# mode walks the grid in a loop, so it uses big blocks to stay fast.
GPU_BLOCK = 2048
INTERPRET_BLOCK = 1 << 16


def elementwise_call(body: Callable[..., Sequence[jax.Array]], inputs: Sequence[jax.Array],
                     out_dtypes: Sequence, *, name: str, interpret: bool,
                     block_size: int | None = None, reference: Callable | None = None,
                     num_warps: int = 4) -> list[jax.Array]:
  """Runs ``body`` blockwise over same-shaped ``inputs`` in one kernel.

  Args:
    body: maps the input blocks (in the compute dtype) to a sequence of output blocks.
    inputs: arrays of one shape.
    out_dtypes: the dtype of each output; outputs take the inputs' shape.
    name: the kernel's name (it shows in profiles and in lowered HLO).
    interpret: run in Pallas interpret mode (CPU tests).
    block_size: elements per program; a power of 2. Defaults by mode.
    reference: the whole-array jnp computation, for the FLOP count of the cost estimate
      (a scheduling hint for XLA).
    num_warps: Triton warps per program.

  Returns:
    The outputs, in the inputs' shape.
  """
  shape = inputs[0].shape
  n = math.prod(shape)
  if n == 0:
    return [jnp.zeros(shape, dt) for dt in out_dtypes]
  cap = block_size or (INTERPRET_BLOCK if interpret else GPU_BLOCK)
  block = common.block_for(n, cap)
  spec = pl.BlockSpec((block,), lambda i: (i,))
  n_in = len(inputs)
  kinds = [common.compute_dtype(x.dtype) for x in inputs]

  def kernel(*refs):
    mask = common.tail_mask(0, block, n)
    values = [pl_triton.load(r, mask=mask, other=0).astype(kind)
              for r, kind in zip(refs[:n_in], kinds)]
    for ref, value in zip(refs[n_in:], body(*values)):
      pl_triton.store(ref, value.astype(ref.dtype), mask=mask)

  out_shapes = [jax.ShapeDtypeStruct((n,), dt) for dt in out_dtypes]
  estimate = common.cost(inputs, out_shapes, fun=reference)
  outs = common.pallas_call(
      kernel,
      out_shape=out_shapes,
      grid=(pl.cdiv(n, block),),
      in_specs=[spec] * n_in,
      out_specs=[spec] * len(out_shapes),
      interpret=interpret,
      compiler_params=common.triton_params(num_warps=num_warps),
      cost_estimate=estimate,
      name=name,
  )(*[x.reshape(n) for x in inputs])
  return [o.reshape(shape) for o in outs]


def _vjp(fn, x, g):
  return jax.vjp(fn, x)[1](g)[0]


def add_act_forward(a, b, activation, *, interpret=False, block_size=None, out_dtype=None):
  """``activation(a + b)`` in one kernel: reads a and b, writes the result."""
  fn = activations.get(activation)
  out_dtype = out_dtype or a.dtype
  return elementwise_call(lambda x, y: (fn(x + y),), [a, b], [out_dtype], name="add_act_fwd",
                          interpret=interpret, block_size=block_size,
                          reference=lambda x, y: fn(x + y))[0]


def add_act_backward(a, b, g, activation, *, interpret=False, block_size=None):
  """``g * activation'(a + b)`` in one kernel, recomputing ``a + b`` instead of reading it
  back."""
  fn = activations.get(activation)
  return elementwise_call(lambda x, y, dy: (_vjp(fn, x + y, dy),), [a, b, g], [a.dtype],
                          name="add_act_bwd", interpret=interpret, block_size=block_size,
                          reference=lambda x, y, dy: _vjp(fn, x + y, dy))[0]


def add_forward(a, b, *, interpret=False, block_size=None):
  """``a + b``: the first kernel of the unfused chain."""
  return elementwise_call(lambda x, y: (x + y,), [a, b], [a.dtype], name="add",
                          interpret=interpret, block_size=block_size,
                          reference=lambda x, y: x + y)[0]


def act_forward(c, activation, *, interpret=False, block_size=None, out_dtype=None):
  """``activation(c)``: the second kernel of the unfused chain."""
  fn = activations.get(activation)
  return elementwise_call(lambda x: (fn(x),), [c], [out_dtype or c.dtype], name="act_fwd",
                          interpret=interpret, block_size=block_size, reference=fn)[0]


def act_backward(c, g, activation, *, interpret=False, block_size=None):
  """``g * activation'(c)``: the unfused chain's backward, which reads the saved ``c``."""
  fn = activations.get(activation)
  return elementwise_call(lambda x, dy: (_vjp(fn, x, dy),), [c, g], [c.dtype],
                          name="act_bwd", interpret=interpret, block_size=block_size,
                          reference=lambda x, dy: _vjp(fn, x, dy))[0]


def relu_backward_from_output(y, g, *, interpret=False, block_size=None):
  """``g`` where ``y > 0``, else 0: relu's backward from its saved output (as torch keeps)."""
  return elementwise_call(lambda out, dy: (jnp.where(out > 0, dy, jnp.zeros_like(dy)),),
                          [y, g], [g.dtype], name="relu_bwd", interpret=interpret,
                          block_size=block_size)[0]
