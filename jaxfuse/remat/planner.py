"""What to recompute, measured and chosen: :func:`profile` and :func:`plan`.

:func:`profile` measures, for every layer of a model and every candidate choice (no
recomputation, a preset, a MaxText recipe, a group of names), the bytes the layer's backward
keeps (device and host) and the FLOPs of its forward and backward pass with the recomputation
included (:func:`jaxfuse.metrics.flops`, loops counted as they run), and per named value
(:mod:`jaxfuse.ops.names`) the bytes keeping it costs. It reads everything off the traced
programs, as :func:`jaxfuse.metrics.residual_bytes` does; time is measured only when asked.

:func:`plan` picks one choice per layer so that the whole step's residual bytes fit a budget at
the least FLOPs: an exact multiple-choice knapsack over the layers (a dynamic program over
Pareto-optimal ``(bytes, FLOPs)`` partial plans). The plan it returns is accepted by
``Decoder(remat=plan)``, :meth:`Decoder.set_remat`, :func:`jaxfuse.remat.remat` (when it chose
one policy for all layers) and ``python -m jaxfuse.train --remat-budget 50%``; ``print(plan)``
shows the choices and their costs, and its ``measured_bytes`` is the whole step's residual
bytes under it, measured after planning. The prediction adds the layers' costs to those of the
rest of the step, which include every layer's input carry; a layer that recomputes nothing
keeps its input among its own residuals, so a plan with such layers can measure up to one
carry per such layer below its prediction. A plan whose measured bytes exceed the budget is
planned again with the excess taken off.

A model that can be profiled has ``num_layers``, ``layer(i)``, ``remat`` and ``segments``,
``set_remat(remat, segments)`` and ``remat_block(batch) -> (step, carry)`` (``carry = step(layer, carry)`` runs one layer), as
:class:`jaxfuse.models.Decoder` has; ``loss_fn(model, batch)`` returns the scalar loss.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from flax import nnx
  >>> from jaxfuse.models import Decoder, DecoderConfig, next_token_targets
  >>> from jaxfuse import remat
  >>> cfg = DecoderConfig(vocab_size=64, d_model=32, num_layers=4, num_heads=2, mlp_dim=64)
  >>> model = Decoder(cfg, rngs=nnx.Rngs(0))
  >>> tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 64)
  >>> batch = (tokens, next_token_targets(tokens))
  >>> loss_fn = lambda m, b: m(*b)
  >>> p = remat.plan(loss_fn, model, batch, "50%", choices=["none", "nothing", "minimal"])
  >>> p.measured_bytes <= p.budget_bytes
  True
  >>> model.set_remat(p)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfuse.metrics.flops import flops as count_flops
from jaxfuse.metrics.residuals import residuals
from jaxfuse.metrics.timing import time_fn
from jaxfuse.ops import names as n
from jaxfuse.remat.layers import equal_runs
from jaxfuse.remat.policies import PRESETS, RECIPES, freeze_policy, resolve_policy

# Choices that are not presets or recipes: groups of names worth keeping on their own.
NAMED_CHOICES: dict[str, tuple[str, ...]] = {
    "save_context": (n.ATTN_OUT, n.ATTN_LSE),
    "save_context_and_mlp_in": (n.ATTN_OUT, n.ATTN_LSE, n.MLP_GATE, n.MLP_UP, n.MLP_PRE),
    "save_mlp_hidden": (n.MLP_HIDDEN,),
    "save_norm_out": (n.NORM_OUT,),
}
# What plan() chooses among by default: no recomputation, the presets, MaxText's recipes kept
# on the device (offloading needs a cost per byte, see plan()), and the named groups.
DEFAULT_CHOICES = (("none", "nothing", "dots", "dots_no_batch")
                   + tuple(r for r, t in RECIPES.items()
                           if r != "full" and "offload" not in t.values())
                   + tuple(NAMED_CHOICES))


def choice_policy(choice: str):
  """The policy of a choice name: ``"none"`` is no recomputation (None)."""
  if choice == "none":
    return None
  if choice in NAMED_CHOICES:
    return NAMED_CHOICES[choice]
  if choice in PRESETS or choice in RECIPES:
    return choice
  raise ValueError(f"unknown choice {choice!r}: use 'none', a preset {sorted(PRESETS)}, a "
                   f"recipe {sorted(RECIPES)} or a named group {sorted(NAMED_CHOICES)}")


def layer_policies(remat, num_layers: int, who: str = "layers") -> tuple:
  """One policy per layer (None: no recomputation) from what a model's ``remat`` takes:
  None, ``"block"`` (``"nothing"``), a policy for every layer, or a :class:`Plan`."""
  if remat is None:
    return (None,) * num_layers
  if isinstance(remat, Plan):
    if len(remat.policies) != num_layers:
      raise ValueError(f"{who}: the plan has {len(remat.policies)} layers, the model "
                       f"{num_layers}")
    return tuple(remat.policies)
  if remat == "block":
    remat = "nothing"
  try:
    resolve_policy(remat)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{who}: remat must be None, 'block', a policy or a Plan: {e}") from None
  return (freeze_policy(remat),) * num_layers


# Profiling -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ChoiceCost:
  """One layer under one choice: the bytes its backward keeps on the device and on the host,
  the FLOPs of its forward and backward pass (recomputation included) and, when measured, the
  milliseconds of both."""

  choice: str
  residual_bytes: int
  offloaded_bytes: int
  flops: int
  ms: float | None = None


@dataclasses.dataclass(frozen=True)
class Profile:
  """What :func:`profile` measured.

  Attributes:
    layers: per layer, ``{choice: ChoiceCost}``.
    named_bytes: per layer, ``{name: bytes}``: what keeping only that named value costs beyond
      keeping nothing (0 where the layer has no such value).
    base_bytes, base_flops: the step's residual bytes and FLOPs outside the layers (the
      embedding, the head, the carries between layers), measured with every layer keeping
      nothing.
    no_remat_bytes, no_remat_flops: the whole step without recomputation (``remat=None``).
  """

  layers: tuple[dict[str, ChoiceCost], ...]
  named_bytes: tuple[dict[str, int], ...]
  base_bytes: int
  base_flops: int
  no_remat_bytes: int
  no_remat_flops: int

  def total(self, choices: Sequence[str]) -> tuple[int, int]:
    """``(residual bytes, FLOPs)`` of the whole step, predicted for one choice per layer."""
    b = self.base_bytes + sum(self.layers[i][c].residual_bytes for i, c in enumerate(choices))
    f = self.base_flops + sum(self.layers[i][c].flops for i, c in enumerate(choices))
    return b, f

  def __str__(self) -> str:
    lines = [f"step without recomputation: {_mib(self.no_remat_bytes)} residual, "
             f"{_gflop(self.no_remat_flops)}; outside the layers: {_mib(self.base_bytes)}, "
             f"{_gflop(self.base_flops)}"]
    groups = equal_runs(self.layers)
    for a, b in groups:
      costs = self.layers[a]
      label = f"layer {a}" if b == a + 1 else f"layers {a}-{b - 1} (each)"
      lines.append(f"{label}:")
      lines.append(f"  {'choice':34s} {'residual':>12s} {'offloaded':>12s} {'MFLOP':>10s}"
                   f" {'ms':>8s}")
      for c in sorted(costs.values(), key=lambda c: (c.residual_bytes, c.flops)):
        ms = "" if c.ms is None else f"{c.ms:.2f}"
        lines.append(f"  {c.choice:34s} {_mib(c.residual_bytes):>12s} "
                     f"{_mib(c.offloaded_bytes):>12s} {c.flops / 1e6:10.2f} {ms:>8s}")
      named = {k: v for k, v in self.named_bytes[a].items() if v}
      lines.append("  named values (bytes each keeps): " + ", ".join(
          f"{k} {_mib(v)}" for k, v in named.items()))
    return "\n".join(lines)


def _mib(b: int) -> str:
  """Bytes in the largest binary unit that keeps them at least 1."""
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if abs(b) >= size:
      return f"{b / size:.2f} {unit}"
  return f"{b} B"


def _gflop(f: int) -> str:
  return f"{f / 1e9:.4g} GFLOP"


def _device_and_host(f, *args) -> tuple[int, int]:
  rs = residuals(f, *args)
  return (sum(r.nbytes for r in rs if r.memory == "device"),
          sum(r.nbytes for r in rs if r.memory == "host"))


def _step_costs(loss_fn, model, batch, with_flops: bool = True):
  """Residual bytes and FLOPs (of value and grad) of the whole step, as the model is set."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(params):
    return loss_fn(nnx.merge(graphdef, params, rest), batch)

  residual = _device_and_host(loss, params)[0]
  if not with_flops:
    return residual
  return residual, count_flops(lambda p: jax.value_and_grad(loss)(p), params)


