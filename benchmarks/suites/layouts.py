"""The weight-gradient layout of ``jaxfuse.ops.dense`` on CPU: ``a^T @ b`` as XLA's own
``dot_general`` (both operands contracted over their rows) against a transposed copy of ``a``
and a row-major product (what ``dense`` does for large products with the narrower ``a``).

Cases ``rows_product n,p,q``: ``a`` is ``[n, p]``, ``b`` is ``[n, q]`` float32, as the kernel
gradient of a ``[p -> q]`` projection over ``n`` tokens. Rows:

- ``jax-unfused``: ``lax.dot_general`` contracting axis 0 of both (XLA's layout choice);
- ``jaxfuse-xla``: ``jaxfuse.ops.linear._rows_product`` (the copy where it applies).

Plus one case ``gated_mlp ...``: a GatedMLP forward + backward with the copy on (``jaxfuse-xla``)
and off (``jax-unfused``, the threshold raised so that no product takes the copy).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks import harness
from benchmarks.records import Record
from jaxfuse.ops import linear as linear_ops
from jaxfuse.remat import mlp as blocks

SUITE = "layouts"
_HIGHEST = jax.lax.Precision.HIGHEST


def _rows_product_case(ctx, n, p, q) -> list[Record]:
  case = f"rows_product n,p,q={n},{p},{q}"
  ctx.step(case)
  ka, kb = jax.random.split(jax.random.key(n + p + q))
  a, b = jax.random.normal(ka, (n, p)), jax.random.normal(kb, (n, q))
  plain = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())),
                                                   precision=_HIGHEST))
  ours = jax.jit(lambda a, b: linear_ops._rows_product(a, b, jnp.float32, _HIGHEST))
  times = ctx.time({"jax-unfused": lambda: plain(a, b), "jaxfuse-xla": lambda: ours(a, b)})
  copied = linear_ops.dispatch.platform() == "cpu" and p < q and (
      n * p * q >= linear_ops._TRANSPOSE_MIN_MACS)
  error = harness.max_abs_err([ours(a, b)], [plain(a, b)])
  return _records(ctx, case, times, error, "transposed copy of a" if copied else
                  "no copy (p >= q or a small product): the same product as dot_general")


def _gated_mlp_case(ctx, n, d, h) -> list[Record]:
  case = f"gated_mlp fwd+bwd tokens={n} {d}->{h}->{d}"
  ctx.step(case)
  keys = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(keys[0], (n, d))
  wg, wu = (jax.random.normal(k, (d, h)) * d ** -0.5 for k in keys[1:3])
  wd = jax.random.normal(keys[3], (h, d)) * h ** -0.5

  def step():
    return jax.jit(jax.value_and_grad(
        lambda *w: jnp.sum(blocks.gated_mlp(*w)), argnums=(0, 1, 2, 3)))

  with_copy = step()
  jax.block_until_ready(with_copy(x, wg, wu, wd))          # traced with the copy
  threshold = linear_ops._TRANSPOSE_MIN_MACS
  linear_ops._TRANSPOSE_MIN_MACS = 1 << 62
  try:
    without_copy = step()
    jax.block_until_ready(without_copy(x, wg, wu, wd))     # traced without it
  finally:
    linear_ops._TRANSPOSE_MIN_MACS = threshold
  times = ctx.time({"jax-unfused": lambda: without_copy(x, wg, wu, wd),
                    "jaxfuse-xla": lambda: with_copy(x, wg, wu, wd)})
  error = harness.max_abs_err(jax.tree.leaves(with_copy(x, wg, wu, wd)),
                              jax.tree.leaves(without_copy(x, wg, wu, wd)))
  return _records(ctx, case, times, error, "GatedMLP's kernel gradients with the copy")


def _records(ctx, case, times, error, what) -> list[Record]:
  out = []
  for impl in ("jax-unfused", "jaxfuse-xla"):
    r = Record(SUITE, case, impl, ctx.platform, "float32")
    r.set("time_ms", times[impl], harness.time_source(times[impl]))
    if impl == "jaxfuse-xla":
      r.set("max_abs_err", error, "against the jax-unfused row's result")
      r.reference = "jax-unfused"
      r.add_note(what)
    else:
      r.add_note("XLA's own layout (dot_general contracting the rows of both)")
    out.append(r)
  harness.ratio_to_fastest(out, ["jax-unfused"])
  return out


def run(ctx) -> list[Record]:
  shapes = ([(2048, 768, 3072), (2048, 3072, 768)] if ctx.quick else
            [(4096, 1024, 4096), (16384, 512, 2048), (2048, 768, 3072), (4096, 4096, 1024)])
  records = []
  for n, p, q in shapes:
    records += _rows_product_case(ctx, n, p, q)
  records += _gated_mlp_case(ctx, *((1024, 512, 2048) if ctx.quick else (4096, 1024, 4096)))
  return records
