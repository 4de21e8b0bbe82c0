"""Tokenizers: a checkpoint's Hugging Face tokenizer, UTF-8 bytes, or a byte-level BPE trained on
the training texts.

The pipeline needs little of a tokenizer: ``encode(text, add_special_tokens=...)``,
``decode(ids)``, ``eos_token_id`` (``None`` where it has none), ``len(tokenizer)`` (the ids it
can produce) and, for chat records, ``chat_template`` and ``apply_chat_template``. Hugging Face
tokenizers have all of it; :class:`ByteTokenizer` has the same interface over bytes.

Example:
  >>> tokenizer = ByteTokenizer()
  >>> tokenizer.encode("hé"), len(tokenizer), tokenizer.eos_token_id
  ([104, 195, 169], 256, None)
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from jaxfuse.data.records import DataError

# What a directory must hold (one of) to have a Hugging Face tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# The file save_tokenizer writes for a ByteTokenizer (which has no Hugging Face files).
BYTE_TOKENIZER_FILE = "byte_tokenizer.json"
# The end-of-text token of tokenizers trained by train_tokenizer (their EOS).
END_OF_TEXT = "<|endoftext|>"


class TokenizerError(ValueError):
  """A tokenizer that cannot be loaded or trained; the message starts with the directory."""


class VocabularyError(DataError):
  """Token ids the model's embedding table has no row for."""


class ByteTokenizer:
  """UTF-8 bytes as tokens: ids 0-255, no special tokens (no EOS), no chat template.

  Example:
    >>> tokenizer = ByteTokenizer()
    >>> tokenizer.decode(tokenizer.encode("naïve ☃"))
    'naïve ☃'
  """
  eos_token_id = None
  bos_token_id = None
  pad_token_id = None
  chat_template = None
  vocab_size = 256
  name_or_path = "bytes"

  def __len__(self) -> int:
    return 256

  def __repr__(self) -> str:
    return "ByteTokenizer()"

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    """The UTF-8 bytes of ``text`` (there are no special tokens to add)."""
    return list(text.encode("utf-8"))

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
    """The text of byte ids; a cut multi-byte character decodes as U+FFFD."""
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def has_tokenizer(directory: str | os.PathLike) -> bool:
  """Whether ``directory`` holds tokenizer files (Hugging Face's, or :func:`save_tokenizer`'s
  for a :class:`ByteTokenizer`)."""
  path = Path(directory)
  return any((path / name).is_file() for name in (*TOKENIZER_FILES, BYTE_TOKENIZER_FILE))


def save_tokenizer(tokenizer: Any, directory: str | os.PathLike) -> None:
  """Writes ``tokenizer`` into ``directory`` so that :func:`load_tokenizer` reads it back: a
  Hugging Face tokenizer's own files (``save_pretrained``), or a small JSON file for a
  :class:`ByteTokenizer`.

  Example:
    >>> import tempfile
    >>> directory = tempfile.mkdtemp()
    >>> save_tokenizer(ByteTokenizer(), directory)
    >>> load_tokenizer(directory)
    ByteTokenizer()
  """
  path = Path(directory)
  path.mkdir(parents=True, exist_ok=True)
  if isinstance(tokenizer, ByteTokenizer):
    (path / BYTE_TOKENIZER_FILE).write_text(json.dumps({"type": "utf-8 bytes"}) + "\n")
  else:
    tokenizer.save_pretrained(str(path))


