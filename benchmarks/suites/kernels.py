"""Registers, spills, shared memory and occupancy of every GPU kernel, compiled on this machine.

Each case is one kernel in one configuration that ships: the forward and backward kernels
that the ops of ``jaxfuse.ops`` launch with each kernel implementation they have
(``implementation="pallas"``: the Pallas kernels; ``"triton"``: the ``@triton.jit`` kernels of
``jaxfuse.kernels.triton`` with the constants their jax-triton wrappers pass), traced as on a
GPU so that tiles, warps and stages are those the heuristic tables choose there. Every kernel
is compiled for ``--arch`` (``sm_90a`` by default, or ``sm_80``) by
:mod:`jaxfuse.metrics.kernel_resources`, through the ``triton`` package and its bundled
``ptxas``: Pallas kernels from the Triton module their CUDA lowering writes, Triton kernels from
their source. No GPU is needed and nothing runs.

Configurations: float32, bfloat16 and float16; attention (batch 2, 1024 tokens, 8 heads) at
head dims 40, 64, 128 and 256, causal or not, with or without a float32 ``[1, 8, T, T]`` bias
(which adds the dbias kernel); the norms over 4096 rows of widths 1024, 4096, 16384 and the
largest each implementation takes (widths past it are left out); softmax rows of 1024 and
32768, with and without a mask; the elementwise kernels over 16M elements or 4096 x 4096; the
linear and cross-entropy kernels at 4096 tokens; the grouped matmul, the grouped gated unit
and the experts' whole MLP at 4096 tokens over 8 experts, 1024 -> 2816 (-> 1024). ``--quick`` keeps a few configurations per
family. Which kernel implementations each op has, and their modules, come from its registry
entry (``jaxfuse.ops.base.REGISTRY``).

Fields: ``regs`` (registers per thread), ``spill_bytes`` (spill stores + loads per thread),
``stack_bytes`` (stack frame per thread), ``smem_bytes`` (dynamic + static shared memory per
block), ``occupancy`` (resident blocks per SM on the arch's GPU: H100 for ``sm_90a``, A100
for ``sm_80``). ``note`` says whether the kernel is within the arch's limits (227 KiB of
shared memory per block on sm_90a, 255 registers per thread, 64K registers per block), how
much it spills if it does (for a float32 spill :data:`FLOAT32_SPILLS` knows of, why it is left),
and what limits its blocks per SM. A kernel that does not compile keeps null figures and says
why.
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
from jaxfuse.ops import base as op_base
from jaxfuse.ops.flash_attention import tuning

SUITE = "kernels"
DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_SHAPE = {"batch": 2, "tokens": 1024, "heads": 8}
ATTENTION_HEAD_DIMS = (40, 64, 128, 256)
ROWS = 4096
NORM_WIDTHS = (1024, 4096, 16384)    # and the largest each implementation takes
SOFTMAX_WIDTHS = (1024, 32768)
ELEMENTS = 1 << 24
FEATURES = 4096
VOCAB = 32000
MODEL = 1024
EXPERTS, EXPERT_HIDDEN = 8, 2816

_REGS = "ptxas -v of the cubin the triton package compiles for {arch} ({how})"
_SMEM = ("Triton's dynamic shared memory (compiled metadata `shared`) + ptxas's static smem, "
         "for {arch} ({how})")
_OCCUPANCY = ("modelled: resident blocks per SM from registers (allocated per warp in units of "
              "256), shared memory (+1 KiB reserved per block) and threads, {device} limits "
              "(jaxfuse.metrics.kernel_resources.occupancy)")
_HOW = {"pallas": "from the Triton module of the CUDA lowering",
        "triton": "from the @triton.jit source with the constants jax-triton is called with"}


@dataclasses.dataclass(frozen=True)
class Config:
  """One configuration of one op: the function whose kernels are compiled.

  Attributes:
    family: what the headline groups by (``attention``, ``norm``, ...).
    label: the configuration in the case name (``d=128 causal``).
    dtype: the inputs' dtype.
    kind: the implementation, ``"pallas"`` or ``"triton"``.
    build: returns ``(f, args)``: a function running the op's forward and backward with that
      implementation, and its arguments (``jax.ShapeDtypeStruct``s).
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


# Configurations -------------------------------------------------------------------------------


def implementations(op_name: str) -> tuple[str, ...]:
  """The GPU kernel implementations (``pallas``, ``triton``) an op of ``jaxfuse.ops`` has:
  the kernel kinds of its registry entry that compile for GPUs."""
  return kr.gpu_kinds(op_base.REGISTRY[op_name])


