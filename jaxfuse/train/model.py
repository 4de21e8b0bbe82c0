"""The model a run trains and its optimizer, and text sampled from the trained model.

The model is :class:`jaxfuse.models.Decoder`, from scratch or ``--init-from`` a Hugging Face
directory (its MoE layers keeping the experts' products ``--expert-keep`` names), with the
recomputation the options ask for and, with ``--lora-rank``, LoRA adapters
(:func:`jaxfuse.nnx.apply_lora`). The optimizer is optax AdamW with linear warm-up, cosine
decay and global-norm gradient clipping, rejecting a gradient that is not finite, in an
``nnx.Optimizer`` over the ``nnx.Param``
variables (only the ``nnx.LoRAParam`` adapters with LoRA: the base stays frozen).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxfuse import data
from jaxfuse.models import Decoder, generate
from jaxfuse.nnx import apply_lora
from jaxfuse.train import config
from jaxfuse.train.config import TrainConfig, segments


def build(cfg: TrainConfig, tokenizer: Any = None) -> tuple[Decoder, nnx.Optimizer]:
  """The model (from scratch over ``tokenizer``'s vocabulary, or ``--init-from`` a Hugging Face
  directory), its LoRA adapters with ``--lora-rank``, and its optimizer (over the adapters
  only with LoRA: the base stays frozen)."""
  fused = not cfg.baseline
  policy = "block" if cfg.remat else cfg.remat_policy
  if cfg.init_from:
    from jaxfuse import interop

    keep = config.expert_keep(cfg)
    model = interop.from_pretrained(cfg.init_from, dtype=jnp.dtype(cfg.dtype), fused=fused,
                                    remat=policy, scan_layers=cfg.scan_layers, expert_keep=keep)
    if keep and not model.cfg.num_experts:
      raise ValueError(f"--expert-keep: the model at --init-from {cfg.init_from} has no "
                       f"experts")
  else:
    vocab = 256 if tokenizer is None else len(tokenizer)
    model = Decoder(cfg.model_config(vocab), fused=fused, scan_layers=cfg.scan_layers,
                    rngs=nnx.Rngs(cfg.seed))
  if cfg.lora_rank is not None:
    apply_lora(model, rank=cfg.lora_rank, alpha=config.lora_alpha(cfg),
               targets=config.lora_targets(cfg), rngs=nnx.Rngs(cfg.seed + 1))
  model.set_remat(policy, segments(cfg))
  return model, nnx.Optimizer(model, optimizer(cfg), wrt=trained(cfg))


def build_teacher(cfg: TrainConfig) -> Decoder:
  """The frozen teacher of ``--objective distill``: ``--teacher``'s Hugging Face checkpoint in
  the run's dtype, fused unless ``--baseline``."""
  from jaxfuse import interop

  return interop.from_pretrained(cfg.teacher, dtype=jnp.dtype(cfg.dtype), fused=not cfg.baseline,
                                 scan_layers=cfg.scan_layers)


def trained(cfg: TrainConfig):
  """What the optimizer updates: the LoRA adapters with ``--lora-rank``, else every
  parameter."""
  return nnx.LoRAParam if cfg.lora_rank is not None else nnx.Param


def schedule(cfg: TrainConfig) -> optax.Schedule:
  """The learning rate by step: linear warm-up over ``--warmup`` steps to ``--lr``, then cosine
  decay to 10% of it at ``--steps``."""
  return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup, cfg.steps,
                                            end_value=cfg.lr * 0.1)


def learning_rate(cfg: TrainConfig, step: int) -> float:
  """The learning rate of step ``step`` (counted from 0), as the optimizer applies it."""
  return float(schedule(cfg)(step))


# apply_if_finite's limit on consecutive rejected steps, past which it would apply them: never
# reached (the training loop stops a run past --skip-nonfinite rejected steps in all).
_NEVER = 2**30


def optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  """Global-norm clipping, then AdamW on :func:`schedule`; a gradient that is not finite
  everywhere is rejected (``optax.apply_if_finite``: no update, the state as it was)."""
  return optax.apply_if_finite(
      optax.chain(optax.clip_by_global_norm(cfg.clip),
                  optax.adamw(schedule(cfg), weight_decay=cfg.weight_decay)), _NEVER)


def complete(model: Decoder, tokenizer: Any, prompt: str, *, max_new_tokens: int = 128,
             temperature: float = 0.8, seed: int = 0, chat: bool = False) -> str:
  """The text ``model`` writes after ``prompt`` (the new text only), sampled with the KV cache
  (greedy at ``temperature=0``), up to ``max_new_tokens`` tokens or ``tokenizer``'s
  end-of-sequence token. ``chat``: the prompt is a user message, rendered by the tokenizer's
  chat template with the assistant's turn opened."""
  if chat:
    if getattr(tokenizer, "chat_template", None) is None:
      raise ValueError("--chat: the tokenizer has no chat template")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                        add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
  else:
    ids = list(tokenizer.encode(prompt))
  if not ids:
    raise ValueError("the prompt encodes to no tokens")
  if len(ids) + max_new_tokens > model.cfg.max_seq_len:
    raise ValueError(f"the prompt ({len(ids)} tokens) and {max_new_tokens} new tokens exceed "
                     f"the model's {model.cfg.max_seq_len} positions")
  tokens = generate(model, jnp.asarray(ids, jnp.int32)[None], max_new_tokens,
                    jax.random.key(seed), temperature=temperature)
  new = np.asarray(tokens[0, len(ids):]).tolist()
  eos = tokenizer.eos_token_id
  if eos is not None and eos in new:
    new = new[:new.index(eos)]
  return tokenizer.decode(new, skip_special_tokens=True)


def sample_text(model: Decoder, cfg: TrainConfig, tokenizer: Any = None) -> str:
  """``cfg.prompt`` and up to ``cfg.sample_tokens`` tokens sampled after it (:func:`complete`),
  decoded by ``tokenizer`` (UTF-8 bytes by default)."""
  tokenizer = data.ByteTokenizer() if tokenizer is None else tokenizer
  return cfg.prompt + complete(model, tokenizer, cfg.prompt, max_new_tokens=cfg.sample_tokens,
                               temperature=cfg.temperature, seed=cfg.seed)