def load_tokenizer(directory: str | os.PathLike) -> Any:
  """The tokenizer saved in ``directory`` (a checkpoint or a ``--tokenizer DIR``): Hugging
  Face's, read from local files only, or a :class:`ByteTokenizer` that :func:`save_tokenizer`
  wrote.

  Example:
    >>> import tempfile
    >>> load_tokenizer(tempfile.mkdtemp())
    Traceback (most recent call last):
    ...
    jaxfuse.data.tokenization.TokenizerError: ...: no tokenizer files (tokenizer.json, ...
  """
  path = Path(directory)
  if not path.is_dir():
    raise TokenizerError(f"{directory}: no such directory (expected a checkpoint or tokenizer "
                         "directory)")
  if (path / BYTE_TOKENIZER_FILE).is_file():
    return ByteTokenizer()
  if not any((path / name).is_file() for name in TOKENIZER_FILES):
    raise TokenizerError(f"{directory}: no tokenizer files ({', '.join(TOKENIZER_FILES)}); pass "
                         "--tokenizer DIR naming a directory that has them")
  from transformers import AutoTokenizer

  try:
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
  except Exception as e:  # any failure: reported with the directory
    raise TokenizerError(f"{directory}: the tokenizer could not be loaded: {e}") from e


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | os.PathLike, *,
                    chat_template: str | None = None,
                    additional_special_tokens: Sequence[str] = ()) -> Any:
  """A byte-level BPE of at most ``vocab_size`` tokens trained on ``texts``, with
  ``<|endoftext|>`` as its EOS, saved as Hugging Face tokenizer files in ``out_dir`` (which
  ``transformers.AutoTokenizer.from_pretrained`` loads) and returned loaded from there.

  ``additional_special_tokens``: strings that are one special token each, never split nor
  merged (a chat template's markers such as ``<|im_start|>``), with the ids after EOS's.

  Example:
    >>> import tempfile
    >>> tokenizer = train_tokenizer(["low lower lowest"] * 4, 270, tempfile.mkdtemp(),
    ...                             additional_special_tokens=["<|im_end|>"])
    >>> tokenizer.decode(tokenizer.encode("lowest")), tokenizer.eos_token
    ('lowest', '<|endoftext|>')
    >>> tokenizer.convert_ids_to_tokens(tokenizer.encode("low<|im_end|>"))
    ['low', '<|im_end|>']
  """
  specials = [END_OF_TEXT, *(t for t in additional_special_tokens if t != END_OF_TEXT)]
  if vocab_size < 256 + len(specials):
    raise TokenizerError(f"{out_dir}: vocab_size must be at least {256 + len(specials)} (256 "
                         f"bytes and the special tokens {specials}), got {vocab_size}")

  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  from transformers import PreTrainedTokenizerFast

  bpe = Tokenizer(models.BPE())
  bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  bpe.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  bpe.train_from_iterator(texts, trainer=trainer)
  tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=END_OF_TEXT)
  if specials[1:]:
    tokenizer.add_special_tokens({"additional_special_tokens": specials[1:]})
  if chat_template is not None:
    tokenizer.chat_template = chat_template
  tokenizer.save_pretrained(str(out_dir))
  return load_tokenizer(out_dir)


def check_vocabulary(tokenizer: Any, vocab_size: int, source: str) -> None:
  """Raises :class:`VocabularyError` (naming ``source``) when ``tokenizer`` can produce ids past
  a model vocabulary of ``vocab_size``; a smaller tokenizer is fine (checkpoints pad their
  vocabularies).

  Example:
    >>> check_vocabulary(ByteTokenizer(), 512, "bytes")
    >>> check_vocabulary(ByteTokenizer(), 100, "bytes")
    Traceback (most recent call last):
    ...
    jaxfuse.data.tokenization.VocabularyError: bytes: the tokenizer has 256 tokens, more than ...
  """
  if len(tokenizer) > vocab_size:
    raise VocabularyError(f"{source}: the tokenizer has {len(tokenizer)} tokens, more than the "
                          f"model's vocabulary of {vocab_size}: its ids would index past the "
                          "embedding table")


def tokenizer_fingerprint(tokenizer: Any) -> str:
  """A hash of what decides a tokenizer's ids: its whole definition (vocabulary, merges,
  normalizer, pre- and post-processing, added tokens), chat template and special tokens; not
  where it was loaded from.

  Example:
    >>> tokenizer_fingerprint(ByteTokenizer()) == tokenizer_fingerprint(ByteTokenizer())
    True
  """
  if isinstance(tokenizer, ByteTokenizer):
    definition = "utf-8 bytes"
  elif hasattr(tokenizer, "backend_tokenizer"):
    definition = tokenizer.backend_tokenizer.to_str()
  else:
    definition = json.dumps(sorted(tokenizer.get_vocab().items()))
  parts = [definition, repr(getattr(tokenizer, "chat_template", None)),
           repr(getattr(tokenizer, "bos_token_id", None)),
           repr(getattr(tokenizer, "eos_token_id", None))]
  return hashlib.sha256("\0".join(parts).encode("utf-8")).hexdigest()


def special_tokens(tokenizer: Any) -> tuple[list[int], list[int]]:
  """``(prefix, suffix)``: the ids ``tokenizer.encode(text)`` puts before and after the text's
  own (a BOS, an EOS, ...), found by encoding a probe with and without special tokens.

  Example:
    >>> special_tokens(ByteTokenizer())
    ([], [])
  """
  probe = "a"
  bare = list(tokenizer.encode(probe, add_special_tokens=False))
  full = list(tokenizer.encode(probe, add_special_tokens=True))
  for start in range(len(full) - len(bare) + 1):
    if full[start:start + len(bare)] == bare:
      return full[:start], full[start + len(bare):]
  raise TokenizerError(f"{getattr(tokenizer, 'name_or_path', tokenizer)}: encoding with special "
                       "tokens changes the text's own tokens; cannot tell its special tokens")
