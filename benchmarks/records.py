"""The benchmark record (one per case and implementation) and its table, JSON and README forms.

Figures that do not apply or cannot be measured are None (null in JSON), never made up. Each
record's ``sources`` says, per field, how its figure was produced.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

# How the figures that several suites share are produced (the ``sources`` of a record).
XLA_BYTES_SOURCE = "XLA compiled cost analysis (jaxfuse.metrics.xla_cost)"
TEMP_BYTES_SOURCE = "XLA compiled memory analysis, temp bytes (jaxfuse.metrics.compiled_memory)"
KERNEL_BYTES_SOURCE = "kernel loads/stores counted over the grid (jaxfuse.metrics.bytes_moved)"
CPU_KERNEL_BYTES_SOURCE = ("CPU kernels: operands read and results written once per call "
                           "(jaxfuse.metrics.cpu_kernel_traffic)")
JAX_RESIDUAL_SOURCE = "jax.vjp residuals (jaxfuse.metrics.residual_bytes)"
TORCH_RESIDUAL_SOURCE = "autograd saved tensors (jaxfuse.metrics.torch_residual_bytes)"
HAND_FORMULA_SOURCE = "modelled: hand formula"


@dataclasses.dataclass
class Record:
  """One implementation in one case: its figures, and where each comes from.

  Attributes:
    suite: the suite that wrote the record (``seed``, ``norm``, ...).
    case: the case, e.g. ``add_act[gelu] n=16777216 fwd+bwd``.
    impl: ``jaxfuse-<implementation>``, ``jax-unfused``, ``jax-jit``, ``torch-eager``, ...
    platform: ``cpu`` or ``gpu``.
    dtype: the inputs' dtype.
    time_ms: ``{"median", "min", "max"}`` in ms (and ``runs``, the timed rounds); None when
      not timed.
    ratio_to: the impl this row's median time is divided by.
    ratio: this row's median time over ``ratio_to``'s.
    residual_bytes: what the backward keeps beyond inputs and parameters.
    bytes_moved: HBM bytes read + written by the kernels, counted from the kernels
      (``jaxfuse.metrics.bytes_moved``) or, where ``sources`` says so, modelled.
    xla_bytes_accessed: XLA's compiled cost analysis of the step (never in ``bytes_moved``).
    temp_bytes: XLA's compiled temp memory of the step.
    flops: FLOPs of one step, recomputation included.
    budget_bytes: the residual bytes a recomputation plan had to fit.
    final_loss: a training suite's loss (which step's: ``sources``).
    peak_bytes: peak device memory, where it can be attributed to this row.
    arch: the GPU target a kernel was compiled for (``sm_90a``), kernel-resource rows.
    regs: registers per thread of the compiled kernel.
    spill_bytes: bytes of registers spilled per thread, stores + loads.
    stack_bytes: the kernel's stack frame per thread.
    smem_bytes: shared memory per block, dynamic + static.
    occupancy: resident blocks per SM that the kernel's registers, shared memory and threads
      allow on ``arch``.
    param_bytes: the parameters' bytes on one device (their largest shards, under a mesh).
    collective_bytes: bytes of every collective of the compiled step, on one device.
    max_abs_err: largest output error against ``reference``.
    max_grad_err: largest gradient error (inputs and parameters) against ``reference``.
    reference: what the errors are taken against.
    note: free text.
    sources: field name -> how that figure was produced.
    series: named lists of numbers a plot draws (e.g. a planner's frontier); not tabled.
  """

  suite: str
  case: str
  impl: str
  platform: str
  dtype: str
  time_ms: dict | None = None
  ratio_to: str | None = None
  ratio: float | None = None
  residual_bytes: int | None = None
  bytes_moved: int | None = None
  xla_bytes_accessed: int | None = None
  temp_bytes: int | None = None
  flops: float | None = None
  budget_bytes: int | None = None
  final_loss: float | None = None
  peak_bytes: int | None = None
  arch: str | None = None
  regs: int | None = None
  spill_bytes: int | None = None
  stack_bytes: int | None = None
  smem_bytes: int | None = None
  occupancy: int | None = None
  param_bytes: int | None = None
  collective_bytes: int | None = None
  max_abs_err: float | None = None
  max_grad_err: float | None = None
  reference: str | None = None
  note: str | None = None
  sources: dict[str, str] | None = None
  series: dict[str, list] | None = None

  def set(self, field: str, value, source: str) -> None:
    """Sets a figure and says where it comes from; a None value records no source."""
    if field not in {f.name for f in dataclasses.fields(self)}:
      raise ValueError(f"Record has no field {field!r}")
    setattr(self, field, value)
    if value is not None:
      self.sources = {**(self.sources or {}), field: source}

  def add_note(self, text: str | None) -> None:
    """Appends ``text`` to the note (``; `` between parts)."""
    if text:
      self.note = f"{self.note}; {text}" if self.note else text

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def write_json(records: Sequence[Record], path: str | Path) -> None:
  Path(path).parent.mkdir(parents=True, exist_ok=True)
  text = json.dumps([r.as_dict() for r in records], indent=1, ensure_ascii=False)
  Path(path).write_text(text + "\n", encoding="utf-8")


def read_json(path: str | Path) -> list[Record]:
  """The records in a JSON file."""
  return [Record(**d) for d in json.loads(Path(path).read_text(encoding="utf-8"))]


# Text forms -------------------------------------------------------------------------------------


def format_bytes(n: int | None) -> str:
  if n is None:
    return "—"
  for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
    if abs(n) >= size:
      return f"{n / size:.1f} {unit}"
  return f"{n} B"


def format_time(t: dict | None) -> str:
  if not t:
    return "—"
  return f"{t['median']:.2f} ({t['min']:.2f}–{t['max']:.2f})"


def format_median(t: dict | None) -> str:
  return f"{t['median']:.2f}" if t else "—"


def format_err(e: float | None) -> str:
  if e is None:
    return "—"
  if e == 0:
    return "0"
  return f"{e:.1e}"


def format_ratio(r: Record) -> str:
  if r.ratio is None or not math.isfinite(r.ratio):
    return "—"
  return f"{r.ratio:.2f}×"


# Column name -> the cell of a record.
CELLS: dict[str, Callable[[Record], str]] = {
    "case": lambda r: r.case,
    "impl": lambda r: r.impl,
    "dtype": lambda r: r.dtype,
    "time ms (min–max)": lambda r: format_time(r.time_ms),
    "median ms": lambda r: format_median(r.time_ms),
    "ratio": format_ratio,
    "ratio to": lambda r: r.ratio_to or "—",
    "residual": lambda r: format_bytes(r.residual_bytes),
    "bytes moved": lambda r: format_bytes(r.bytes_moved),
    "XLA bytes": lambda r: format_bytes(r.xla_bytes_accessed),
    "temp": lambda r: format_bytes(r.temp_bytes),
    "params": lambda r: format_bytes(r.param_bytes),
    "collectives": lambda r: format_bytes(r.collective_bytes),
    "max err": lambda r: format_err(r.max_abs_err),
    "max grad err": lambda r: format_err(r.max_grad_err),
    "arch": lambda r: r.arch or "—",
    "regs": lambda r: "—" if r.regs is None else str(r.regs),
    "spill": lambda r: format_bytes(r.spill_bytes),
    "stack": lambda r: format_bytes(r.stack_bytes),
    "smem": lambda r: format_bytes(r.smem_bytes),
    "blocks/SM": lambda r: "—" if r.occupancy is None else str(r.occupancy),
    "final loss": lambda r: "—" if r.final_loss is None else f"{r.final_loss:.3f}",
    "budget": lambda r: format_bytes(r.budget_bytes),
    "GFLOP": lambda r: "—" if r.flops is None else f"{r.flops / 1e9:.3f}",
    "note": lambda r: r.note or "—",
}
COLUMNS = ("case", "impl", "dtype", "time ms (min–max)", "ratio", "residual", "bytes moved",
           "XLA bytes", "max err", "max grad err")
HEADLINE_COLUMNS = ("case", "impl", "dtype", "median ms", "ratio", "residual", "bytes moved",
                    "max grad err")
# Suites whose figures are not times and bytes: their (full, headline) columns instead.
SUITE_COLUMNS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "kernels": (("case", "impl", "dtype", "arch", "regs", "spill", "stack", "smem", "blocks/SM",
                 "note"),
                ("case", "impl", "dtype", "arch", "regs", "spill", "smem", "blocks/SM", "note")),
    "train-cli": (("case", "impl", "time ms (min–max)", "ratio", "temp", "final loss", "note"),
                  ("case", "impl", "median ms", "ratio", "temp", "final loss", "note")),
    "finetune": (("case", "impl", "time ms (min–max)", "ratio", "residual", "max err",
                  "final loss", "note"),
                 ("case", "impl", "median ms", "ratio", "residual", "note")),
    "shard": (("case", "impl", "median ms", "residual", "params", "collectives", "max err",
               "max grad err", "note"),
              ("case", "impl", "residual", "params", "collectives", "max err", "note")),
    "moe": (("case", "impl", "time ms (min–max)", "ratio", "residual", "GFLOP", "max err",
             "max grad err", "note"),
            ("case", "impl", "median ms", "ratio", "residual", "GFLOP", "max grad err", "note")),
    "posttrain": (("case", "impl", "time ms (min–max)", "ratio", "ratio to", "residual",
                   "XLA bytes", "temp", "max err", "max grad err", "note"),
                  ("case", "impl", "median ms", "ratio", "ratio to", "residual", "max grad err",
                   "note")),
    "rl": (("case", "impl", "time ms (min–max)", "ratio", "ratio to", "note"),
           ("case", "impl", "median ms", "ratio", "ratio to", "note")),
    "remat": (("case", "impl", "median ms", "ratio", "residual", "budget", "GFLOP",
               "max grad err", "note"),
              ("case", "impl", "median ms", "ratio", "residual", "budget", "GFLOP",
               "max grad err", "note")),
}


def row(r: Record, columns: Sequence[str] = COLUMNS) -> list[str]:
  return [CELLS[column](r) for column in columns]


def markdown_table(records: Sequence[Record], columns: Sequence[str] = COLUMNS) -> str:
  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  lines += ["| " + " | ".join(row(r, columns)) + " |" for r in records]
  return "\n".join(lines)


def sources_list(records: Sequence[Record]) -> str:
  """Markdown bullets: each field's distinct sources, with the impls they apply to."""
  by_field: dict[str, dict[str, list[str]]] = {}
  for r in records:
    for field, source in (r.sources or {}).items():
      impls = by_field.setdefault(field, {}).setdefault(source, [])
      if r.impl not in impls:
        impls.append(r.impl)
  order = [f.name for f in dataclasses.fields(Record)]
  lines = []
  for field in sorted(by_field, key=lambda f: order.index(f) if f in order else len(order)):
    for source, impls in by_field[field].items():
      lines.append(f"- `{field}` ({', '.join(impls)}): {source}")
  return "\n".join(lines)


def default_headline(records: Sequence[Record]) -> list[Record]:
  """The rows of the main case: the one with the most timed rows (the last of equals)."""
  timed: dict[tuple[str, str], int] = {}
  for r in records:
    key = (r.case, r.dtype)
    timed[key] = timed.get(key, 0) + (1 if r.time_ms else 0)
  if not timed:
    return []
  most = max(timed.values())
  main = [key for key, count in timed.items() if count == most][-1]
  return [r for r in records if (r.case, r.dtype) == main]


def _baselines(records: Sequence[Record]) -> list[str]:
  return list(dict.fromkeys(r.ratio_to for r in records if r.ratio_to))


def table_columns(records: Sequence[Record], columns: Sequence[str]) -> list[str]:
  """``columns`` for these records: with ``ratio to`` after ``ratio`` where rows are compared
  with different impls, and without ``dtype`` where every row has the same. A suite of
  :data:`SUITE_COLUMNS` gets its own columns in place of :data:`COLUMNS` and
  :data:`HEADLINE_COLUMNS`."""
  suites = {r.suite for r in records}
  if len(suites) == 1 and (suite := suites.pop()) in SUITE_COLUMNS:
    full, short = SUITE_COLUMNS[suite]
    columns = {tuple(COLUMNS): full, tuple(HEADLINE_COLUMNS): short}.get(tuple(columns), columns)
  out = list(columns)
  if len(_baselines(records)) > 1 and "ratio" in out and "ratio to" not in out:
    out.insert(out.index("ratio") + 1, "ratio to")
  if len({r.dtype for r in records}) == 1 and "dtype" in out:
    out.remove("dtype")
  return out


def _summary(records: Sequence[Record], origin: str) -> str:
  platform = records[0].platform if records else "?"
  dtypes = list(dict.fromkeys(r.dtype for r in records))
  text = f"{origin} on {platform}" + (f", {dtypes[0]}." if len(dtypes) == 1 else ".")
  baselines = _baselines(records)
  if len(baselines) == 1:
    text += f" Ratios are to {baselines[0]} in the same case, timed interleaved."
  elif baselines:
    text += (" Ratios are to the `ratio to` row of the same case, timed interleaved "
             "(which one and why: `sources`).")
  references = list(dict.fromkeys(r.reference for r in records if r.reference))
  if not references and all(r.max_abs_err is None and r.max_grad_err is None for r in records):
    return text  # nothing is compared with a reference (kernel resources)
  return text + f" Errors are against {', '.join(references) or 'nothing'}."


def table_block(records: Sequence[Record], origin: str) -> str:
  """The full table of a suite, then where each figure comes from."""
  columns = table_columns(records, COLUMNS)
  text = f"{_summary(records, origin)}\n\n{markdown_table(records, columns)}\n"
  sources = sources_list(records)
  if sources:
    text += f"\nWhere the figures come from:\n\n{sources}\n"
  return text


def headline_block(records: Sequence[Record], origin: str, link: str | None = None) -> str:
  """A short table of a suite's headline rows, and a link to the full table."""
  columns = table_columns(records, HEADLINE_COLUMNS)
  text = f"{_summary(records, origin)}\n\n{markdown_table(records, columns)}\n"
  if link:
    text += f"\nAll cases, every figure and its source: [{link}]({link}).\n"
  return text


def markers(suite: str, part: str | None = None) -> tuple[str, str]:
  """The README markers of a suite's block: ``<!-- bench:SUITE[:PART]:start -->`` and end."""
  key = f"bench:{suite}" + (f":{part}" if part else "")
  return f"<!-- {key}:start -->", f"<!-- {key}:end -->"


def replace_block(path: str | Path, suite: str, body: str, part: str | None = None) -> bool:
  """Replaces the text between a suite's markers in ``path`` with ``body``.

  Returns False (and leaves the file alone) when the markers are missing.
  """
  path = Path(path)
  text = path.read_text(encoding="utf-8")
  start, end = markers(suite, part)
  pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
  if not pattern.search(text):
    return False
  block = f"{start}\n{body.rstrip()}\n{end}"
  path.write_text(pattern.sub(lambda _: block, text), encoding="utf-8")
  return True


def update_readme(path: str | Path, suite: str, records: Sequence[Record], origin: str) -> bool:
  """Writes the suite's full table between ``<!-- bench:SUITE:start -->`` and ``...:end -->``."""
  return replace_block(path, suite, table_block(records, origin))


def update_headline(path: str | Path, suite: str, records: Sequence[Record], origin: str,
                    full_table: str | Path | None = None) -> bool:
  """Writes the headline rows between ``<!-- bench:SUITE:headline:start -->`` and its end,
  with a link (relative to ``path``) to the file holding the full table."""
  link = None
  if full_table is not None:
    link = Path(os.path.relpath(Path(full_table).resolve(), Path(path).resolve().parent))
    link = link.as_posix()
  return replace_block(path, suite, headline_block(records, origin, link), part="headline")
