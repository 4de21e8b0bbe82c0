"""What a ``python -m jaxfuse.train`` run does: :class:`TrainConfig` and its checks.

Every field of :class:`TrainConfig` is a command-line option (``--d-model`` for ``d_model``,
:mod:`jaxfuse.train.cli`); :func:`check_config` refuses a bad combination by the options' names
before anything is built or written.
"""

# The annotations stay strings: jaxfuse.train.cli reads each option's type from them.
from __future__ import annotations

import dataclasses
import difflib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from jaxfuse import parallel, remat
from jaxfuse.models import DecoderConfig
from jaxfuse.ops.names import moe_products


# The option groups of ``--help`` and of a configuration file's sections, in this order.
GROUPS = {
    "model": "the decoder: its shape from scratch, or a checkpoint to fine-tune",
    "data": "what the model reads: files and their tokenizer, or the standard library's bytes",
    "objective": "what the loss is taken on",
    "optimisation": "the steps, batches and AdamW",
    "LoRA": "low-rank adapters on a frozen base",
    "recomputation": "what the backward pass recomputes instead of keeping",
    "parallelism": "the device mesh and the processes of a run",
    "checkpoints": "where a run writes, saves and resumes",
    "logging": "progress, evaluation, TensorBoard and Weights & Biases, the sample at the end",
}
DTYPES = ("float32", "bfloat16", "float16")
LOSS_ON = ("all", "completion")
LONG_DOCUMENTS = ("auto", "split", "truncate")
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
OBJECTIVES = ("sft", "dpo", "cpo", "simpo", "orpo", "kto", "distill", "grpo")
# The objectives whose records are pairs (prompt/chosen/rejected; KTO's completion and its
# mismatched pair), one a row.
PAIRED = ("dpo", "cpo", "simpo", "orpo", "kto")
# The options each objective takes (the others must stay unset).
OBJECTIVE_OPTIONS = {
    "sft": (),
    "dpo": ("beta", "loss_type", "label_smoothing", "ld_alpha", "reference_free"),
    "cpo": ("beta", "loss_type", "label_smoothing", "simpo_gamma", "cpo_alpha"),
    "simpo": ("beta", "loss_type", "label_smoothing", "simpo_gamma", "cpo_alpha"),
    "orpo": ("beta",),
    "kto": ("beta", "loss_type", "desirable_weight", "undesirable_weight"),
    "distill": ("beta", "distill_temperature", "teacher", "teacher_topk"),
    "grpo": ("beta", "loss_type", "epsilon", "epsilon_high", "delta",
             "importance_sampling_level", "rollout_temperature", "reward", "reward_weights",
             "num_generations", "max_new_tokens", "top_p", "top_k", "num_iterations",
             "scale_rewards"),
}
# The options of --objective grpo that the rollouts take, not its loss.
ROLLOUT_OPTIONS = ("reward", "reward_weights", "num_generations", "max_new_tokens", "top_p",
                   "top_k", "num_iterations", "scale_rewards")
# Their defaults (TRL's GRPOConfig's, but for a CPU-sized max_new_tokens).
ROLLOUT_DEFAULTS = {"num_generations": 8, "max_new_tokens": 64, "top_p": 1.0, "top_k": 0,
                    "num_iterations": 1, "scale_rewards": "group", "rollout_temperature": 1.0}
REMAT_POLICIES = tuple(sorted(remat.PRESETS) + sorted(remat.RECIPES))


def option(default, group: str, help: str, choices: tuple | None = None):  # noqa: A002
  """A :class:`TrainConfig` field: its default, ``--help`` group and line, and fixed choices."""
  assert group in GROUPS, group
  return dataclasses.field(default=default,
                           metadata={"group": group, "help": help, "choices": choices})


