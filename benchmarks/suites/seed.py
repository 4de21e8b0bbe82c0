"""The seed's two examples: fused ``fn(a + b)`` and SimpleNN's three recomputation layouts.

add_act cases (``add_act[fn] n=N fwd`` and ``... fwd+bwd``), one row per implementation:

- ``jax-unfused``: the seed's two kernels as two XLA executables (add, then fn; the backward is
  a third), so ``a + b`` round-trips through memory on any platform. Its residual is measured on
  ``add_act_unfused(implementation="xla")``, the same add-then-fn structure.
- ``jax-jit``: one ``jax.jit`` of plain ``fn(a + b)`` (and of its ``jax.vjp`` for fwd+bwd),
  which XLA fuses by itself: the comparison a JAX user makes.
- ``jaxfuse-xla``: one jit of ``add_act``; ``jaxfuse-unfused``: the Pallas add kernel, then the
  Pallas fn kernel; ``jaxfuse-pallas``: the fused Pallas kernel; ``jaxfuse-triton``: the fused
  Triton kernel. Kernel rows are timed on GPUs only; on CPU their errors come from interpret
  mode (Triton's interpreter for the Triton row) and their residuals from tracing the Pallas
  implementation. The Triton implementation is traced through jax-triton, which needs a GPU:
  elsewhere its residual is null. The Triton kernels' bytes are counted while Triton's
  interpreter runs them (on CPU).
- ``torch-eager`` and ``torch-compile`` (``torch.compile`` of ``fn(a + b)``, autograd's
  backward through it).

SimpleNN cases (``simple_nn recompute=none|fc1|block B=.. in->hidden->out``): one training step
(forward, backward, SGD update) of jaxfuse's NNX model, jit-compiled, against the torch twin
(the seed's RecomputationLayer for fc1, torch.utils.checkpoint for block), same weights.

``ratio`` is a row's median time over the fastest of ``jax-jit``, ``torch-eager`` and
``torch-compile`` in the same case (``ratio_to`` names it). Each record's ``sources`` says how
each of its figures was produced.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp

import jaxfuse
from benchmarks import harness
from benchmarks import records as rec
from benchmarks.records import Record
from jaxfuse import interop, metrics, ops
from jaxfuse.ops import activations, base, dispatch

SUITE = "seed"
REFERENCE = "torch-fp64"
PEERS = ("jax-jit", "torch-eager", "torch-compile")
ADD_ACT = base.REGISTRY["add_act"]
# The unfused chain of kernels (add_act_unfused: the add kernel, then the fn kernel), and the
# implementation whose kernels it runs.
UNFUSED, UNFUSED_IMPLEMENTATION = "jaxfuse-unfused", "pallas"
# The rows: jaxfuse's are its XLA implementation, the unfused chain, then add_act's kernels of
# each kind it has (its registry entry).
ORDER = ("jax-unfused", "jax-jit", "jaxfuse-xla", UNFUSED,
         *(harness.jaxfuse_row(impl) for impl in ADD_ACT.kinds), "torch-eager", "torch-compile")
# The Triton kernels' loads and stores are counted in Triton's interpreter with this block: the
# kernels mask every element once, so the count does not depend on it, and big blocks keep the
# interpreter quick.
TRITON_COUNT_BLOCK = 1 << 16
TRITON_BYTES_SOURCE = ("kernel loads/stores counted in Triton's interpreter "
                       "(jaxfuse.metrics.triton_traffic)")
# What a JAX user writes for each activation.
JAX_ACTIVATIONS = {"relu": jax.nn.relu, "gelu": functools.partial(jax.nn.gelu, approximate=False),
                   "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
                   "silu": jax.nn.silu, "tanh": jnp.tanh}


# add_act -----------------------------------------------------------------------------------------


def _torch_act(name):
  import torch
  import torch.nn.functional as F  # noqa: N812

  return {"relu": F.relu, "gelu": F.gelu, "silu": F.silu, "tanh": torch.tanh,
          "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}[name]


def _triton_interpreted(a, b, g, act, with_grad):
  """The Triton kernels' bodies in Triton's interpreter, on torch CPU tensors."""
  os.environ["TRITON_INTERPRET"] = "1"
  import torch

  tk = ADD_ACT.module("triton")   # the op's Triton kernels (its registry entry)

  n = a.numel()
  # The interpreter runs each program in numpy: use big blocks to keep it quick. It truncates
  # float32 -> bfloat16 stores, so outputs are stored in float32 and rounded as a GPU would.
  block = 1 << 16
  flat = [t.reshape(-1) for t in (a, b, g)]
  out = torch.empty(n, dtype=torch.float32, device=a.device)
  tk.add_act_fwd_kernel[tk.grid_for(n, block)](flat[0], flat[1], out, N=n, BLOCK=block, ACT=act)
  out = out.to(a.dtype).reshape(a.shape)
  if not with_grad:
    return out, []
  grad = torch.empty(n, dtype=torch.float32, device=a.device)
  tk.add_act_bwd_kernel[tk.grid_for(n, block)](*flat, grad, N=n, BLOCK=block, ACT=act)
  grad = grad.to(a.dtype).reshape(a.shape)
  return out, [grad, grad]


def _triton_counted_bytes(a, b, g, act, with_grad) -> int | None:
  """Bytes the Triton kernels load and store, counted while Triton's interpreter runs them
  (``jaxfuse.metrics.triton_traffic``); None where the kernels are compiled instead.

  Outputs are in the inputs' dtype, as on a GPU (the count does not depend on the values).
  """
  if os.environ.get("TRITON_INTERPRET") != "1":
    return None
  import torch

  tk = ADD_ACT.module("triton")   # the op's Triton kernels (its registry entry)
  from jaxfuse.metrics import triton_traffic

  n = a.numel()
  flat = [t.reshape(-1).cpu() for t in (a, b, g)]
  grid = tk.grid_for(n, TRITON_COUNT_BLOCK)
  with triton_traffic.counting() as counted:
    out = torch.empty(n, dtype=a.dtype)
    tk.add_act_fwd_kernel[grid](flat[0], flat[1], out, N=n, BLOCK=TRITON_COUNT_BLOCK, ACT=act)
    if with_grad:
      grad = torch.empty(n, dtype=a.dtype)
      tk.add_act_bwd_kernel[grid](*flat, grad, N=n, BLOCK=TRITON_COUNT_BLOCK, ACT=act)
  return counted.bytes if counted.launches else None


@functools.cache
def _takes(implementation: str, act: str) -> bool:
  """Whether the elementwise kernels of ``implementation`` take ``act`` (their module's
  ``refuses``; add_act_unfused's kernels are the same module's); False where they do not
  import here."""
  if dispatch.KINDS[implementation].package is None:  # XLA: the op's own formulas
    return True
  os.environ.setdefault("TRITON_INTERPRET", "1" if not dispatch.on_gpu() else "0")
  try:
    return ADD_ACT.refuses(implementation, {"activation": act}) is None
  except ImportError:
    return False


def _jaxfuse_fns(act: str) -> dict[str, Callable]:
  """jaxfuse's rows: each implementation of add_act, and the unfused chain."""
  fns = harness.jaxfuse_rows("add_act", functools.partial(ops.add_act, activation=act))
  fns[UNFUSED] = functools.partial(ops.add_act_unfused, activation=act,
                                   implementation=UNFUSED_IMPLEMENTATION)
  return fns


