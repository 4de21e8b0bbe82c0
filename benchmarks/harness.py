"""What every suite shares: jaxfuse's rows of an op (from its registry entry), conversions
between JAX and torch, the forward + backward steps of both, error figures, residual and
compiled-memory figures, interleaved timing, ratios, the table and a plot."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import records as rec
import jaxfuse.ops  # noqa: F401 - declares every op in the registry
from jaxfuse import metrics
from jaxfuse.metrics import timing
from jaxfuse.ops import base, dispatch


# jaxfuse's rows ---------------------------------------------------------------------------------


def jaxfuse_row(implementation: str) -> str:
  """The name of the row of jaxfuse's ``implementation``: ``jaxfuse-<implementation>``."""
  return f"jaxfuse-{implementation}"


def kind(row: str) -> dispatch.Kind | None:
  """The kind of implementation (:data:`jaxfuse.ops.dispatch.KINDS`) a ``jaxfuse-<impl>`` row
  runs; None for every other row (peers, and jaxfuse rows named otherwise, such as
  ``jaxfuse-unfused`` or ``jaxfuse-xla[grad_in_forward]``)."""
  return dispatch.KINDS.get(row.removeprefix("jaxfuse-")) if row.startswith("jaxfuse-") else None


def runs(implementation: str) -> bool:
  """Whether jaxfuse's ``implementation`` runs here: natively, or, for a kind that interprets,
  in Pallas' interpret mode (its errors, not its time)."""
  return dispatch.runs_natively(implementation) or dispatch.KINDS[implementation].interpretable


def kernel_kind(row: str) -> dispatch.Kind | None:
  """The kind of a row that runs jaxfuse's kernels (Pallas, Triton: a kind with a kernel
  package); None for every other row, XLA's included."""
  row_kind = kind(row)
  return row_kind if row_kind is not None and row_kind.package is not None else None


def jaxfuse_rows(op_name: str, call: Callable, *, keep: Callable[[str], bool] | None = None,
                 kernels_only: bool = False) -> dict[str, Callable]:
  """A row for each implementation the op has (its registry entry, ``base.REGISTRY``).

  Args:
    op_name: the op's name in the registry (``"rms_norm"``).
    call: ``call(*arrays, implementation=...)`` runs the op.
    keep: which implementations get a row (default: all); e.g. ``ctx.native`` for the ones
      that compile here, or :func:`runs` to add those that run in Pallas' interpret mode.
    kernels_only: only its kernel implementations (Pallas, Triton), not XLA.

  Returns:
    ``{"jaxfuse-<impl>": functools.partial(call, implementation=impl)}``, in the registry's
    order (the kernel kinds, then XLA).

  Example:
    >>> from jaxfuse import ops
    >>> list(jaxfuse_rows("softmax", ops.softmax))
    ['jaxfuse-pallas', 'jaxfuse-triton', 'jaxfuse-xla']
  """
  op = base.REGISTRY[op_name]
  return {jaxfuse_row(impl): functools.partial(call, implementation=impl)
          for impl in (op.kinds if kernels_only else op.implementations)
          if keep is None or keep(impl)}


# JAX <-> torch ----------------------------------------------------------------------------------


def to_numpy(x) -> np.ndarray:
  """A float64 numpy copy of a JAX array or torch tensor.

  float16, bfloat16 and float32 widen exactly; float64 (a torch reference) keeps every bit.
  """
  if hasattr(x, "detach"):
    x = x.detach().cpu()
    x = (x.double() if x.is_floating_point() else x).numpy()
  return np.asarray(x, dtype=np.float64)


def torch_dtype(dtype):
  """The torch dtype of a JAX (numpy) dtype."""
  import torch

  name = jnp.dtype(dtype).name
  if name == "bool":
    return torch.bool
  return getattr(torch, name)


def torch_device() -> str:
  import torch

  return "cuda" if torch.cuda.is_available() else "cpu"


def to_torch(x, *, dtype=None, device: str | None = None, requires_grad: bool = False):
  """A torch tensor holding the values of ``x`` (a JAX or numpy array) exactly.

  Args:
    x: the array; bfloat16 goes through float32, which holds it exactly.
    dtype: the torch dtype (default: ``x``'s own).
    device: default ``cuda`` where torch sees a GPU, else ``cpu``.
    requires_grad: whether the tensor is a leaf that takes gradients.
  """
  import torch

  x = jnp.asarray(x)
  if x.dtype == jnp.bfloat16:
    t = torch.from_numpy(np.array(x.astype(jnp.float32))).to(torch.bfloat16)
  else:
    t = torch.from_numpy(np.array(x))
  t = t.to(device or torch_device())
  if dtype is not None:
    t = t.to(dtype)
  return t.requires_grad_(requires_grad)