@dataclasses.dataclass
class TrainConfig:
  """What a run does; every field is a command-line option (``--d-model`` for ``d_model``) and a
  key of a ``--config`` file (:func:`read_config_file`)."""

  # model
  d_model: int = option(128, "model", "the residual stream's width (from scratch)")
  layers: int = option(4, "model", "decoder blocks (from scratch)")
  heads: int = option(4, "model", "query heads (from scratch)")
  kv_heads: int = option(2, "model", "key/value heads; fewer than --heads is GQA (from scratch)")
  mlp: int = option(384, "model", "the gated MLP's hidden width (from scratch)")
  dtype: str = option("float32", "model", "the computation dtype", DTYPES)
  init_from: str | None = option(None, "model", "a Hugging Face checkpoint directory to "
                                 "fine-tune (instead of a model from scratch)")
  expert_keep: str | None = option(None, "model", "MoE: keep the experts' 'gate', 'up' or "
                                   "'gate,up' products for the backward pass")
  baseline: bool = option(False, "model", "plain flax/jax parts instead of jaxfuse's fused ops "
                          "(for comparison)")
  seed: int = option(0, "model", "seeds the initial weights, the batch order and the sample")
  # data
  data: list[str] | None = option(None, "data", "files, directories or globs of .txt, .jsonl "
                                  "and .parquet records (default: the standard library's bytes)")
  eval_data: list[str] | None = option(None, "data", "evaluation files (else --eval-share of "
                                       "--data)")
  eval_share: float = option(0.0, "data", "hold out this share of --data's documents for "
                             "evaluation")
  seq: int = option(128, "data", "tokens a row")
  text_field: str = option("text", "data", "the field of a text record in JSON lines and "
                           "Parquet")
  long_documents: str = option("auto", "data", "documents longer than --seq: split "
                               "(pretraining), truncate (SFT), or auto by the records' kind",
                               LONG_DOCUMENTS)
  tokenizer: str | None = option(None, "data", "a tokenizer directory (default: --init-from's "
                                 "own, else bytes)")
  train_tokenizer: int | None = option(None, "data", "train a byte-level BPE of this many tokens "
                                       "on --data")
  # objective
  loss_on: str = option("all", "objective", "the tokens the loss is taken on: all, or only the "
                        "completions and assistant turns (SFT)", LOSS_ON)
  objective: str = option("sft", "objective", "sft (next tokens), a preference objective on "
                          "prompt/chosen/rejected records (dpo, cpo, simpo, orpo), kto on "
                          "prompt/completion/label records, distill (a --teacher's head into "
                          "the model's, on SFT records), or grpo (reinforcement learning with "
                          "--reward on prompt records)", OBJECTIVES)
  beta: float | None = option(None, "objective", "preference objectives: the KL coefficient "
                              "beta (default 0.1); distill: the JSD's beta, 0 forward KL, 1 "
                              "reverse KL (default 0.5); grpo: the KL to the reference (default "
                              "0: no reference)")
  loss_type: str | None = option(None, "objective", "dpo: sigmoid, ipo, hinge, robust, ... or "
                                 "several comma-separated (summed); cpo: sigmoid, hinge, ipo, "
                                 "simpo, alphapo; kto: kto, apo_zero_unpaired; grpo: dapo, grpo, "
                                 "dr_grpo, bnpo, cispo, sapo, luspo, vespo")
  label_smoothing: float | None = option(None, "objective", "dpo, cpo: the preference labels' "
                                         "noise (robust, exo_pair, aot losses)")
  simpo_gamma: float | None = option(None, "objective", "simpo: the target reward margin "
                                     "(default 0.5)")
  cpo_alpha: float | None = option(None, "objective", "cpo, simpo: the weight of the chosen "
                                   "completions' NLL (default 1 for cpo, 0 for simpo)")
  ld_alpha: float | None = option(None, "objective", "dpo: LD-DPO's weight of the longer "
                                  "completion's tail")
  reference_free: bool = option(False, "objective", "dpo: no reference model (its "
                                "log-probabilities taken as 0)")
  teacher: str | None = option(None, "objective", "distill: the teacher, a Hugging Face "
                               "checkpoint directory over the student's vocabulary")
  distill_temperature: float | None = option(None, "objective", "distill: both heads' logits "
                                             "divided by it (default 1)")
  teacher_topk: int | None = option(None, "objective", "distill: store the teacher's top k "
                                    "log-probabilities once before training and hold no "
                                    "teacher (forward KL over them, --beta 0)")
  desirable_weight: float | None = option(None, "objective", "kto: the weight of the "
                                          "desirable completions' losses (default 1)")
  undesirable_weight: float | None = option(None, "objective", "kto: the weight of the "
                                            "undesirable completions' losses (default 1)")
  reward: list[str] | None = option(None, "objective", "grpo: the reward functions, each "
                                    "module:function, path/file.py:function, exact_match, "
                                    "format:REGEX or length:CHARS")
  reward_weights: str | None = option(None, "objective", "grpo: comma-separated weights of the "
                                      "--reward functions (default 1 each)")
  num_generations: int | None = option(None, "objective", "grpo: completions sampled a prompt "
                                       "(default 8); a step's --batch x --grad-accum rows hold "
                                       "the completions of that many / G prompts")
  max_new_tokens: int | None = option(None, "objective", "grpo: the longest completion "
                                      "(default 64)")
  rollout_temperature: float | None = option(None, "objective", "grpo: the sampling "
                                             "temperature, and the policy's in the loss (TRL's "
                                             "temperature; default 1)")
  top_p: float | None = option(None, "objective", "grpo: nucleus sampling (default 1: off)")
  top_k: int | None = option(None, "objective", "grpo: sample among the k most likely tokens "
                             "(default 0: off)")
  epsilon: float | None = option(None, "objective", "grpo: the ratio's lower clipping range "
                                 "(default 0.2)")
  epsilon_high: float | None = option(None, "objective", "grpo: the upper one (default "
                                      "--epsilon; cispo: the ratio's cap)")
  delta: float | None = option(None, "objective", "grpo: two-sided clipping, the ratio capped "
                               "at delta")
  importance_sampling_level: str | None = option(None, "objective", "grpo: token (default) or "
                                                 "sequence (GSPO) ratios")
  num_iterations: int | None = option(None, "objective", "grpo: optimizer updates a batch of "
                                      "rollouts (mu, default 1)")
  scale_rewards: str | None = option(None, "objective", "grpo: group (default), batch or "
                                     "none: what the advantages are divided by")
  # optimisation
  steps: int = option(600, "optimisation", "optimizer steps (the schedule spans them)")
  batch: int = option(16, "optimisation", "rows a micro-batch; a step takes --batch x "
                      "--grad-accum rows")
  grad_accum: int = option(1, "optimisation", "micro-batches a step sums its gradient over, "
                           "inside the jitted step (one step on the N-times larger batch)")
  lr: float = option(3e-3, "optimisation", "AdamW's peak learning rate")
  warmup: int = option(50, "optimisation", "steps of linear warm-up; then cosine decay to 10% "
                       "of --lr")
  weight_decay: float = option(0.01, "optimisation", "AdamW's decoupled weight decay")
  clip: float = option(1.0, "optimisation", "the gradients' global norm is clipped to this")
  skip_nonfinite: int = option(0, "optimisation", "skip (do not apply) up to this many steps "
                               "whose loss or gradient is not finite; one more stops the run")
  # LoRA
  lora_rank: int | None = option(None, "LoRA", "train LoRA adapters of this rank; the base "
                                 "stays frozen")
  lora_alpha: float | None = option(None, "LoRA", "adapters scaled by alpha / rank (default: "
                                    "2 x rank)")
  lora_targets: str = option("q,k,v,o,gate,up,down", "LoRA", "the projections that get "
                             "adapters, comma-separated among " + ",".join(LORA_TARGETS))
  # recomputation
  remat: bool = option(False, "recomputation", "recompute each block but its input")
  remat_policy: str | None = option(None, "recomputation", "a preset or MaxText recipe for "
                                    "every block", REMAT_POLICIES)
  remat_budget: str | None = option(None, "recomputation", "plan per block within this many "
                                    "residual bytes, or a share like 50% (profiled on the "
                                    "first batch)")
  remat_choices: str | None = option(None, "recomputation", "what the plan may choose for a "
                                     "block, comma-separated")
  segments: str | None = option(None, "recomputation", "'sqrt' or a number of blocks per "
                                "checkpointed segment")
  scan_layers: bool = option(False, "recomputation", "the blocks stacked under one scan")
  # parallelism
  mesh: str | None = option(None, "parallelism", "train on a device mesh, e.g. "
                            "data=2,fsdp=2,tensor=2 (axes data, fsdp, context, tensor, expert)")
  distributed: bool = option(False, "parallelism", "join the processes of a cluster job "
                             "(SLURM, Open MPI) with jax.distributed")
  coordinator: str | None = option(None, "parallelism", "HOST:PORT of process 0: join "
                                   "--num-processes processes")
  num_processes: int | None = option(None, "parallelism", "how many processes train together "
                                     "(one a host or GPU)")
  process_id: int | None = option(None, "parallelism", "this process, in [0, --num-processes)")
  # checkpoints
  out: str = option("runs/jaxfuse-train", "checkpoints", "the run's directory: checkpoints, "
                    "logs, the resolved configuration")
  save_every: int = option(200, "checkpoints", "save a checkpoint every this many steps")
  resume: bool = option(False, "checkpoints", "continue from the latest readable checkpoint in "
                        "--out")
  stop_at: int | None = option(None, "checkpoints", "stop after this step (the schedule still "
                               "spans --steps)")
  export_hf: str | None = option(None, "checkpoints", "at the end, write a Hugging Face "
                                 "checkpoint here")
  # logging
  log_every: int = option(10, "logging", "read the losses back every this many steps (the "
                          "steps in between run without waiting for the host)")
  eval_every: int = option(100, "logging", "measure the validation loss every this many steps")
  eval_batches: int = option(8, "logging", "batches the validation loss is measured on")
  tensorboard: bool = option(True, "logging", "write TensorBoard event files into --out/"
                             "tensorboard")
  wandb: str | None = option(None, "logging", "log to this Weights & Biases project (needs "
                             "wandb installed)")
  peak_tflops: float | None = option(None, "logging", "the peak TFLOP/s of one device, for the "
                                     "MFU (default: known accelerators' dense bf16 peak)")
  sample_tokens: int = option(200, "logging", "tokens sampled after --prompt at the end")
  prompt: str = option("def ", "logging", "the sample's prompt")
  temperature: float = option(0.8, "logging", "the sample's temperature")

  @property
  def global_batch(self) -> int:
    """The rows of one step: ``--batch`` x ``--grad-accum``."""
    return self.batch * self.grad_accum

  def model_config(self, vocab_size: int = 256) -> DecoderConfig:
    """The decoder a run trains from scratch, over a vocabulary of ``vocab_size``."""
    return DecoderConfig(vocab_size=vocab_size, d_model=self.d_model, num_layers=self.layers,
                         num_heads=self.heads, num_kv_heads=self.kv_heads, mlp_dim=self.mlp,
                         max_seq_len=max(self.seq, len(self.prompt.encode()) + self.sample_tokens),
                         dtype=jnp.dtype(self.dtype))

  def as_dict(self) -> dict:
    """The fields, as the run's log and checkpoints record them."""
    return dataclasses.asdict(self)


