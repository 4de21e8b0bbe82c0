"""What a run reads: its tokenizer and its batches, from ``--data`` files or the standard
library's bytes.

- The tokenizer (:func:`resolve_tokenizer`): ``--tokenizer DIR``; else the ``--init-from``
  checkpoint's own files; else one ``--train-tokenizer VOCAB`` trains on the ``--data`` texts;
  else UTF-8 bytes. It is saved in the run (``<out>/tokenizer``), where a resumed run, the
  export and :mod:`jaxfuse.generate` find it.
- The batches (:class:`Inputs`): with ``--data``, :func:`jaxfuse.data.prepare`'s packed rows
  (tokens, targets, positions and segment ids; tokenized once into ``<out>/data``); without,
  random windows of the standard library's bytes (:mod:`jaxfuse.train.corpus`); for a preference
  ``--objective``, rows of one pair each (:mod:`jaxfuse.posttrain.data`) with the reference
  model's per-token log-probabilities once computed (:meth:`Inputs.set_reference`). Either way the
  batch of a step is a function of the step, so a resumed run sees the batches the
  uninterrupted one would have; each process builds only the rows its devices hold.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxfuse import data
from jaxfuse.train import config, placement
from jaxfuse.train.config import TrainConfig
from jaxfuse.train.corpus import batch_at, stdlib_corpus, unigram_entropy_bits

# The arrays of a batch, in the order the model takes them.
BATCH_KEYS = ("tokens", "targets", "positions", "segment_ids")
# A preference batch's reference log-probabilities (per token, float32), where the objective
# needs them.
REFERENCE_KEY = "ref_logps"
# A distillation batch's teacher top-k word ids and log-probabilities ([batch, seq, k]), where
# they were stored (--teacher-topk).
TEACHER_KEYS = ("teacher_ids", "teacher_logps")


def tokenizer_dir(out: str | Path) -> Path:
  """Where a run keeps its tokenizer."""
  return Path(out) / "tokenizer"


def resolve_tokenizer(cfg: TrainConfig, *, log=print) -> Any:
  """The run's tokenizer (see the module docstring). A trained one is trained once, into the
  run's directory, where a resumed run reads it back; :func:`save_tokenizer` saves the others
  once the run's inputs are checked."""
  saved = tokenizer_dir(cfg.out)
  if cfg.tokenizer:
    return data.load_tokenizer(cfg.tokenizer)
  if cfg.init_from and data.has_tokenizer(cfg.init_from):
    return data.load_tokenizer(cfg.init_from)
  if cfg.train_tokenizer is not None:
    if data.has_tokenizer(saved):
      return data.load_tokenizer(saved)
    texts = (text for record in data.read_records(cfg.data, cfg.text_field)
             for text in record.texts)
    log(f"training a byte-level BPE tokenizer of {cfg.train_tokenizer} tokens on --data")
    return data.train_tokenizer(texts, cfg.train_tokenizer, saved)
  return data.ByteTokenizer()


def save_tokenizer(cfg: TrainConfig, tokenizer: Any) -> None:
  """Saves ``tokenizer`` into the run's directory (process 0), where the export and
  :mod:`jaxfuse.generate` find it."""
  if jax.process_index() == 0:
    data.save_tokenizer(tokenizer, tokenizer_dir(cfg.out))


