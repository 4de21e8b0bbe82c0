"""A record as ``(ids, loss_mask)``: the tokens a model reads and which of them it learns to
predict.

- ``text``: the tokenizer's own special tokens around the text (a BOS where it adds one), then
  EOS where the tokenizer has one; loss on every token.
- ``prompt_completion``: the prompt with the leading special tokens, the completion, then the
  trailing ones and EOS. ``loss_on="completion"`` puts the loss on the completion and what
  follows it only; ``"all"`` on every token.
- ``chat``: the tokenizer's chat template (``apply_chat_template``). ``loss_on="completion"``
  puts the loss on the assistant turns only: each assistant message's text and what the template
  closes its turn with (an end-of-turn token), not the next turn's header. A template's
  ``{% generation %}`` blocks mark them where it has some; otherwise they are located in the
  rendered text (see :meth:`Encoder.encode_chat`) and a token is in the loss when its characters
  overlap a turn's. A tokenizer without character offsets (not a "fast" one) locates them by
  tokens: the messages before each assistant message with the generation prompt, and those up to
  and including it, must render as token prefixes of the whole conversation.

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

import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxfuse.data.records import DataError, Record
from jaxfuse.data.tokenization import VocabularyError, special_tokens

LOSS_ON = ("completion", "all")

# A template that marks the assistant's text itself (transformers' assistant-tokens mask).
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# A reasoning block at the start of an assistant message, which templates drop from earlier turns.
_LEADING_THINK = re.compile(r"^\s*<think>.*?</think>", re.DOTALL)
# Characters appended to a message's content to find where the template's rendering of it ends.
_SENTINELS = ("\ue000", "\ue001", "\ue002", "\U000f0000")


class ChatTemplateError(DataError):
  """A chat template whose rendering of a conversation leaves an assistant turn that cannot be
  located (its message, its tokens or where it ends), or whose text does not tokenize to the
  template's own tokens."""


def _name(tokenizer: Any) -> str:
  return str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def _runs(mask: Sequence[int]) -> list[tuple[int, int]]:
  """The ``[start, stop)`` index ranges of ``mask``'s runs of nonzero entries."""
  runs, start = [], None
  for t, value in enumerate([*mask, 0]):
    if value and start is None:
      start = t
    elif not value and start is not None:
      runs.append((start, t))
      start = None
  return runs


def _content_forms(content: str) -> list[str]:
  """The texts a template may render an assistant message's ``content`` as: as given, stripped
  of surrounding whitespace, and without a leading ``<think>...</think>`` block."""
  forms = [content, content.strip()]
  unthought = _LEADING_THINK.sub("", content, count=1)
  if unthought != content:
    forms += [unthought.lstrip("\n"), unthought.strip()]
  return [f for f in dict.fromkeys(forms) if f]