def _layer_costs(step, layer, carry, choices, named, time) -> tuple[dict, dict]:
  graphdef, state = nnx.split(layer)

  def run(state, carry):
    return step(nnx.merge(graphdef, state), carry)

  costs = {}
  for choice in choices:
    policy = choice_policy(choice)
    fn = run if policy is None else jax.checkpoint(run, policy=resolve_policy(policy))
    dev, host = _device_and_host(fn, state, carry)

    def fwd_bwd(state, carry, fn=fn):
      out, vjp = jax.vjp(fn, state, carry)
      return vjp(jax.tree_util.tree_map(jnp.ones_like, out))

    ms = None
    if time:
      compiled = jax.jit(fwd_bwd)
      ms = time_fn(lambda compiled=compiled: compiled(state, carry)).median
    costs[choice] = ChoiceCost(choice, dev, host, count_flops(fwd_bwd, state, carry), ms)
  keep_nothing = jax.checkpoint(run, policy=resolve_policy("nothing"))
  floor = _device_and_host(keep_nothing, state, carry)[0]
  named_bytes = {}
  for name in named:
    fn = jax.checkpoint(run, policy=resolve_policy([name]))
    named_bytes[name] = _device_and_host(fn, state, carry)[0] - floor
  return costs, named_bytes


def _signature(layer):
  graphdef, state = nnx.split(layer)
  return graphdef, tuple((x.shape, str(x.dtype)) for x in jax.tree_util.tree_leaves(state))


