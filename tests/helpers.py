"""Small test utilities shared by the op tests: torch conversion, tolerances, GPU lowering."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jaxfuse.ops import dispatch

ON_GPU = jax.default_backend() == "gpu"

# Implementations every op is tested with on this machine: XLA, and Pallas (interpret mode on
# CPU). Triton kernels are tested through their own interpreter tests on CPU.
CPU_IMPLEMENTATIONS = ("xla", "pallas")

TORCH_DTYPES = {
    jnp.dtype("float32"): torch.float32,
    jnp.dtype("bfloat16"): torch.bfloat16,
    jnp.dtype("float16"): torch.float16,
    jnp.dtype("float64"): torch.float64,
}


def to_torch(x, dtype=None, requires_grad=False) -> torch.Tensor:
  """A torch CPU tensor from a JAX array (through float32 for bfloat16)."""
  x = jnp.asarray(x)
  t = torch.from_numpy(np.asarray(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x).copy())
  t = t.to(dtype or TORCH_DTYPES[jnp.dtype(x.dtype)])
  return t.requires_grad_(requires_grad)


def to_numpy(x) -> np.ndarray:
  """A float64 numpy copy of a JAX array or torch tensor."""
  if isinstance(x, torch.Tensor):
    return x.detach().to(torch.float64).numpy()
  return np.asarray(jnp.asarray(x).astype(jnp.float32), dtype=np.float64)


def random_pair(shape, dtype, seed=0):
  """``(a, b, g)``: two inputs (``a`` scaled by 2, to reach the activations' tails) and a
  cotangent, drawn from one seed."""
  ka, kb, kg = jax.random.split(jax.random.key(seed), 3)
  a = (2 * jax.random.normal(ka, shape)).astype(dtype)
  b = jax.random.normal(kb, shape).astype(dtype)
  g = jax.random.normal(kg, shape).astype(dtype)
  return a, b, g


def jax_value_and_grads(fn, args, g):
  """``(fn(*args), *grads)`` with the gradients pulled back from cotangent ``g``, under jit."""
  @jax.jit
  def run(args, g):
    out, vjp = jax.vjp(fn, *args)
    return (out, *vjp(g))
  return run(tuple(args), g)


def torch_value_and_grads(fn, args, g, dtype=None):
  """``(fn(*targs), *grads)`` in torch: ``args`` converted (to ``dtype`` if given), backward
  from ``g``."""
  targs = [to_torch(a, dtype, requires_grad=True) for a in args]
  out = fn(*targs)
  out.backward(to_torch(g, dtype))
  return (out, *(t.grad for t in targs))


def max_err(a, b) -> float:
  a, b = to_numpy(a), to_numpy(b)
  assert a.shape == b.shape, (a.shape, b.shape)
  return float(np.max(np.abs(a - b))) if a.size else 0.0


# float32 against a float32 twin: rtol 1e-5 and torch.testing's float32 atol. Two correct float32
# computations of a derivative like 1 - tanh(x)^2 near saturation differ by ~2e-6 (both are that
# far from the float64 value), so a tighter atol would test rounding noise.
FP32_RTOL, FP32_ATOL = 1e-5, 1e-5


def assert_close(got, want, *, rtol: float = FP32_RTOL, atol: float = FP32_ATOL,
                 what: str = "") -> None:
  """``|got - want| <= atol + rtol * |want|`` elementwise, with a readable failure."""
  got, want = to_numpy(got), to_numpy(want)
  assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
  np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=what)


def assert_within_torch_error(got, reference, torch_low, *, k: float = 2.0, floor: float = 0.0,
                              what: str = "") -> None:
  """The low-precision rule (FlashAttention's tests): jaxfuse's error against a float64
  reference is at most ``k`` times torch's error in the same low precision (plus ``floor``)."""
  ours = max_err(got, reference)
  theirs = max_err(torch_low, reference)
  assert ours <= k * theirs + floor, (
      f"{what}: error {ours:.3e} > {k} x torch's {theirs:.3e} + {floor:.1e}")


def lower_for_gpu(f, *args) -> str:
  """Lowers ``f`` for CUDA through Pallas' Triton path, on any machine; returns the HLO text."""
  with dispatch.target_platform("gpu"):
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def triton_kernel_names(hlo_text: str) -> list[str]:
  """Names of the Pallas (Triton) kernels in lowered HLO, one entry per launch."""
  return re.findall(r'name = "([^"]*)"', hlo_text)