def _mask_overlapping(offsets: Sequence[tuple[int, int]],
                      spans: Sequence[tuple[int, int]]) -> list[int]:
  """1 for each token whose characters ``[start, end)`` overlap one of the sorted, disjoint
  ``spans`` (a token of no characters: where it sits inside one)."""
  mask, k = [0] * len(offsets), 0
  for t, (start, end) in enumerate(offsets):
    end = max(end, start + 1)
    while k < len(spans) and spans[k][1] <= start:
      k += 1
    if k < len(spans) and spans[k][0] < end:
      mask[t] = 1
  return mask


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

  def _render(self, source: str, messages: list[dict], *, generation_prompt: bool = False,
              tokenize: bool = False, **options) -> Any:
    """The template's rendering of ``messages``: its text; with ``tokenize`` its token ids, or
    the tokenizer's dict where ``options`` ask for more."""
    if tokenize and not options:
      options = {"return_dict": False}
    try:
      rendered = self.tokenizer.apply_chat_template(
          messages, tokenize=tokenize, add_generation_prompt=generation_prompt, **options)
    except Exception as e:  # a template's own error: reported with the record
      raise DataError(f"{source}: the chat template of {_name(self.tokenizer)} failed: "
                      f"{type(e).__name__}: {e}") from e
    return list(rendered) if options.get("return_dict") is False else rendered

  def _template(self) -> str:
    getter = getattr(self.tokenizer, "get_chat_template", None)
    try:
      template = getter() if getter else self.tokenizer.chat_template
    except Exception:  # several named templates and no default: the caller's call fails too
      template = self.tokenizer.chat_template
    return template if isinstance(template, str) else str(template)

  def _unlocated(self, source: str, i: int, why: str) -> ChatTemplateError:
    return ChatTemplateError(
        f"{source}: the chat template of {_name(self.tokenizer)} is not prefix-stable and "
        f"assistant message {i} cannot be located in its rendering: {why}; use loss_on='all'")

  def encode_chat(self, messages: Sequence[dict], source: str,
                  loss_from: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(ids int32, loss_mask uint8)`` of a conversation rendered by the tokenizer's chat
    template, ``ids`` as ``apply_chat_template(messages, tokenize=True)`` gives them; errors name
    ``source``. With ``loss_on="completion"`` the mask is 1 on the turns of the assistant
    messages at index ``loss_from`` or later only (a preference row: its prompt's messages and
    one answer, ``loss_from=len(prompt)``); with ``"all"`` on every token.

    Where the template has ``{% generation %}`` blocks, transformers' assistant-tokens mask
    gives the turns, its k-th run of tokens being the k-th assistant message's. Otherwise
    assistant message ``i``'s turn is a span of the conversation's rendered text:

    - where the messages before it with the generation prompt, and those up to and including
      it, render as prefixes of the whole text: from the end of the first to the end of the
      second;
    - else it starts where the first ends if that one is a prefix, or else right after the next
      generation prompt past the previous turn (or, with none, at the message's content); its
      content is searched for from there (as given, stripped, or without a leading
      ``<think>...</think>`` block, which templates drop from earlier turns; the one found first
      in the text wins) and the turn ends after it, with as much of the template's closing text
      (what it renders after the content when the message is the last one, such as
      ``<|im_end|>`` and a newline) as the whole text goes on with.

    On templates whose renderings are prefixes of each other both give the same span: the
    message's text and its turn's closing text, up to where the next message's turn begins.
    The text is tokenized once with character offsets and a token is in the loss when its
    characters overlap a span. A tokenizer without offsets uses tokens instead of text and needs
    both prefixes. A turn that cannot be located is a :class:`ChatTemplateError`.

    Example:
      >>> import tempfile
      >>> from jaxfuse.data.tokenization import train_tokenizer
      >>> template = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] }}"
      ...             "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
      ...             "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
      >>> tokenizer = train_tokenizer(["Hi there. Hello!"] * 4, 300, tempfile.mkdtemp(),
      ...                             chat_template=template)
      >>> messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
      >>> ids, mask = Encoder(tokenizer).encode_chat(messages, "pairs.jsonl:1", loss_from=1)
      >>> tokenizer.decode(ids[mask == 1])
      'Hello<|endoftext|>'
    """
    if not getattr(self.tokenizer, "chat_template", None):
      raise DataError(f"{source}: a chat record needs a tokenizer with a chat template; "
                      f"{_name(self.tokenizer)} has none")
    if loss_from < 0:
      raise ValueError(f"{source}: loss_from must be at least 0, got {loss_from}")
    messages = [dict(m) for m in messages]
    if self.loss_on == "all":
      ids = self._render(source, messages, tokenize=True)
      mask = [1] * len(ids)
    elif getattr(self.tokenizer, "is_fast", False) and _GENERATION_TAG.search(self._template()):
      ids, mask = self._generation_blocks(source, messages, loss_from)
    elif getattr(self.tokenizer, "is_fast", False):
      ids, mask = self._text_spans(source, messages, loss_from)
    else:
      ids, mask = self._token_prefixes(source, messages, loss_from)
    return self._checked(source, ids, mask)

  def _generation_blocks(self, source: str, messages: list[dict],
                         loss_from: int) -> tuple[list[int], list[int]]:
    out = self._render(source, messages, tokenize=True, return_dict=True,
                       return_assistant_tokens_mask=True)
    ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    roles = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if any(i < loss_from for i in roles):
      runs = _runs(mask)
      if len(runs) != len(roles):
        raise ChatTemplateError(
            f"{source}: the chat template of {_name(self.tokenizer)} marks {len(runs)} runs of "
            f"tokens with {{% generation %}} for {len(roles)} assistant messages, so the ones "
            f"before message {loss_from} cannot be told apart; use loss_on='all'")
      for (start, stop), i in zip(runs, roles):
        if i < loss_from:
          mask[start:stop] = [0] * (stop - start)
    return ids, mask

  def _text_spans(self, source: str, messages: list[dict],
                  loss_from: int) -> tuple[list[int], list[int]]:
    text = self._render(source, messages)
    encoding = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoding["input_ids"])
    if ids != self._render(source, messages, tokenize=True):
      raise ChatTemplateError(
          f"{source}: the chat template of {_name(self.tokenizer)} renders text whose tokens "
          "are not the template's own (apply_chat_template(tokenize=True)), so its character "
          "offsets cannot place the assistant turns; use loss_on='all'")
    spans, done = [], 0
    for i, message in enumerate(messages):
      if message["role"] == "assistant":
        start, done = self._turn_span(source, messages, i, text, done)
        if i >= loss_from:
          spans.append((start, done))
    return ids, _mask_overlapping([tuple(o) for o in encoding["offset_mapping"]], spans)

  def _turn_span(self, source: str, messages: list[dict], i: int, text: str,
                 done: int) -> tuple[int, int]:
    """``[start, stop)`` of assistant message ``i``'s turn in the conversation's rendered
    ``text``, past ``done`` (the end of the turn before it); see :meth:`encode_chat`."""
    prompt = self._render(source, messages[:i], generation_prompt=True) if i else None
    upto = self._render(source, messages[:i + 1])
    start = (len(prompt) if prompt is not None and text.startswith(prompt)
             and len(prompt) >= done else None)
    if start is not None and text.startswith(upto) and len(upto) >= start:
      return start, len(upto)
    if start is None and prompt is not None:   # after the generation prompt past the last turn
      bare = self._render(source, messages[:i])
      header = prompt[len(bare):] if prompt.startswith(bare) else ""
      at = text.find(header, done) if header else -1
      start = at + len(header) if at >= 0 else None
    search_from = done if start is None else start
    found = [(at, -len(form)) for form in _content_forms(messages[i]["content"])
             if (at := text.find(form, search_from)) >= 0]
    if found:
      at, length = min(found)
      end = at - length
    elif start is not None and not _LEADING_THINK.sub("", messages[i]["content"], 1).strip():
      at = end = start   # no content to find: the turn is its closing text
    else:
      raise self._unlocated(source, i, "its content is not in the rendered text past the "
                            f"turn before it (from character {search_from})")
    start = at if start is None else start
    if text.startswith(upto) and len(upto) >= end:
      return start, len(upto)
    closing = self._closing_text(source, messages, i, text)
    return start, end + len(os.path.commonprefix([closing, text[end:end + len(closing)]]))

  def _closing_text(self, source: str, messages: list[dict], i: int, text: str) -> str:
    """What the template renders after assistant message ``i``'s content when it is the last
    message: its turn's closing text, found by rendering the content with a sentinel after it."""
    contents = "".join(m["content"] for m in messages[:i + 1])
    sentinel = next((c for c in _SENTINELS if c not in text and c not in contents), None)
    if sentinel is not None:
      probe = [*messages[:i], {**messages[i], "content": messages[i]["content"] + sentinel}]
      rendered = self._render(source, probe)
      if rendered.count(sentinel) == 1:
        return rendered[rendered.index(sentinel) + 1:]
    raise self._unlocated(source, i, "the template does not render its content once, so the "
                          "end of its turn is unknown")

  def _token_prefixes(self, source: str, messages: list[dict],
                      loss_from: int) -> tuple[list[int], list[int]]:
    ids = self._render(source, messages, tokenize=True)
    mask = [0] * len(ids)
    for i, message in enumerate(messages):
      if message["role"] != "assistant" or i < loss_from:
        continue
      if not i:
        raise ChatTemplateError(
            f"{source}: assistant message 0 has no prompt before it for the chat template of "
            f"{_name(self.tokenizer)} to render, and without character offsets (not a fast "
            "tokenizer) its tokens cannot be located; use loss_on='all'")
      start = self._token_prefix_length(source, ids, messages[:i], i, True)
      stop = self._token_prefix_length(source, ids, messages[:i + 1], i, False)
      mask[start:stop] = [1] * (stop - start)
    return ids, mask

  def _token_prefix_length(self, source: str, whole: list[int], messages: list[dict], i: int,
                           generation_prompt: bool) -> int:
    part = self._render(source, messages, generation_prompt=generation_prompt, tokenize=True)
    if whole[:len(part)] != part:
      upto = "before" if generation_prompt else "up to and including"
      raise ChatTemplateError(
          f"{source}: the chat template of {_name(self.tokenizer)} is not prefix-stable in "
          f"tokens: the conversation {upto} message {i} does not render as a token prefix of "
          "the whole conversation, and without character offsets (not a fast tokenizer) "
          f"assistant message {i} cannot be located otherwise; use loss_on='all'")
    return len(part)

  def _checked(self, source: str, ids: Sequence[int],
               mask: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    ids = np.asarray(ids, dtype=np.int64)
    if self.vocab_size is not None and ids.size and ids.max() >= self.vocab_size:
      raise VocabularyError(f"{source}: token id {int(ids.max())} is past the model's "
                            f"vocabulary of {self.vocab_size} (tokenizer "
                            f"{_name(self.tokenizer)})")
    return ids.astype(np.int32), np.asarray(mask, dtype=np.uint8)

  def encode_prompt(self, prompt: str | Sequence[dict], source: str) -> np.ndarray:
    """The int32 ids of a prompt to be continued by the model: a string as a prompt/completion
    record's prompt (the tokenizer's leading special tokens, then its tokens), a message list
    rendered by the chat template with the generation prompt (the assistant's turn opened)."""
    if isinstance(prompt, str):
      ids = self.prefix + self._tokens(prompt)
    else:
      ids = self._render(source, list(prompt), generation_prompt=True, tokenize=True)
    return self._checked(source, ids, [0] * len(ids))[0]

  def _chat(self, record: Record) -> tuple[np.ndarray, np.ndarray]:
    return self.encode_chat(record.messages, record.source)

  def __call__(self, record: Record) -> tuple[np.ndarray, np.ndarray]:
    if record.kind == "chat":
      return self._chat(record)
    if record.kind == "text":
      ids = self.prefix + self._tokens(record.text) + self.end
      mask = [1] * len(ids)
    elif record.kind == "prompt_completion":
      prompt = self.prefix + self._tokens(record.prompt)
      completion = self._tokens(record.completion) + self.end
      ids = prompt + completion
      mask = [int(self.loss_on == "all")] * len(prompt) + [1] * len(completion)
    else:
      raise DataError(f"{record.source}: unknown record kind {record.kind!r}")
    return self._checked(record.source, ids, mask)


def encode_record(record: Record, tokenizer: Any, *, loss_on: str = "completion",
                  vocab_size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """``(ids, loss_mask)`` of one record (1-D int32 and uint8); see :class:`Encoder`."""
  return Encoder(tokenizer, loss_on=loss_on, vocab_size=vocab_size)(record)
