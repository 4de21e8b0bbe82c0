"""The fine-tuning data pipeline: files to packed, shuffled, resumable batches.

Records (plain text, JSON lines, Parquet; ``text``, ``chat`` and ``prompt_completion``) are
tokenized once into a memory-mapped cache under the run, packed into rows of ``seq`` tokens by
best-fit decreasing, and read back as batches by step (:func:`prepare`). Each row carries
``tokens``, ``targets`` (``-100`` where there is no loss), ``segment_ids`` and ``positions``.

Example:
  >>> import pathlib, tempfile
  >>> from jaxfuse import data
  >>> root = pathlib.Path(tempfile.mkdtemp())
  >>> _ = (root / "a.jsonl").write_text('{"prompt": "1+1=", "completion": "2"}\\n')
  >>> prepared = data.prepare(root / "a.jsonl", None, root / "cache", seq=8, batch_size=1)
  >>> prepared.train.batch_at(0)["targets"].tolist()
  [[-100, -100, -100, 50, -100, -100, -100, -100]]
"""

# One job a module; data flows down this list (a module imports only those below it):
#   pipeline      files to batches in one call: prepare(), Prepared, DataReport
#   batches       shuffled training batches by step, evaluation batches in order, held-out split
#   packing       best-fit-decreasing packing plans, rows built from the cache
#   cache         the tokenized data set: chunked .npy files, fingerprint, atomic build
#   encoding      a record as (ids, loss_mask): text, prompt/completion, chat templates
#   tokenization  Hugging Face tokenizers, ByteTokenizer, BPE training, vocabulary checks
#   records       files, directories and globs to records; DataError

from jaxfuse.data import batches, cache, encoding, packing, pipeline, records, tokenization
from jaxfuse.data.batches import Batches, EvalBatches, held_out_documents
from jaxfuse.data.cache import TokenCache, build_cache, data_fingerprint, open_cache
from jaxfuse.data.encoding import LOSS_ON, ChatTemplateError, Encoder, encode_record
from jaxfuse.data.packing import (IGNORE_INDEX, LONG_DOCUMENTS, PackedRows, PackingPlan, pack,
                                  plan_packing)
from jaxfuse.data.pipeline import DataReport, Prepared, prepare
from jaxfuse.data.records import DataError, Record, read_objects, read_records, resolve_files
from jaxfuse.data.tokenization import (ByteTokenizer, TokenizerError, VocabularyError,
                                       check_vocabulary, has_tokenizer, load_tokenizer,
                                       save_tokenizer, tokenizer_fingerprint, train_tokenizer)

__all__ = [
    "IGNORE_INDEX",
    "LONG_DOCUMENTS",
    "LOSS_ON",
    "Batches",
    "ByteTokenizer",
    "ChatTemplateError",
    "DataError",
    "DataReport",
    "Encoder",
    "EvalBatches",
    "PackedRows",
    "PackingPlan",
    "Prepared",
    "Record",
    "TokenCache",
    "TokenizerError",
    "VocabularyError",
    "build_cache",
    "check_vocabulary",
    "data_fingerprint",
    "encode_record",
    "has_tokenizer",
    "held_out_documents",
    "load_tokenizer",
    "open_cache",
    "pack",
    "plan_packing",
    "prepare",
    "read_objects",
    "read_records",
    "resolve_files",
    "save_tokenizer",
    "tokenizer_fingerprint",
    "train_tokenizer",
]