def fields_by_group() -> dict[str, list[dataclasses.Field]]:
  """:class:`TrainConfig`'s fields in their groups (:data:`GROUPS`' order)."""
  groups = {name: [] for name in GROUPS}
  for field in dataclasses.fields(TrainConfig):
    groups[field.metadata["group"]].append(field)
  return groups


# Configuration files ---------------------------------------------------------------------------

CONFIG_SUFFIXES = (".yaml", ".yml", ".toml", ".json")


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
  """The options a ``--config`` file sets, by field name, checked.

  A YAML, TOML or JSON mapping of option names (``d_model`` or ``d-model``) to values, flat or
  in sections named by the groups of ``--help`` (:data:`GROUPS`), as :func:`write_config_file`
  writes them::

      model:
        d_model: 256
      optimisation:
        steps: 1000
        lr: 1.0e-3

  Raises:
    ValueError: the file cannot be read or parsed, a key is not an option (naming the nearest
      one), or a value has the wrong type (naming the option).
  """
  path = Path(path)
  if path.suffix.lower() not in CONFIG_SUFFIXES:
    raise ValueError(f"--config {path}: a configuration file is {', '.join(CONFIG_SUFFIXES)}")
  try:
    text = path.read_text()
  except OSError as e:
    raise ValueError(f"--config {path}: cannot read it ({e.strerror or e})") from e
  try:
    if path.suffix.lower() == ".toml":
      import tomllib
      raw = tomllib.loads(text)
    elif path.suffix.lower() == ".json":
      raw = json.loads(text)
    else:
      import yaml
      raw = yaml.safe_load(text)
  except Exception as e:  # noqa: BLE001 - each parser has its own error types
    raise ValueError(f"--config {path}: not valid {path.suffix[1:].upper()}: {e}") from e
  if raw is None:
    return {}
  if not isinstance(raw, Mapping):
    raise ValueError(f"--config {path}: must be a mapping of options to values, got "
                     f"{type(raw).__name__}")
  fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
  values = {}

  def take(key, value, where: str):
    name = str(key).replace("-", "_")
    if name not in fields:
      known = list(fields) + list(GROUPS)
      near = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
      hint = f"; did you mean {near[0]!r}?" if near else ""
      raise ValueError(f"--config {path}: unknown option {where}{key!r}{hint}")
    if name in values:
      raise ValueError(f"--config {path}: {name!r} is given twice")
    values[name] = _checked_value(fields[name], value, f"--config {path}: {where}{key!r}")

  for key, value in raw.items():
    if key in GROUPS and isinstance(value, Mapping):
      for inner, inner_value in value.items():
        take(inner, inner_value, f"{key}.")
    else:
      take(key, value, "")
  return values