def _kind(name: str) -> dispatch.Kind | None:
  """The kind of implementation of a row (None for the baselines and torch)."""
  return dispatch.KINDS[UNFUSED_IMPLEMENTATION] if name == UNFUSED else harness.kind(name)


def _native(ctx, name: str) -> bool:
  """Whether a row compiles here (the baselines and torch do)."""
  kind = _kind(name)
  return kind is None or ctx.native(kind.name)


def _unfused_parts(act, dtype, with_grad):
  """The jax-unfused row's executables (add; fn; fn's backward) and one call of the chain."""
  fn = activations.get(act)
  cd = jnp.promote_types(dtype, jnp.float32)
  parts = {
      "add": lambda a, b: a + b,
      "act": lambda c: fn(c.astype(cd)).astype(c.dtype),
      "act_bwd": lambda c, g: jax.vjp(fn, c.astype(cd))[1](g.astype(cd))[0].astype(c.dtype),
  }
  if not with_grad:
    del parts["act_bwd"]
  compiled = {name: jax.jit(part) for name, part in parts.items()}

  def chain(args, cts=None):
    c = compiled["add"](*args)
    out = compiled["act"](c)
    if not with_grad:
      return out, []
    dc = compiled["act_bwd"](c, cts)
    return out, [dc, dc]

  return parts, chain


