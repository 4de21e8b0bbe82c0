"""``--objective grpo``: the prompts a run reads and the step that samples, scores and trains.

Each step takes ``--batch x --grad-accum / --num-generations`` prompts (an order shuffled by
``--seed`` anew each pass, a function of the step), samples ``--num-generations`` completions of
each with the current policy and the KV cache (the key ``fold_in(key(seed), step)``: a resumed
run samples what the uninterrupted one did), scores them with the ``--reward`` functions, and
makes ``--num-iterations`` optimizer updates on them (:class:`jaxfuse.posttrain.objectives.GRPO`).
With ``--num-iterations`` above 1 the sampling policy's log-probabilities are computed once
before the updates (``old_logps``); with ``--beta`` the reference's: with LoRA, the base with
the adapters off (no second copy of the model), else the model as the run started (one copy of
its parameters).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfuse.data import DataError
from jaxfuse.posttrain.grpo import PromptRows, read_prompt_rows, rollout_batch
from jaxfuse.posttrain.rewards import load_reward
from jaxfuse.train import config, placement
from jaxfuse.train.config import TrainConfig

__all__ = ["GRPOSteps", "Prompts"]


@dataclasses.dataclass
class Prompts:
  """The prompt records of a ``--objective grpo`` run, with what the training loop asks of a
  run's inputs (its ``report``, ``fingerprint``, no evaluation batches)."""

  cfg: TrainConfig
  tokenizer: Any
  rows: PromptRows
  report: str = ""
  corpus: Any = None
  entropy_bits: float | None = None

  @classmethod
  def load(cls, cfg: TrainConfig, tokenizer: Any, vocab_size: int, *, log=print) -> Prompts:
    max_new = config.rollout_options(cfg)["max_new_tokens"]
    rows = read_prompt_rows(cfg.data, tokenizer, vocab_size=vocab_size,
                            max_length=cfg.seq - max_new)
    report = (f"{len(rows)} prompts of up to {int(rows.lengths.max())} tokens, "
              f"{config.rollout_options(cfg)['num_generations']} completions of up to "
              f"{max_new} tokens each")
    if jax.process_index() == 0:
      log(f"data: {report}")
    return cls(cfg, tokenizer, rows, report)

  @property
  def fingerprint(self) -> str:
    return f"prompts-{self.rows.fingerprint}/batch{self.cfg.global_batch}/seed{self.cfg.seed}"

  @property
  def sample_tokenizer(self) -> Any:
    return self.tokenizer

  def check_resume(self, recorded: str | None) -> None:
    if recorded is not None and recorded != self.fingerprint:
      raise DataError(f"the checkpoint was trained on data {recorded}, this run's is "
                      f"{self.fingerprint} (other prompts, tokenizer, batch size or seed): "
                      "resume with the same options, or another --out")

  def evaluation(self, mesh=None) -> list:
    return []


class GRPOSteps:
  """``steps(step, state) -> (state, metrics)``: one step of ``--objective grpo`` (see the
  module docstring) with the jitted training step ``train_step``."""

  def __init__(self, cfg: TrainConfig, prompts: Prompts, graphdef, state, train_step, mesh,
               objective, *, log=print):
    self.cfg, self.prompts, self.graphdef, self.train_step = cfg, prompts, graphdef, train_step
    self.mesh, self.objective, self.log = mesh, objective, log
    self.options = config.rollout_options(cfg)
    self.reward_fns = [load_reward(spec) for spec in cfg.reward]
    eos = getattr(prompts.tokenizer, "eos_token_id", None)
    self.eos = () if eos is None else (int(eos),)
    self.lora = cfg.lora_rank is not None
    temperature = objective.temperature

    def log_probs(state, batch, reference, base):
      model, _ = nnx.merge(graphdef, state)
      if reference is not None:   # the run's first parameters
        nnx.update(model, reference)
      if base:   # the base model: the adapters' parameters zero
        gdef, adapters, rest = nnx.split(model, nnx.LoRAParam, ...)
        model = nnx.merge(gdef, jax.tree.map(jnp.zeros_like, adapters), rest)
      return model.token_log_probs(batch["tokens"], batch["targets"], temperature=temperature)

    self._log_probs = jax.jit(log_probs, static_argnames="base")
    self.reference = None
    if objective.beta != 0.0 and not self.lora:
      model, _ = nnx.merge(graphdef, state)
      self.reference = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))

  def _place(self, batch: dict) -> dict:
    keys = tuple(batch)
    arrays = placement.place_batch_rows(lambda lo, hi: tuple(batch[k][lo:hi] for k in keys),
                                        batch["tokens"].shape, self.mesh)
    return dict(zip(keys, (jnp.asarray(a) for a in arrays)))

  def __call__(self, step: int, state):
    cfg, options = self.cfg, self.options
    g = options["num_generations"]
    indices = self.prompts.rows.indices(step, cfg.global_batch // g, cfg.seed)
    model, _ = nnx.merge(self.graphdef, state)
    batch, host, samples = rollout_batch(
        model, self.prompts.rows, indices, tokenizer=self.prompts.tokenizer,
        reward_fns=self.reward_fns, reward_weights=options["reward_weights"],
        num_generations=g, max_new_tokens=options["max_new_tokens"],
        key=jax.random.fold_in(jax.random.key(cfg.seed), step), seq=cfg.seq,
        temperature=options["rollout_temperature"], top_p=options["top_p"], top_k=options["top_k"],
        scale_rewards=options["scale_rewards"], eos_token_ids=self.eos)
    placed = self._place(batch)
    if options["num_iterations"] > 1:   # the sampling policy's, before the updates
      placed["old_logps"] = self._log_probs(state, placed, None, base=False)
    if self.objective.beta != 0.0:
      placed["ref_logps"] = self._log_probs(state, placed, self.reference, base=self.lora)
    for _ in range(options["num_iterations"]):
      state, metrics = self.train_step(state, placed)
    if (step + 1) % cfg.log_every == 0 and samples:
      s = samples[0]
      self.log(f"step {step + 1} sample (reward {s['reward']:.3f}): {s['prompt']!r} -> "
               f"{s['completion']!r}")
    return state, {**metrics, **host}