def _checked_value(field: dataclasses.Field, value: Any, where: str) -> Any:
  """``value`` for ``field`` from a file (YAML/TOML types), or ValueError naming ``where``."""
  kind = str(field.type)
  optional = kind.endswith("| None")
  base = kind.split(" ")[0]
  if value is None:
    if optional:
      return None
    raise ValueError(f"{where} cannot be null")
  if base == "bool":
    ok = isinstance(value, bool)
  elif base == "int":
    ok = isinstance(value, int) and not isinstance(value, bool)
  elif base == "float":
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    value = float(value) if ok else value
  elif base == "list[str]":
    value = [value] if isinstance(value, str) else value
    ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
  else:   # str; numbers written bare in YAML (a remat budget of bytes) are taken as text
    ok = isinstance(value, (str, int, float)) and not isinstance(value, bool)
    value = str(value) if ok else value
  if not ok:
    raise ValueError(f"{where} must be {'a list of strings' if base == 'list[str]' else base}"
                     f"{' or null' if optional else ''}, got {value!r}")
  choices = field.metadata.get("choices")
  if choices and value not in choices:
    raise ValueError(f"{where} must be one of {', '.join(choices)}, got {value!r}")
  return value


def config_sections(cfg: TrainConfig) -> dict[str, dict[str, Any]]:
  """``cfg`` as sections of :data:`GROUPS`: what :func:`write_config_file` writes."""
  return {group: {f.name: getattr(cfg, f.name) for f in fields}
          for group, fields in fields_by_group().items()}


