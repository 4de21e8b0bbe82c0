"""The seed's two examples: fused ``fn(a + b)`` and SimpleNN's three recomputation layouts.

add_act cases (``add_act[fn] n=N fwd`` and ``... fwd+bwd``), one row per implementation:

- ``jax-unfused``: the seed's two kernels as two XLA executables (add, then fn; the backward is
  a third), so ``a + b`` round-trips through memory on any platform. The timing baseline.
- ``jaxfuse-xla``: one jit of ``add_act``; ``jaxfuse-unfused``: the Pallas add kernel, then the
  Pallas fn kernel; ``jaxfuse-pallas``: the fused Pallas kernel; ``jaxfuse-triton``: the fused
  Triton kernel. Kernel rows are timed on GPUs only; on CPU their errors come from interpret
  mode (Triton's interpreter for the Triton row) and their bytes from the block specs.
- ``torch-eager`` and ``torch-compile``.

SimpleNN cases (``simple_nn recompute=none|fc1|block B=.. in->hidden->out``): one training step
(forward, backward, SGD update) of jaxfuse's NNX model, jit-compiled, against the torch twin
(the seed's RecomputationLayer for fc1, torch.utils.checkpoint for block), same weights.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from benchmarks.records import Record, set_ratios
from jaxfuse import interop, metrics, ops
from jaxfuse.ops import activations, dispatch

SUITE = "seed"
REFERENCE = "torch-fp64"


# add_act -----------------------------------------------------------------------------------------


def _torch_act(name):
  import torch
  import torch.nn.functional as F

  return {"relu": F.relu, "gelu": F.gelu, "silu": F.silu, "tanh": torch.tanh,
          "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}[name]


def _torch_add_act(a, b, g, act, with_grad):
  """torch eager: add, then fn (two kernels), and autograd's backward."""
  import torch

  fn = _torch_act(act)
  if not with_grad:
    with torch.no_grad():
      return (fn(a + b),)
  a_, b_ = a.detach().requires_grad_(), b.detach().requires_grad_()
  out = fn(a_ + b_)
  out.backward(g)
  return out, a_.grad, b_.grad


def _interpret_pallas(f, *args):
  with dispatch.pallas_interpret():
    return jax.jit(f)(*args)


def _triton_interpreted(a, b, g, act, with_grad):
  """The Triton kernels' bodies in Triton's interpreter, on torch CPU tensors."""
  os.environ["TRITON_INTERPRET"] = "1"
  import torch

  from jaxfuse.kernels.triton import elementwise as tk

  n = a.numel()
  # The interpreter runs each program in numpy: use big blocks to keep it quick. It truncates
  # float32 -> bfloat16 stores, so outputs are stored in float32 and rounded as a GPU would.
  block = 1 << 16
  flat = [t.reshape(-1) for t in (a, b, g)]
  out = torch.empty(n, dtype=torch.float32)
  tk.add_act_fwd_kernel[tk.grid_for(n, block)](flat[0], flat[1], out, N=n, BLOCK=block, ACT=act)
  results = [out.to(a.dtype).reshape(a.shape)]
  if with_grad:
    grad = torch.empty(n, dtype=torch.float32)
    tk.add_act_bwd_kernel[tk.grid_for(n, block)](*flat, grad, N=n, BLOCK=block, ACT=act)
    grad = grad.to(a.dtype).reshape(a.shape)
    results += [grad, grad]
  return results