def _unfused_compiled_figures(record, parts, a, b, g):
  """XLA's figures of the jax-unfused chain: bytes summed over its executables, temp memory
  the largest of them (they run one after another)."""
  part_args = {"add": (a, b), "act": (a,), "act_bwd": (a, g)}
  accessed = [metrics.xla_cost(part, *part_args[name])["bytes_accessed"]
              for name, part in parts.items()]
  temps = [metrics.compiled_memory(part, *part_args[name])["temp_bytes"]
           for name, part in parts.items()]
  executables = " + ".join(parts)
  record.set("xla_bytes_accessed", None if None in accessed else int(sum(accessed)),
             f"{rec.XLA_BYTES_SOURCE}, summed over the executables {executables}")
  record.set("temp_bytes", int(max(temps)),
             f"{rec.TEMP_BYTES_SOURCE}, the largest of the executables {executables}")


def _add_act_case(ctx, act: str, n: int, dtype, with_grad: bool) -> list[Record]:
  import torch

  case = f"add_act[{act}] n={n} {'fwd+bwd' if with_grad else 'fwd'}"
  ctx.step(case)
  dtype = jnp.dtype(dtype)
  ka, kb, kg = jax.random.split(jax.random.key(0), 3)
  a, b, g = (jax.random.normal(k, (n,), dtype) for k in (ka, kb, kg))
  args, cts = (a, b), (g if with_grad else None)
  ta, tb, tg = (harness.to_torch(x) for x in (a, b, g))
  t_args, t_cts = (ta, tb), (tg if with_grad else None)

  torch_fn = _torch_act(act)
  torch_add_act = lambda a, b: torch_fn(a + b)  # noqa: E731
  reference = harness.torch_step(torch_add_act, grad=with_grad)(
      harness.to_float64_cpu(t_args), harness.to_float64_cpu([tg])[0] if with_grad else None)

  jax_fn = JAX_ACTIVATIONS[act]
  fns = {"jax-jit": lambda a, b: jax_fn(a + b), **_jaxfuse_fns(act)}
  steps = {name: harness.jax_step(f, grad=with_grad) for name, f in fns.items()
           if _native(ctx, name) and (_kind(name) is None or _takes(_kind(name).name, act))}
  unfused_parts, unfused_chain = _unfused_parts(act, dtype, with_grad)
  torch_compiled = torch.compile(torch_add_act)
  torch_steps = {"torch-eager": harness.torch_step(torch_add_act, grad=with_grad),
                 "torch-compile": harness.torch_step(torch_compiled, grad=with_grad)}

  candidates = {"jax-unfused": lambda: unfused_chain(args, cts)}
  candidates.update({name: functools.partial(step, args, cts) for name, step in steps.items()})
  candidates.update({name: functools.partial(step, t_args, t_cts)
                     for name, step in torch_steps.items()})
  times = ctx.time(candidates)
  outputs = {name: call() for name, call in candidates.items()}

  error_sources = {name: f"the timed step's own outputs against {REFERENCE}" for name in outputs}
  notes = {}
  for name, f in fns.items():
    if name in outputs:
      continue
    if _kind(name).interpretable:
      with jaxfuse.pallas_interpret():
        outputs[name] = harness.jax_step(f, grad=with_grad)(args, cts)
      error_sources[name] = f"Pallas interpret mode against {REFERENCE}"
      notes[name] = "CPU: errors from Pallas interpret mode; time needs a GPU"
    elif _takes(_kind(name).name, act):  # the Triton kernels, in Triton's interpreter
      outputs[name] = _triton_interpreted(ta, tb, tg, act, with_grad)
      error_sources[name] = f"Triton's interpreter (torch CPU tensors) against {REFERENCE}"
      notes[name] = "CPU: errors from Triton's interpreter; time needs a GPU"

  records = []
  for name in ORDER:
    r = Record(SUITE, case, name, ctx.platform, dtype.name, reference=REFERENCE,
               note=notes.get(name))
    records.append(r)
    if name not in outputs:
      r.reference = None
      r.add_note(f"no Triton kernel for {act}")
      continue
    r.set("time_ms", times.get(name), harness.time_source(times.get(name)))
    harness.set_errors(r, harness.errors(outputs[name], reference), error_sources[name])
    ctx.step(f"{case}: {name} residuals and bytes")
    _residual(ctx, r, act, args, t_args, fns, torch_add_act, torch_compiled)
    if name == "jax-unfused":
      _unfused_compiled_figures(r, unfused_parts, a, b, g)
    elif name in steps:
      harness.record_compiled_figures(r, steps[name], args, cts)
    kind = _kind(name)
    if kind is None or kind.package is None:  # no kernels
      continue
    if kind.interpretable:  # pallas_call kernels: counted from their grid and block specs
      r.set("bytes_moved", harness.step_bytes_moved(fns[name], args, cts, grad=with_grad),
            rec.KERNEL_BYTES_SOURCE)
    else:  # the Triton kernels
      counted = _triton_counted_bytes(ta, tb, tg, act, with_grad)
      r.set("bytes_moved", counted, TRITON_BYTES_SOURCE)
      if counted is None:
        r.add_note("bytes_moved null: counted only where Triton's interpreter runs the kernels")
  harness.ratio_to_fastest(records, PEERS)
  return records