def config_text(cfg: TrainConfig) -> str:
  """``cfg`` as YAML in sections, which ``--config`` reads back."""
  import yaml

  return yaml.safe_dump(config_sections(cfg), sort_keys=False, default_flow_style=False)


def write_config_file(cfg: TrainConfig, path: str | os.PathLike) -> None:
  """Writes ``cfg`` (:func:`config_text`) to ``path``, atomically."""
  path = Path(path)
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text("# The resolved configuration of a run of python -m jaxfuse.train: "
                 "--config reads it back.\n" + config_text(cfg))
  os.replace(tmp, path)


def check_config(cfg: TrainConfig) -> None:
  """Raises ValueError, naming the option, for a configuration that cannot run."""
  if cfg.sample_tokens < 0:
    raise ValueError(f"--sample-tokens must be >= 0, got {cfg.sample_tokens}")
  for name in ("steps", "batch", "grad_accum", "seq", "eval_every", "eval_batches",
               "save_every", "log_every"):
    if getattr(cfg, name) < 1:
      raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
  if cfg.skip_nonfinite < 0:
    raise ValueError(f"--skip-nonfinite must be >= 0, got {cfg.skip_nonfinite}")
  if cfg.peak_tflops is not None and cfg.peak_tflops <= 0:
    raise ValueError(f"--peak-tflops must be > 0, got {cfg.peak_tflops}")
  if cfg.dtype not in DTYPES:
    raise ValueError(f"--dtype must be float32, bfloat16 or float16, got {cfg.dtype!r}")
  if cfg.warmup < 0 or cfg.warmup >= cfg.steps:
    raise ValueError(f"--warmup must be in [0, --steps), got {cfg.warmup} with {cfg.steps} steps")
  if cfg.stop_at is not None and not 1 <= cfg.stop_at <= cfg.steps:
    raise ValueError(f"--stop-at must be in [1, --steps], got {cfg.stop_at}")
  if cfg.lr <= 0 or cfg.clip <= 0:
    raise ValueError(f"--lr and --clip must be > 0, got {cfg.lr} and {cfg.clip}")
  chosen = [f for f in ("remat", "remat_policy", "remat_budget") if getattr(cfg, f)]
  if len(chosen) > 1:
    raise ValueError(f"give at most one of --remat, --remat-policy and --remat-budget, got "
                     f"{', '.join('--' + f.replace('_', '-') for f in chosen)}")
  if cfg.remat_policy is not None:
    remat.resolve_policy(cfg.remat_policy)
  if cfg.remat_choices is not None:
    for choice in remat_choices(cfg):
      remat.choice_policy(choice)
  segments(cfg)
  if cfg.mesh is not None:
    mesh_shape(cfg)
  _check_data(cfg)
  _check_objective(cfg)
  _check_lora(cfg)
  expert_keep(cfg)
  joined = processes(cfg)
  if cfg.mesh is None and (cfg.distributed or (joined and joined[1] > 1)):
    raise ValueError(f"{'--distributed' if cfg.distributed else '--coordinator'} trains on the "
                     f"devices of every process: give --mesh over all of them (e.g. --mesh "
                     f"data=N, N devices in all)")


# The environment variables that stand in for --coordinator, --num-processes and --process-id.
PROCESS_ENV = {"coordinator": "JAXFUSE_COORDINATOR", "num_processes": "JAXFUSE_NUM_PROCESSES",
               "process_id": "JAXFUSE_PROCESS_ID"}