def to_float64_cpu(tensors: Iterable):
  """float64 CPU copies of torch tensors (others as they are), for a float64 reference."""
  import torch

  return [t.to(device="cpu", dtype=torch.float64)
          if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in tensors]


# Steps ------------------------------------------------------------------------------------------


def _as_list(x) -> list:
  return list(x) if isinstance(x, (tuple, list)) else [x]


def jax_step(f: Callable, *, n_diff: int | None = None, grad: bool = True,
             matmul_precision: str | None = None) -> Callable:
  """One jit-compiled step of ``f``: ``step(args, cotangents) -> (outputs, gradients)``.

  Args:
    f: a function of JAX arrays returning an array or a tuple of arrays.
    n_diff: how many leading arguments are differentiated (default: all).
    grad: False for a forward-only step, whose gradients are ``[]``.
    matmul_precision: traces and runs the step under ``jax.default_matmul_precision(...)``
      (e.g. ``"highest"``): the precision of the matmuls of a peer that takes no precision
      argument, its backward included.

  ``cotangents`` has ``f``'s output structure; None stands for 1 (a scalar loss). A gradient
  that is the very same array as an earlier one (``x``'s and ``residual``'s in an add + norm)
  leaves the compiled step once, as torch's autograd returns one tensor for both: returning it
  twice would make XLA copy it.
  """
  layout: list[int] = []

  @jax.jit
  def compiled(args, cts):
    if not grad:
      return f(*args), []
    n = len(args) if n_diff is None else n_diff
    rest = tuple(args[n:])
    out, vjp = jax.vjp(lambda *d: f(*d, *rest), *args[:n])
    if cts is None:
      cts = jax.tree_util.tree_map(jnp.ones_like, out)
    layout.clear()
    unique: list = []
    for g in vjp(cts):
      same = [i for i, u in enumerate(unique) if u is g]
      layout.append(same[0] if same else len(unique))
      if not same:
        unique.append(g)
    return out, unique

  def step(args, cts=None):
    with (jax.default_matmul_precision(matmul_precision) if matmul_precision
          else contextlib.nullcontext()):
      out, unique = compiled(tuple(args), cts)
    return out, [unique[i] for i in layout] if grad else []

  return step


def torch_step(fn: Callable, *, n_diff: int | None = None, grad: bool = True) -> Callable:
  """One torch autograd step of ``fn``: ``step(args, cotangents) -> (outputs, gradients)``.

  The leading ``n_diff`` arguments (default: all) become fresh leaves each call; gradients come
  from ``torch.autograd.grad``. ``cotangents`` None stands for 1 (a scalar loss); with
  ``grad=False`` the step runs the forward under ``no_grad`` and its gradients are ``[]``.
  """
  import torch

  def step(args, cts=None):
    if not grad:
      with torch.no_grad():
        return fn(*args), []
    n = len(args) if n_diff is None else n_diff
    leaves = [a.detach().requires_grad_() for a in args[:n]]
    out = fn(*leaves, *args[n:])
    grad_outputs = None if cts is None else _as_list(cts)
    return out, list(torch.autograd.grad(_as_list(out), leaves, grad_outputs))

  return step


# Figures ----------------------------------------------------------------------------------------


def max_abs_err(got, want) -> float:
  """Largest absolute difference over matching leaves of two pytrees (or sequences)."""
  got_leaves = got if isinstance(got, (list, tuple)) else jax.tree_util.tree_leaves(got)
  want_leaves = want if isinstance(want, (list, tuple)) else jax.tree_util.tree_leaves(want)
  if len(got_leaves) != len(want_leaves):
    raise ValueError(f"{len(got_leaves)} leaves against {len(want_leaves)}")
  worst = 0.0
  for g, w in zip(got_leaves, want_leaves):
    g, w = to_numpy(g), to_numpy(w)
    if g.shape != w.shape:
      raise ValueError(f"shape {g.shape} against {w.shape}")
    if g.size:
      worst = max(worst, float(np.max(np.abs(g - w))))
  return worst


