"""LoRA adapters on the ``nnx.Linear`` projections of a model (Hu et al. 2021, as peft has them).

:func:`apply_lora` gives each targeted projection (``q_proj``, ``k_proj``, ``v_proj``,
``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``: Hugging Face's names, the decoder's)
two ``nnx.LoRAParam`` arrays, ``lora_a`` ``[in, rank]`` and ``lora_b`` ``[rank, out]`` (with a
leading layer axis where the layers are stacked for a scan), and its ``lora_scale``
(``alpha / rank``). The projection then computes ``x @ kernel + bias + lora_scale * (x @ lora_a)
@ lora_b``: in one op (:func:`jaxfuse.ops.lora_dense`) on the fused path, and as
``linear(x) + scale * (x @ A) @ B`` on the plain one. ``nnx.LoRAParam`` is an ``nnx.Param``
of its own type, so an optimizer made with ``wrt=nnx.LoRAParam`` trains the adapters alone and
leaves the base frozen (the kernels' gradients are then dead code XLA removes).

:func:`merge_lora` folds the adapters into the kernels (``W += scale * A @ B``) and removes them,
so that :func:`jaxfuse.interop.save_pretrained` writes a plain checkpoint;
:func:`save_peft_adapter` writes the adapters alone as a peft checkpoint
(``adapter_config.json`` and ``adapter_model.safetensors``) that
``peft.PeftModel.from_pretrained`` loads onto the base.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from jaxfuse.nnx import GatedMLP, apply_lora, merge_lora
  >>> mlp = GatedMLP(8, 16, rngs=nnx.Rngs(0))
  >>> _ = apply_lora(mlp, rank=2, alpha=4, targets=("gate", "down"), rngs=nnx.Rngs(1))
  >>> mlp.gate_proj.lora_a.shape, mlp.down_proj.lora_b.shape, mlp.gate_proj.lora_scale
  ((8, 2), (2, 8), 2.0)
  >>> sorted(p[0] for p, _ in nnx.to_flat_state(nnx.state(mlp, nnx.LoRAParam)))
  ['down_proj', 'down_proj', 'gate_proj', 'gate_proj']
  >>> _ = merge_lora(mlp)
  >>> hasattr(mlp.gate_proj, "lora_a")
  False
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxfuse.blocks.linear import HIGHEST, Adapter

# The short names apply_lora takes, and the projections they name (Hugging Face's).
TARGETS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj",
           "up": "up_proj", "down": "down_proj"}
ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"


def adapter_of(linear: nnx.Module) -> Adapter | None:
  """The LoRA adapter :func:`apply_lora` gave ``linear`` (its arrays as they are stored), or
  None."""
  lora_a = getattr(linear, "lora_a", None)
  if lora_a is None:
    return None
  return Adapter(lora_a[...], linear.lora_b[...], linear.lora_scale)


def _projection_names(targets: Sequence[str]) -> set[str]:
  if isinstance(targets, str):
    raise TypeError(f"apply_lora: targets must be a sequence of names, got the string "
                    f"{targets!r}")
  names = set()
  for target in targets:
    name = TARGETS.get(target, target)
    if name not in TARGETS.values():
      raise ValueError(f"apply_lora: targets has {target!r}; the targets are {sorted(TARGETS)} "
                       f"(or their projections' names)")
    names.add(name)
  return names


def _linears(model: nnx.Module, names: set[str] | None = None
             ) -> Iterator[tuple[tuple, nnx.Linear]]:
  """``(path, linear)`` of every ``nnx.Linear`` whose name is in ``names`` (default: any)."""
  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Linear) and path and (names is None or path[-1] in names):
      yield tuple(path), node


def _adapted(model: nnx.Module) -> list[tuple[tuple, nnx.Linear]]:
  return [(path, linear) for path, linear in _linears(model) if adapter_of(linear) is not None]


def apply_lora(model: nnx.Module, *, rank: int, alpha: float,
               targets: Sequence[str] = ("q", "k", "v", "o", "gate", "up", "down"),
               rngs: nnx.Rngs, dtype=jnp.float32) -> nnx.Module:
  """Gives the targeted projections of ``model`` LoRA adapters, in place (see the module
  docstring); returns ``model``.

  ``lora_a`` is drawn as peft draws it (``kaiming_uniform_(a=sqrt(5))`` of torch's
  ``[rank, in]`` weight: uniform in ``±1 / sqrt(in)``) and ``lora_b`` is zeros, so the adapted
  model computes what the base does until the adapters are trained. Stacked layers (a kernel
  ``[layers, in, out]``) get adapters ``[layers, in, rank]`` and ``[layers, rank, out]``, one
  draw per layer.

  Args:
    model: a module holding ``nnx.Linear`` projections of those names, such as a
      :class:`jaxfuse.models.Decoder` (unrolled or ``scan_layers=True``) or a
      :class:`jaxfuse.nnx.GatedMLP`.
    rank: the adapters' rank ``r``.
    alpha: peft's ``lora_alpha``; the adapters' output is scaled by ``alpha / rank``.
    targets: which projections: ``"q"``, ``"k"``, ``"v"``, ``"o"``, ``"gate"``, ``"up"``,
      ``"down"`` (or ``"q_proj"``, ...).
    rngs: draws ``lora_a`` (``rngs.params()``).
    dtype: the adapters' dtype (float32 by default, whatever the base's; they are cast to the
      computation's dtype where they are used).

  Raises:
    ValueError: a bad rank, alpha or target, no projection of those names, or a projection
      that has an adapter already.

  Example:
    >>> import jax
    >>> from flax import nnx
    >>> from jaxfuse.models import Decoder, DecoderConfig
    >>> from jaxfuse.nnx import apply_lora
    >>> cfg = DecoderConfig(vocab_size=32, d_model=16, num_layers=2, num_heads=2, mlp_dim=32)
    >>> model = apply_lora(Decoder(cfg, rngs=nnx.Rngs(0)), rank=4, alpha=8, targets=("q", "v"),
    ...                    rngs=nnx.Rngs(1))
    >>> model.layers[0].self_attn.q_proj.lora_a.shape
    (16, 4)
    >>> [a.shape for a in jax.tree.leaves(nnx.state(model, nnx.LoRAParam))][:2]
    [(16, 4), (4, 16)]
  """
  if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
    raise ValueError(f"apply_lora: rank must be a positive int, got {rank!r}")
  if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
    raise ValueError(f"apply_lora: alpha must be a finite number, got {alpha!r}")
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"apply_lora: dtype must be a floating dtype, got {jnp.dtype(dtype).name}")
  names = _projection_names(targets)
  found = list(_linears(model, names))
  if not found:
    raise ValueError(f"apply_lora: the model has no nnx.Linear named {sorted(names)}")
  for path, linear in found:
    if adapter_of(linear) is not None:
      raise ValueError(f"apply_lora: {'.'.join(map(str, path))} has an adapter already "
                       f"(merge_lora folds it into the kernel)")
  for _, linear in found:
    kernel = linear.kernel
    *lead, n_in, n_out = kernel.shape
    bound = 1.0 / math.sqrt(n_in)
    linear.lora_a = nnx.LoRAParam(jax.random.uniform(rngs.params(), (*lead, n_in, rank), dtype,
                                                     -bound, bound))
    linear.lora_b = nnx.LoRAParam(jnp.zeros((*lead, rank, n_out), dtype))
    linear.lora_scale = alpha / rank
  return model


def merge_lora(model: nnx.Module) -> nnx.Module:
  """Folds every adapter into its kernel, ``kernel += scale * lora_a @ lora_b`` (in float32,
  stored in the kernel's dtype), and removes the adapters, in place; returns ``model``, which
  then computes what the adapted model did (up to the kernel dtype's rounding) and saves as a
  plain checkpoint (:func:`jaxfuse.interop.save_pretrained`).

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxfuse.nnx import GatedMLP, apply_lora, merge_lora
    >>> mlp = apply_lora(GatedMLP(4, 8, rngs=nnx.Rngs(0)), rank=2, alpha=2, rngs=nnx.Rngs(1))
    >>> mlp.up_proj.lora_b[...] = jnp.ones((2, 8))
    >>> x = jnp.ones((3, 4))
    >>> before = mlp(x)
    >>> bool(jnp.allclose(merge_lora(mlp)(x), before, atol=1e-5))
    True
  """
  for _, linear in _adapted(model):
    adapter = adapter_of(linear)
    kernel = linear.kernel[...]
    delta = jnp.matmul(adapter.lora_a.astype(jnp.float32), adapter.lora_b.astype(jnp.float32),
                       precision=HIGHEST)
    linear.kernel[...] = (kernel.astype(jnp.float32) + adapter.scale * delta).astype(kernel.dtype)
    del linear.lora_a, linear.lora_b, linear.lora_scale
  return model


def _peft_entries(model: nnx.Module) -> Iterator[tuple[str, nnx.Linear, Adapter]]:
  """``(module name, linear, adapter)`` per layer: the decoder's path under peft's prefix,
  stacked adapters split by layer."""
  for path, linear in _adapted(model):
    adapter = adapter_of(linear)
    if adapter.lora_a.ndim == 2:
      yield ".".join(map(str, path)), linear, adapter
      continue
    if adapter.lora_a.ndim != 3 or "layers" not in path:
      raise ValueError(f"save_peft_adapter: {'.'.join(map(str, path))} has adapters of shape "
                       f"{adapter.lora_a.shape}; only unrolled or layer-stacked ones are saved")
    at = path.index("layers") + 1
    for i in range(adapter.lora_a.shape[0]):
      name = ".".join(map(str, (*path[:at], i, *path[at:])))
      yield name, linear, Adapter(adapter.lora_a[i], adapter.lora_b[i], adapter.scale)


def save_peft_adapter(model: nnx.Module, directory: str | os.PathLike,
                      base_model_name_or_path: str | None = None) -> None:
  """Writes a decoder's adapters as a peft LoRA checkpoint: ``adapter_config.json`` and
  ``adapter_model.safetensors``, which ``peft.PeftModel.from_pretrained(hf_model, directory)``
  loads onto the base model (the decoder saved with :func:`jaxfuse.interop.save_pretrained`
  before :func:`apply_lora`, or the checkpoint it was loaded from).

  The tensors are peft's: ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``
  ``[rank, in]`` (``lora_a`` transposed) and ``...lora_B.weight`` ``[out, rank]``, in the
  adapters' dtype.

  Args:
    model: a :class:`jaxfuse.models.Decoder` (unrolled or stacked) with adapters of one rank
      and one scale.
    directory: created if needed.
    base_model_name_or_path: recorded in the config (where peft finds the base by itself).

  Raises:
    ValueError: no adapters, or adapters of different ranks or scales.
  """
  import safetensors.numpy

  entries = list(_peft_entries(model))
  if not entries:
    raise ValueError("save_peft_adapter: the model has no LoRA adapters (see apply_lora)")
  kinds = {(a.rank, a.scale) for _, _, a in entries}
  if len(kinds) != 1:
    raise ValueError(f"save_peft_adapter: the adapters must share one rank and scale, got "
                     f"(rank, scale) {sorted(kinds)}")
  (rank, scale), = kinds
  alpha = scale * rank
  tensors = {}
  for name, _, adapter in entries:
    prefix = f"base_model.model.model.{name}"
    tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(np.asarray(adapter.lora_a).T)
    tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(np.asarray(adapter.lora_b).T)
  config = {
      "peft_type": "LORA", "task_type": "CAUSAL_LM",
      "base_model_name_or_path": base_model_name_or_path,
      "r": rank, "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
      "target_modules": sorted({name.rsplit(".", 1)[-1] for name, _, _ in entries}),
      "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
      "use_dora": False, "init_lora_weights": True, "inference_mode": True,
      "modules_to_save": None,
  }
  directory = Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  (directory / ADAPTER_CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
  safetensors.numpy.save_file(tensors, directory / ADAPTER_WEIGHTS_NAME,
                              metadata={"format": "pt"})


__all__ = ["ADAPTER_CONFIG_NAME", "ADAPTER_WEIGHTS_NAME", "TARGETS", "adapter_of", "apply_lora",
           "merge_lora", "save_peft_adapter"]
