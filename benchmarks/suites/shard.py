"""The decoder on a mesh of 8 devices: what each parallel strategy costs and saves per device.

Two cases, each the same model and global batch on one device (``strategy=single``, the
reference) and spread over 8 devices by one strategy of :mod:`jaxfuse.parallel`:

- a batch of sequences: data parallel (``dp``, ``data=8``), FSDP (``fsdp``, ``fsdp=8``) and
  tensor parallel with sequence parallelism (``tp``, ``tensor=8``);
- one long sequence (batch 1, which data parallelism cannot split): context parallel (``cp``,
  ``context=8``, ring attention).

Figures per record, of one training step (the loss and its gradients, jitted, the gradients
laid out as the parameters): ``residual_bytes`` (what the backward keeps, per device: the
largest shard of each residual as the compiled forward lays it out), ``param_bytes`` (the
parameters' largest shards), ``collective_bytes`` (every collective of the compiled step, on
one device; the note counts them by kind), ``max_abs_err`` (the loss against ``single``) and
``max_grad_err`` (the gradients against ``single``). The time is a sanity figure only: 8
simulated devices share this machine's cores.

What stays whole on every device is the fused head's gradients, which it computes with the
loss (``Decoder(grad_in_forward=True)``, the default): ``dW`` (vocab x d_model) under data and
context parallelism, whose tokens every device holds a part of, and ``dh`` (tokens x d_model)
under tensor parallelism, whose vocabulary is split. At real sizes they are a few percent of the
residuals; at the tiniest shapes they dominate.

``python -m benchmarks shard`` starts itself with 8 simulated CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``; see ``benchmarks/__main__.py``).
XLA:CPU writes a reduce-scatter that it partitions itself as an all-reduce (and a slice), so
tensor parallelism's collective bytes here count whole arrays where a GPU's reduce-scatter
moves an eighth of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.records import Record
from benchmarks.suites.train import Shape   # a decoder and the batch of one step
from jaxfuse import metrics, parallel
from jaxfuse.metrics.collectives import collectives
from jaxfuse.models import Decoder, next_token_targets

SUITE = "shard"
IMPL = "jaxfuse-xla"
DEVICES = 8
SEED = 0
# (strategy, mesh) per case; "single" is the one-device reference of each.
BATCH_STRATEGIES = (("dp", "data=8"), ("fsdp", "fsdp=8"), ("tp", "tensor=8"))
LONG_STRATEGIES = (("cp", "context=8"),)

RESIDUAL_SOURCE = ("jax.vjp residuals of the loss, each at its largest shard as the compiled "
                   "forward lays it out (jaxfuse.metrics.per_device_residual_bytes)")
PARAM_SOURCE = "the placed parameters' largest shard on one device, summed"
COLLECTIVE_SOURCE = ("collectives of the compiled step's HLO, result bytes on one device "
                     "(jaxfuse.metrics.collective_bytes)")
LOSS_SOURCE = "|loss - loss of strategy=single|, float32"
GRAD_SOURCE = "largest |gradient - gradient of strategy=single| over the parameters"
TIME_SOURCE = ("interleaved runs of the jitted step on simulated CPU devices sharing the "
               "machine's cores: a sanity figure, not a speed")


QUICK = Shape(vocab=1024, d_model=128, layers=2, heads=8, kv_heads=8, mlp=512, batch=8,
              seq=128)
FULL = Shape(vocab=4096, d_model=256, layers=4, heads=8, kv_heads=8, mlp=1024, batch=8,
             seq=512)


def _cases(ctx) -> list[tuple[Shape, tuple]]:
  batch = QUICK if ctx.quick else FULL
  long = dataclasses.replace(batch, batch=1, seq=batch.seq * 8)
  return [(batch, BATCH_STRATEGIES), (long, LONG_STRATEGIES)]


def _largest_shards(tree) -> int:
  return sum(max(s.data.nbytes for s in x.addressable_shards) for x in jax.tree.leaves(tree))


def _counts_text(text: str) -> str:
  counts = Counter(c.kind for c in collectives(text))
  return ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items())) or "no collectives"


def _step(shape: Shape, mesh):
  """``(step, args, loss)``: the compiled loss-and-gradients of the decoder of ``shape`` with
  its arguments placed on ``mesh`` (one device if None), and the loss function."""
  model = Decoder(shape.config(), implementation="xla", rngs=nnx.Rngs(SEED))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tokens = jax.random.randint(jax.random.key(SEED), (shape.batch, shape.seq), 0, shape.vocab)
  targets = next_token_targets(tokens)

  def loss(params, tokens, targets):
    return nnx.merge(graphdef, params, rest)(tokens, targets)

  if mesh is None:
    args = (params, tokens, targets)
    return jax.jit(jax.value_and_grad(loss)).lower(*args).compile(), args, loss
  params = parallel.place(params, mesh)
  batch = NamedSharding(mesh, parallel.logical_spec(("batch", "seq"), mesh, tokens.shape))
  args = (params, jax.device_put(tokens, batch), jax.device_put(targets, batch))
  # The gradients laid out as the parameters: FSDP reduce-scatters them.
  out = (NamedSharding(mesh, P()), jax.tree.map(lambda x: x.sharding, params))
  return jax.jit(jax.value_and_grad(loss), out_shardings=out).lower(*args).compile(), args, loss


def _record(ctx, shape: Shape, strategy: str, mesh_text: str | None, reference) -> tuple:
  mesh = None if mesh_text is None else parallel.make_mesh(mesh_text)
  scope = contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)
  with scope:
    step, args, loss = _step(shape, mesh)
    value, grads = step(*args)
    residual = metrics.per_device_residual_bytes(loss, *args)
    text = step.as_text()
    timing = ctx.time({strategy: lambda: step(*args)})[strategy]
  r = Record(suite=SUITE, case=f"{shape.name} strategy={strategy} mesh={mesh_text or 'none'}",
             impl=IMPL, platform=ctx.platform, dtype="float32")
  r.set("time_ms", timing, TIME_SOURCE)
  r.set("residual_bytes", residual, RESIDUAL_SOURCE)
  r.set("param_bytes", _largest_shards(args[0]), PARAM_SOURCE)
  r.set("collective_bytes", metrics.collective_bytes(text), COLLECTIVE_SOURCE)
  if reference is None:
    r.add_note(f"{jax.tree.reduce(lambda a, b: a + b, jax.tree.map(jnp.size, args[0]))} "
               f"parameters; loss {float(value):.6f}")
  else:
    want_value, want_grads = reference
    r.reference = "strategy=single"
    r.set("max_abs_err", abs(float(value) - float(want_value)), LOSS_SOURCE)
    r.set("max_grad_err", max(float(jnp.max(jnp.abs(np.asarray(g) - np.asarray(w))))
                              for g, w in zip(jax.tree.leaves(grads),
                                              jax.tree.leaves(want_grads))), GRAD_SOURCE)
    r.add_note(_counts_text(text))
  return r, (value, jax.device_get(grads))


def _ratios(records: Sequence[Record]) -> None:
  """Notes each row's per-device bytes as fractions of its case's ``single`` row."""
  single = {r.case.split(" strategy=")[0]: r for r in records if "strategy=single" in r.case}
  for r in records:
    base = single[r.case.split(" strategy=")[0]]
    if r is base:
      continue
    r.add_note(f"per device vs single: residual {r.residual_bytes / base.residual_bytes:.3f}, "
               f"params {r.param_bytes / base.param_bytes:.3f}")


def run(ctx) -> list[Record]:
  if jax.device_count() < DEVICES:
    raise RuntimeError(f"the shard suite needs {DEVICES} devices, jax sees "
                       f"{jax.device_count()}: run it as `python -m benchmarks shard`, which "
                       f"sets XLA_FLAGS=--xla_force_host_platform_device_count={DEVICES}")
  records = []
  for shape, strategies in _cases(ctx):
    ctx.step(f"{shape.name}: single")
    single, reference = _record(ctx, shape, "single", None, None)
    records.append(single)
    for strategy, mesh_text in strategies:
      ctx.step(f"{shape.name}: {strategy} on {mesh_text}")
      records.append(_record(ctx, shape, strategy, mesh_text, reference)[0])
  _ratios(records)
  return records


def headline(records: Sequence[Record]) -> list[Record]:
  return list(records)


def plot(records: Sequence[Record], path: str) -> None:
  """One row per case: per-device residual and parameter bytes over ``single``'s (log, the
  1/8 of a perfect split drawn), and the collective bytes of a step (zero bars labelled)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  cases = list(dict.fromkeys(r.case.split(" strategy=")[0] for r in records))
  fig, axes = plt.subplots(len(cases), 2, figsize=(12, 4 * len(cases)), squeeze=False)
  for row, case in zip(axes, cases):
    mine = [r for r in records if r.case.startswith(case + " ")]
    single = next(r for r in mine if "strategy=single" in r.case)
    labels = [r.case.split("strategy=")[1].replace(" mesh=", "\n") for r in mine]
    xs = np.arange(len(mine))
    ax = row[0]
    for k, (field, color) in enumerate((("residual_bytes", "C0"), ("param_bytes", "C1"))):
      values = [getattr(r, field) / getattr(single, field) for r in mine]
      ax.bar(xs + (k - 0.5) * 0.38, values, 0.38, color=color,
             label=field.replace("_bytes", " bytes"))
      for x, v in zip(xs, values):
        ax.annotate(f"{v:.3f}", (x + (k - 0.5) * 0.38, v), ha="center", va="bottom",
                    fontsize=7)
    ax.axhline(1 / DEVICES, color="k", lw=0.6, ls=":")
    ax.annotate(f"1/{DEVICES}: a perfect split", (xs[0] - 0.45, 1 / DEVICES), fontsize=7,
                va="top", ha="left")
    ax.set_yscale("log")
    ax.set_ylim(0.5 / DEVICES, 1.5)
    ax.set_xticks(xs, labels, fontsize=8)
    ax.set_ylabel("per device / single device (log)")
    ax.set_title(f"{case}: per-device memory", fontsize=9)
    ax.legend(fontsize=7)
    ax = row[1]
    values = [r.collective_bytes / 2**20 for r in mine]
    ax.bar(xs, [max(v, 1e-9) for v in values], 0.5, color="C2")
    for x, v in zip(xs, values):
      ax.annotate("0" if v == 0 else f"{v:.2f}", (x, max(v, 1e-9)), ha="center",
                  va="bottom", fontsize=7)
    ax.set_xticks(xs, labels, fontsize=8)
    ax.set_ylabel("collective bytes per step, per device (MiB)")
    ax.set_title(f"{case}: communication", fontsize=9)
  fig.suptitle(f"shard: the decoder on {DEVICES} simulated devices against one")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
