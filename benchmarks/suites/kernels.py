"""Registers, spills, shared memory and occupancy of every GPU kernel, compiled on this machine.

Each case is one kernel in one configuration that ships: the forward and backward Pallas
kernels that the ops of ``jaxfuse.ops`` launch with ``implementation="pallas"`` (traced as on
a GPU, so that tiles, warps and stages are those ``implementation=None`` and the heuristic
tables choose there), and the ``@triton.jit`` kernels of ``jaxfuse.kernels.triton`` with the
constants their jax-triton wrappers pass. Every kernel is compiled for ``--arch`` (``sm_90a``
by default, or ``sm_80``) by :mod:`jaxfuse.metrics.kernel_resources`: Pallas kernels from the
Triton module their lowering writes, Triton kernels from their source, both through the
``triton`` package and its bundled ``ptxas``. No GPU is needed and nothing runs.

Configurations: float32, bfloat16 and float16; attention (batch 2, 1024 tokens, 8 heads) at
head dims 40, 64, 128 and 256, causal or not, with or without a float32 ``[1, 8, T, T]``
bias (the bias adds the dbias kernel); norms over 4096 rows of widths up to the largest each
implementation takes (Pallas 65536, Triton 32768); softmax rows up to 32768; the elementwise
kernels over 16M elements or 4096 x 4096; the linear and cross-entropy kernels at 4096 tokens.
``--quick`` keeps one or two configurations per kernel.

Fields: ``regs`` (registers per thread), ``spill_bytes`` (spill stores + loads per thread),
``stack_bytes`` (stack frame per thread), ``smem_bytes`` (dynamic + static shared memory per
block), ``occupancy`` (resident blocks per SM on the arch's GPU: H100 for ``sm_90a``, A100
for ``sm_80``). ``note`` says whether the kernel is within the arch's limits (227 KiB of
shared memory per block on sm_90a, 255 registers per thread, 64K registers per block) and what
limits its blocks per SM. A kernel that does not compile keeps null figures and says why.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from benchmarks.records import Record
from jaxfuse import ops
from jaxfuse.metrics import kernel_resources as kr

SUITE = "kernels"
DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_SHAPE = dict(batch=2, tokens=1024, heads=8)
ATTENTION_HEAD_DIMS = (40, 64, 128, 256)
ROWS = 4096
PALLAS_NORM_WIDTHS = (1024, 4096, 16384, 65536)     # 65536: kernels.pallas.normalization
TRITON_NORM_WIDTHS = (1024, 4096, 16384, 32768)     # 32768: kernels.triton.normalization
SOFTMAX_WIDTHS = (1024, 32768)
ELEMENTS = 1 << 24
FEATURES = 4096
VOCAB = 32000
MODEL = 1024

_REGS = "ptxas -v of the cubin the triton package compiles for {arch} ({how})"
_SMEM = ("Triton's dynamic shared memory (compiled metadata `shared`) + ptxas's static smem, "
         "for {arch} ({how})")
_OCCUPANCY = ("modelled: resident blocks per SM from registers (allocated per warp in units of "
              "256), shared memory (+1 KiB reserved per block) and threads, {device} limits "
              "(jaxfuse.metrics.kernel_resources.occupancy)")
_HOW = {"pallas": "from the Triton module of the CUDA lowering",
        "triton": "from the @triton.jit source with the jax-triton wrapper's constants"}


@dataclasses.dataclass(frozen=True)
class Config:
  """One configuration of one op: the function whose kernels are compiled.

  Attributes:
    family: what the headline groups by (``attention``, ``norm``, ...).
    label: the configuration in the case name (``d=128 causal``).
    dtype: the inputs' dtype.
    kind: ``"pallas"`` (``build`` gives a function and its arguments, lowered for CUDA) or
      ``"triton"`` (``build`` gives jax-triton wrappers and their arguments).
    build: returns ``(f, args)`` for Pallas, a list of ``(wrapper, args, kwargs)`` for Triton.
    blocks: kernel name -> its tile, for the case name (None where it says nothing more).
  """

  family: str
  label: str
  dtype: str
  kind: str
  build: Callable
  blocks: Callable[[str], str | None] = lambda name: None


def _spec(shape, dtype) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def _fwd_bwd(loss: Callable, n_diff: int) -> Callable:
  """A function that runs the primal (the forward kernels without residuals) and the gradient
  of ``loss`` with respect to its first ``n_diff`` arguments (the forward kernels that keep
  residuals, then the backward kernels)."""
  def f(*args):
    value = loss(*args)
    grads = jax.grad(lambda *d: jnp.sum(loss(*d, *args[n_diff:]).astype(jnp.float32)),
                     argnums=tuple(range(n_diff)))(*args[:n_diff])
    return value, grads
  return f


def _first(out):
  return out[0] if isinstance(out, tuple) else out


# Pallas configurations ---------------------------------------------------------------------------


def _attention(dtype: str, d: int, causal: bool, bias: bool) -> Config:
  b, t, h = ATTENTION_SHAPE["batch"], ATTENTION_SHAPE["tokens"], ATTENTION_SHAPE["heads"]
  q = _spec((b, t, h, d), dtype)

  def build():
    def loss(q, k, v, *bias_arg):
      return ops.attention(q, k, v, causal=causal, bias=bias_arg[0] if bias_arg else None,
                           implementation="pallas")
    args = (q, q, q) + ((_spec((1, h, t, t), "float32"),) if bias else ())
    return _fwd_bwd(loss, len(args)), args

  def blocks(name):
    from jaxfuse.ops.flash_attention import tuning

    sizes = tuning.block_sizes_for(q, q, causal=causal, has_bias=bias)
    if name.startswith("attention_fwd"):
      return f"block={sizes.block_q}x{sizes.block_k}"
    if name in ("attention_bwd_dq", "attention_bwd_dbias"):
      return f"block={sizes.block_q_dq}x{sizes.block_k_dq}"
    if name == "attention_bwd_dkdv":
      return f"block={sizes.block_q_dkdv}x{sizes.block_k_dkdv}"
    return None

  label = f"d={d}" + (" causal" if causal else "") + (" bias" if bias else "")
  return Config("attention", label, dtype, "pallas", build, blocks)


def _norm(op_name: str, dtype: str, width: int) -> Config:
  op = getattr(ops, op_name)
  x = _spec((ROWS, width), dtype)
  w = _spec((width,), dtype)
  residual = op_name.startswith("add_")
  centered = "layer" in op_name

  def build():
    def loss(x, *rest):
      rest = list(rest)
      res = rest.pop(0) if residual else None
      scale = rest.pop(0)
      bias = rest.pop(0) if centered else None
      args = (x, res) if residual else (x,)
      kwargs = {"bias": bias} if centered else {}
      return _first(op(*args, scale, implementation="pallas", **kwargs))
    args = (x,) + ((x,) if residual else ()) + (w,) + ((w,) if centered else ())
    return _fwd_bwd(loss, len(args)), args

  return Config("norm", f"{op_name} H={width} rows={ROWS}", dtype, "pallas", build)


def _softmax(dtype: str, width: int, masked: bool) -> Config:
  x = _spec((ROWS, width), dtype)

  def build():
    if masked:
      return _fwd_bwd(lambda x, m: ops.softmax(x, mask=m, implementation="pallas"), 1), (
          x, _spec((ROWS, width), "bool"))
    return _fwd_bwd(lambda x: ops.softmax(x, implementation="pallas"), 1), (x,)

  return Config("softmax", f"softmax n={width} rows={ROWS}" + (" mask" if masked else ""),
                dtype, "pallas", build)


def _elementwise(name: str, dtype: str) -> Config:
  flat = _spec((ELEMENTS,), dtype)
  grid = _spec((ROWS, FEATURES), dtype)
  vector = _spec((FEATURES,), dtype)
  calls = {
      "add_act": (lambda a, b: ops.add_act(a, b, "gelu", implementation="pallas"), (flat, flat),
                  f"add_act[gelu] n={ELEMENTS}"),
      "add_act_unfused": (lambda a, b: ops.add_act_unfused(a, b, "gelu", implementation="pallas"),
                          (flat, flat), f"add_act_unfused[gelu] n={ELEMENTS}"),
      "relu": (lambda x: ops.relu(x, implementation="pallas"), (flat,), f"relu n={ELEMENTS}"),
      "bias_act": (lambda x, b: ops.bias_act(x, b, "gelu", implementation="pallas"),
                   (grid, vector), f"bias_act[gelu] {ROWS}x{FEATURES}"),
      "glu": (lambda a, b: ops.glu(a, b, "silu", implementation="pallas"), (grid, grid),
              f"glu[silu] {ROWS}x{FEATURES}"),
  }
  loss, args, label = calls[name]
  return Config("elementwise", label, dtype, "pallas",
                lambda: (_fwd_bwd(loss, len(args)), args))


def _linear(dtype: str) -> Config:
  x = _spec((ROWS, MODEL), dtype)
  w = _spec((FEATURES, MODEL), dtype)
  b = _spec((FEATURES,), dtype)
  loss = lambda x, w, b: ops.recompute_linear(x, w, b, implementation="pallas")  # noqa: E731
  return Config("linear", f"recompute_linear {ROWS}x{MODEL}->{FEATURES}", dtype, "pallas",
                lambda: (_fwd_bwd(loss, 3), (x, w, b)))


def _cross_entropy(dtype: str) -> Config:
  h = _spec((ROWS, MODEL), dtype)
  w = _spec((VOCAB, MODEL), dtype)
  labels = _spec((ROWS,), "int32")
  loss = lambda h, w, y: ops.linear_cross_entropy(h, w, y, implementation="pallas")  # noqa: E731
  return Config("xent", f"linear_cross_entropy N={ROWS} D={MODEL} V={VOCAB}", dtype, "pallas",
                lambda: (_fwd_bwd(loss, 2), (h, w, labels)))


# Triton configurations ---------------------------------------------------------------------------


def _triton_elementwise(dtype: str) -> Config:
  from jaxfuse.kernels.triton import elementwise as tk

  flat = _spec((ELEMENTS,), dtype)
  return Config("triton", f"add_act[gelu] n={ELEMENTS}", dtype, "triton", lambda: [
      (tk.add_act_forward, (flat, flat), {"act": "gelu"}),
      (tk.add_act_backward, (flat, flat, flat), {"act": "gelu"})])


def _triton_glu(dtype: str) -> Config:
  from jaxfuse.kernels.triton import gated_linear as tk

  half = _spec((ROWS, FEATURES), dtype)
  packed = _spec((ROWS, 2 * FEATURES), dtype)
  return Config("triton", f"glu[silu] {ROWS}x{FEATURES}", dtype, "triton", lambda: [
      (tk.glu_forward, (half, half), {"act": "silu"}),
      (tk.glu_backward, (half, half, half), {"act": "silu"}),
      (functools.partial(tk.glu_backward, b=None), (packed, half), {"act": "silu"})])


def _triton_rms_norm(dtype: str, width: int) -> Config:
  from jaxfuse.kernels.triton import normalization as tk

  x = _spec((ROWS, width), dtype)
  w = _spec((width,), dtype)
  rstd = _spec((ROWS, 1), "float32")
  return Config("triton", f"rms_norm H={width} rows={ROWS}", dtype, "triton", lambda: [
      (tk.rms_norm_forward, (x, w), {"eps": 1e-6}),
      (tk.rms_norm_backward, (x, x, w, rstd), {})])


# The configurations ------------------------------------------------------------------------------


def configs(quick: bool = False) -> list[Config]:
  """Every configuration the suite compiles (``quick``: one or two per kernel)."""
  out: list[Config] = []
  if quick:
    out += [_attention("float16", 128, True, False), _attention("bfloat16", 64, False, True),
            _attention("float32", 64, True, False)]
    out += [_norm("rms_norm", "bfloat16", 4096), _norm("add_layer_norm", "bfloat16", 65536),
            _softmax("bfloat16", 32768, True)]
    out += [_elementwise(name, "bfloat16")
            for name in ("add_act", "add_act_unfused", "relu", "bias_act", "glu")]
    out += [_linear("bfloat16"), _cross_entropy("bfloat16")]
    out += [_triton_elementwise("bfloat16"), _triton_glu("bfloat16"),
            _triton_rms_norm("bfloat16", 32768)]
    return out
  for dtype in DTYPES:
    for d in ATTENTION_HEAD_DIMS:
      for causal in (True, False):
        for bias in (False, True):
          out.append(_attention(dtype, d, causal, bias))
  for dtype in DTYPES:
    for op_name in ("rms_norm", "layer_norm", "add_rms_norm", "add_layer_norm"):
      out += [_norm(op_name, dtype, width) for width in PALLAS_NORM_WIDTHS]
    out += [_softmax(dtype, width, masked) for width in SOFTMAX_WIDTHS for masked in (False, True)]
    out += [_elementwise(name, dtype)
            for name in ("add_act", "add_act_unfused", "relu", "bias_act", "glu")]
    out += [_linear(dtype), _cross_entropy(dtype)]
    out += [_triton_elementwise(dtype), _triton_glu(dtype)]
    out += [_triton_rms_norm(dtype, width) for width in TRITON_NORM_WIDTHS]
  return out


def sources(config: Config) -> list[kr.KernelSource]:
  """The kernels of one configuration, as :mod:`jaxfuse.metrics.kernel_resources` takes them."""
  if config.kind == "pallas":
    f, args = config.build()
    return kr.pallas_kernels(f, *args)
  found: list[kr.KernelSource] = []
  for wrapper, args, kwargs in config.build():
    found += kr.triton_kernels(wrapper, *args, **kwargs)
  return found


def case_name(config: Config, source: kr.KernelSource) -> str:
  block = config.blocks(source.name)
  parts = [source.name, config.label] + ([block] if block else [])
  return " ".join(parts + [f"warps={source.num_warps}", f"stages={source.num_stages}"])


def record(config: Config, source: kr.KernelSource, resources: kr.KernelResources | None,
           arch: str, platform: str, error: str | None = None) -> Record:
  """The record of one kernel: its figures and their sources, or null figures and why."""
  r = Record(suite=SUITE, case=case_name(config, source), impl=f"jaxfuse-{config.kind}",
             platform=platform, dtype=config.dtype)
  target = kr.arch(arch)
  how = _HOW[config.kind]
  r.set("arch", target.name, f"compile target ({target.device}-class)")
  if resources is None:
    r.add_note(f"does not compile: {error}")
    return r
  regs = _REGS.format(arch=target.name, how=how)
  r.set("regs", resources.registers, regs)
  r.set("spill_bytes", resources.spill_bytes, regs + ": spill stores + spill loads per thread")
  r.set("stack_bytes", resources.stack_bytes, regs + ": stack frame per thread")
  r.set("smem_bytes", resources.smem_bytes, _SMEM.format(arch=target.name, how=how))
  r.set("occupancy", resources.blocks_per_sm, _OCCUPANCY.format(device=target.device))
  r.add_note("within limits" if resources.within_limits else "; ".join(resources.problems))
  r.add_note(f"{resources.blocks_per_sm} blocks/SM by {resources.limited_by}")
  if resources.launches > 1:
    r.add_note(f"{resources.launches} launches")
  return r


def measure(config: Config, arch: str, platform: str) -> list[Record]:
  """The records of one configuration's kernels (Triton's cache in a temporary directory)."""
  out = []
  with kr.triton_cache():
    for source in sources(config):
      try:
        resources, error = kr.compile_kernel(source, arch), None
      except RuntimeError as e:
        resources, error = None, str(e).removeprefix("kernel_resources: ")[:300]
      out.append(record(config, source, resources, arch, platform, error))
  return out


def run(ctx) -> list[Record]:
  arch = getattr(ctx, "arch", None) or kr.DEFAULT_ARCH
  missing = kr.missing_toolchain(arch)
  if missing:
    raise RuntimeError(f"the kernels suite needs {missing}")
  records: list[Record] = []
  seen: set[tuple[str, str, str]] = set()
  for config in configs(ctx.quick):
    ctx.step(f"{config.family}: {config.label} {config.dtype}")
    for r in measure(config, arch, ctx.platform):
      key = (r.case, r.impl, r.dtype)
      if key not in seen:  # a kernel shared by two configurations is listed once
        seen.add(key)
        records.append(r)
  return records


# The headline ------------------------------------------------------------------------------------

_FAMILIES = (("attention_", "attention"), ("linear_xent", "xent"), ("linear_", "linear"),
             ("softmax", "softmax"))


def family(r: Record) -> str:
  """The kernel family of a record: attention, norm, softmax, linear, xent, elementwise or
  triton."""
  if r.impl == "jaxfuse-triton":
    return "triton"
  name = r.case.split(" ", 1)[0]
  for prefix, fam in _FAMILIES:
    if name.startswith(prefix):
      return fam
  return "norm" if "norm" in name else "elementwise"


def _badness(r: Record) -> tuple:
  """Kernels that do not compile first, then spills, registers, and low occupancy."""
  if r.regs is None:
    return (1, 0, 0, 0)
  return (0, r.spill_bytes or 0, r.regs, -(r.occupancy or 0))


def headline(records: Sequence[Record]) -> list[Record]:
  """The worst kernel of each family: one that does not compile, else the one that spills
  most, then the one with the most registers."""
  worst: dict[str, Record] = {}
  for r in records:
    fam = family(r)
    if fam not in worst or _badness(r) > _badness(worst[fam]):
      worst[fam] = r
  return list(worst.values())
