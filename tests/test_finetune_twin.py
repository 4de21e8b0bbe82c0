"""Fine-tuning convergence twin: ``python -m jaxfuse.train --init-from`` against PyTorch.

A tiny Llama and a tiny Qwen3 written by ``transformers`` (random weights, with a byte-level
BPE that :func:`jaxfuse.data.train_tokenizer` trained) are fine-tuned for 50 steps on
prompt/completion records, loss on the completions only, twice:

- by jaxfuse's own entry point (:func:`jaxfuse.train.train`), fused kernels and recomputation
  on, the batches packed by :func:`jaxfuse.data.prepare` (several documents a row);
- by ``transformers`` in PyTorch, eager attention, on exactly those batches (a causal and
  same-document 4D mask, the positions restarting at each document), with the optimizer
  written out again in torch: global-norm clipping, then ``torch.optim.AdamW`` with optax's
  ``warmup_cosine_decay_schedule`` evaluated at each update's count.

Every one of the 50 per-step losses agrees within 1e-4 relative, and the loss falls. Since the
losses after the first step depend on every earlier update, this checks the gradients of every
parameter, the clipping, the schedule, AdamW (decoupled weight decay on every parameter), the
data's targets, positions and segments, and the recomputed backward together, over a run. The
same holds with LoRA adapters (``--lora-rank``) against peft, the base frozen, the adapters
started from jaxfuse's initial values.
"""

import json
import random

import numpy as np
import optax
import pytest
import torch

from jaxfuse import data
from jaxfuse import train as jtrain
from jaxfuse.train.inputs import Inputs
from jaxfuse.train.model import build
from tests.test_families import _hf_model
from tests.test_lora import ALPHA, PROJECTIONS, RANK, _peft_twin

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings(   # peft asks transformers a deprecated question
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

STEPS, WARMUP, BATCH, SEQ = 50, 5, 4, 64
RTOL = 1e-4
SIZES = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}
# Per family: its model type, config changes, and the recomputation the run asks for.
FAMILIES = {
    "llama": ("llama", {}, ["--remat"]),
    "qwen3": ("qwen3", {"head_dim": 16}, ["--remat-policy", "save_qkv_proj"]),
}
TOKENIZER_VOCAB = 300


def _records(count=64, seed=0):
  """Prompt/completion records of varied lengths (a packed row holds several)."""
  rng = random.Random(seed)
  animals = ["cat", "dog", "fox", "owl", "bee", "eel", "yak", "emu"]
  records = []
  for i in range(count):
    a, b = rng.randint(0, 30), rng.randint(0, 30)
    if i % 3 == 0:
      records.append({"prompt": f"What is {a} plus {b}?", "completion": f" It is {a + b}."})
    elif i % 3 == 1:
      pet = rng.choice(animals)
      records.append({"prompt": f"Name {a % 5 + 1} {pet}s.",
                      "completion": " " + ", ".join([pet] * (a % 5 + 1)) + "."})
    else:
      words = " ".join(rng.choice(animals) for _ in range(a % 7 + 2))
      records.append({"prompt": f"Repeat: {words}", "completion": f" {words}"})
  return records


@pytest.fixture(scope="module")
def records_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("sft") / "train.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in _records()))
  return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, records_file):
  """Per family, a directory holding a tokenizer trained on the records and a random
  ``transformers`` model over its vocabulary (written lazily, once)."""
  texts = [r[k] for r in _records() for k in ("prompt", "completion")]
  made = {}

  def get(name):
    if name not in made:
      directory = tmp_path_factory.mktemp(name)
      tokenizer = data.train_tokenizer(texts, TOKENIZER_VOCAB, directory)
      model_type, changes, _ = FAMILIES[name]
      hf = _hf_model(model_type, {**SIZES, **changes, "vocab_size": len(tokenizer)},
                      seed=0)
      hf.save_pretrained(directory)
      made[name] = directory
    return made[name]

  return get


def _jaxfuse_run(directory, records_file, out, *extra, lr):
  """jaxfuse's fine-tuning run: its config and per-step losses."""
  cfg = jtrain.parse_args([
      "--init-from", str(directory), "--data", str(records_file), "--loss-on", "completion",
      "--steps", str(STEPS), "--warmup", str(WARMUP), "--batch", str(BATCH), "--seq", str(SEQ),
      "--dtype", "float32", "--lr", str(lr), "--sample-tokens", "0", "--out", str(out),
      *extra])
  assert not cfg.baseline and cfg.eval_data is None and not cfg.eval_share   # fused, no eval
  result = jtrain.train(cfg, log=lambda *_: None)
  assert result["final_val_loss"] is None
  return cfg, result["history"]["loss"]


