"""Small test utilities shared by the op tests: torch conversion, tolerances, GPU lowering."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jaxfuse.ops import dispatch

ON_GPU = jax.default_backend() == "gpu"

# The tests compile many small programs and run each once: skip LLVM's optimizations.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}

# Implementations every op is tested with on this machine: XLA, and Pallas (interpret mode on
# CPU). Triton kernels are tested through their own interpreter tests on CPU.
CPU_IMPLEMENTATIONS = ("xla", "pallas")
# The C++ CPU kernels, where this machine can build them; the op tables test them for the ops
# that have them (TABLE_IMPLEMENTATIONS is filtered by each case's op).
CPU_KERNELS = ("cpu",) if dispatch.runs_natively("cpu") else ()
TABLE_IMPLEMENTATIONS = CPU_IMPLEMENTATIONS + CPU_KERNELS

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


# Random inputs are drawn by numpy: jax.random compiles its sampler anew for every shape it
# draws (seconds for a rank-4 shape on a CPU), and the tests draw inputs of many shapes.


def numpy_normals(seed, *shapes) -> tuple[np.ndarray, ...]:
  """float32 standard normal numpy arrays of ``shapes``, drawn in turn from one generator
  seeded with ``seed``."""
  rng = np.random.default_rng(seed)
  return tuple(rng.standard_normal(shape, dtype=np.float32) for shape in shapes)


def to_jax(dtype, *arrays) -> tuple[jax.Array, ...]:
  """Numpy arrays as JAX arrays of ``dtype`` (rounded to nearest even, as XLA does)."""
  return tuple(jnp.asarray(np.asarray(x).astype(jnp.dtype(dtype))) for x in arrays)


def normals(seed, *shapes, dtype=jnp.float32, scale=1.0) -> tuple[jax.Array, ...]:
  """Standard normal arrays of ``shapes`` (times ``scale``, in ``dtype``), drawn in turn from
  one generator seeded with ``seed``."""
  return to_jax(dtype, *(scale * x for x in numpy_normals(seed, *shapes)))


def normal(seed, shape, dtype=jnp.float32, scale=1.0) -> jax.Array:
  """One array of :func:`normals`."""
  return normals(seed, shape, dtype=dtype, scale=scale)[0]


def random_pair(shape, dtype, seed=0):
  """``(a, b, g)``: two inputs (``a`` scaled by 2, to reach the activations' tails) and a
  cotangent, drawn from one seed."""
  a, b, g = numpy_normals(seed, shape, shape, shape)
  return to_jax(dtype, 2 * a, b, g)


def jax_value_and_grads(fn, args, g):
  """``(fn(*args), *grads)`` with the gradients pulled back from cotangent ``g``, under jit."""
  def run(args, g):
    out, vjp = jax.vjp(fn, *args)
    return (out, *vjp(g))
  return jax.jit(run, compiler_options=FAST_COMPILE)(tuple(args), g)


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


# The one tolerance rule of the test suite:
# - float32 against a float32 (or float64) twin: elementwise |got - want| <= rtol |want| + atol
#   with rtol = 1e-5 and atol = 1e-5 times the larger of 1 and the largest |want|. A float32
#   sum over many terms (a weight gradient, a row reduction) rounds in proportion to its
#   largest terms, so the absolute part scales with the array; torch.testing's float32 atol is
#   the same 1e-5 at unit scale.
# - bfloat16/float16: against a float64 reference, the error is at most k = 2 times that of the
#   twin computed in the same low precision (FlashAttention's and Cut Cross-Entropy's rule):
#   :func:`assert_within_low_precision_error`.
FP32_RTOL, FP32_ATOL = 1e-5, 1e-5


def assert_close(got, want, *, rtol: float = FP32_RTOL, atol: float | None = None,
                 what: str = "") -> None:
  """The float32 rule above (``atol=0, rtol=0`` asks for equality)."""
  got, want = to_numpy(got), to_numpy(want)
  assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
  if atol is None:
    scale = float(np.max(np.abs(want[np.isfinite(want)]))) if np.isfinite(want).any() else 0.0
    atol = FP32_ATOL * max(1.0, scale)
  np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=what)


def assert_within_low_precision_error(got, reference, twin_low, *, k: float = 2.0,
                                      floor: float | None = None, what: str = "") -> None:
  """The low-precision rule above: jaxfuse's error against a float64 (or float32) ``reference``
  is at most ``k`` times the error of ``twin_low``, the twin (torch, or flax for the modules) in
  the same low precision, plus ``floor``: by default the float32 rule's absolute tolerance, for
  outputs that the twin computes exactly (low-precision parameters promoted to float32)."""
  if floor is None:
    scale = float(np.max(np.abs(to_numpy(reference)))) if np.size(reference) else 0.0
    floor = FP32_ATOL * max(1.0, scale)
  ours = max_err(got, reference)
  theirs = max_err(twin_low, reference)
  assert ours <= k * theirs + floor, (
      f"{what}: error {ours:.3e} > {k} x the twin's {theirs:.3e} + {floor:.1e}")


def lower_for_gpu(f, *args) -> str:
  """Lowers ``f`` for CUDA through Pallas' Triton path, on any machine; returns the HLO text."""
  with dispatch.target_platform("gpu"):
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def triton_kernel_names(hlo_text: str) -> list[str]:
  """Names of the Pallas (Triton) kernels in lowered HLO, one entry per launch."""
  return re.findall(r'name = "([^"]*)"', hlo_text)


# Second order -------------------------------------------------------------------------------------


def jax_hessian_vector_products(fn, args, w, vs):
  """``H v`` of ``L(args) = sum(fn(*args) * w)`` for directions ``vs`` (one per arg), twice: by
  reverse over reverse (``grad`` of ``<grad L, v>``) and by forward over reverse (``jvp`` of
  ``grad L``). Returns ``(reverse, forward)``, a tuple of arrays each."""
  def loss(*args):
    return jnp.sum(fn(*args).astype(jnp.float32) * w)

  argnums = tuple(range(len(args)))
  grad = jax.grad(loss, argnums=argnums)

  def directional(*args):
    return sum(jnp.vdot(g, v) for g, v in zip(grad(*args), vs))

  reverse = jax.jit(jax.grad(directional, argnums=argnums), compiler_options=FAST_COMPILE)(*args)
  forward = jax.jit(lambda args, vs: jax.jvp(lambda *a: grad(*a), args, vs)[1],
                    compiler_options=FAST_COMPILE)(tuple(args), tuple(vs))
  return reverse, forward


def torch_hessian_vector_products(fn, args, w, vs):
  """``H v`` of ``sum(fn(*args) * w)`` by torch's double backward, in float64."""
  targs = [to_torch(a, torch.float64, requires_grad=True) for a in args]
  loss = (fn(*targs) * to_torch(w, torch.float64)).sum()
  grads = torch.autograd.grad(loss, targs, create_graph=True)
  directional = sum((g * to_torch(v, torch.float64)).sum() for g, v in zip(grads, vs))
  return torch.autograd.grad(directional, targs, allow_unused=True)


def assert_second_order_close(got, want, *, rtol: float = FP32_RTOL, what: str = "") -> None:
  """float32 second derivatives against float64 ones: within ``rtol`` of the largest entry.

  A Hessian-vector product sums products of first and second derivatives over every element;
  its float32 rounding error grows with that sum, so the tolerance is relative to the result's
  scale rather than elementwise.
  """
  for i, (g, t) in enumerate(zip(got, want)):
    t = np.zeros(np.shape(g)) if t is None else to_numpy(t)
    scale = max(float(np.max(np.abs(t))) if t.size else 0.0, 1e-30)
    assert_close(g, t, rtol=0.0, atol=rtol * scale, what=f"{what} arg {i}")