def _build(loss: Callable, n_diff: int, args: tuple) -> tuple[Callable, tuple]:
  return _fwd_bwd(loss, n_diff), args


def _op_configs(family: str, label: str, dtype: str, op_name: str, call: Callable,
                args: Sequence, n_diff: int | None = None, impls: Sequence[str] | None = None,
                blocks: Callable[[str], str | None] | None = None) -> list[Config]:
  """One configuration per kernel implementation of the op ``op_name`` (or of ``impls``): the
  forward and the gradient of ``call(*args, implementation=impl)``."""
  n = len(args) if n_diff is None else n_diff
  return [Config(family, label, dtype, impl,
                 functools.partial(_build, functools.partial(call, implementation=impl), n,
                                   tuple(args)),
                 blocks or (lambda name: None))
          for impl in impls or implementations(op_name)]


def attention_configs(dtype: str, d: int, causal: bool, bias: bool) -> list[Config]:
  """Attention at head dim ``d``, causal or not, with or without a bias."""
  b, t, h = ATTENTION_SHAPE["batch"], ATTENTION_SHAPE["tokens"], ATTENTION_SHAPE["heads"]
  q = _spec((b, t, h, d), dtype)

  def call(q, k, v, *bias_arg, implementation):
    return ops.attention(q, k, v, causal=causal, bias=bias_arg[0] if bias_arg else None,
                         implementation=implementation)

  def blocks(name):
    sizes = tuning.block_sizes_for(q, q, causal=causal, has_bias=bias)
    name = name.removesuffix("_kernel")  # the Triton kernels' names
    if name.startswith("attention_fwd"):
      return f"block={sizes.block_q}x{sizes.block_k}"
    if name in ("attention_bwd_dq", "attention_bwd_dbias"):
      return f"block={sizes.block_q_dq}x{sizes.block_k_dq}"
    if name == "attention_bwd_dkdv":
      return f"block={sizes.block_q_dkdv}x{sizes.block_k_dkdv}"
    return None

  args = (q, q, q) + ((_spec((1, h, t, t), "float32"),) if bias else ())
  label = f"d={d}" + (" causal" if causal else "") + (" bias" if bias else "")
  return _op_configs("attention", label, dtype, "attention", call, args, blocks=blocks)


def _max_hidden(op_name: str, impl: str) -> int:
  """The widest rows ``impl``'s kernels of the op take (its kernel module's ``MAX_HIDDEN``)."""
  return op_base.REGISTRY[op_name].module(impl).MAX_HIDDEN


def _norm(op_name: str, dtype: str, width: int | None, impls=None) -> list[Config]:
  """``op_name`` over ROWS rows of ``width`` (None: the largest each implementation takes)."""
  op = getattr(ops, op_name)
  out = []
  for impl in impls or implementations(op_name):
    h = width or _max_hidden(op_name, impl)
    if h > _max_hidden(op_name, impl):
      continue
    x, w = _spec((ROWS, h), dtype), _spec((h,), dtype)
    residual, centered = op_name.startswith("add_"), "layer" in op_name

    def call(x, *rest, implementation, op=op, residual=residual, centered=centered):
      rest = list(rest)
      args = (x, rest.pop(0)) if residual else (x,)
      kwargs = {"bias": rest[1]} if centered else {}
      return _first(op(*args, rest[0], implementation=implementation, **kwargs))

    args = (x,) + ((x,) if residual else ()) + (w,) + ((w,) if centered else ())
    out += _op_configs("norm", f"{op_name} H={h} rows={ROWS}", dtype, op_name, call, args,
                       impls=(impl,))
  return out


def _softmax(dtype: str, width: int, masked: bool) -> list[Config]:
  x = _spec((ROWS, width), dtype)
  label = f"softmax n={width} rows={ROWS}" + (" mask" if masked else "")
  if masked:
    call = lambda x, m, implementation: ops.softmax(x, mask=m, implementation=implementation)
    return _op_configs("softmax", label, dtype, "softmax", call,
                       (x, _spec((ROWS, width), "bool")), n_diff=1)
  return _op_configs("softmax", label, dtype, "softmax", ops.softmax, (x,))