def _add_act_case(ctx, act: str, n: int, dtype, with_grad: bool) -> list[Record]:
  import torch

  ctx.step(f"add_act[{act}] n={n} {'fwd+bwd' if with_grad else 'fwd'}")
  case = f"add_act[{act}] n={n} {'fwd+bwd' if with_grad else 'fwd'}"
  dtype = jnp.dtype(dtype)
  ka, kb, kg = jax.random.split(jax.random.key(0), 3)
  a = jax.random.normal(ka, (n,), dtype)
  b = jax.random.normal(kb, (n,), dtype)
  g = jax.random.normal(kg, (n,), dtype)
  ta, tb, tg = (torch.from_numpy(np.array(x.astype(jnp.float32))).to(
      harness_torch_dtype(dtype)) for x in (a, b, g))
  reference = _torch_add_act(*(t.double() for t in (ta, tb, tg)), act, with_grad)

  fn = activations.get(act)
  cd = jnp.promote_types(dtype, jnp.float32)
  add_jit = jax.jit(lambda a, b: a + b)
  act_jit = jax.jit(lambda c: fn(c.astype(cd)).astype(c.dtype))
  act_bwd_jit = jax.jit(lambda c, g: jax.vjp(fn, c.astype(cd))[1](g.astype(cd))[0].astype(c.dtype))

  def jax_unfused():
    c = add_jit(a, b)
    out = act_jit(c)
    if not with_grad:
      return (out,)
    dc = act_bwd_jit(c, g)
    return out, dc, dc

  def jaxfuse(op, impl):
    def call(a, b, g):
      if not with_grad:
        return (op(a, b, act, implementation=impl),)
      out, vjp = jax.vjp(lambda a, b: op(a, b, act, implementation=impl), a, b)
      return (out, *vjp(g))
    return call

  fused_xla = jax.jit(jaxfuse(ops.add_act, "xla"))
  torch_compiled = torch.compile(functools.partial(_torch_add_act, act=act, with_grad=with_grad))

  candidates = {
      "jax-unfused": jax_unfused,
      "jaxfuse-xla": lambda: fused_xla(a, b, g),
      "torch-eager": lambda: _torch_add_act(ta, tb, tg, act, with_grad),
      "torch-compile": lambda: torch_compiled(ta, tb, tg),
  }
  kernel_rows = {"jaxfuse-unfused": (ops.add_act_unfused, "pallas"),
                 "jaxfuse-pallas": (ops.add_act, "pallas"),
                 "jaxfuse-triton": (ops.add_act, "triton")}
  native_kernels = {}
  for name, (op, impl) in kernel_rows.items():
    if ctx.native(impl):
      native_kernels[name] = jax.jit(jaxfuse(op, impl))
      candidates[name] = functools.partial(native_kernels[name], a, b, g)
  times = ctx.time(candidates)

  outputs = {name: call() for name, call in candidates.items()}
  notes = {}
  for name, (op, impl) in kernel_rows.items():
    if name in outputs:
      continue
    if impl == "pallas":
      outputs[name] = _interpret_pallas(jaxfuse(op, impl), a, b, g)
      notes[name] = "CPU: errors from Pallas interpret mode; time needs a GPU"
    elif act in _triton_activations():
      outputs[name] = _triton_interpreted(ta, tb, tg, act, with_grad)
      notes[name] = "CPU: errors from Triton's interpreter; time needs a GPU"

  # Bytes moved: Pallas rows from their block specs, XLA rows from XLA's cost analysis.
  def fwd_or_step(op, impl):
    return lambda a, b, g: jaxfuse(op, impl)(a, b, g)

  bytes_moved = {}
  with dispatch.pallas_interpret():
    for name, (op, impl) in kernel_rows.items():
      if impl == "pallas":
        bytes_moved[name] = metrics.bytes_moved(fwd_or_step(op, impl), a, b, g)
  from jaxfuse.kernels.triton import elementwise as tk_meta  # traffic arithmetic only

  bytes_moved["jaxfuse-triton"] = tk_meta.traffic_bytes(n, dtype.itemsize) + (
      tk_meta.traffic_bytes(n, dtype.itemsize, backward=True) if with_grad else 0)
  bytes_moved["jaxfuse-xla"] = _xla_bytes(jaxfuse(ops.add_act, "xla"), a, b, g)
  unfused_parts = [_xla_bytes(lambda a, b: a + b, a, b),
                   _xla_bytes(lambda c: fn(c.astype(cd)).astype(c.dtype), a)]
  if with_grad:
    unfused_parts.append(_xla_bytes(
        lambda c, g: jax.vjp(fn, c.astype(cd))[1](g.astype(cd))[0].astype(c.dtype), a, g))
  bytes_moved["jax-unfused"] = None if None in unfused_parts else int(sum(unfused_parts))

  residual = {
      "jax-unfused": n * dtype.itemsize,  # c = a + b, kept for fn's backward
      "jaxfuse-xla": metrics.residual_bytes(lambda a, b: ops.add_act(a, b, act), a, b),
      "jaxfuse-unfused": metrics.residual_bytes(lambda a, b: ops.add_act_unfused(a, b, act), a, b),
  }
  residual["jaxfuse-pallas"] = residual["jaxfuse-triton"] = residual["jaxfuse-xla"]
  residual["torch-eager"] = _torch_residual(ta, tb, act)

  records = []
  order = ["jax-unfused", "jaxfuse-xla", "jaxfuse-unfused", "jaxfuse-pallas", "jaxfuse-triton",
           "torch-eager", "torch-compile"]
  for name in order:
    if name not in outputs:
      records.append(Record(SUITE, case, name, ctx.platform, dtype.name,
                            note=f"no Triton kernel for {act}"))
      continue
    out = outputs[name]
    records.append(Record(
        SUITE, case, name, ctx.platform, dtype.name, time_ms=times.get(name),
        residual_bytes=residual.get(name), bytes_moved=bytes_moved.get(name),
        flops=None, peak_bytes=None,
        max_abs_err=harness.max_abs_err(out[:1], reference[:1]),
        max_grad_err=harness.max_abs_err(out[1:], reference[1:]) if with_grad else None,
        reference=REFERENCE, note=notes.get(name)))
  set_ratios(records, "jax-unfused")
  return records


