"""A record as ``(ids, loss_mask)``: the tokens a model reads and which of them it learns to
predict.

- ``text``: the tokenizer's own special tokens around the text (a BOS where it adds one), then
  EOS where the tokenizer has one; loss on every token.
- ``prompt_completion``: the prompt with the leading special tokens, the completion, then the
  trailing ones and EOS. ``loss_on="completion"`` puts the loss on the completion and what
  follows it only; ``"all"`` on every token.
- ``chat``: the tokenizer's chat template (``apply_chat_template``). ``loss_on="completion"``
  puts the loss on the assistant turns only: the tokens between each assistant message's
  prompt (the messages before it with the generation prompt) and the conversation up to and
  including it, both of which must be prefixes of the whole conversation's tokens.

A mask entry of 1 at token ``t`` means ``t`` is a target: the loss of predicting it from the
tokens before it counts.

Example:
  >>> from jaxfuse.data.records import Record
  >>> from jaxfuse.data.tokenization import ByteTokenizer
  >>> record = Record("a.jsonl:1", "prompt_completion", prompt="Q", completion="A")
  >>> ids, mask = encode_record(record, ByteTokenizer())
  >>> ids.tolist(), mask.tolist()
  ([81, 65], [0, 1])
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxfuse.data.records import DataError, Record
from jaxfuse.data.tokenization import VocabularyError, special_tokens

LOSS_ON = ("completion", "all")


class ChatTemplateError(DataError):
  """A chat template whose rendering of a conversation's beginning is not a prefix of its
  rendering of the whole conversation, so the assistant turns' tokens cannot be located."""


def _name(tokenizer: Any) -> str:
  return str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


class Encoder:
  """Encodes records with one tokenizer: ``encoder(record) -> (ids int32, loss_mask uint8)``.

  ``vocab_size``: the model's vocabulary; an id at or past it is a :class:`VocabularyError`
  naming the record.

  Example:
    >>> from jaxfuse.data.records import Record
    >>> from jaxfuse.data.tokenization import ByteTokenizer
    >>> Encoder(ByteTokenizer(), vocab_size=100)(Record("notes.txt", "text", text="hé"))
    Traceback (most recent call last):
    ...
    jaxfuse.data.tokenization.VocabularyError: notes.txt: token id 195 is past the model's ...
  """

  def __init__(self, tokenizer: Any, *, loss_on: str = "completion",
               vocab_size: int | None = None):
    if loss_on not in LOSS_ON:
      raise ValueError(f"Encoder: loss_on must be one of {LOSS_ON}, got {loss_on!r}")
    self.tokenizer = tokenizer
    self.loss_on = loss_on
    self.vocab_size = vocab_size
    self.prefix, suffix = special_tokens(tokenizer)
    eos = getattr(tokenizer, "eos_token_id", None)
    # What ends a document: the tokenizer's trailing special tokens, then EOS unless they end
    # with it already.
    self.end = suffix + ([eos] if eos is not None and suffix[-1:] != [eos] else [])

  def _tokens(self, text: str) -> list[int]:
    return list(self.tokenizer.encode(text, add_special_tokens=False))

  def _render(self, record: Record, messages: list[dict], generation_prompt: bool) -> list[int]:
    try:
      return list(self.tokenizer.apply_chat_template(
          messages, tokenize=True, return_dict=False, add_generation_prompt=generation_prompt))
    except Exception as e:  # a template's own error: reported with the record
      raise DataError(f"{record.source}: the chat template of {_name(self.tokenizer)} failed: "
                      f"{type(e).__name__}: {e}") from e

  def _prefix_length(self, record: Record, whole: list[int], messages: list[dict], i: int,
                     generation_prompt: bool) -> int:
    part = self._render(record, messages, generation_prompt)
    if whole[:len(part)] != part:
      upto = "before" if generation_prompt else "up to and including"
      raise ChatTemplateError(
          f"{record.source}: the chat template of {_name(self.tokenizer)} is not prefix-stable: "
          f"the conversation {upto} message {i} does not render as a prefix of the whole "
          "conversation, so the assistant turns cannot be found; use loss_on='all'")
    return len(part)

  def _chat(self, record: Record) -> tuple[list[int], list[int]]:
    if not getattr(self.tokenizer, "chat_template", None):
      raise DataError(f"{record.source}: a chat record needs a tokenizer with a chat template; "
                      f"{_name(self.tokenizer)} has none")
    messages = [dict(m) for m in record.messages]
    ids = self._render(record, messages, False)
    if self.loss_on == "all":
      return ids, [1] * len(ids)
    mask = [0] * len(ids)
    for i, message in enumerate(messages):
      if message["role"] != "assistant":
        continue
      start = self._prefix_length(record, ids, messages[:i], i, True)
      stop = self._prefix_length(record, ids, messages[:i + 1], i, False)
      mask[start:stop] = [1] * (stop - start)
    return ids, mask

  def __call__(self, record: Record) -> tuple[np.ndarray, np.ndarray]:
    if record.kind == "text":
      ids = self.prefix + self._tokens(record.text) + self.end
      mask = [1] * len(ids)
    elif record.kind == "prompt_completion":
      prompt = self.prefix + self._tokens(record.prompt)
      completion = self._tokens(record.completion) + self.end
      ids = prompt + completion
      mask = [int(self.loss_on == "all")] * len(prompt) + [1] * len(completion)
    elif record.kind == "chat":
      ids, mask = self._chat(record)
    else:
      raise DataError(f"{record.source}: unknown record kind {record.kind!r}")
    ids = np.asarray(ids, dtype=np.int64)
    if self.vocab_size is not None and ids.size and ids.max() >= self.vocab_size:
      raise VocabularyError(f"{record.source}: token id {int(ids.max())} is past the model's "
                            f"vocabulary of {self.vocab_size} (tokenizer "
                            f"{_name(self.tokenizer)})")
    return ids.astype(np.int32), np.asarray(mask, dtype=np.uint8)


def encode_record(record: Record, tokenizer: Any, *, loss_on: str = "completion",
                  vocab_size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """``(ids, loss_mask)`` of one record (1-D int32 and uint8); see :class:`Encoder`."""
  return Encoder(tokenizer, loss_on=loss_on, vocab_size=vocab_size)(record)