def _batches(cfg):
  """The batches the run trained on, step by step: the same preparation (its token cache,
  reused) and the same per-step rows."""
  tokenizer = data.load_tokenizer(cfg.init_from)
  inputs = Inputs.load(cfg, tokenizer, len(tokenizer), log=lambda *_: None)
  assert inputs.prepared.report.reused
  for step in range(cfg.steps):
    batch = {k: np.asarray(v) for k, v in inputs.train(step).items()}
    assert batch["tokens"].shape == (BATCH, SEQ)
    assert batch["segment_ids"].max(axis=1).min() > 1   # packed: several documents a row
    yield batch


def packed_mask(segment_ids: torch.Tensor) -> torch.Tensor:
  """The additive 4D mask ``[batch, 1, seq, seq]`` of packed rows: 0 where a token may attend
  (an earlier or the same position of its own document), the dtype's minimum elsewhere.
  ``transformers`` passes a 4D mask through to eager attention unchanged."""
  seq = segment_ids.shape[1]
  causal = torch.tril(torch.ones(seq, seq, dtype=torch.bool))
  allowed = causal & (segment_ids[:, :, None] == segment_ids[:, None, :])
  mask = torch.zeros(allowed.shape, dtype=torch.float32)
  return mask.masked_fill(~allowed, torch.finfo(torch.float32).min)[:, None]


def _torch_losses(model, cfg, batches):
  """Trains ``model``'s trainable parameters as jaxfuse's optimizer does
  (:func:`jaxfuse.train.model.optimizer`), one step a batch; the losses before each update."""
  params = [p for p in model.parameters() if p.requires_grad]
  # optax.adamw's defaults; its weight decay applies to every parameter it updates.
  optimizer = torch.optim.AdamW(params, lr=0.0, betas=(0.9, 0.999), eps=1e-8,
                                weight_decay=cfg.weight_decay)
  schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup, cfg.steps,
                                                end_value=cfg.lr * 0.1)
  model.train()
  losses = []
  for step, batch in enumerate(batches):
    tokens, targets, positions, segment_ids = (
        torch.from_numpy(batch[k].astype(np.int64))
        for k in ("tokens", "targets", "positions", "segment_ids"))
    logits = model(input_ids=tokens, attention_mask=packed_mask(segment_ids),
                   position_ids=positions).logits
    # The targets are next tokens already (-100: no loss): no shift.
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             targets.reshape(-1), ignore_index=-100)
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, cfg.clip)
    for group in optimizer.param_groups:
      group["lr"] = float(schedule(step))   # optax counts updates from 0
    optimizer.step()
    losses.append(loss.item())
  return losses


def _compare(name, ours, theirs):
  ours, theirs = np.asarray(ours), np.asarray(theirs)
  assert ours.shape == theirs.shape == (STEPS,)
  worst = float(np.max(np.abs(ours - theirs) / np.abs(theirs)))
  print(f"\n{name}: loss {ours[0]:.4f} -> {ours[-1]:.4f}, worst relative difference "
        f"{worst:.2e} over {STEPS} steps")
  np.testing.assert_allclose(ours, theirs, rtol=RTOL, err_msg=name)
  # Training happened: the last steps' loss is well below the first steps'.
  assert np.mean(ours[-5:]) < 0.7 * np.mean(ours[:5]), ours


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fine_tuning_losses_match_transformers_step_by_step(family, checkpoints, records_file,
                                                           tmp_path):
  directory = checkpoints(family)
  cfg, ours = _jaxfuse_run(directory, records_file, tmp_path / "run", *FAMILIES[family][2],
                           lr=3e-3)
  hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                         attn_implementation="eager")
  theirs = _torch_losses(hf, cfg, _batches(cfg))
  _compare(family, ours, theirs)


def test_lora_fine_tuning_losses_match_peft_step_by_step(checkpoints, records_file, tmp_path):
  directory = checkpoints("llama")
  targets = "q,k,v,o,gate,up,down"
  cfg, ours = _jaxfuse_run(directory, records_file, tmp_path / "run", "--remat",
                           "--lora-rank", str(RANK), "--lora-alpha", str(ALPHA),
                           "--lora-targets", targets, lr=1e-2)
  # The run's initial adapters (lora_a drawn, lora_b zero), built as the run builds them.
  model, _ = build(cfg, data.load_tokenizer(directory))
  twin = _peft_twin(directory, model)
  assert sorted({n.split(".")[-4] for n, p in twin.named_parameters() if p.requires_grad}) == \
      sorted(PROJECTIONS)
  theirs = _torch_losses(twin, cfg, _batches(cfg))
  _compare("llama-lora", ours, theirs)
