"""Triton kernels for the seed's fused ``act(a + b)`` and its unfused chain (an add kernel, then
an ``act`` kernel), and relu's, called from JAX through jax-triton.

The kernels take flat pointers, the element count ``N`` and the activation ``ACT`` as
compile-time constants, and mask the tail block. They compute in float32 and store in the output
pointer's dtype. The same kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, torch CPU
tensors), which is how CPU tests check their bodies.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

# The activations these kernels implement; each matches jaxfuse.ops.activations of that name.
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh", "squared_relu",
               "identity")

BLOCK = 1024
NUM_WARPS = 4


def refuses(*, activation=None, **_) -> str | None:
  """Why these kernels cannot take a call (None: they can): an activation they lack. The
  activations' kernels (this module's, bias_activation's and gated_linear's) share it."""
  if activation is not None and activation not in ACTIVATIONS:
    return f"supports the named activations {ACTIVATIONS}, got activation={activation!r}"
  return None


@triton.jit
def _tanh(x):
  # tl.math has no tanh; use exp away from 0 and the Taylor series near it (no cancellation).
  ax = tl.abs(x)
  e = tl.exp(-2.0 * ax)
  far = (1.0 - e) / (1.0 + e)
  x2 = ax * ax
  near = ax * (1.0 - x2 * (1.0 / 3.0 - x2 * (2.0 / 15.0 - x2 * (17.0 / 315.0))))
  t = tl.where(ax < 0.1, near, far)
  return tl.where(x < 0.0, -t, t)


@triton.jit
def _sigmoid(x):
  return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _gelu_tanh_inner(x):
  return 0.7978845608028654 * (x + 0.044715 * x * x * x)


@triton.jit
def activation(x, ACT: tl.constexpr):
  """``ACT(x)`` for x in float32."""
  if ACT == "relu":
    y = tl.maximum(x, 0.0)
  elif ACT == "gelu":
    y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
  elif ACT == "gelu_tanh":
    y = 0.5 * x * (1.0 + _tanh(_gelu_tanh_inner(x)))
  elif ACT == "silu":
    y = x * _sigmoid(x)
  elif ACT == "sigmoid":
    y = _sigmoid(x)
  elif ACT == "tanh":
    y = _tanh(x)
  elif ACT == "squared_relu":
    r = tl.maximum(x, 0.0)
    y = r * r
  else:
    y = x
  return y


@triton.jit
def activation_grad(x, ACT: tl.constexpr):
  """``ACT'(x)`` for x in float32 (relu'(0) = 0, as torch)."""
  if ACT == "relu":
    d = tl.where(x > 0.0, 1.0, 0.0)
  elif ACT == "gelu":
    cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
    d = cdf + x * 0.3989422804014327 * tl.exp(-0.5 * x * x)
  elif ACT == "gelu_tanh":
    t = _tanh(_gelu_tanh_inner(x))
    d = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (
        1.0 + 3.0 * 0.044715 * x * x)
  elif ACT == "silu":
    s = _sigmoid(x)
    d = s * (1.0 + x * (1.0 - s))
  elif ACT == "sigmoid":
    s = _sigmoid(x)
    d = s * (1.0 - s)
  elif ACT == "tanh":
    t = _tanh(x)
    d = 1.0 - t * t
  elif ACT == "squared_relu":
    d = 2.0 * tl.maximum(x, 0.0)
  else:
    d = tl.full(x.shape, 1.0, tl.float32)
  return d


@triton.jit
def _block(N: tl.constexpr, BLOCK: tl.constexpr):
  """This program's flat offsets and the mask of its tail."""
  offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
  return offsets, offsets < N


@triton.jit
def _load(ptr, offsets, mask):
  return tl.load(ptr + offsets, mask=mask).to(tl.float32)