def _residual(ctx, r: Record, act, args, t_args, fns, torch_add_act, torch_compiled) -> None:
  """Measures one row's residual bytes on its own implementation; never copied from a row."""
  name = r.impl
  if name.startswith("torch"):
    fn = torch_add_act if name == "torch-eager" else torch_compiled
    r.set("residual_bytes", harness.torch_residual_bytes(fn, t_args), rec.TORCH_RESIDUAL_SOURCE)
    return
  if name == "jax-unfused":
    f = functools.partial(ops.add_act_unfused, activation=act, implementation="xla")
    r.set("residual_bytes", harness.residual_bytes(f, args),
          f"{rec.JAX_RESIDUAL_SOURCE}, of add_act_unfused(implementation='xla'): the same "
          "add-then-fn structure")
    return
  kind = _kind(name)
  if kind is not None and not harness.runs(kind.name):
    r.add_note("residual_bytes null: the Triton implementation is traced through jax-triton, "
               "which needs a GPU")
    return
  interpreted = not _native(ctx, name)
  with jaxfuse.pallas_interpret(interpreted):  # traced only
    kept = harness.residual_bytes(fns[name], args)
  where = " (traced in Pallas interpret mode)" if interpreted else ""
  r.set("residual_bytes", kept, f"{rec.JAX_RESIDUAL_SOURCE}{where}")


# SimpleNN ----------------------------------------------------------------------------------------


