"""Collectives of a compiled program: which ones, on what shapes, how many bytes per device.

Read from the compiled HLO text (``jax.jit(f).lower(...).compile().as_text()``), after XLA's
SPMD partitioner has inserted them, so they are the ones that run. A collective's bytes are
its result's bytes on one device (an all-reduce of ``f32[1024]`` counts 4 KiB, an all-gather
the gathered array); asynchronous pairs (``*-start`` / ``*-done``) count once.

Example:
  >>> from jaxfuse.metrics.collectives import collectives
  >>> text = "%ar = f32[8,4]{1,0} all-reduce(f32[8,4]{1,0} %x), replica_groups={{0,1}}"
  >>> [(c.kind, c.shape, c.nbytes) for c in collectives(text)]
  [('all-reduce', (8, 4), 128)]
"""

from __future__ import annotations

import dataclasses
import math
import re

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")

_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
             "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")
_COMMENT = re.compile(r"/\*.*?\*/")
_LINE = re.compile(r"=\s*(\([^=]*?\)|[a-z]+[0-9]*\[[0-9,]*\](?:\{[^}]*\})?)\s+"
                   r"(" + "|".join(KINDS) + r")(-start)?\(")


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective: its kind, its result's shape (the first array of a tuple result), dtype
  and bytes on one device (all arrays of a tuple result)."""

  kind: str
  shape: tuple[int, ...]
  dtype: str
  nbytes: int


def _arrays(result: str):
  for dtype, dims in _ARRAY.findall(result):
    if dtype in _ITEMSIZE:
      shape = tuple(int(d) for d in dims.split(",") if d)
      yield dtype, shape, math.prod(shape) * _ITEMSIZE[dtype]


def collectives(hlo_text: str) -> list[Collective]:
  """Every collective in a compiled HLO module's text, in order."""
  out = []
  for line in hlo_text.splitlines():
    line = _COMMENT.sub("", line)   # /*index=5*/ in long tuple types
    match = _LINE.search(line)
    if match is None:
      continue
    result, kind, start = match.group(1), match.group(2), match.group(3)
    arrays = list(_arrays(result))
    if start and result.startswith("(") and kind != "collective-permute":
      arrays = arrays[len(arrays) // 2:]   # (operands, results) of an async start
    if not arrays:
      continue
    dtype, shape, _ = arrays[0]
    out.append(Collective(kind, shape, dtype, sum(a[2] for a in arrays)))
  return out


def collective_bytes(hlo_text: str) -> int:
  """The bytes of every collective of a compiled HLO module, on one device."""
  return sum(c.nbytes for c in collectives(hlo_text))


def collective_counts(hlo_text: str) -> dict[str, int]:
  """How many collectives of each kind the module runs (kinds that do not occur are 0)."""
  found = collectives(hlo_text)
  return {kind: sum(c.kind == kind for c in found) for kind in KINDS}