def processes(cfg: TrainConfig,
              environ: Mapping[str, str] | None = None) -> tuple[str, int, int] | None:
  """``(coordinator, num_processes, process_id)`` of ``--coordinator``, ``--num-processes`` and
  ``--process-id``, each else from its variable of :data:`PROCESS_ENV` (``os.environ`` by
  default); None when none is given. Refuses a partial or inconsistent combination, and any
  of them with ``--distributed`` (which reads all three from the cluster's environment)."""
  environ = os.environ if environ is None else environ
  values, names = {}, {}
  for field, variable in PROCESS_ENV.items():
    values[field], names[field] = getattr(cfg, field), "--" + field.replace("_", "-")
    if values[field] is None and environ.get(variable, "").strip():
      values[field], names[field] = environ[variable].strip(), variable
      if field != "coordinator":
        try:
          values[field] = int(values[field])
        except ValueError:
          raise ValueError(f"{variable} must be an integer, got {environ[variable]!r}") from None
  given = " and ".join(names[f] for f in PROCESS_ENV if values[f] is not None)
  missing = " and ".join(names[f] for f in PROCESS_ENV if values[f] is None)
  if not given:
    return None
  if cfg.distributed:
    raise ValueError(f"--distributed reads the coordinator, process count and process id from "
                     f"the cluster's environment: drop {given}, or drop --distributed")
  if missing:
    raise ValueError(f"{given} without {missing}: give all three (or --distributed, which reads "
                     f"them from the cluster's environment)")
  coordinator, count, index = (values[f] for f in PROCESS_ENV)
  host, sep, port = coordinator.rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ValueError(f"{names['coordinator']} must be HOST:PORT (process 0's address and a free "
                     f"port), got {coordinator!r}")
  if count < 1:
    raise ValueError(f"{names['num_processes']} must be >= 1, got {count}")
  if not 0 <= index < count:
    raise ValueError(f"{names['process_id']} must be in [0, {count}) ({names['num_processes']} "
                     f"{count}), got {index}")
  return coordinator, count, index


def mesh_shape(cfg: TrainConfig) -> dict[str, int]:
  """The ``--mesh`` axes, checked against the (micro-)batch's shape."""
  shape = parallel.parse_mesh(cfg.mesh)
  rows = shape.get("data", 1) * shape.get("fsdp", 1) * shape.get("expert", 1)
  if cfg.batch % rows:
    raise ValueError(f"--batch {cfg.batch} must be a multiple of data x fsdp x expert = {rows}"
                     + (" (each of the --grad-accum micro-batches is split over them)"
                        if cfg.grad_accum > 1 else ""))
  parts = shape.get("context", 1)
  if parts > 1 and cfg.seq % (2 * parts):
    raise ValueError(f"--seq {cfg.seq} must be a multiple of 2 x context = {2 * parts} (the "
                     f"zig-zag order of ring attention)")
  if cfg.baseline and parts > 1:
    raise ValueError("--baseline cannot run context parallel (its attention is not a ring): "
                     "drop context= from --mesh")
  return shape


def segments(cfg: TrainConfig) -> str | int | None:
  """``--segments``: None, ``"sqrt"`` or a number of blocks per checkpointed segment."""
  if cfg.segments is None or cfg.segments == "sqrt":
    return cfg.segments
  if cfg.segments.isdigit() and int(cfg.segments) >= 1:
    return int(cfg.segments)
  raise ValueError(f"--segments must be 'sqrt' or a positive number of blocks, got "
                   f"{cfg.segments!r}")


def remat_budget(cfg: TrainConfig) -> str | int:
  """``--remat-budget``: a percentage (``"50%"``, as given) or a number of bytes."""
  text = cfg.remat_budget
  if text.endswith("%"):
    return text
  try:
    return int(text)
  except ValueError:
    raise ValueError(f"--remat-budget must be a number of bytes or a percentage like '50%', "
                     f"got {text!r}") from None


def remat_choices(cfg: TrainConfig) -> tuple[str, ...]:
  """``--remat-choices``: what the recomputation plan may choose for a block."""
  if cfg.remat_choices is None:
    return remat.DEFAULT_CHOICES
  return tuple(c.strip() for c in cfg.remat_choices.split(",") if c.strip())


