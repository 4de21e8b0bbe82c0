"""Chat records under the templates models ship (ChatML, Llama 3, Llama 2 / Mistral, Gemma, a
Qwen3-style one that drops earlier turns' reasoning): the loss mask is exactly the assistant
turns as each template renders them, checked token by token against spans found by the
template's own markers; the ids are apply_chat_template's; completion-only SFT trains on a Llama 2
template, whose "[/INST] " space merges into the answer's first token."""

import re

import numpy as np
import pytest

from jaxfuse import data, train
from jaxfuse.testing.checkpoints import arithmetic_chats, write_jsonl, write_tiny_checkpoint

CHATML = ("{% for m in messages %}"
          "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3 = ("{{ '<|begin_of_text|>' }}{% for m in messages %}"
          "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim"
          " + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
# The system prompt goes into the first user turn; a user turn ends with "[/INST] ", its space
# before the answer.
LLAMA2 = ("{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
          "{% set turns = messages[1:] %}{% else %}{% set system = '' %}"
          "{% set turns = messages %}{% endif %}{% for m in turns %}{% if m['role'] == 'user' %}"
          "{% set content = m['content'] %}{% if loop.first and system %}"
          "{% set content = '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' + content %}{% endif %}"
          "{{ '<s>[INST] ' + content.strip() + ' [/INST] ' }}"
          "{% else %}{{ m['content'].strip() + '</s>' }}{% endif %}{% endfor %}")
GEMMA = ("{{ '<bos>' }}{% if messages[0]['role'] == 'system' %}"
         "{% set first = messages[0]['content'] + '\\n\\n' %}{% set turns = messages[1:] %}"
         "{% else %}{% set first = '' %}{% set turns = messages %}{% endif %}"
         "{% for m in turns %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
         "{{ '<start_of_turn>' + role + '\\n' + (first if loop.first else '')"
         " + m['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")
# ChatML that drops the <think> block of the assistant turns before the last user message, so a
# conversation's beginning is not a prefix of the whole.
QWEN3 = ("{% set ns = namespace(last_user=-1) %}{% for m in messages %}"
         "{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
         "{% for m in messages %}{% set content = m['content'] %}"
         "{% if m['role'] == 'assistant' and loop.index0 < ns.last_user"
         " and '</think>' in content %}"
         "{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
         "{{ '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# ChatML whose {% generation %} block marks the answer and its <|im_end|>, not the newline.
CHATML_GENERATION = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{% else %}{{ m['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

CHATML_TOKENS = ["<|im_start|>", "<|im_end|>"]
CHATML_TURN = r"<\|im_start\|>assistant\n(.*?<\|im_end\|>\n)"
# name: (template, its special tokens, an assistant turn: group 1 is what the loss covers)
TEMPLATES = {
    "chatml": (CHATML, CHATML_TOKENS, CHATML_TURN),
    "llama3": (LLAMA3, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                        "<|eot_id|>"],
               r"<\|start_header_id\|>assistant<\|end_header_id\|>\n\n(.*?<\|eot_id\|>)"),
    "llama2": (LLAMA2, ["<s>", "</s>"], r" \[/INST\] (.*?</s>)"),
    "gemma": (GEMMA, ["<bos>", "<start_of_turn>", "<end_of_turn>"],
              r"<start_of_turn>model\n(.*?<end_of_turn>\n)"),
    "qwen3": (QWEN3, CHATML_TOKENS, CHATML_TURN),
    "chatml_generation": (CHATML_GENERATION, CHATML_TOKENS,
                          r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)"),
}


def _chat(*turns, system=None):
  """A conversation of alternating user and assistant ``turns``, after an optional system one."""
  messages = [{"role": "system", "content": system}] if system else []
  return messages + [{"role": ("user", "assistant")[i % 2], "content": c}
                     for i, c in enumerate(turns)]


CONVERSATIONS = [
    _chat("What is two plus two?", "It is four.", "And three plus three?",
          "Six, the lazy dog says.", system="Answer briefly."),
    _chat("Is four even? Reply yes or no.", "yes", "Name a fox.", "  The quick brown fox.\n",
          "Why?", "It jumps over the lazy dog.", system="You are a helpful assistant."),
]
THINKING = [
    _chat("What is two plus two?", "<think>\nAdd them.\n</think>\n\nIt is four.",
          "And three plus three?", "<think>\nSix.\n</think>\n\nSix, the lazy dog says.",
          system="Answer briefly."),
    _chat("Is four even? Reply yes or no.", "<think>\nIt is.\n</think>\n\nyes", "Name a fox.",
          "<think>\nA brown one.\n</think>\n\nThe quick brown fox.", "Why?",
          "<think>\nDogs.\n</think>\n\nIt jumps over the lazy dog.")]
# Each message alone and after a space, as a real vocabulary has words with and without one.
CORPUS = [m["content"] for c in CONVERSATIONS + THINKING for m in c] * 4
CORPUS += [" ".join(m["content"] for m in c) for c in CONVERSATIONS] * 4


def _conversations(name):
  return THINKING if name == "qwen3" else CONVERSATIONS


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
  """A byte-level BPE for each template, its markers special tokens as in the real ones."""
  return {name: data.train_tokenizer(CORPUS, 400, tmp_path_factory.mktemp(name),
                                     chat_template=template, additional_special_tokens=specials)
          for name, (template, specials, _) in TEMPLATES.items()}


def _expected(tokenizer, ids, text, turn, last_only=False):
  """The assistant turns' character spans in ``text`` by the template's markers (the last one
  only with ``last_only``), and the mask of the tokens whose characters overlap one (found from
  each token's decoded text)."""
  pieces = [tokenizer.decode([i], clean_up_tokenization_spaces=False) for i in ids]
  assert "".join(pieces) == text
  spans = [m.span(1) for m in re.finditer(turn, text, re.DOTALL)][-1 if last_only else 0:]
  mask, at = [], 0
  for piece in pieces:
    mask.append(int(any(start < at + len(piece) and at < stop for start, stop in spans)))
    at += len(piece)
  return spans, mask


def _runs(mask):
  edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
  return list(zip(edges[::2], edges[1::2]))


@pytest.mark.parametrize("name", TEMPLATES)
def test_the_mask_is_exactly_the_assistant_turns_of_each_template(tokenizers, name):
  tokenizer, (_, specials, turn) = tokenizers[name], TEMPLATES[name]
  assert all(len(tokenizer.encode(s, add_special_tokens=False)) == 1 for s in specials)
  encoder = data.Encoder(tokenizer)
  for conversation in _conversations(name):
    ids, mask = encoder.encode_chat(conversation, "c.jsonl:1")
    assert ids.dtype == np.int32 and mask.dtype == np.uint8
    assert ids.tolist() == tokenizer.apply_chat_template(conversation, tokenize=True,
                                                         return_dict=False)
    text = tokenizer.apply_chat_template(conversation, tokenize=False)
    spans, expected = _expected(tokenizer, ids.tolist(), text, turn)
    assert len(spans) == sum(m["role"] == "assistant" for m in conversation)
    assert mask.tolist() == expected
    # A preference row: the prompt's turns and one answer, whose turn alone is learned.
    last = len(conversation) - 1
    _, answer_only = _expected(tokenizer, ids.tolist(), text, turn, last_only=True)
    assert encoder.encode_chat(conversation, "c.jsonl:1", loss_from=last)[1].tolist() == \
        answer_only
    assert data.encode_record(data.Record("c.jsonl:1", "chat", messages=tuple(conversation)),
                              tokenizer)[1].tolist() == expected
    ids_all, mask_all = data.Encoder(tokenizer, loss_on="all").encode_chat(conversation, "c")
    assert ids_all.tolist() == ids.tolist() and mask_all.all()


def test_dropped_reasoning_and_merged_spaces_stay_with_the_answer(tokenizers):
  # Qwen3: the first answer is rendered without its <think> block, the last one with it.
  qwen3 = tokenizers["qwen3"]
  ids, mask = data.Encoder(qwen3).encode_chat(THINKING[0], "c.jsonl:1")
  learned = [qwen3.decode(ids[a:b]) for a, b in _runs(mask)]
  assert learned == ["It is four.<|im_end|>\n",
                     "<think>\nSix.\n</think>\n\nSix, the lazy dog says.<|im_end|>\n"]
  # Llama 2: the space of "[/INST] " is in the answer's first token, which is learned.
  llama2 = tokenizers["llama2"]
  ids, mask = data.Encoder(llama2).encode_chat(CONVERSATIONS[0], "c.jsonl:1")
  first = _runs(mask)[0][0]
  assert llama2.convert_ids_to_tokens([int(ids[first - 1]), int(ids[first])]) == ["]", "ĠIt"]
  assert [llama2.decode(ids[a:b]) for a, b in _runs(mask)] == [
      " It is four.</s>", " Six, the lazy dog says.</s>"]


class _WithoutOffsets:
  """A tokenizer that gives no character offsets (as a slow one)."""
  is_fast = False

  def __init__(self, tokenizer):
    self._tokenizer = tokenizer

  def __getattr__(self, name):
    return getattr(self._tokenizer, name)


def test_a_tokenizer_without_offsets_locates_turns_by_tokens(tokenizers):
  chatml = tokenizers["chatml"]
  conversation = CONVERSATIONS[0]
  assert (data.Encoder(_WithoutOffsets(chatml)).encode_chat(conversation, "c")[1].tolist() ==
          data.Encoder(chatml).encode_chat(conversation, "c")[1].tolist())
  # Llama 2's prompt tokens end in the space its answer's first token holds: refused by name.
  llama2 = tokenizers["llama2"]
  with pytest.raises(data.ChatTemplateError,
                     match=rf"c\.jsonl:4: the chat template of {re.escape(llama2.name_or_path)}"
                           r" .* assistant message 2 cannot be located"):
    data.Encoder(_WithoutOffsets(llama2)).encode_chat(conversation, "c.jsonl:4")


def test_a_header_that_depends_on_the_whole_conversation(tokenizers):
  # Nothing renders as a prefix of the whole; each answer is found after its generation prompt,
  # not in the user's text before it ("yes").
  tokenizer = tokenizers["chatml"]
  tokenizer.chat_template = "{{ messages|length }} messages\n" + CHATML
  try:
    conversation = CONVERSATIONS[1]
    ids, mask = data.Encoder(tokenizer).encode_chat(conversation, "c")
    text = tokenizer.apply_chat_template(conversation, tokenize=False)
    assert mask.tolist() == _expected(tokenizer, ids.tolist(), text, CHATML_TURN)[1]
    # A template that does not render the answers' text cannot be located: named.
    tokenizer.chat_template = ("{{ messages|length }} messages\n" +
                               CHATML.replace("m['content']", "(m['content']|upper)"))
    with pytest.raises(data.ChatTemplateError, match=r"c\.jsonl:9: .* assistant message 2 "
                                                     r"cannot be located .* its content"):
      data.Encoder(tokenizer).encode_chat(conversation, "c.jsonl:9")
    assert data.Encoder(tokenizer, loss_on="all").encode_chat(conversation, "c")[1].all()
  finally:
    tokenizer.chat_template = CHATML


def test_completion_only_sft_trains_with_the_llama2_template(tmp_path):
  checkpoint = write_tiny_checkpoint(tmp_path / "ckpt", chat_template=LLAMA2)
  chats = write_jsonl(tmp_path / "chats.jsonl", arithmetic_chats(24))
  result = train.train(train.parse_args([
      "--init-from", str(checkpoint), "--data", str(chats), "--loss-on", "completion",
      "--steps", "2", "--warmup", "1", "--batch", "4", "--seq", "128", "--sample-tokens", "0",
      "--out", str(tmp_path / "run")]), log=lambda *_: None)
  assert result["history"]["step"] == [1, 2]
  assert np.isfinite(result["history"]["loss"]).all()


@pytest.mark.parametrize("name", [n for n in TEMPLATES if n != "chatml_generation"])
def test_preference_rows_learn_exactly_the_answer_turn_of_each_template(tokenizers, name,
                                                                        tmp_path):
  """Chat preference records (TRL's format: a prompt of messages, chosen and rejected answers)
  through the trainer's reader: each sequence is the template's rendering of the prompt and
  that answer, and its targets are exactly the answer turn's tokens (spans by the template's
  markers)."""
  import json

  from jaxfuse.posttrain.data import read_preference_rows

  tokenizer, (_, _, turn) = tokenizers[name], TEMPLATES[name]
  conversation = _conversations(name)[1]
  prompt, chosen = conversation[:-1], conversation[-1]
  rejected = {"role": "assistant", "content": "No idea, the lazy dog says."}
  path = tmp_path / "pairs.jsonl"
  path.write_text(json.dumps({"prompt": prompt, "chosen": [chosen], "rejected": [rejected]})
                  + "\n")
  rows = read_preference_rows(path, tokenizer, seq=512)
  for side, answer in ((1, chosen), (2, rejected)):
    where = rows.segment_ids[0] == side
    ids, targets = rows.tokens[0][where].tolist(), rows.targets[0][where]
    assert ids == tokenizer.apply_chat_template(prompt + [answer], tokenize=True,
                                                return_dict=False)
    text = tokenizer.apply_chat_template(prompt + [answer], tokenize=False)
    _, answer_only = _expected(tokenizer, ids, text, turn, last_only=True)
    # A target is the next token: position t learns token t + 1.
    want = [i if m else -100 for i, m in zip(ids[1:], answer_only[1:])]
    assert targets[:-1].tolist() == want and targets[-1] == -100
    assert sum(answer_only) > 2