def profile(loss_fn: Callable, model, batch, *, choices: Sequence[str] = DEFAULT_CHOICES,
            time: bool = False) -> Profile:
  """Measures every layer of ``model`` under every choice; see the module docstring.

  Args:
    loss_fn: ``loss_fn(model, batch)``, the scalar loss of a training step.
    model: a model with the protocol of the module docstring (a :class:`jaxfuse.models.
      Decoder`).
    batch: the arguments of one step.
    choices: names: ``"none"``, presets, recipes (:data:`jaxfuse.remat.RECIPES`) or named
      groups (:data:`NAMED_CHOICES`).
    time: also time each layer's forward and backward pass under each choice.

  Layers with the same structure and shapes are measured once.
  """
  for c in choices:
    choice_policy(c)
  measured_choices = list(dict.fromkeys(list(choices) + ["nothing"]))
  saved = (model.remat, model.segments)
  try:
    model.set_remat(None)
    no_remat = _step_costs(loss_fn, model, batch)
    # The layers are measured as they run under a plan: their ops keep nothing by themselves.
    model.set_remat("nothing")
    step, carry = model.remat_block(batch)
    measured: dict = {}
    layers, named = [], []
    for i in range(model.num_layers):
      layer = model.layer(i)
      key = _signature(layer)
      if key not in measured:
        measured[key] = _layer_costs(step, layer, carry, measured_choices, n.ALL, time)
      layers.append(measured[key][0])
      named.append(measured[key][1])
    nothing_bytes, nothing_flops = _step_costs(loss_fn, model, batch)
  finally:
    model.set_remat(*saved)
  base_bytes = nothing_bytes - sum(layer["nothing"].residual_bytes for layer in layers)
  base_flops = nothing_flops - sum(layer["nothing"].flops for layer in layers)
  return Profile(tuple(layers), tuple(named), base_bytes, base_flops, *no_remat)


