"""``python -m jaxfuse.generate DIR --prompt TEXT``: text from a model, with the KV cache.

``DIR`` is a Hugging Face checkpoint directory with its tokenizer files (one that
``save_pretrained`` or ``python -m jaxfuse.export`` wrote), or the ``--out`` directory of a
``python -m jaxfuse.train`` run (its latest checkpoint, LoRA adapters included). The prompt is
encoded with the model's tokenizer (a chat record's messages with ``--chat``, rendered by its
chat template); sampling stops at ``--max-new-tokens`` or the tokenizer's end-of-sequence
token. ``--temperature 0`` decodes greedily.

Example::

    python -m jaxfuse.generate runs/sft --prompt "def fib(n):" --max-new-tokens 64
    python -m jaxfuse.generate exported/ --chat --prompt "What is 2 + 2?" --temperature 0
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def load(directory: str | Path, *, dtype: str = "float32"):
  """``(model, tokenizer)`` of a Hugging Face checkpoint directory or a training run's."""
  import jax.numpy as jnp

  from jaxfuse import data, interop
  from jaxfuse.train.export import MODEL_CONFIG, load_run

  path = Path(directory)
  if (path / MODEL_CONFIG).is_file():
    model, tokenizer, _ = load_run(path)
    return model, tokenizer
  model = interop.from_pretrained(path, dtype=jnp.dtype(dtype))
  tokenizer = data.load_tokenizer(path) if data.has_tokenizer(path) else data.ByteTokenizer()
  return model, tokenizer


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jaxfuse.generate", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("directory", help="a Hugging Face checkpoint or a training run's --out")
  parser.add_argument("--prompt", required=True)
  parser.add_argument("--max-new-tokens", type=int, default=128)
  parser.add_argument("--temperature", type=float, default=0.8)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--chat", action="store_true",
                      help="render the prompt as a user message with the chat template")
  parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
  args = parser.parse_args(argv)
  from jaxfuse.train.model import complete

  try:
    model, tokenizer = load(args.directory, dtype=args.dtype)
    text = complete(model, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens,
                    temperature=args.temperature, seed=args.seed, chat=args.chat)
  except (FileNotFoundError, ValueError) as e:
    print(f"python -m jaxfuse.generate: error: {e}", file=sys.stderr)
    return 2
  print(args.prompt + text if not args.chat else text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