def _elementwise(name: str, dtype: str) -> list[Config]:
  flat = _spec((ELEMENTS,), dtype)
  grid = _spec((ROWS, FEATURES), dtype)
  vector = _spec((FEATURES,), dtype)
  gelu, silu = {"activation": "gelu"}, {"activation": "silu"}
  # name -> (op, its keyword arguments, its arguments, the label)
  calls = {
      "add_act": ("add_act", gelu, (flat, flat), f"add_act[gelu] n={ELEMENTS}"),
      "add_act_unfused": ("add_act_unfused", gelu, (flat, flat),
                          f"add_act_unfused[gelu] n={ELEMENTS}"),
      "relu": ("relu", {}, (flat,), f"relu n={ELEMENTS}"),
      "bias_act": ("bias_act", gelu, (grid, vector), f"bias_act[gelu] {ROWS}x{FEATURES}"),
      "glu": ("glu", silu, (grid, grid), f"glu[silu] {ROWS}x{FEATURES}"),
      "glu_packed": ("glu", silu, (_spec((ROWS, 2 * FEATURES), dtype),),
                     f"glu[silu] packed {ROWS}x{2 * FEATURES}"),
  }
  op_name, kwargs, args, label = calls[name]
  call = functools.partial(getattr(ops, op_name), **kwargs)
  return _op_configs("elementwise", label, dtype, op_name, call, args)


ELEMENTWISE = ("add_act", "add_act_unfused", "relu", "bias_act", "glu", "glu_packed")


def _linear(dtype: str) -> list[Config]:
  x, w, b = _spec((ROWS, MODEL), dtype), _spec((FEATURES, MODEL), dtype), _spec((FEATURES,), dtype)
  return _op_configs("linear", f"recompute_linear {ROWS}x{MODEL}->{FEATURES}", dtype,
                     "recompute_linear", ops.recompute_linear, (x, w, b))


def _cross_entropy(dtype: str) -> list[Config]:
  h, w = _spec((ROWS, MODEL), dtype), _spec((VOCAB, MODEL), dtype)
  return _op_configs("xent", f"linear_cross_entropy N={ROWS} D={MODEL} V={VOCAB}", dtype,
                     "linear_cross_entropy", ops.linear_cross_entropy,
                     (h, w, _spec((ROWS,), "int32")), n_diff=2)


def _grouped_matmul(dtype: str) -> list[Config]:
  """A Mixture-of-Experts projection: ROWS tokens over EXPERTS experts, MODEL -> EXPERT_HIDDEN."""
  lhs, rhs = _spec((ROWS, MODEL), dtype), _spec((EXPERTS, MODEL, EXPERT_HIDDEN), dtype)
  return _op_configs("grouped_matmul",
                     f"grouped_matmul {ROWS}x{MODEL}->{EXPERT_HIDDEN} experts={EXPERTS}", dtype,
                     "grouped_matmul", ops.grouped_matmul,
                     (lhs, rhs, _spec((EXPERTS,), "int32")), n_diff=2)


def _grouped_glu(dtype: str) -> list[Config]:
  """A Mixture-of-Experts first layer: ROWS tokens over EXPERTS experts, SwiGLU of two
  MODEL -> EXPERT_HIDDEN grouped products."""
  lhs, w = _spec((ROWS, MODEL), dtype), _spec((EXPERTS, MODEL, EXPERT_HIDDEN), dtype)
  return _op_configs("grouped_matmul",
                     f"grouped_glu[silu] {ROWS}x{MODEL}->{EXPERT_HIDDEN} experts={EXPERTS}",
                     dtype, "grouped_glu", ops.grouped_glu,
                     (lhs, w, w, _spec((EXPERTS,), "int32")), n_diff=3)


def _grouped_mlp(dtype: str, keep: tuple[str, ...] = ()) -> list[Config]:
  """A Mixture-of-Experts block's experts: ROWS tokens over EXPERTS experts, the SwiGLU of
  MODEL -> EXPERT_HIDDEN and the down product back to MODEL; ``keep``: the products the
  forward writes and the backward reads (``grouped_mlp``'s ``keep``)."""
  lhs = _spec((ROWS, MODEL), dtype)
  w, down = (_spec((EXPERTS, MODEL, EXPERT_HIDDEN), dtype),
             _spec((EXPERTS, EXPERT_HIDDEN, MODEL), dtype))
  label = f"silu, keep {'+'.join(keep)}" if keep else "silu"
  call = functools.partial(ops.grouped_mlp, keep=keep)
  return _op_configs("grouped_matmul",
                     f"grouped_mlp[{label}] {ROWS}x{MODEL}->{EXPERT_HIDDEN}->{MODEL} "
                     f"experts={EXPERTS}", dtype, "grouped_mlp",
                     lambda *a, implementation: call(*a, implementation=implementation),
                     (lhs, w, w, down, _spec((EXPERTS,), "int32")), n_diff=4)