def errors(got, want) -> tuple[float, float | None]:
  """Largest output error and largest gradient error of one step's ``(outputs, gradients)``
  against another's (None for the gradients of a forward-only step)."""
  (outs, grads), (want_outs, want_grads) = got, want
  out_err = max_abs_err(_as_list(outs), _as_list(want_outs))
  grad_err = max_abs_err(list(grads), list(want_grads)) if len(grads) else None
  return out_err, grad_err


def set_errors(record: rec.Record, errors: tuple[float, float | None], source: str) -> None:
  """Sets a record's ``max_abs_err`` and ``max_grad_err`` (from :func:`errors`) and their
  source."""
  record.set("max_abs_err", errors[0], source)
  record.set("max_grad_err", errors[1], source)


def residual_bytes(f: Callable, args: Sequence, *, n_diff: int | None = None) -> int:
  """Bytes ``jax.vjp`` of ``f`` keeps beyond its arguments, for its leading ``n_diff``
  arguments (default: all); traced only, so Pallas kernels need no interpret run."""
  n = len(args) if n_diff is None else n_diff
  rest = tuple(args[n:])
  return metrics.residual_bytes(lambda *d: f(*d, *rest), *args[:n])


def torch_residual_bytes(fn: Callable, t_args: Sequence, *, n_diff: int | None = None) -> int:
  """Bytes torch's autograd saves for the backward of ``fn`` (eager or compiled), beyond its
  arguments, for its leading ``n_diff`` arguments (default: all)."""
  n = len(t_args) if n_diff is None else n_diff
  leaves = [a.detach().requires_grad_() for a in t_args[:n]]
  return metrics.torch_residual_bytes(lambda: fn(*leaves, *t_args[n:]),
                                      exclude=[*t_args, *leaves])


def step_bytes_moved(f: Callable, args: Sequence, cts=None, **step_options) -> int | None:
  """Bytes the Pallas kernels of one ``jax_step(f)`` read + write; None if it launches none.

  ``jaxfuse.metrics.bytes_moved`` traces the step for a GPU (nothing runs), so that the kernels
  are counted with the tiles they use there: call it outside ``jaxfuse.pallas_interpret()``,
  whose kernels pick other tiles. ``step_options`` go to :func:`jax_step`.
  """
  step = jax_step(f, **step_options)
  return metrics.bytes_moved(lambda *a: step(a, cts), *args)


def runs_cpu_kernels(row: str) -> bool:
  """Whether a row runs jaxfuse's CPU kernels here (compiled, on this machine)."""
  row_kind = kernel_kind(row)
  return (row_kind is not None and "cpu" in row_kind.platforms and not row_kind.interpretable
          and dispatch.runs_natively(row_kind.name))


def record_cpu_kernel_figures(record: rec.Record, f: Callable, args: Sequence, cts=None,
                              **step_options) -> None:
  """``bytes_moved`` of a row with CPU kernels: the operands and results of each call (they
  read and write each once), traced here; and no ``xla_bytes_accessed``, since XLA's cost
  analysis does not see into them. ``step_options`` go to :func:`jax_step`."""
  step = jax_step(f, **step_options)
  found = metrics.cpu_kernel_traffic(lambda *a: step(a, cts), *args)
  record.set("bytes_moved", sum(k.bytes for k in found) if found else None,
             rec.CPU_KERNEL_BYTES_SOURCE)
  record.set("xla_bytes_accessed", None, rec.XLA_BYTES_SOURCE)
  record.add_note("XLA's cost analysis does not see into the CPU kernels: bytes moved counts "
                  "their operands and results")


def compiled_figures(step: Callable, args: Sequence, cts=None) -> tuple[int | None, int]:
  """``(xla_bytes_accessed, temp_bytes)`` of one compiled ``jax_step``: XLA's cost analysis
  and its compiled temp memory."""
  run = lambda *a: step(a, cts)  # noqa: E731
  accessed = metrics.xla_cost(run, *args)["bytes_accessed"]
  temp = metrics.compiled_memory(run, *args)["temp_bytes"]
  return (None if accessed is None else int(accessed)), int(temp)


def record_compiled_figures(record: rec.Record, step: Callable, args: Sequence,
                            cts=None) -> None:
  """Sets ``xla_bytes_accessed`` and ``temp_bytes`` of a record from its compiled step."""
  accessed, temp = compiled_figures(step, args, cts)
  record.set("xla_bytes_accessed", accessed, rec.XLA_BYTES_SOURCE)
  record.set("temp_bytes", temp, rec.TEMP_BYTES_SOURCE)