@triton.jit
def _store(ptr, offsets, value, mask):
  tl.store(ptr + offsets, value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def add_act_fwd_kernel(a_ptr, b_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr,
                       ACT: tl.constexpr):
  offsets, mask = _block(N, BLOCK)
  x = _load(a_ptr, offsets, mask) + _load(b_ptr, offsets, mask)
  _store(out_ptr, offsets, activation(x, ACT), mask)


@triton.jit
def add_act_bwd_kernel(a_ptr, b_ptr, g_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr,
                       ACT: tl.constexpr):
  offsets, mask = _block(N, BLOCK)
  x = _load(a_ptr, offsets, mask) + _load(b_ptr, offsets, mask)
  _store(out_ptr, offsets, _load(g_ptr, offsets, mask) * activation_grad(x, ACT), mask)


# The unfused chain's kernels: an add, then ``ACT`` alone, each reading and writing memory, and
# the backward of relu from its output. They are the baselines the fused kernels are measured
# against, and relu's kernels.


@triton.jit
def add_kernel(a_ptr, b_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
  offsets, mask = _block(N, BLOCK)
  _store(out_ptr, offsets, _load(a_ptr, offsets, mask) + _load(b_ptr, offsets, mask), mask)


@triton.jit
def act_fwd_kernel(c_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr, ACT: tl.constexpr):
  offsets, mask = _block(N, BLOCK)
  _store(out_ptr, offsets, activation(_load(c_ptr, offsets, mask), ACT), mask)


@triton.jit
def act_bwd_kernel(c_ptr, g_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr,
                   ACT: tl.constexpr):
  offsets, mask = _block(N, BLOCK)
  c = _load(c_ptr, offsets, mask)
  _store(out_ptr, offsets, _load(g_ptr, offsets, mask) * activation_grad(c, ACT), mask)


@triton.jit
def relu_bwd_from_output_kernel(y_ptr, g_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
  offsets, mask = _block(N, BLOCK)
  y = _load(y_ptr, offsets, mask)
  _store(out_ptr, offsets, tl.where(y > 0.0, _load(g_ptr, offsets, mask), 0.0), mask)


def grid_for(n: int, block: int = BLOCK) -> tuple[int]:
  return (max(1, math.ceil(n / block)),)


def _flat_call(kernel, inputs, out_dtype, **constants):
  """One launch of an elementwise ``kernel`` over the flattened same-shaped ``inputs``: its
  output in their shape, in ``out_dtype``."""
  import jax
  import jax.numpy as jnp
  import jax_triton

  shape, n = inputs[0].shape, inputs[0].size
  if n == 0:
    return jnp.zeros(shape, out_dtype)
  out = jax_triton.triton_call(
      *(x.reshape(n) for x in inputs), kernel=kernel,
      out_shape=jax.ShapeDtypeStruct((n,), out_dtype), grid=grid_for(n),
      num_warps=NUM_WARPS, N=n, BLOCK=BLOCK, **constants)
  return out.reshape(shape)


def add_act_forward(a, b, activation: str):
  """``activation(a + b)`` through jax-triton (GPU only)."""
  return _flat_call(add_act_fwd_kernel, (a, b), a.dtype, ACT=activation)


def add_act_backward(a, b, g, activation: str):
  """``g * activation'(a + b)`` through jax-triton (GPU only)."""
  return _flat_call(add_act_bwd_kernel, (a, b, g), a.dtype, ACT=activation)


def add_forward(a, b):
  """``a + b`` through jax-triton (GPU only): the first kernel of the unfused chain."""
  return _flat_call(add_kernel, (a, b), a.dtype)


def act_forward(c, activation: str):
  """``activation(c)`` through jax-triton (GPU only): the second kernel of the unfused chain."""
  return _flat_call(act_fwd_kernel, (c,), c.dtype, ACT=activation)


def act_backward(c, g, activation: str):
  """``g * activation'(c)`` through jax-triton (GPU only): the unfused chain's backward, reading the
  saved ``c``."""
  return _flat_call(act_bwd_kernel, (c, g), c.dtype, ACT=activation)


def relu_backward_from_output(y, g):
  """``g`` where ``y > 0``, else 0, through jax-triton (GPU only): relu's backward from its saved
  output."""
  return _flat_call(relu_bwd_from_output_kernel, (y, g), g.dtype)
