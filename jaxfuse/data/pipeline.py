"""Files to batches in one call: records, the token cache, packing, training and evaluation
batches (:func:`prepare`)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

from jaxfuse.data.batches import Batches, EvalBatches, held_out_documents
from jaxfuse.data.cache import build_cache
from jaxfuse.data.encoding import LOSS_ON
from jaxfuse.data.packing import LONG_DOCUMENTS, pack
from jaxfuse.data.records import PathLike
from jaxfuse.data.tokenization import ByteTokenizer, check_vocabulary


@dataclasses.dataclass(frozen=True)
class DataReport:
  """What :func:`prepare` made: the training cache (and whether it was reused), its record
  kinds, each split's documents, rows and tokens, the training rows' packing efficiency, and the
  documents and tokens truncation cut (both splits)."""
  cache: str
  reused: bool
  kinds: dict[str, int]
  train_documents: int
  train_rows: int
  train_tokens: int
  efficiency: float
  truncated_documents: int
  truncated_tokens: int
  eval_documents: int = 0
  eval_rows: int = 0
  eval_tokens: int = 0

  def __str__(self) -> str:
    kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(self.kinds.items()))
    text = (f"data: {self.train_documents} documents ({kinds}), {self.train_tokens} tokens in "
            f"{self.train_rows} rows, packing efficiency {self.efficiency:.1%}")
    if self.eval_rows:
      text += f"; eval: {self.eval_documents} documents in {self.eval_rows} rows"
    if self.truncated_documents:
      text += (f"; truncated: {self.truncated_documents} documents, {self.truncated_tokens} "
               "tokens cut")
    return text + f"; cache {self.cache}{' (reused)' if self.reused else ''}"


@dataclasses.dataclass(frozen=True)
class Prepared:
  """:func:`prepare`'s result: ``train`` batches, ``eval`` batches (``None`` without evaluation
  data) and the ``report``."""
  train: Batches
  eval: EvalBatches | None
  report: DataReport


def prepare(paths: PathLike | Sequence[PathLike], tokenizer: Any,
            cache_root: str | os.PathLike, *, seq: int, batch_size: int,
            text_field: str = "text", loss_on: str = "completion",
            long_documents: str = "auto",
            eval_paths: PathLike | Sequence[PathLike] | None = None, eval_share: float = 0.0,
            vocab_size: int | None = None, seed: int = 0,
            log: Callable[[str], None] | None = None) -> Prepared:
  """Reads the records ``paths`` name, tokenizes them into a cache under ``cache_root`` (reused
  when nothing changed), packs them into rows of ``seq`` tokens and returns shuffled training
  batches of ``batch_size`` rows and, from ``eval_paths`` or a held-out ``eval_share`` of the
  documents (chosen with ``seed``), evaluation batches in order.

  ``tokenizer``: a Hugging Face tokenizer, or ``None`` for :class:`ByteTokenizer`.
  ``vocab_size``: the model's vocabulary; a tokenizer or token ids past it are an error.
  ``loss_on``, ``long_documents``: see :mod:`jaxfuse.data.encoding`, :mod:`jaxfuse.data.packing`;
  ``long_documents="auto"`` splits long documents when every record is plain text
  (pretraining) and truncates them otherwise (chat or prompt/completion records: SFT).

  Example:
    >>> import pathlib, tempfile
    >>> root = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (root / "train.jsonl").write_text('{"text": "hello world"}\\n{"text": "hi"}\\n')
    >>> data = prepare(root / "train.jsonl", None, root / "cache", seq=8, batch_size=2)
    >>> data.train.batch_at(0)["tokens"].shape, data.train.num_rows   # 11 + 2 bytes: 8 | 3 + 2
    ((2, 8), 2)
    >>> print(data.report)
    data: 2 documents (2 text), 13 tokens in 2 rows, packing efficiency 81.2%; cache ...
    >>> prepare(root / "train.jsonl", None, root / "cache", seq=8, batch_size=2,
    ...         long_documents="truncate").train.truncated
    1
  """
  tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
  if seq < 2:
    raise ValueError(f"prepare: seq must be at least 2, got {seq}")
  if batch_size < 1:
    raise ValueError(f"prepare: batch_size must be at least 1, got {batch_size}")
  if loss_on not in LOSS_ON:
    raise ValueError(f"prepare: loss_on must be one of {LOSS_ON}, got {loss_on!r}")
  if long_documents not in ("auto", *LONG_DOCUMENTS):
    raise ValueError(f"prepare: long_documents must be 'auto' or one of {LONG_DOCUMENTS}, got "
                     f"{long_documents!r}")
  if not 0 <= eval_share < 1:
    raise ValueError(f"prepare: eval_share must be in [0, 1), got {eval_share}")
  if eval_share and eval_paths is not None:
    raise ValueError("prepare: give eval_paths or eval_share, not both")
  if vocab_size is not None:
    check_vocabulary(tokenizer, vocab_size, str(getattr(tokenizer, "name_or_path", "tokenizer")))
  options = {"text_field": text_field, "loss_on": loss_on, "vocab_size": vocab_size, "log": log}
  cache = build_cache(paths, tokenizer, cache_root, **options)
  if long_documents == "auto":
    long_documents = "split" if set(cache.meta["kinds"]) == {"text"} else "truncate"
  train_documents, eval_documents = None, None
  if eval_share:
    train_documents, eval_documents = held_out_documents(cache.num_documents, eval_share, seed)
  train = pack(cache, seq, long_documents=long_documents, documents=train_documents)
  evaluation, eval_count = None, 0
  if eval_documents is not None:
    evaluation = pack(cache, seq, long_documents=long_documents, documents=eval_documents)
    eval_count = len(eval_documents)
  elif eval_paths is not None:
    eval_cache = build_cache(eval_paths, tokenizer, cache_root, **options)
    evaluation = pack(eval_cache, seq, long_documents=long_documents)
    eval_count = eval_cache.num_documents
  plans = [train.plan] + ([] if evaluation is None else [evaluation.plan])
  report = DataReport(
      cache=str(cache.directory), reused=cache.reused, kinds=dict(cache.meta["kinds"]),
      train_documents=cache.num_documents - (eval_count if eval_share else 0),
      train_rows=train.num_rows, train_tokens=train.num_tokens, efficiency=train.efficiency,
      truncated_documents=sum(p.truncated_documents for p in plans),
      truncated_tokens=sum(p.truncated_tokens for p in plans), eval_documents=eval_count,
      eval_rows=0 if evaluation is None else evaluation.num_rows,
      eval_tokens=0 if evaluation is None else evaluation.num_tokens)
  if log:
    log(str(report))
  return Prepared(Batches(train, batch_size, seed),
                  None if evaluation is None else EvalBatches(evaluation, batch_size), report)