def _check_data(cfg: TrainConfig) -> None:
  """The data options: where they need ``--data`` and what values they take."""
  if cfg.data is None:
    given = [f for f in ("eval_data", "train_tokenizer") if getattr(cfg, f) is not None]
    given += ["eval_share"] if cfg.eval_share else []
    given += ["loss_on"] if cfg.loss_on != "all" else []
    if given:
      raise ValueError(f"--{given[0].replace('_', '-')} needs --data (the standard library's "
                       "bytes, the default corpus, take none)")
  if cfg.loss_on not in LOSS_ON:
    raise ValueError(f"--loss-on must be one of {', '.join(LOSS_ON)}, got {cfg.loss_on!r}")
  if cfg.long_documents not in LONG_DOCUMENTS:
    raise ValueError(f"--long-documents must be one of {', '.join(LONG_DOCUMENTS)}, got "
                     f"{cfg.long_documents!r}")
  if not 0 <= cfg.eval_share < 1:
    raise ValueError(f"--eval-share must be in [0, 1), got {cfg.eval_share}")
  if cfg.eval_share and cfg.eval_data:
    raise ValueError("give --eval-data or --eval-share, not both")
  if cfg.train_tokenizer is not None:
    if cfg.init_from or cfg.tokenizer:
      raise ValueError("--train-tokenizer trains a model's vocabulary from scratch: it cannot "
                       "go with --init-from or --tokenizer (a checkpoint has its own)")
    if cfg.train_tokenizer < 257:
      raise ValueError(f"--train-tokenizer must be at least 257 tokens (the 256 bytes and an "
                       f"end-of-text token), got {cfg.train_tokenizer}")


def objective_options(cfg: TrainConfig) -> dict[str, Any]:
  """The options of ``--objective`` that the run sets (the others take its defaults)."""
  options = {}
  for name in OBJECTIVE_OPTIONS.get(cfg.objective, ()):
    value = getattr(cfg, name)
    if (name not in ("teacher", "teacher_topk") + ROLLOUT_OPTIONS and value is not None
        and value is not False):
      options["temperature" if name.endswith("_temperature") else name] = value
  return options


def _check_objective(cfg: TrainConfig) -> None:
  """``--objective`` and its options: each objective takes only its own; preference objectives
  read prompt/chosen/rejected records from ``--data``."""
  if cfg.objective not in OBJECTIVES:
    raise ValueError(f"--objective must be one of {', '.join(OBJECTIVES)}, got "
                     f"{cfg.objective!r}")
  defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
  mine = OBJECTIVE_OPTIONS[cfg.objective]
  for name in sorted({n for names in OBJECTIVE_OPTIONS.values() for n in names}):
    if getattr(cfg, name) != defaults[name] and name not in mine:
      takes = ", ".join("--" + n.replace("_", "-") for n in mine) or "none"
      raise ValueError(f"--{name.replace('_', '-')} is not an option of --objective "
                       f"{cfg.objective} (it takes {takes})")
  if cfg.objective == "sft":
    return
  if cfg.objective == "distill" and cfg.teacher is None:
    raise ValueError("--objective distill needs --teacher DIR (a Hugging Face checkpoint)")
  if cfg.teacher_topk is not None:
    if cfg.teacher_topk < 1:
      raise ValueError(f"--teacher-topk must be >= 1, got {cfg.teacher_topk}")
    if cfg.beta not in (None, 0.0):
      raise ValueError(f"--teacher-topk distils by the forward KL over the teacher's top k "
                       f"(--beta 0), got --beta {cfg.beta}")
  if cfg.objective == "grpo":
    _check_grpo(cfg)
    return
  if cfg.data is None and cfg.objective == "distill":
    raise ValueError("--objective distill needs --data (the records it distils on)")
  if cfg.data is None:
    fields = "prompt/completion/label" if cfg.objective == "kto" else "prompt/chosen/rejected"
    raise ValueError(f"--objective {cfg.objective} needs --data: {fields} records in JSON "
                     "lines or Parquet")
  given = [] if cfg.objective not in PAIRED else [
      f for f in ("eval_data", "train_tokenizer") if getattr(cfg, f) is not None]
  given += ["eval_share"] if cfg.eval_share and cfg.objective in PAIRED else []
  given += ["remat_budget"] if cfg.remat_budget else []
  if given:
    raise ValueError(f"--{given[0].replace('_', '-')} is not available with --objective "
                     f"{cfg.objective} yet")
  if cfg.beta is not None and cfg.objective != "distill" and not cfg.beta > 0:
    raise ValueError(f"--beta must be > 0, got {cfg.beta}")
  from jaxfuse.posttrain.objectives import make_objective

  make_objective(cfg.objective, **objective_options(cfg))


