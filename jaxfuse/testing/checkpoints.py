"""Tiny fine-tuning inputs written the way users' are: a Hugging Face checkpoint that
``transformers``' ``save_pretrained`` wrote, with a byte-level BPE tokenizer (and a chat
template) trained by ``tokenizers`` beside it, and JSON-lines data sets of chat or
prompt/completion records.

Example:
  >>> import tempfile, pathlib
  >>> root = pathlib.Path(tempfile.mkdtemp())
  >>> directory = write_tiny_checkpoint(root / "ckpt")
  >>> sorted(p.name for p in directory.iterdir())[:2]
  ['chat_template.jinja', 'config.json']
  >>> path = write_jsonl(root / "chat.jsonl", arithmetic_chats(3))
  >>> len(path.read_text().splitlines())
  3
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

# Turns as "<|role|>content", the assistant's closed by the end-of-text token.
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] }}"
                 "{% if m['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\\n' }}{% endif %}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")

_NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def arithmetic_chats(count: int, *, system: bool = True) -> list[dict]:
  """``count`` chat records (``messages``: an optional system turn, a question, its answer)."""
  records = []
  for i in range(count):
    a, b = i % 10, (3 * i + 1) % 10
    messages = [{"role": "system", "content": "Answer in words."}] if system else []
    messages += [{"role": "user", "content": f"What is {a} plus {b}?"},
                 {"role": "assistant", "content": f"{a} plus {b} is {a + b}, "
                                                  f"{_NUMBERS[(a + b) % 10]} in the last digit."}]
    records.append({"messages": messages})
  return records


def arithmetic_completions(count: int) -> list[dict]:
  """``count`` prompt/completion records."""
  return [{"prompt": f"What is {i % 10} times {(i + 3) % 10}? ",
           "completion": f"It is {(i % 10) * ((i + 3) % 10)}."} for i in range(count)]


def write_jsonl(path: str | os.PathLike, records: Iterable[dict]) -> Path:
  """Writes ``records`` one JSON object a line; returns the path."""
  path = Path(path)
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return path


def write_tiny_checkpoint(directory: str | os.PathLike, *, family: str = "llama",
                          tokenizer_size: int = 320, chat_template: str | None = CHAT_TEMPLATE,
                          seed: int = 0, **overrides) -> Path:
  """A random ``family`` (``llama``, ``qwen3`` or ``mixtral``) model of 2 layers, d_model 32,
  saved by ``transformers`` in ``directory`` with a byte-level BPE of ``tokenizer_size`` tokens
  trained on the arithmetic records' text (the model's vocabulary is the tokenizer's length).
  ``overrides`` change the transformers config."""
  import torch
  import transformers

  from jaxfuse.data import train_tokenizer

  directory = Path(directory)
  texts = [m["content"] for r in arithmetic_chats(50) for m in r["messages"]]
  texts += [r["prompt"] + r["completion"] for r in arithmetic_completions(50)]
  tokenizer = train_tokenizer(texts, tokenizer_size, directory, chat_template=chat_template)
  shape = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=512, eos_token_id=tokenizer.eos_token_id,
               bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=False)
  if family == "llama":
    config = transformers.LlamaConfig(**{**shape, **overrides})
  elif family == "qwen3":
    config = transformers.Qwen3Config(**{**shape, "head_dim": 8, **overrides})
  elif family == "mixtral":   # 4 experts of width 32, top 2
    config = transformers.MixtralConfig(**{**shape, "intermediate_size": 32,
                                           "num_local_experts": 4, "num_experts_per_tok": 2,
                                           **overrides})
  else:
    raise ValueError(f"family must be 'llama', 'qwen3' or 'mixtral', got {family!r}")
  torch.manual_seed(seed)
  transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
  return directory
