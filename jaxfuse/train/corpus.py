"""The byte corpus of ``python -m jaxfuse.train``: the running Python's standard library.

The corpus is built at run time from the standard library's top-level ``.py`` files (no
download): files sorted by name, every tenth one held out for validation. Tokens are bytes (a
vocabulary of 256). Batches are random windows drawn from a generator seeded by the run's seed
and the step, so a resumed run sees exactly the batches the uninterrupted run would have.
"""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import numpy as np

# A loss in nats divided by LN2 is in bits (per byte: the tokens are bytes).
LN2 = math.log(2.0)


def stdlib_corpus(max_files: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """``(train, validation)`` bytes of the standard library's top-level ``.py`` files, sorted by
  name; every tenth file (the 10th, 20th, ...) is validation."""
  root = Path(sysconfig.get_paths()["stdlib"])
  files = sorted(root.glob("*.py"))[:max_files]
  if len(files) < 10:
    raise RuntimeError(f"stdlib_corpus: found {len(files)} .py files under {root}; need 10")
  train, val = [], []
  for i, path in enumerate(files):
    (val if i % 10 == 9 else train).append(path.read_bytes())
  as_array = lambda parts: np.frombuffer(b"\n".join(parts), dtype=np.uint8)  # noqa: E731
  return as_array(train), as_array(val)


def unigram_entropy_bits(data: np.ndarray) -> float:
  """Bits per byte of the corpus' byte frequencies: what a model that ignores context gets."""
  counts = np.bincount(data, minlength=256).astype(np.float64)
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log2(p)).sum())


def batch_at(data: np.ndarray, step: int, batch: int, seq: int, seed: int, stream: int = 0):
  """``(tokens, targets)`` ``[batch, seq]`` int32 for this step: random windows of ``data``,
  targets shifted by one; the same for the same ``(seed, stream, step)`` (stream 0: training,
  1: validation)."""
  rng = np.random.default_rng([seed, stream, step])
  starts = rng.integers(0, len(data) - seq - 1, size=batch)
  windows = np.stack([data[s:s + seq + 1] for s in starts]).astype(np.int32)
  return windows[:, :-1], windows[:, 1:]