def rollout_options(cfg: TrainConfig) -> dict[str, Any]:
  """The rollouts' options of ``--objective grpo``, defaults filled in."""
  names = ROLLOUT_OPTIONS + ("rollout_temperature",)
  options = {n: getattr(cfg, n) if getattr(cfg, n) is not None else ROLLOUT_DEFAULTS.get(n)
             for n in names}
  weights = options.pop("reward_weights")
  options["reward_weights"] = (None if weights is None
                               else [float(w) for w in str(weights).split(",")])
  return options


def _check_grpo(cfg: TrainConfig) -> None:
  if cfg.data is None:
    raise ValueError("--objective grpo needs --data: prompt records (a 'prompt' field, and "
                     "whatever the reward functions read) in JSON lines or Parquet")
  if not cfg.reward:
    raise ValueError("--objective grpo needs --reward: one or more reward functions "
                     "(module:function, exact_match, format:REGEX, length:CHARS)")
  given = [f for f in ("eval_data", "train_tokenizer", "remat_budget") if getattr(cfg, f)]
  given += ["eval_share"] if cfg.eval_share else []
  if given:
    raise ValueError(f"--{given[0].replace('_', '-')} is not available with --objective grpo")
  options = rollout_options(cfg)
  g = options["num_generations"]
  if g < 2:
    raise ValueError(f"--num-generations must be >= 2 (the advantages compare a prompt's "
                     f"completions), got {g}")
  if cfg.global_batch % g:
    raise ValueError(f"--batch x --grad-accum ({cfg.global_batch} rows) must be a multiple of "
                     f"--num-generations ({g}): a step's rows are the completions of whole "
                     f"groups")
  weights = options["reward_weights"]
  if weights is not None and len(weights) != len(cfg.reward):
    raise ValueError(f"--reward-weights gives {len(weights)} weights for {len(cfg.reward)} "
                     f"--reward functions")
  for name, low in (("max_new_tokens", 1), ("num_iterations", 1), ("top_k", 0)):
    if options[name] < low:
      raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {options[name]}")
  if not 0 < options["top_p"] <= 1:
    raise ValueError(f"--top-p must be in (0, 1], got {options['top_p']}")
  if options["scale_rewards"] not in ("group", "batch", "none"):
    raise ValueError(f"--scale-rewards must be group, batch or none, got "
                     f"{options['scale_rewards']!r}")
  if options["max_new_tokens"] >= cfg.seq:
    raise ValueError(f"--max-new-tokens ({options['max_new_tokens']}) must leave room for the "
                     f"prompts in --seq ({cfg.seq})")
  if cfg.beta is not None and cfg.beta < 0:
    raise ValueError(f"--beta must be >= 0, got {cfg.beta}")
  from jaxfuse.posttrain.objectives import make_objective

  # The reward functions are loaded when the run starts (a module may not exist yet here).
  make_objective("grpo", **objective_options(cfg))


def _check_lora(cfg: TrainConfig) -> None:
  """The LoRA options."""
  if cfg.lora_rank is None:
    if cfg.lora_alpha is not None:
      raise ValueError("--lora-alpha needs --lora-rank")
    return
  if cfg.lora_rank < 1:
    raise ValueError(f"--lora-rank must be >= 1, got {cfg.lora_rank}")
  if cfg.lora_alpha is not None and cfg.lora_alpha <= 0:
    raise ValueError(f"--lora-alpha must be > 0, got {cfg.lora_alpha}")
  lora_targets(cfg)


def lora_targets(cfg: TrainConfig) -> tuple[str, ...]:
  """``--lora-targets`` as a tuple of projection names."""
  targets = tuple(t.strip() for t in cfg.lora_targets.split(",") if t.strip())
  unknown = [t for t in targets if t not in LORA_TARGETS]
  if unknown or not targets:
    raise ValueError(f"--lora-targets takes a comma-separated subset of "
                     f"{','.join(LORA_TARGETS)}, got {cfg.lora_targets!r}")
  return targets


def expert_keep(cfg: TrainConfig) -> tuple[str, ...]:
  """``--expert-keep`` as a tuple of product names (``DecoderConfig.expert_keep``)."""
  if cfg.expert_keep is None:
    return ()
  if not cfg.init_from:
    raise ValueError("--expert-keep needs --init-from a Mixture-of-Experts checkpoint")
  given = tuple(t.strip() for t in cfg.expert_keep.split(",") if t.strip())
  if not given:
    raise ValueError(f"--expert-keep takes gate, up or gate,up, got {cfg.expert_keep!r}")
  return moe_products(given, "--expert-keep")


def lora_alpha(cfg: TrainConfig) -> float:
  """``--lora-alpha``, by default twice the rank."""
  return float(2 * cfg.lora_rank if cfg.lora_alpha is None else cfg.lora_alpha)