def _qk_norm_rope(dtype: str, over: str) -> list[Config]:
  heads, d = 16, 128
  x, half = _spec((ROWS, heads, d), dtype), _spec((ROWS, d // 2), "float32")
  w = _spec((d if over == "head" else heads * d,), dtype)
  call = functools.partial(ops.qk_norm_rope, over=over)
  return _op_configs("norm", f"qk_norm_rope[{over}] {ROWS}x{heads}x{d}", dtype, "qk_norm_rope",
                     lambda x, w, c, s, implementation: call(x, w, c, s,
                                                            implementation=implementation),
                     (x, w, half, half), n_diff=2)


def configs(quick: bool = False) -> list[Config]:
  """Every configuration the suite compiles (``quick``: a few per kernel family)."""
  out: list[Config] = []
  if quick:
    out += attention_configs("float16", 128, True, False)
    out += attention_configs("bfloat16", 64, False, True)
    out += attention_configs("float32", 64, True, False)
    out += attention_configs("bfloat16", 256, True, False)   # Gemma's head dimension
    out += _norm("rms_norm", "bfloat16", None) + _norm("add_layer_norm", "bfloat16", 4096)
    out += _softmax("bfloat16", 32768, True) + _qk_norm_rope("bfloat16", "head")
    for name in ELEMENTWISE:
      out += _elementwise(name, "bfloat16")
    out += _grouped_glu("bfloat16") + _grouped_mlp("bfloat16")
    out += _grouped_mlp("bfloat16", ("gate",))
    return out + _linear("bfloat16") + _cross_entropy("bfloat16") + _grouped_matmul("bfloat16")
  for dtype in DTYPES:
    for d in ATTENTION_HEAD_DIMS:
      for causal in (True, False):
        for bias in (False, True):
          out += attention_configs(dtype, d, causal, bias)
  for dtype in DTYPES:
    for op_name in ("rms_norm", "layer_norm", "add_rms_norm", "add_layer_norm"):
      for width in NORM_WIDTHS + (None,):
        out += _norm(op_name, dtype, width)
    for width in SOFTMAX_WIDTHS:
      out += _softmax(dtype, width, False) + _softmax(dtype, width, True)
    out += _qk_norm_rope(dtype, "head") + _qk_norm_rope(dtype, "projection")
    for name in ELEMENTWISE:
      out += _elementwise(name, dtype)
    out += _linear(dtype) + _cross_entropy(dtype) + _grouped_matmul(dtype)
    out += _grouped_glu(dtype) + _grouped_mlp(dtype) + _grouped_mlp(dtype, ("gate",))
    out += _grouped_mlp(dtype, ("gate", "up"))
  return out


def core() -> list[Config]:
  """The configurations ``tests/test_kernel_resources.py`` compiles: every kernel once, in
  bfloat16 or float16, at the tiles the heuristics choose (the cheapest shapes that reach it:
  a Triton kernel shared by several ops is compiled for one of them)."""
  out = attention_configs("float16", 64, True, True)
  out += _norm("rms_norm", "bfloat16", 4096, impls=("pallas",))
  # Rows of several column chunks: the Pallas backward then reads its row sums from XLA.
  out += _norm("add_layer_norm", "float16", 16384, impls=("pallas",))
  # The widest rows the Triton norms take, with the most their backward keeps in registers.
  out += _norm("add_layer_norm", "bfloat16", None, impls=("triton",))
  out += _softmax("bfloat16", 4096, True) + _qk_norm_rope("bfloat16", "projection")
  for name in ("add_act", "add_act_unfused", "relu", "bias_act", "glu"):
    out += _elementwise(name, "bfloat16")
  out += [c for c in _elementwise("glu_packed", "bfloat16") if c.kind == "triton"]
  out += _grouped_glu("bfloat16") + _grouped_mlp("bfloat16") + _grouped_mlp("bfloat16", ("gate",))
  return out + _linear("bfloat16") + _cross_entropy("bfloat16") + _grouped_matmul("bfloat16")


def sources(config: Config) -> list[kr.KernelSource]:
  """The kernels of one configuration, as :mod:`jaxfuse.metrics.kernel_resources` takes them."""
  f, args = config.build()
  return kr.kernels_of(config.kind, f, *args)


def _constants(source: kr.KernelSource, keys: Sequence[str]) -> list[str]:
  values = dict(source.constexprs)
  return [f"{k}={values[k]}" for k in keys if k in values]


def case_names(config: Config, found: Sequence[kr.KernelSource]) -> list[str]:
  """The case of each kernel: its name, the configuration, its tile and launch settings.

  A Triton kernel's tile is its ``BLOCK*`` constexprs; where one kernel is launched with
  different constexprs in the same configuration (a forward with and without statistics), the
  ones that differ are named too.
  """
  names = []
  for source in found:
    twins = [s for s in found if s.name == source.name]
    differing = sorted({k for s in twins for k, v in s.constexprs
                        if any(dict(t.constexprs).get(k) != v for t in twins)})
    block = config.blocks(source.name)
    tile = ([block] if block else []) + _constants(
        source, [k for k, _ in source.constexprs if k.startswith("BLOCK")])
    parts = [source.name, config.label, *_constants(source, differing), *tile,
             f"warps={source.num_warps}", f"stages={source.num_stages}"]
    names.append(" ".join(parts))
  return names


# Kernels known to spill in float32 in a configuration that ships, and why: kernel -> the
# reason, in the note of each float32 configuration of it that spills. Every other spill is
# noted by its size alone; a 2-byte configuration that spills is a bug
# (tests/test_kernel_resources.py fails on the core set).
FLOAT32_SPILLS = {
    "norm_bwd_kernel": (
        "a whole float32 row of x, g and the scale and two float32 gradient accumulators stay "
        "in registers, at most 128 a thread with 16 warps; the widest rows the Triton norms "
        "take (MAX_HIDDEN) then spill a little in float32, not in bfloat16 or float16"),
}


def source_name(case: str) -> str:
  """The kernel's name: the first word of its case."""
  return case.split(" ", 1)[0]


def spill_note(name: str, dtype: str, resources: kr.KernelResources) -> str:
  """What the note says of a kernel that spills: how much, and why where that is known."""
  text = (f"spills {resources.spill_stores} B stored + {resources.spill_loads} B loaded a "
          f"thread")
  if dtype == "float32" and name in FLOAT32_SPILLS:
    return f"{text} (float32: {FLOAT32_SPILLS[name]})"
  return text


def record(config: Config, case: str, resources: kr.KernelResources | None, arch: str,
           platform: str, error: str | None = None) -> Record:
  """The record of one kernel: its figures and their sources, or null figures and why."""
  r = Record(suite=SUITE, case=case, impl=f"jaxfuse-{config.kind}", platform=platform,
             dtype=config.dtype)
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
  if resources.spill_bytes:
    r.add_note(spill_note(source_name(case), config.dtype, resources))
  r.add_note(f"{resources.blocks_per_sm} blocks/SM by {resources.limited_by}")
  if resources.launches > 1:
    r.add_note(f"{resources.launches} launches")
  return r


def compiled(config: Config, arch: str = kr.DEFAULT_ARCH
             ) -> list[tuple[str, kr.KernelResources | None, str | None]]:
  """``(case, resources, error)`` for each kernel of one configuration: its figures, or None
  and why it does not compile."""
  found = sources(config)
  results = kr.compile_each(found, arch)
  return [(case, None, r) if isinstance(r, str) else (case, r, None)
          for case, r in zip(case_names(config, found), results)]


def compile_all(configs: Sequence[Config], arch: str = kr.DEFAULT_ARCH
                ) -> list[tuple[Config, str, kr.KernelSource, kr.KernelResources | None,
                                str | None]]:
  """Every kernel of ``configs`` compiled in one batch (Triton kernels that compile in another
  process share it): ``(config, case, source, resources, error)`` per kernel."""
  found = [(c, sources(c)) for c in configs]
  results = iter(kr.compile_each([s for _, group in found for s in group], arch))
  out = []
  for config, group in found:
    for case, source in zip(case_names(config, group), group):
      r = next(results)
      out.append((config, case, source, None, r) if isinstance(r, str)
                 else (config, case, source, r, None))
  return out


def measure(config: Config, arch: str, platform: str) -> list[Record]:
  """The records of one configuration's kernels."""
  return [record(config, case, resources, arch, platform, error)
          for case, resources, error in compiled(config, arch)]


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