# Planning ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
  """One choice per layer, made by :func:`plan`; see the module docstring.

  Attributes:
    choices: per layer, the choice's name.
    policies: per layer, its policy (None: no recomputation).
    budget_bytes: the residual bytes the plan had to fit.
    predicted_bytes, predicted_flops: the step's residual bytes and FLOPs, from the profile.
    no_remat_bytes, no_remat_flops: the step's without recomputation.
    min_bytes: the fewest residual bytes any plan reaches.
    measured_bytes: the step's residual bytes under the plan, measured (None if not).
  """

  choices: tuple[str, ...]
  policies: tuple
  budget_bytes: int
  predicted_bytes: int
  predicted_flops: int
  no_remat_bytes: int
  no_remat_flops: int
  min_bytes: int
  measured_bytes: int | None = None

  @property
  def extra_flops(self) -> float:
    """The step's FLOPs over those without recomputation, minus 1 (0.1 = 10% more)."""
    return self.predicted_flops / self.no_remat_flops - 1

  def single_policy(self):
    """The policy, when every layer has the same one."""
    if len(set(self.policies)) != 1:
      raise ValueError(f"this plan chose per layer ({sorted(set(self.choices))}); give it to a "
                       f"model's remat=, or use plan.policies[i] for one layer")
    return self.policies[0]

  def __str__(self) -> str:
    lines = [f"plan for a budget of {_mib(self.budget_bytes)} "
             f"({self.budget_bytes / self.no_remat_bytes:.0%} of {_mib(self.no_remat_bytes)} "
             f"without recomputation; the least any plan keeps is {_mib(self.min_bytes)}):"]
    for a, b in equal_runs(list(self.choices)):
      label = f"layer {a}" if b == a + 1 else f"layers {a}-{b - 1}"
      lines.append(f"  {label:14s} {self.choices[a]}")
    measured = ("" if self.measured_bytes is None
                else f", measured {_mib(self.measured_bytes)}")
    lines.append(f"residual bytes: predicted {_mib(self.predicted_bytes)}{measured}")
    lines.append(f"FLOPs: {_gflop(self.predicted_flops)}, {self.extra_flops:+.1%} over no "
                 f"recomputation ({_gflop(self.no_remat_flops)})")
    return "\n".join(lines)


class BudgetError(ValueError):
  """No plan fits the budget; the message states the fewest bytes any plan keeps."""


def _knapsack(layers: Sequence[dict[str, ChoiceCost]], capacity: int,
              cost: Callable[[ChoiceCost], float]) -> list[str] | None:
  """The choices per layer of least total ``cost`` whose bytes sum to at most ``capacity``
  (None if none do): a DP over layers keeping the Pareto-optimal (bytes, cost) partial plans."""
  frontier = [(0, 0.0, ())]
  for options in layers:
    # Each layer's own dominated options never help.
    opts = _pareto([(c.residual_bytes, cost(c), name) for name, c in options.items()])
    grown = [(b + ob, f + of, path + (name,)) for b, f, path in frontier
             for ob, of, name in opts if b + ob <= capacity]
    if not grown:
      return None
    frontier = _pareto(grown)
  return list(min(frontier, key=lambda s: (s[1], s[0]))[2])


def _pareto(items):
  """The items no other has fewer bytes and no more cost than (by bytes, then cost)."""
  items = sorted(items, key=lambda s: (s[0], s[1]))
  kept, best = [], float("inf")
  for item in items:
    if item[1] < best:
      kept.append(item)
      best = item[1]
  return kept