def _simple_nn_case(ctx, recompute, batch, sizes) -> list[Record]:
  import optax
  import torch
  from flax import nnx

  from jaxfuse.nnx import SimpleNN
  from jaxfuse.testing.torch_ref.seed import SimpleNN as TorchSimpleNN

  n_in, n_hidden, n_out = sizes
  label = recompute or "none"
  case = f"simple_nn recompute={label} B={batch} {n_in}->{n_hidden}->{n_out}"
  ctx.step(case)
  kx, ky = jax.random.split(jax.random.key(1))
  x = jax.random.normal(kx, (batch, n_in))
  y = jax.random.normal(ky, (batch, n_out))
  tx, ty = (harness.to_torch(v) for v in (x, y))
  lr = 1e-3

  torch.manual_seed(0)
  torch_model = TorchSimpleNN(n_in, n_hidden, n_out, recompute=recompute)
  with torch.no_grad():
    torch_model.fc1_weight.mul_(n_in ** -0.5)  # the seed's randn init, scaled
  model = SimpleNN(n_in, n_hidden, n_out, recompute=recompute, rngs=nnx.Rngs(0))
  interop.load_torch_state_dict(model, torch_model.state_dict())
  # The float64 reference, on the CPU, before the timed model moves to torch's device.
  reference_model = TorchSimpleNN(n_in, n_hidden, n_out, recompute=recompute).double()
  reference_model.load_state_dict(torch_model.state_dict())
  torch_model.to(tx.device)
  graphdef, params = nnx.split(model, nnx.Param)
  optimizer = optax.sgd(lr)
  opt_state = optimizer.init(params)

  def loss_fn(params, x, y):
    return jnp.mean((nnx.merge(graphdef, params)(x) - y) ** 2)

  @jax.jit
  def train_step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, grads

  torch_optimizer = torch.optim.SGD(torch_model.parameters(), lr=lr)

  def torch_loss():
    return torch.mean((torch_model(tx) - ty) ** 2)

  def torch_step():
    torch_optimizer.zero_grad(set_to_none=True)
    loss = torch_loss()
    loss.backward()
    torch_optimizer.step()
    return loss

  # Errors first, on the shared initial weights: loss and every parameter gradient against the
  # float64 torch model.
  tx64, ty64 = harness.to_float64_cpu((tx, ty))
  ref_loss = torch.mean((reference_model(tx64) - ty64) ** 2)
  ref_loss.backward()
  ref_grads = {k: p.grad for k, p in reference_model.named_parameters()}
  _, _, loss, grads = train_step(params, opt_state, x, y)
  nnx.update(model, grads)
  jax_grads = interop.torch_state_dict(model)
  nnx.update(model, params)
  names = sorted(ref_grads)
  jax_grad_err = harness.max_abs_err([jax_grads[k] for k in names], [ref_grads[k] for k in names])
  scale = max(float(p.abs().max()) for p in ref_grads.values())

  torch_model.zero_grad()
  t_loss = torch_loss()
  t_loss.backward()
  torch_grad_err = harness.max_abs_err([torch_model.get_parameter(k).grad for k in names],
                                       [ref_grads[k] for k in names])

  state = {"params": params, "opt_state": opt_state}

  def jax_step():
    state["params"], state["opt_state"], loss, _ = train_step(state["params"],
                                                              state["opt_state"], x, y)
    return loss

  times = ctx.time({"jaxfuse-xla": jax_step, "torch-eager": torch_step})
  error_source = f"loss and every parameter gradient of one step against {REFERENCE}"
  records = []
  for name, loss_value, grad_err in (("jaxfuse-xla", loss, jax_grad_err),
                                     ("torch-eager", t_loss, torch_grad_err)):
    r = Record(SUITE, case, name, ctx.platform, "float32", reference=REFERENCE,
               note=f"max grad err / max |grad| = {grad_err / scale:.1e}")
    r.set("time_ms", times[name], harness.time_source(times[name]))
    harness.set_errors(r, (harness.max_abs_err([loss_value], [ref_loss]), grad_err),
                       error_source)
    records.append(r)
  jax_row, torch_row = records
  jax_row.set("residual_bytes", metrics.residual_bytes(loss_fn, params, x, y),
              f"{rec.JAX_RESIDUAL_SOURCE}, of the loss over the parameters and the batch")
  ctx.step(f"{case}: compiled figures")
  accessed = metrics.xla_cost(train_step, params, opt_state, x, y)["bytes_accessed"]
  temp = metrics.compiled_memory(train_step, params, opt_state, x, y)["temp_bytes"]
  jax_row.set("xla_bytes_accessed", None if accessed is None else int(accessed),
              f"{rec.XLA_BYTES_SOURCE}, of the whole training step")
  jax_row.set("temp_bytes", temp, f"{rec.TEMP_BYTES_SOURCE}, of the whole training step")
  torch_row.set("residual_bytes", metrics.torch_residual_bytes(
      torch_loss, exclude=[tx, ty, *torch_model.parameters()]), rec.TORCH_RESIDUAL_SOURCE)
  harness.ratio_to_fastest(records, PEERS)
  return records


def headline(records) -> list[Record]:
  """The fused add + gelu, forward + backward in float32, and SimpleNN's three layouts."""
  fused = [r for r in records if r.case.startswith("add_act[gelu]") and
           r.case.endswith("fwd+bwd") and r.dtype == "float32"]
  return fused + [r for r in records if r.case.startswith("simple_nn")]


def run(ctx) -> list[Record]:
  n = 1 << 22 if ctx.quick else 1 << 24
  records = []
  for act, with_grad in (("relu", False), ("gelu", False), ("gelu", True)):
    records += _add_act_case(ctx, act, n, jnp.float32, with_grad)
  records += _add_act_case(ctx, "gelu", n, jnp.bfloat16, True)
  batch, sizes = (1024, (512, 2048, 512)) if ctx.quick else (4096, (1024, 4096, 1024))
  for recompute in (None, "fc1", "block"):
    records += _simple_nn_case(ctx, recompute, batch, sizes)
  return records


__all__ = ["headline", "run"]
