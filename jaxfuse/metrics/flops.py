"""FLOPs of a program as it runs: every loop counted as many times as it iterates.

XLA's cost analysis counts a loop body once, whatever its trip count, and a traced jaxpr knows
no trip count of a ``while`` loop whose bounds are computed (the attention's causal tile
ranges). :func:`flops` walks the jaxpr instead: a ``scan`` body counts ``length`` times, a
``cond`` counts the branch taken, and a ``while`` loop counts its body once per iteration. Where
a program has ``while`` loops the count is taken by running an instrumented copy of it on the
given arguments (one execution, under ``jit``); otherwise it is read off the jaxpr and nothing
runs.

What counts as a FLOP: ``dot_general`` is ``2 · M · N · K``; ``ragged_dot_general`` (grouped
products) ``2 · M · N · K`` too, each of its ``M`` rows times its own group's matrix (not the
``G``-fold product XLA:CPU computes for it); an elementwise op one per output
element (transcendentals included); a reduction one per input element; data movement
(reshapes, slices, transposes, gathers, casts, copies, device transfers) nothing. A Pallas
kernel counts what its ``CostEstimate`` declares. Recomputation under ``jax.checkpoint`` is
counted where the backward pass runs it, so the FLOPs of ``jax.value_and_grad`` of a
recomputed function include the recomputation.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core

from jaxfuse.metrics.jaxprs import open_jaxpr

# Data movement, casts, names and sharding annotations: no arithmetic.
_FREE = frozenset({
    "reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims", "slice",
    "dynamic_slice", "dynamic_update_slice", "concatenate", "pad", "gather", "rev", "iota",
    "convert_element_type", "bitcast_convert_type", "copy", "copy_p", "device_put", "name",
    "stop_gradient", "reduce_precision", "optimization_barrier", "random_wrap",
    "random_unwrap", "sharding_constraint", "mesh_cast", "reshard", "split", "pvary",
    "axis_index",
})
_REDUCTIONS = frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
    "reduce_xor", "argmax", "argmin", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp",
})
_SUBJAXPR_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
# Primitives with bodies that run as they are when their count is known without running.
_BOUND_AS_IS = frozenset({"scan", "while", "cond", "pallas_call"})


def _size(aval) -> int:
  return math.prod(getattr(aval, "shape", ()))


def _sub_jaxpr(eqn):
  for key in _SUBJAXPR_PARAMS:
    if key in eqn.params and eqn.params[key] is not None:
      return open_jaxpr(eqn.params[key])
  return None


def _leaf_flops(eqn) -> int:
  """The FLOPs of a primitive without a body."""
  name = eqn.primitive.name
  if name == "dot_general":
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval
    k = math.prod(lhs.shape[d] for d in lhs_contract)
    return 2 * _size(eqn.outvars[0].aval) * k
  if name == "ragged_dot_general":
    numbers = eqn.params["ragged_dot_dimension_numbers"]
    (lhs_contract, _), _ = numbers.dot_dimension_numbers
    lhs = eqn.invars[0].aval
    k = math.prod(lhs.shape[d] for d in lhs_contract)
    out = _size(eqn.outvars[0].aval)
    if set(numbers.lhs_ragged_dimensions) & set(lhs_contract):
      # Summed over the ragged rows into one output per group: each row adds to its group's.
      return 2 * out // eqn.invars[2].aval.shape[-1] * k
    return 2 * out * k
  if name == "pallas_call":
    estimate = eqn.params.get("cost_estimate")
    return int(getattr(estimate, "flops", 0) or 0)
  if name in _FREE:
    return 0
  if name in _REDUCTIONS:
    return sum(_size(v.aval) for v in eqn.invars[:1])
  return sum(_size(v.aval) for v in eqn.outvars)


def _static(jaxpr, memo: dict) -> int | None:
  """The FLOPs of ``jaxpr`` if no ``while`` loop is in it (at any depth), else None."""
  key = id(jaxpr)
  if key in memo:
    return memo[key]
  total = 0
  for eqn in jaxpr.eqns:
    f = _eqn_static(eqn, memo)
    if f is None:
      total = None
      break
    total += f
  memo[key] = total
  return total


def _eqn_static(eqn, memo) -> int | None:
  name = eqn.primitive.name
  if name == "while":
    return None
  if name == "scan":
    body = _static(eqn.params["jaxpr"].jaxpr, memo)
    return None if body is None else body * eqn.params["length"]
  if name == "cond":
    costs = [_static(b.jaxpr, memo) for b in eqn.params["branches"]]
    if any(c is None for c in costs):
      return None
    # The branch taken is known only when it runs; the costliest one is an upper bound, and
    # the dynamic count below takes the one taken.
    return None if len(set(costs)) > 1 else costs[0]
  if name == "pallas_call":
    return _leaf_flops(eqn)
  sub = _sub_jaxpr(eqn)
  if sub is not None:
    return _static(sub[0], memo)
  return _leaf_flops(eqn)


def _run(jaxpr, consts, args, memo):
  """Evaluates ``jaxpr`` on (traced) ``args``; returns its outputs and its FLOPs, a Python int
  plus a traced float32 for the parts with loops."""
  env = {}

  def read(v):
    return v.val if isinstance(v, jex_core.Literal) else env[v]

  for v, x in zip(jaxpr.constvars, consts):
    env[v] = x
  for v, x in zip(jaxpr.invars, args):
    env[v] = x
  static, dynamic = 0, jnp.float32(0)
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    f = _eqn_static(eqn, memo)
    sub = None if eqn.primitive.name in _BOUND_AS_IS else _sub_jaxpr(eqn)
    if f is not None and sub is None:
      outs = eqn.primitive.bind(*invals, **eqn.params)
      static += f
    elif f is not None:   # a call (jit, checkpoint, custom_jvp/vjp): run its body inline
      outs = jax.core.eval_jaxpr(sub[0], sub[1], *invals)
      static += f
    else:
      outs, s, d = _run_dynamic(eqn, invals, memo)
      static += s
      dynamic = dynamic + d
    if not eqn.primitive.multiple_results:
      outs = [outs]
    for v, x in zip(eqn.outvars, outs):
      env[v] = x
  return [read(v) for v in jaxpr.outvars], static, dynamic


def _run_dynamic(eqn, invals, memo):
  """An equation with a ``while`` loop inside: ``(outputs, static FLOPs, traced FLOPs)``."""
  name, p = eqn.primitive.name, eqn.params
  if name == "while":
    cj, bj = p["cond_jaxpr"], p["body_jaxpr"]
    cconsts, bconsts = invals[:p["cond_nconsts"]], invals[p["cond_nconsts"]:
                                                          p["cond_nconsts"] + p["body_nconsts"]]
    init = invals[p["cond_nconsts"] + p["body_nconsts"]:]
    body_static = _static(bj.jaxpr, memo)
    cond_static = _static(cj.jaxpr, memo) or 0

    def cond(c):
      return jax.core.eval_jaxpr(cj.jaxpr, cj.consts, *cconsts, *c[0])[0]

    def body(c):
      carry, acc = c
      if body_static is not None:
        return jax.core.eval_jaxpr(bj.jaxpr, bj.consts, *bconsts, *carry), acc + 1.0
      outs, s, d = _run(bj.jaxpr, bj.consts, list(bconsts) + list(carry), memo)
      return outs, acc + (d + s)

    outs, acc = lax.while_loop(cond, body, (list(init), jnp.float32(0)))
    if body_static is not None:   # acc counted iterations
      return outs, 0, acc * float(body_static + cond_static)
    return outs, 0, acc
  if name == "scan":
    nc, ncarry = p["num_consts"], p["num_carry"]
    body = p["jaxpr"]
    consts, init, xs = invals[:nc], invals[nc:nc + ncarry], invals[nc + ncarry:]

    def step(c, x):
      carry, acc = c
      outs, s, d = _run(body.jaxpr, body.consts, list(consts) + list(carry) + list(x), memo)
      return (outs[:ncarry], acc + (d + s)), outs[ncarry:]

    (carry, acc), ys = lax.scan(step, (list(init), jnp.float32(0)), list(xs),
                                length=p["length"], reverse=p["reverse"])
    return list(carry) + list(ys), 0, acc
  if name == "cond":
    index, ops = invals[0], invals[1:]

    def branch(b):
      def run(*ops):
        outs, s, d = _run(b.jaxpr, b.consts, ops, memo)
        return outs, d + s
      return run

    outs, acc = lax.switch(index, [branch(b) for b in p["branches"]], *ops)
    return outs, 0, acc
  sub = _sub_jaxpr(eqn)
  if sub is None:
    raise NotImplementedError(f"flops: cannot count the loops inside {name!r}")
  jaxpr, consts = sub
  return _run(jaxpr, consts, invals, memo)


def flops(f, *args, **kwargs) -> int:
  """The FLOPs of ``f(*args, **kwargs)`` as it runs (see the module docstring).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxfuse.metrics import flops
    >>> x = jnp.ones((64, 32))
    >>> flops(lambda x: x @ x.T, x)                 # 2 · 64 · 64 · 32
    262144
    >>> loop = lambda x, n: jax.lax.fori_loop(0, n, lambda i, c: c @ x.T @ x, x)
    >>> flops(loop, x, jnp.int32(3))   # 3 iterations of 2 matmuls, of i + 1 and of i < n
    1572870
  """
  leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
  # Python scalars stay static: they may be loop bounds.
  static_pos = [i for i, x in enumerate(leaves) if not isinstance(x, jax.Array | jnp.ndarray)
                and not hasattr(x, "dtype")]

  def flat_f(*arrays):
    full = list(leaves)
    it = iter(arrays)
    for i in range(len(full)):
      if i not in static_pos:
        full[i] = next(it)
    a, k = jax.tree_util.tree_unflatten(tree, full)
    return f(*a, **k)

  arrays = [x for i, x in enumerate(leaves) if i not in static_pos]
  closed = jax.make_jaxpr(flat_f)(*arrays)
  memo: dict = {}
  static = _static(closed.jaxpr, memo)
  if static is not None:
    return static

  static_part = []

  def counted(*arrays):
    _, s, d = _run(closed.jaxpr, closed.consts, arrays, memo)
    static_part.append(s)
    return d

  dynamic = float(jax.jit(counted)(*arrays))
  return static_part[0] + int(round(dynamic))