def time_source(t: Mapping | None) -> str:
  """How a ``time_ms`` figure was taken, and the process settings of ``benchmarks.__main__``
  in force (``system settings`` where none is)."""
  runs = (t or {}).get("runs")
  rounds = f"{runs} interleaved rounds" if runs else "interleaved rounds"
  return f"median of {rounds} after warm-up, candidates in shuffled order; {process_settings()}"


def process_settings() -> str:
  """The settings of ``python -m benchmarks`` (``benchmarks.__main__``) that this process
  runs with."""
  from benchmarks.__main__ import NAMES

  found = [f"{k}={os.environ[k]}" for k in NAMES if k in os.environ]
  return "process: " + (" ".join(found) if found else "system settings")


def ratio_to_fastest(records: Sequence[rec.Record], peers: Sequence[str]) -> None:
  """Sets each timed record's ``ratio`` to its median time over the fastest of ``peers`` in the
  same case and dtype, and ``ratio_to`` to that peer's name. A case without a timed peer keeps
  its ratios None."""
  groups: dict[tuple[str, str], list[rec.Record]] = {}
  for r in records:
    groups.setdefault((r.case, r.dtype), []).append(r)
  for group in groups.values():
    timed = [r for r in group if r.impl in peers and r.time_ms]
    if not timed:
      continue
    fastest = min(timed, key=lambda r: r.time_ms["median"])
    names = [r.impl for r in timed]
    source = (f"median time over the fastest of {', '.join(names)} in the same case"
              if len(names) > 1 else f"median time over {names[0]}'s in the same case")
    for r in group:
      if r.time_ms:
        r.ratio_to = fastest.impl
        r.set("ratio", r.time_ms["median"] / fastest.time_ms["median"], source)


def tokamax():
  """tokamax, or None when it is not installed (a peer row is then skipped with a note).

  tokamax reads its options from absl flags and parses sys.argv on first use, which fails on
  this CLI's own arguments (``--quick``): its flags keep their defaults instead.
  """
  try:
    import tokamax as module
    from absl import flags
  except Exception:  # noqa: BLE001 - any import failure means the peer is not available.
    return None
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  return module


def torch_sync(out):
  """Torch on CPU is synchronous; on CUDA wait for the stream."""
  import torch

  if torch.cuda.is_available():
    torch.cuda.synchronize()
  return out


def in_fresh_process(fn: Callable, ctx: Context, *args, **kwargs):
  """``fn(ctx, *args, **kwargs)`` in a newly spawned Python process, whose memory goes back to the system
  when it ends: a suite's large cases (compiled programs, torch.compile's graphs, allocator
  pools) then do not add up from one case to the next. ``fn`` and what it returns must pickle."""
  import concurrent.futures
  import multiprocessing

  child = Context(ctx.suite, ctx.quick, ctx.runs)
  with concurrent.futures.ProcessPoolExecutor(
      1, mp_context=multiprocessing.get_context("spawn")) as pool:
    return pool.submit(fn, child, *args, **kwargs).result()