@functools.cache
def _triton_activations():
  try:
    os.environ.setdefault("TRITON_INTERPRET", "1" if not dispatch.on_gpu() else "0")
    from jaxfuse.kernels.triton import elementwise as tk
  except ImportError:
    return ()
  return tk.ACTIVATIONS


def harness_torch_dtype(dtype):
  import torch

  return {"float32": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16}[jnp.dtype(dtype).name]


def _xla_bytes(f, *args):
  value = metrics.xla_cost(f, *args)["bytes_accessed"]
  return None if value is None else int(value)


def _torch_residual(ta, tb, act):
  a_, b_ = ta.detach().requires_grad_(), tb.detach().requires_grad_()
  fn = _torch_act(act)
  return metrics.torch_residual_bytes(lambda: fn(a_ + b_), exclude=[a_, b_])


# SimpleNN ----------------------------------------------------------------------------------------


def _simple_nn_case(ctx, recompute, batch, sizes) -> list[Record]:
  import optax
  import torch
  from flax import nnx

  from jaxfuse.nnx import SimpleNN
  from tests.torch_ref.seed import SimpleNN as TorchSimpleNN

  n_in, n_hidden, n_out = sizes
  label = recompute or "none"
  case = f"simple_nn recompute={label} B={batch} {n_in}->{n_hidden}->{n_out}"
  ctx.step(case)
  kx, ky = jax.random.split(jax.random.key(1))
  x = jax.random.normal(kx, (batch, n_in))
  y = jax.random.normal(ky, (batch, n_out))
  tx, ty = (torch.from_numpy(np.array(v)) for v in (x, y))
  lr = 1e-3

  torch.manual_seed(0)
  torch_model = TorchSimpleNN(n_in, n_hidden, n_out, recompute=recompute)
  with torch.no_grad():
    torch_model.fc1_weight.mul_(n_in ** -0.5)  # the seed's randn init, scaled
  model = SimpleNN(n_in, n_hidden, n_out, recompute=recompute, rngs=nnx.Rngs(0))
  interop.load_torch_state_dict(model, torch_model.state_dict())
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

  def torch_step():
    torch_optimizer.zero_grad(set_to_none=True)
    loss = torch.mean((torch_model(tx) - ty) ** 2)
    loss.backward()
    torch_optimizer.step()
    return loss

  # Errors first, on the shared initial weights: loss and every parameter gradient against the
  # float64 torch model.
  reference_model = TorchSimpleNN(n_in, n_hidden, n_out, recompute=recompute).double()
  reference_model.load_state_dict(torch_model.state_dict())
  ref_loss = torch.mean((reference_model(tx.double()) - ty.double()) ** 2)
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
  t_loss = torch.mean((torch_model(tx) - ty) ** 2)
  t_loss.backward()
  torch_grad_err = harness.max_abs_err([torch_model.get_parameter(k).grad for k in names],
                                       [ref_grads[k] for k in names])

  state = {"params": params, "opt_state": opt_state}

  def jax_step():
    state["params"], state["opt_state"], loss, _ = train_step(state["params"],
                                                              state["opt_state"], x, y)
    return loss

  times = ctx.time({"jaxfuse-xla": jax_step, "torch-eager": torch_step})
  resid = metrics.residual_bytes(loss_fn, params, x, y)
  tx_ = tx.requires_grad_(False)
  torch_resid = metrics.torch_residual_bytes(
      lambda: torch.mean((torch_model(tx_) - ty) ** 2),
      exclude=[tx_, ty, *torch_model.parameters()])
  step_bytes = _xla_bytes(lambda p, s, x, y: train_step(p, s, x, y), params, opt_state, x, y)
  records = [
      Record(SUITE, case, "jaxfuse-xla", ctx.platform, "float32", time_ms=times["jaxfuse-xla"],
             residual_bytes=resid, bytes_moved=step_bytes, peak_bytes=metrics.peak_bytes(),
             max_abs_err=harness.max_abs_err([loss], [ref_loss]), max_grad_err=jax_grad_err,
             reference=REFERENCE,
             note=f"max grad err / max |grad| = {jax_grad_err / scale:.1e}"),
      Record(SUITE, case, "torch-eager", ctx.platform, "float32", time_ms=times["torch-eager"],
             residual_bytes=torch_resid,
             max_abs_err=harness.max_abs_err([t_loss], [ref_loss]), max_grad_err=torch_grad_err,
             reference=REFERENCE,
             note=f"max grad err / max |grad| = {torch_grad_err / scale:.1e}"),
  ]
  set_ratios(records, "torch-eager")
  return records


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
