"""The model a run trains and its optimizer, and text sampled from the trained model.

The model is :class:`jaxfuse.models.Decoder`, from scratch or ``--init-from`` a Hugging Face
directory, with the recomputation the options ask for. The optimizer is optax AdamW with linear
warm-up, cosine decay and global-norm gradient clipping, in an ``nnx.Optimizer`` over the
``nnx.Param`` variables.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxfuse.models import Decoder, generate
from jaxfuse.train.config import TrainConfig, segments


def build(cfg: TrainConfig) -> tuple[Decoder, nnx.Optimizer]:
  """The model (from scratch or ``--init-from`` a Hugging Face directory) and its optimizer."""
  fused = not cfg.baseline
  policy = "block" if cfg.remat else cfg.remat_policy
  if cfg.init_from:
    from jaxfuse import interop

    model = interop.from_pretrained(cfg.init_from, dtype=jnp.dtype(cfg.dtype), fused=fused,
                                    remat=policy, scan_layers=cfg.scan_layers)
    if model.cfg.vocab_size < 256:
      raise ValueError(f"--init-from: the model's vocabulary ({model.cfg.vocab_size}) cannot "
                       f"hold the 256 byte tokens")
  else:
    model = Decoder(cfg.model_config(), fused=fused, scan_layers=cfg.scan_layers,
                    rngs=nnx.Rngs(cfg.seed))
  model.set_remat(policy, segments(cfg))
  return model, nnx.Optimizer(model, optimizer(cfg), wrt=nnx.Param)


def optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  """Global-norm clipping, then AdamW on a warm-up + cosine schedule down to 10% of ``--lr``."""
  schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup, cfg.steps,
                                                end_value=cfg.lr * 0.1)
  return optax.chain(optax.clip_by_global_norm(cfg.clip),
                     optax.adamw(schedule, weight_decay=cfg.weight_decay))


def sample_text(model: Decoder, cfg: TrainConfig) -> str:
  """``cfg.sample_tokens`` bytes after ``cfg.prompt``, sampled with the KV cache."""
  prompt = jnp.asarray(np.frombuffer(cfg.prompt.encode(), np.uint8).astype(np.int32))[None]
  tokens = generate(model, prompt, cfg.sample_tokens, jax.random.key(cfg.seed),
                    temperature=cfg.temperature)
  return bytes(np.asarray(tokens[0], np.uint8).tolist()).decode("utf-8", errors="replace")
