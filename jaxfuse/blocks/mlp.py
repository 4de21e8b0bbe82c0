"""MLP blocks over arrays: their parameter layouts and what they compute.

Two kinds, each named after the module that holds it:

- :data:`GATED` (``GatedMLP``, LLaMA's SwiGLU MLP): ``gate_proj``, ``up_proj`` and
  ``down_proj``; ``down(act(gate(x)) * up(x))`` with the gated unit fused
  (:func:`jaxfuse.ops.glu`);
- :data:`PLAIN` (``MLP``): ``up_proj`` (always with a bias: it is the fused one) and
  ``down_proj``; ``down(act(up(x) + bias))`` with the bias and activation fused
  (:func:`jaxfuse.ops.bias_act`).

Kernels are ``[in, out]`` (``flax`` ``Linear`` / ``Dense``). Each computation names what it
computes (``mlp.gate``, ``mlp.up`` or ``mlp.pre``, ``mlp.hidden``, ``mlp.down`` of
:mod:`jaxfuse.ops.names`) so that a recomputation policy can choose what to keep;
:mod:`jaxfuse.remat.mlp` wraps them with the modules' ``recompute=`` choices. A projection with
a LoRA adapter (``adapters={name: Adapter}``, :class:`jaxfuse.blocks.linear.Adapter`) adds it in
the same op (:func:`jaxfuse.ops.lora_dense`, which names its ``x @ lora_a`` ``lora.xa``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
from jax.ad_checkpoint import checkpoint_name

from jaxfuse.blocks.linear import Adapter
from jaxfuse.blocks.torch_names import linear_torch_params
from jaxfuse.ops import bias_act, dense, glu, lora_dense, names
from jaxfuse.parallel.rules import constrain

GATED = "gated"
PLAIN = "plain"
KINDS = (GATED, PLAIN)
# Each kind's projections, in the order they are created.
PROJECTIONS = {GATED: ("gate_proj", "up_proj", "down_proj"), PLAIN: ("up_proj", "down_proj")}
_HIGHEST = jax.lax.Precision.HIGHEST


def biases(kind: str, use_bias: bool) -> dict[str, bool]:
  """Which projections of a ``kind`` of MLP have a bias."""
  if kind == GATED:
    return dict.fromkeys(PROJECTIONS[GATED], use_bias)
  return {"up_proj": True, "down_proj": use_bias}


def projections(kind: str, in_features: int, hidden_features: int, out_features: int,
                use_bias: bool) -> dict[str, tuple[int, int, bool]]:
  """``{name: (in, out, has_bias)}`` of each projection, in the order they are created.

  Example:
    >>> from jaxfuse.blocks import mlp
    >>> mlp.projections(mlp.PLAIN, 8, 32, 4, use_bias=False)
    {'up_proj': (8, 32, True), 'down_proj': (32, 4, False)}
  """
  sizes = {"gate_proj": (in_features, hidden_features), "up_proj": (in_features, hidden_features),
           "down_proj": (hidden_features, out_features)}
  return {name: (*sizes[name], has_bias) for name, has_bias in biases(kind, use_bias).items()}


def torch_params(kind: str, use_bias: bool) -> dict:
  """The projections as torch ``nn.Linear`` submodules of the same names (Hugging Face
  ``LlamaMLP``'s for :data:`GATED`): ``name.weight`` (the kernel, transposed), ``name.bias``."""
  return linear_torch_params(biases(kind, use_bias))


def _project(x, kernel, bias, adapter: Adapter | None, precision):
  """A projection: :func:`jaxfuse.ops.dense`, or :func:`jaxfuse.ops.lora_dense` with its
  adapter."""
  if adapter is None:
    return dense(x, kernel, bias, precision=precision)
  return lora_dense(x, kernel, adapter.lora_a, adapter.lora_b, bias, scale=adapter.scale,
                    precision=precision)


def check_adapters(kind: str, adapters: Mapping[str, Adapter | None] | None,
                   owner: str = "mlp") -> dict[str, Adapter]:
  """The adapters given (None entries dropped); raises ``ValueError`` (starting with ``owner``)
  for a name that is not a projection of ``kind``."""
  adapters = {name: a for name, a in (adapters or {}).items() if a is not None}
  unknown = sorted(set(adapters) - set(PROJECTIONS[kind]))
  if unknown:
    raise ValueError(f"{owner}: adapters has {unknown}, which are not projections of a {kind} "
                     f"MLP {PROJECTIONS[kind]}")
  return adapters


def gated_mlp(x: jax.Array, gate_kernel: jax.Array, up_kernel: jax.Array,
              down_kernel: jax.Array, gate_bias: jax.Array | None = None,
              up_bias: jax.Array | None = None, down_bias: jax.Array | None = None, *,
              activation: str | Callable = "silu", precision=_HIGHEST,
              implementation: str | None = None,
              adapters: Mapping[str, Adapter] | None = None) -> jax.Array:
  """``(act(x @ gate_kernel) * (x @ up_kernel)) @ down_kernel`` (with the biases given).

  Under a mesh the hidden width is split (Megatron's column- then row-parallel MLP). Nothing is
  recomputed here: see :func:`jaxfuse.remat.mlp.gated_mlp` for that.

  Args:
    x: ``(..., in_features)``.
    gate_kernel, up_kernel: ``(in_features, hidden_features)``.
    down_kernel: ``(hidden_features, out_features)``.
    gate_bias, up_bias, down_bias: optional biases of the projections' output sizes.
    activation: the gate's activation, as :func:`jaxfuse.ops.glu` takes it.
    precision: the matmuls' precision (HIGHEST: no TF32 for float32 on GPUs, as torch).
    implementation: passed to :func:`jaxfuse.ops.glu`.
    adapters: ``{projection: Adapter}``, LoRA adapters of some of ``gate_proj``, ``up_proj``
      and ``down_proj`` (in x's dtype).

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxfuse.blocks.mlp import gated_mlp
    >>> x, wg, wu, wd = (jnp.ones(s) for s in ((4, 8), (8, 16), (8, 16), (16, 8)))
    >>> gated_mlp(x, wg, wu, wd, activation="gelu").shape
    (4, 8)
  """
  adapters = check_adapters(GATED, adapters, "gated_mlp")
  gate = _project(x, gate_kernel, gate_bias, adapters.get("gate_proj"), precision)
  gate = checkpoint_name(constrain(gate, ..., "act_mlp"), names.MLP_GATE)
  up = _project(x, up_kernel, up_bias, adapters.get("up_proj"), precision)
  up = checkpoint_name(constrain(up, ..., "act_mlp"), names.MLP_UP)
  hidden = checkpoint_name(glu(gate, up, activation, implementation=implementation),
                           names.MLP_HIDDEN)
  return checkpoint_name(_project(hidden, down_kernel, down_bias, adapters.get("down_proj"),
                                  precision), names.MLP_DOWN)


def mlp(x: jax.Array, up_kernel: jax.Array, up_bias: jax.Array, down_kernel: jax.Array,
        down_bias: jax.Array | None = None, *, activation: str | Callable = "gelu",
        precision=_HIGHEST, implementation: str | None = None,
        adapters: Mapping[str, Adapter] | None = None) -> jax.Array:
  """``act(x @ up_kernel + up_bias) @ down_kernel + down_bias``, the bias and activation fused
  by :func:`jaxfuse.ops.bias_act` (nothing recomputed: see :func:`jaxfuse.remat.mlp.mlp`).

  Args:
    x: ``(..., in_features)``.
    up_kernel: ``(in_features, hidden_features)``; up_bias: ``(hidden_features,)``.
    down_kernel: ``(hidden_features, out_features)``; down_bias: ``(out_features,)`` or None.
    activation: as :func:`jaxfuse.ops.bias_act` takes it.
    precision: the matmuls' precision.
    implementation: passed to :func:`jaxfuse.ops.bias_act`.
    adapters: ``{projection: Adapter}``, LoRA adapters of ``up_proj`` and/or ``down_proj``.
  """
  adapters = check_adapters(PLAIN, adapters, "mlp")
  pre = checkpoint_name(_project(x, up_kernel, None, adapters.get("up_proj"), precision),
                        names.MLP_PRE)
  hidden = checkpoint_name(bias_act(pre, up_bias, activation, implementation=implementation),
                           names.MLP_HIDDEN)
  return checkpoint_name(_project(hidden, down_kernel, down_bias, adapters.get("down_proj"),
                                  precision), names.MLP_DOWN)


BLOCKS: dict[str, Callable] = {GATED: gated_mlp, PLAIN: mlp}


def arguments(kind: str, params: Mapping[str, tuple]) -> tuple:
  """The arrays a ``kind``'s block takes after ``x``, in its order, from ``{projection:
  (kernel, bias)}``."""
  if kind == GATED:
    (wg, bg), (wu, bu), (wd, bd) = (params[n] for n in ("gate_proj", "up_proj", "down_proj"))
    return wg, wu, wd, bg, bu, bd
  (wu, bu), (wd, bd) = params["up_proj"], params["down_proj"]
  return wu, bu, wd, bd