@dataclasses.dataclass
class Context:
  """Per-run settings and helpers handed to a suite's ``run``."""

  suite: str
  quick: bool = False
  runs: int | None = None
  _progress: object = None
  _task: object = None

  @property
  def platform(self) -> str:
    return dispatch.platform()

  @property
  def n_runs(self) -> int:
    return self.runs or (5 if self.quick else 7)

  @property
  def min_seconds(self) -> float:
    """Timed rounds go on until this long (fast cases get more samples); 0 with ``--runs``."""
    return 0.0 if self.runs else (3.0 if self.quick else 10.0)

  def native(self, implementation: str) -> bool:
    """Whether jaxfuse's ``implementation`` compiles here (so its time means something)."""
    return dispatch.runs_natively(implementation)

  def interpreted(self, row: str) -> bool:
    """Whether a row's kernels run (or are traced) here in Pallas' interpret mode: a row of a
    kind that interprets, which does not compile here."""
    row_kind = kind(row)
    return row_kind is not None and row_kind.interpretable and not self.native(row_kind.name)

  def tracing(self, row: str):
    """A context in which a row's function is traced as it runs here: in Pallas' interpret
    mode where :meth:`interpreted` (to trace its residuals; nothing runs)."""
    return dispatch.pallas_interpret(self.interpreted(row))

  # Progress -------------------------------------------------------------------------------------

  @contextlib.contextmanager
  def progress_bar(self):
    try:
      from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:  # rich is optional: fall back to plain lines.
      yield
      return
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TimeElapsedColumn(),
                  transient=True) as progress:
      self._progress = progress
      self._task = progress.add_task(self.suite, total=None)
      try:
        yield
      finally:
        self._progress = None

  def step(self, description: str) -> None:
    """Shows what the suite is doing now."""
    if self._progress is not None:
      self._progress.update(self._task, description=f"{self.suite}: {description}", advance=1)
    else:
      print(f"[{self.suite}] {description}", flush=True)

  # Timing ---------------------------------------------------------------------------------------

  def time(self, candidates: Mapping[str, Callable[[], object]], *, warmup: int = 2,
           sync: Callable[[object], object] | None = None) -> dict[str, dict]:
    """Interleaved median/min/max in ms, and the rounds timed, for each candidate (shuffled
    rounds, after warm-up)."""
    if not candidates:
      return {}
    timings = timing.interleaved(candidates, warmup=warmup, runs=self.n_runs,
                                 sync=sync or _sync_any, min_seconds=self.min_seconds)
    return {name: {**t.as_dict(), "runs": t.runs} for name, t in timings.items()}

  # Output ---------------------------------------------------------------------------------------

  def print_table(self, records: Sequence[rec.Record], title: str) -> None:
    columns = rec.table_columns(records, rec.COLUMNS)
    try:
      from rich.console import Console
      from rich.table import Table
    except ImportError:
      print(title)
      print(rec.markdown_table(records, columns))
      return
    table = Table(title=title)
    for column in columns:
      table.add_column(column, justify="left" if column in ("case", "impl", "dtype", "ratio to")
                       else "right")
    from rich.markup import escape

    for r in records:
      table.add_row(*(escape(cell) for cell in rec.row(r, columns)))
    Console(width=200).print(table)

  def default_plot(self, records: Sequence[rec.Record], path: str) -> None:
    """One row of panels per case family (the case name's first word): median time over the
    row's ``ratio_to`` (or the median time, where no ratio is recorded) on a log axis, and
    residual bytes, with zero bars labelled ``0``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = list(dict.fromkeys(_family(r.case) for r in records))
    impls = list(dict.fromkeys(r.impl for r in records))
    colors = {impl: f"C{i}" for i, impl in enumerate(impls)}
    fig, axes = plt.subplots(len(families), 2, figsize=(14, 4.2 * len(families)), squeeze=False)
    for row, family in zip(axes, families):
      mine = [r for r in records if _family(r.case) == family]
      cases = list(dict.fromkeys(r.case for r in mine))
      ratios = any(r.ratio is not None for r in mine)
      width = 0.8 / max(1, len(impls))
      for ax, field in zip(row, ("time", "residual")):
        for k, impl in enumerate(impls):
          xs, values = [], []
          for i, case in enumerate(cases):
            r = next((r for r in mine if r.case == case and r.impl == impl), None)
            if r is None:
              continue
            if field == "time":
              value = r.ratio if ratios else (r.time_ms or {}).get("median")
            else:
              value = None if r.residual_bytes is None else r.residual_bytes / 2**20
            if value is None or not math.isfinite(value):
              continue
            xs.append(i + k * width)
            values.append(value)
          if xs:
            ax.bar(xs, values, width, color=colors[impl], label=impl)
          if field == "residual":
            for x, v in zip(xs, values):
              if v == 0:
                ax.annotate("0", (x, 0), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(np.arange(len(cases)) + 0.4 - width / 2)
        ax.set_xticklabels(cases, rotation=20, ha="right", fontsize=7)
        if field == "time":
          ax.set_yscale("log")
          if ratios:
            ax.axhline(1.0, color="k", lw=0.6)
          ax.set_ylabel("time / fastest peer (log)" if ratios else "median time, ms (log)")
        else:
          ax.set_ylabel("residual bytes (MiB)")
        ax.set_title(f"{family}: {'time' if field == 'time' else 'residual bytes'}", fontsize=9)
      row[0].legend(fontsize=7)
      row[1].legend(fontsize=7)
    fig.suptitle(f"{self.suite} on {self.platform}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _family(case: str) -> str:
  """The family a case belongs to in plots: its first word, without a bracketed variant."""
  return case.split(" ", 1)[0].split("[", 1)[0]


def _sync_any(out):
  leaves = jax.tree_util.tree_leaves(out)
  if any(hasattr(x, "detach") for x in leaves):
    return torch_sync(out)
  return jax.block_until_ready(out)