def plan(loss_fn: Callable, model, batch, budget_bytes: int | float | str, *,
         choices: Sequence[str] = DEFAULT_CHOICES, profiled: Profile | None = None,
         offload_flops_per_byte: float | None = None, measure: bool = True) -> Plan:
  """The choice per layer that fits ``budget_bytes`` at the least FLOPs.

  Args:
    loss_fn, model, batch: as :func:`profile` takes them.
    budget_bytes: the step's residual bytes: an int, or a fraction of those without
      recomputation (``0.5`` or ``"50%"``).
    choices: what a layer may choose (see :func:`profile`); ignored with ``profiled``.
    profiled: a :class:`Profile` of this model and batch, to plan from without measuring.
    offload_flops_per_byte: the cost of moving a byte to host memory and back, in FLOPs (about
      peak FLOP/s over host bandwidth); choices that offload are left out unless given.
    measure: measure the step's residual bytes under the plan (``Plan.measured_bytes``).

  Raises:
    BudgetError: the budget is below the fewest bytes any plan keeps (stated).
  """
  prof = profiled or profile(loss_fn, model, batch, choices=choices)
  budget = _budget(budget_bytes, prof.no_remat_bytes)

  def cost(c: ChoiceCost) -> float:
    if c.offloaded_bytes and offload_flops_per_byte is None:
      return float("inf")
    return c.flops + (offload_flops_per_byte or 0) * c.offloaded_bytes

  usable = [{k: c for k, c in layer.items() if cost(c) != float("inf")} for layer in prof.layers]
  min_bytes = prof.base_bytes + sum(min(c.residual_bytes for c in layer.values())
                                    for layer in usable)
  if budget < min_bytes:
    raise BudgetError(f"plan: no plan fits {budget} bytes: the least any plan keeps is "
                      f"{min_bytes} bytes ({min_bytes / prof.no_remat_bytes:.1%} of the "
                      f"{prof.no_remat_bytes} bytes without recomputation)")
  capacity = budget - prof.base_bytes
  for _ in range(4):
    picked = _knapsack(usable, capacity, cost)
    if picked is None:
      raise BudgetError(f"plan: no plan fits {budget} bytes once measured (the least any plan "
                        f"keeps is about {min_bytes} bytes)")
    predicted_bytes, predicted_flops = prof.total(picked)
    result = Plan(tuple(picked), tuple(freeze_policy(choice_policy(c)) for c in picked), budget,
                  predicted_bytes, predicted_flops, prof.no_remat_bytes, prof.no_remat_flops,
                  min_bytes)
    if not measure:
      return result
    measured = _measure(loss_fn, model, batch, result)
    result = dataclasses.replace(result, measured_bytes=measured)
    if measured <= budget:
      return result
    # The layers' bytes did not add up exactly (e.g. a scan's index vector): plan again with
    # the overshoot taken off.
    capacity -= measured - budget
  raise BudgetError(f"plan: the plans found keep more than the {budget} bytes when measured")


def _measure(loss_fn, model, batch, result: Plan) -> int:
  saved = (model.remat, model.segments)
  try:
    model.set_remat(result)
    return _step_costs(loss_fn, model, batch, with_flops=False)
  finally:
    model.set_remat(*saved)


def _budget(budget, no_remat_bytes: int) -> int:
  if isinstance(budget, str):
    text = budget.strip()
    if not text.endswith("%"):
      raise ValueError(f"plan: a budget string is a percentage like '50%', got {budget!r}")
    try:
      budget = float(text[:-1]) / 100
    except ValueError:
      raise ValueError(f"plan: a budget string is a percentage like '50%', got {budget!r}")
  if isinstance(budget, float):
    if not 0 < budget <= 1:
      raise ValueError(f"plan: a fractional budget is in (0, 1], got {budget}")
    return int(budget * no_remat_bytes)
  if isinstance(budget, int) and budget > 0:
    return budget
  raise ValueError(f"plan: budget_bytes must be a positive int, a fraction or 'N%', got "
                   f"{budget!r}")
