"""The measurement helpers measure what they claim."""

import time

import jax
import jax.numpy as jnp
import pytest
import torch

import jaxfuse
from jaxfuse import metrics


def test_residual_bytes_counts_what_the_backward_keeps():
  x = jnp.ones((128,))
  assert metrics.residual_bytes(lambda x: jnp.sum(x * 2.0), x) == 0       # linear: nothing
  assert metrics.residual_bytes(lambda x: jnp.sum(jnp.sin(x)), x) == 512  # cos(x)
  assert metrics.residual_bytes(lambda x: jnp.sum(x * x), x) == 0         # x itself is an input
  # A value used by two backward rules (exp's and the product's) counts once.
  def square_of_exp(x):
    e = jnp.exp(x)
    return jnp.sum(e * e)

  assert metrics.residual_bytes(square_of_exp, x) == 512


def test_residual_bytes_leaves_out_views_of_inputs_and_closed_over_values():
  w = jnp.ones((16, 8))
  x = jnp.ones((4, 8))
  assert metrics.residual_bytes(lambda x: jnp.sum(x @ w.T), x) == 0
  # The square's backward keeps 2 * (x @ w.T); w.T is a view of an input and is not counted.
  kept = metrics.residuals(lambda x, w: jnp.sum((x @ w.T) ** 2), x, w)
  assert [(r.shape, r.dtype) for r in kept] == [((4, 16), "float32")]


def test_recompute_keeps_only_inputs():
  f = lambda x: jnp.sum(jnp.tanh(jnp.tanh(x) * 3.0))  # noqa: E731
  x = jnp.ones((64,))
  assert metrics.residual_bytes(f, x) > 0
  assert metrics.residual_bytes(jaxfuse.recompute(f), x) == 0


def test_recompute_policy_keeps_named_values():
  def f(x):
    y = jaxfuse.remat.checkpoint_name(jnp.sin(x), "kept")
    return jnp.sum(jnp.sin(y))

  x = jnp.ones((64,))
  assert metrics.residual_bytes(jaxfuse.recompute(f, policy=["kept"]), x) == 64 * 4
  assert metrics.residual_bytes(jaxfuse.recompute(f, policy="nothing"), x) == 0
  assert jnp.allclose(jax.grad(jaxfuse.recompute(f, policy="dots"))(x), jax.grad(f)(x))
  with pytest.raises(ValueError, match="policy must be"):
    jaxfuse.recompute(f, policy="some")


def test_torch_residual_bytes_dedupes_storage_and_excludes_inputs():
  x = torch.ones(256, requires_grad=True)
  assert metrics.torch_residual_bytes(lambda: torch.sin(x).sum(), exclude=[x]) == 0
  # exp saves its output; the product saves both factors, the same tensor: counted once.
  assert metrics.torch_residual_bytes(lambda: (torch.exp(x) * torch.exp(x)).sum(),
                                      exclude=[x]) == 2 * 256 * 4


def test_bytes_moved_sums_the_kernels_and_none_without_kernels():
  a = jnp.ones((1000,))
  assert metrics.bytes_moved(lambda a: a * 2, a) is None
  f = lambda a, b: jaxfuse.ops.add_act(a, b, "relu", implementation="pallas")  # noqa: E731
  step = jax.jit(jax.value_and_grad(lambda a, b: jnp.sum(f(a, b)), (0, 1)))
  costs = metrics.kernel_costs(step, a, a)  # traced for a GPU: no interpret mode needed
  assert [c.name for c in costs] == ["add_act_fwd", "add_act_bwd"]
  assert [(c.reads, c.writes, c.exact) for c in costs] == [(8000, 4000, True),
                                                          (12000, 4000, True)]
  assert [c.bytes_accessed for c in costs] == [3 * 4000, 4 * 4000]
  assert metrics.bytes_moved(step, a, a) == 7 * 4000
  # The forward's operands: a and b read once, the output written once.
  assert [(o.role, o.reads, o.writes) for o in costs[0].operands] == [
      ("input", 4000, 0), ("input", 4000, 0), ("output", 0, 4000)]