@dataclasses.dataclass
class Inputs:
  """A run's batches. ``train(step, mesh)`` and ``evaluation(mesh)`` give dicts of placed
  ``[batch x grad_accum, seq]`` arrays, a step's rows, which the step splits into micro-batches
  (:data:`BATCH_KEYS`; the byte corpus has no positions or segment ids); ``fingerprint`` names
  the data, its packing, batch size and seed (a checkpoint records it); ``entropy_bits`` is the
  byte corpus' unigram entropy (None for ``--data``)."""

  cfg: TrainConfig
  tokenizer: Any
  prepared: data.Prepared | None = None
  corpus: tuple[np.ndarray, np.ndarray] | None = None
  pairs: Any = None   # jaxfuse.posttrain.data.PreferenceRows
  reference: np.ndarray | None = None
  teacher_topk: tuple[np.ndarray, np.ndarray] | None = None   # ids, log-probs [rows, seq, k]
  report: str = ""

  @classmethod
  def load(cls, cfg: TrainConfig, tokenizer: Any, vocab_size: int, *, log=print) -> Inputs:
    """The batches of ``cfg``: ``--data`` prepared for a model of ``vocab_size`` tokens, or
    the standard library's bytes."""
    if cfg.objective in config.PAIRED:
      from jaxfuse.posttrain.data import read_kto_rows, read_preference_rows

      if cfg.objective == "kto":
        pairs = read_kto_rows(cfg.data, tokenizer, seq=cfg.seq, group=cfg.batch,
                              vocab_size=vocab_size)
      else:
        pairs = read_preference_rows(cfg.data, tokenizer, seq=cfg.seq, vocab_size=vocab_size)
      what = "completions with their mismatched pairs" if cfg.objective == "kto" else "pairs"
      report = (f"{len(pairs)} preference {what}, one a row of {cfg.seq} tokens"
                + (f" ({pairs.truncated} cut to {cfg.seq // 2} tokens a sequence)"
                   if pairs.truncated else ""))
      if jax.process_index() == 0:
        log(f"data: {report}")
      return cls(cfg, tokenizer, pairs=pairs, report=report)
    if cfg.data is None:
      if vocab_size < 256:
        raise ValueError(f"--init-from: the model's vocabulary ({vocab_size}) cannot hold the "
                         "256 byte tokens of the default corpus; give --data")
      if not isinstance(tokenizer, data.ByteTokenizer):
        log("no --data: training on the standard library's bytes (the tokenizer is used for "
            "the sample only)")
      return cls(cfg, tokenizer, corpus=stdlib_corpus())
    prepared = data.prepare(
        cfg.data, tokenizer, Path(cfg.out) / "data", seq=cfg.seq, batch_size=cfg.global_batch,
        text_field=cfg.text_field, loss_on=cfg.loss_on, long_documents=cfg.long_documents,
        eval_paths=cfg.eval_data, eval_share=cfg.eval_share, vocab_size=vocab_size,
        seed=cfg.seed, log=log if jax.process_index() == 0 else None)
    return cls(cfg, tokenizer, prepared=prepared, report=str(prepared.report))

  @property
  def fingerprint(self) -> str:
    if self.pairs is not None:
      return f"{self.pairs.fingerprint}/batch{self.cfg.global_batch}/seed{self.cfg.seed}"
    if self.prepared is None:
      return f"stdlib-bytes/batch{self.cfg.global_batch}/seq{self.cfg.seq}/seed{self.cfg.seed}"
    return self.prepared.train.fingerprint

  @property
  def sample_tokenizer(self) -> Any:
    """What the model reads and writes: the tokenizer, or bytes for the byte corpus."""
    return data.ByteTokenizer() if self.corpus is not None else self.tokenizer

  @property
  def entropy_bits(self) -> float | None:
    return None if self.corpus is None else unigram_entropy_bits(self.corpus[0])

  def check_resume(self, recorded: str | None) -> None:
    """Refuses to resume a run (whose checkpoint recorded ``recorded``) on other data."""
    if recorded is not None and recorded != self.fingerprint:
      raise data.DataError(f"the checkpoint was trained on data {recorded}, this run's is "
                           f"{self.fingerprint} (other files, tokenizer, packing, batch size, "
                           "sequence or seed): resume with the same options, or another --out")

  @property
  def keys(self) -> tuple[str, ...]:
    """The arrays of this run's batches."""
    if self.teacher_topk is not None:
      return BATCH_KEYS + TEACHER_KEYS
    if self.pairs is not None:
      return (BATCH_KEYS + (("labels",) if self.pairs.labels is not None else ())
              + ((REFERENCE_KEY,) if self.reference is not None else ()))
    return BATCH_KEYS if self.prepared is not None else BATCH_KEYS[:2]

  def pair_indices(self, step: int, lo: int = 0, hi: int | None = None) -> np.ndarray:
    """The preference rows of step ``step``'s batch, positions ``lo .. hi - 1``: an order of
    the rows shuffled by ``--seed``, repeated."""
    hi = self.cfg.global_batch if hi is None else hi
    if not hasattr(self, "_order"):
      import grain

      self._order = grain.MapDataset.source(range(len(self.pairs))).shuffle(
          seed=self.cfg.seed).repeat(None)
    first = step * self.cfg.global_batch
    return np.asarray([int(self._order[first + k]) for k in range(lo, hi)], np.int64)

  def pair_rows(self, indices) -> dict:
    """The preference rows ``indices`` (and their reference log-probabilities, once set)."""
    rows = self.pairs.rows(indices)
    if self.reference is not None:
      rows[REFERENCE_KEY] = self.reference[np.asarray(indices)]
    return rows

  def packed_rows(self, indices) -> dict:
    """The packed training rows ``indices``, with the teacher's stored top-k once set."""
    indices = np.asarray(indices)
    rows = self.prepared.train.packed.rows(indices)
    if self.teacher_topk is not None:
      rows["teacher_ids"], rows["teacher_logps"] = (a[indices] for a in self.teacher_topk)
    return rows

  def set_teacher_topk(self, ids: np.ndarray, logps: np.ndarray) -> None:
    """The teacher's top-k word ids and log-probabilities at every position of every packed
    training row ``[rows, seq, k]``: batches carry them from now on."""
    self.teacher_topk = (ids, logps)

  def set_reference(self, reference: np.ndarray) -> None:
    """The reference model's per-token log-probabilities of every preference row
    ``[pairs, seq]``: batches carry them as ``ref_logps`` from now on."""
    assert reference.shape == self.pairs.tokens.shape, reference.shape
    self.reference = reference.astype(np.float32)

  def _place(self, rows, mesh) -> dict:
    shape = (self.cfg.global_batch, self.cfg.seq)
    keys = self.keys
    arrays = placement.place_batch_rows(lambda lo, hi: _ordered(rows(lo, hi), keys), shape,
                                        mesh)
    return dict(zip(keys, arrays))

  def train(self, step: int, mesh=None) -> dict:
    """The placed batch of ``step``."""
    if self.pairs is not None:
      return self._place(lambda lo, hi: self.pair_rows(self.pair_indices(step, lo, hi)), mesh)
    if self.teacher_topk is not None:
      return self._place(lambda lo, hi: self.packed_rows(self.prepared.train.indices(step, lo,
                                                                                     hi)), mesh)
    if self.prepared is None:
      tokens, targets = batch_at(self.corpus[0], step, self.cfg.global_batch, self.cfg.seq,
                                 self.cfg.seed)
      return self._place(lambda lo, hi: {"tokens": tokens[lo:hi], "targets": targets[lo:hi]},
                         mesh)
    return self._place(lambda lo, hi: self.prepared.train.rows(step, lo, hi), mesh)

  def first_batch(self) -> tuple:
    """Step 0's arrays on this host, in :data:`BATCH_KEYS` order (for the remat planner)."""
    batch = self.train(0)
    return tuple(batch[k] for k in BATCH_KEYS if k in batch)

  def evaluation(self, mesh=None) -> list[dict]:
    """The evaluation batches (at most ``--eval-batches``): held-out windows of the byte
    corpus, or ``--eval-data`` / ``--eval-share`` in order; none without evaluation data (and
    for preference objectives)."""
    if self.pairs is not None:
      return []
    if self.prepared is None:
      validation = self.corpus[1]
      batches = []
      for i in range(self.cfg.eval_batches):
        tokens, targets = batch_at(validation, i, self.cfg.global_batch, self.cfg.seq,
                                   self.cfg.seed, stream=1)
        batches.append(self._place(
            lambda lo, hi, t=tokens, y=targets: {"tokens": t[lo:hi], "targets": y[lo:hi]},
            mesh))
      return batches
    evaluation = self.prepared.eval
    if evaluation is None:
      return []
    count = min(len(evaluation), self.cfg.eval_batches)
    return [self._place(lambda lo, hi, i=i: evaluation.rows(i, lo, hi), mesh)
            for i in range(count)]


def _ordered(batch: dict, keys: tuple[str, ...]) -> tuple:
  return tuple(np.asarray(batch[k]) for k in keys)