def test_kernel_costs_can_trace_for_the_current_platform():
  a = jnp.ones((100_000,))
  f = lambda a, b: jaxfuse.ops.add_act(a, b, "relu", implementation="pallas")  # noqa: E731
  with jaxfuse.pallas_interpret():
    here = metrics.kernel_traffic(f, a, a)  # traced as is: interpret mode's bigger blocks
    with jaxfuse.ops.dispatch.target_platform("gpu"):
      gpu = metrics.kernel_traffic(f, a, a)
    costs = metrics.kernel_costs(f, a, a, platform=None)
  assert (here[0].programs, gpu[0].programs) == (2, 49)
  assert here[0].bytes == gpu[0].bytes == costs[0].bytes_accessed == 3 * a.nbytes


def test_xla_cost_reports_bytes():
  cost = metrics.xla_cost(lambda a, b: jax.nn.relu(a + b), jnp.ones(1024), jnp.ones(1024))
  assert cost["bytes_accessed"] == 3 * 4096


def test_timing_interleaves_and_counts_runs():
  calls = []
  fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
  timings = metrics.interleaved(fns, warmup=1, runs=4, sync=lambda out: out)
  assert calls[:3] == ["a", "b", "c"]  # warm-up
  rounds = [calls[3 + 3 * i: 6 + 3 * i] for i in range(4)]
  assert all(sorted(r) == ["a", "b", "c"] for r in rounds)  # every candidate once per round
  assert len({tuple(r) for r in rounds}) > 1  # in shuffled orders
  assert timings["a"].runs == 4 and timings["a"].min <= timings["a"].median <= timings["a"].max
  calls.clear()
  metrics.interleaved(fns, warmup=0, runs=2, sync=lambda out: out, shuffle_seed=None)
  assert calls == ["a", "b", "c", "a", "b", "c"]


def test_timing_adds_rounds_until_min_seconds():
  fns = {"nap": lambda: time.sleep(0.01)}
  timed = metrics.interleaved(fns, warmup=0, runs=2, sync=lambda out: out, min_seconds=0.1,
                              max_runs=50)
  assert 8 <= timed["nap"].runs < 50  # ~0.1 s of 10 ms naps, not the 2 asked for
  capped = metrics.interleaved(fns, warmup=0, runs=2, sync=lambda out: out, min_seconds=10.0,
                               max_runs=3)
  assert capped["nap"].runs == 3


class _Device:
  def __init__(self, stats):
    self.stats = stats

  def memory_stats(self):
    if isinstance(self.stats, Exception):
      raise self.stats
    return self.stats


def test_peak_bytes_reads_the_device_statistics():
  assert metrics.peak_bytes(_Device({"peak_bytes_in_use": 123, "bytes_in_use": 7})) == 123
  assert metrics.peak_bytes(_Device({"bytes_in_use": 7})) is None     # no peak reported
  assert metrics.peak_bytes(_Device(None)) is None                    # XLA:CPU's answer
  assert metrics.peak_bytes(_Device(RuntimeError("unsupported"))) is None
  if jax.default_backend() == "cpu":
    assert metrics.peak_bytes() is None


def test_compiled_memory_reports_the_temporaries():
  """Sorting exp(x) needs the exponentials in a temporary buffer."""
  x = jnp.ones((1024, 1024))
  stats = metrics.compiled_memory(lambda x: jnp.sort(jnp.exp(x), axis=0).sum(), x)
  assert stats["argument_bytes"] == 4 * 1024 * 1024
  assert stats["output_bytes"] == 4
  assert stats["temp_bytes"] >= 4 * 1024 * 1024


def test_flops_of_grouped_products_count_each_row_once():
  """A grouped product (``ragged_dot``) is 2·M·K·N: each row times its own group's matrix, in
  the forward and in both backward products (the per-group weight gradient included)."""
  x, w = jnp.ones((16, 4)), jnp.ones((2, 4, 3))
  sizes = jnp.array([10, 6], jnp.int32)

  def product(x, w):
    return jax.lax.ragged_dot(x, w, sizes)

  assert metrics.flops(product, x, w) == 2 * 16 * 4 * 3
  step = lambda x, w: jax.vjp(product, x, w)[1](jnp.ones((16, 3)))  # noqa: E731
  assert metrics.flops(step, x, w) == 3 * 2 * 16 * 4 * 3
