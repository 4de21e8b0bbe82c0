"""Tile sizes of the Pallas attention kernels: the heuristic table and autotuning.

:func:`block_sizes_for` gives the sizes a call uses: a cached autotuned choice (in memory, or
in the JSON file named by ``$JAXFUSE_ATTENTION_TUNING``), else the heuristic table's entry for
the head dim, dtype and bias presence. :func:`autotune` times candidates on the GPU and caches
the fastest.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from jaxfuse.kernels.pallas import flash_attention as pallas_attention
from jaxfuse.kernels.pallas.flash_attention import BlockSizes
from jaxfuse.ops import dispatch
from jaxfuse.ops.flash_attention import arguments

heuristic_block_sizes = pallas_attention.heuristic_block_sizes

_AUTOTUNE_CACHE: dict[str, BlockSizes] = {}
_CACHE_ENV = "JAXFUSE_ATTENTION_TUNING"
_loaded_cache_files: set[str] = set()


def _device_kind() -> str:
  return jax.devices()[0].device_kind if dispatch.on_gpu() else dispatch.platform()


def _tuning_key(q_shape, k_shape, dtype, causal: bool, has_bias: bool) -> str:
  return json.dumps([_device_kind(), list(q_shape), list(k_shape), jnp.dtype(dtype).name,
                     bool(causal), bool(has_bias)])


def _load_cache_file(path: str) -> None:
  try:
    with open(path) as f:
      entries = json.load(f)
  except (OSError, ValueError):
    return
  for key, sizes in entries.items():
    _AUTOTUNE_CACHE.setdefault(key, BlockSizes(**sizes))


def block_sizes_for(q, k, *, causal: bool, has_bias: bool = False) -> BlockSizes:
  """The tile sizes the Pallas (and Triton) kernels use for these shapes: the autotuned choice
  if one is cached (in memory, or in the JSON file named by ``$JAXFUSE_ATTENTION_TUNING``), else
  the heuristic table's for the head dim, dtype and bias presence, clipped to the sequence
  lengths."""
  path = os.environ.get(_CACHE_ENV)
  if path and path not in _loaded_cache_files:
    _loaded_cache_files.add(path)
    _load_cache_file(path)
  key = _tuning_key(q.shape, k.shape, q.dtype, causal, has_bias)
  sizes = _AUTOTUNE_CACHE.get(key) or heuristic_block_sizes(q.shape[-1], q.dtype,
                                                             has_bias=has_bias)
  return sizes.clipped(q.shape[1], k.shape[1])


def clear_autotune_cache() -> None:
  """Forgets every autotuned choice held in memory."""
  _AUTOTUNE_CACHE.clear()
  _loaded_cache_files.clear()


def default_candidates(head_dim: int, dtype, *, has_bias: bool = False) -> list[BlockSizes]:
  """The heuristic choice and its neighbours: tiles of 32..128, 4 or 8 warps, 1..3 stages."""
  base = heuristic_block_sizes(head_dim, dtype, has_bias=has_bias)
  out = [base]
  for fwd in ((128, 64), (64, 64), (128, 32), (64, 32)):
    for bwd in ((64, 64), (32, 64), (64, 32), (32, 32)):
      for warps in (4, 8):
        for stages in (1, 2, 3):
          out.append(BlockSizes(fwd[0], fwd[1], bwd[0], bwd[1], bwd[0], bwd[1], num_warps=warps,
                                num_stages=stages, num_warps_bwd=warps,
                                num_stages_bwd=max(1, stages - 1)))
  return list(dict.fromkeys(out))


def autotune(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
             bias: jax.Array | None = None, candidates: Sequence[BlockSizes] | None = None,
             runs: int = 5, cache_path: str | None = None,
             timer: Callable[[Callable[[], object]], float] | None = None) -> BlockSizes:
  """Times the Pallas kernels (forward + backward) with each candidate tile size; caches the
  fastest for this device, these shapes, dtype, causality and bias presence.

  Later calls of :func:`attention` with ``implementation="pallas"`` (or None on a GPU) and the
  same signature use the cached choice. Candidates that fail to compile are skipped.

  Args:
    q, k, v: example inputs (their shapes and dtype are the cache key; values are used to run).
    causal, bias: as in :func:`attention`.
    candidates: the tile sizes to try (default :func:`default_candidates`).
    runs: timed calls per candidate (after one warm-up call that also compiles).
    cache_path: also merge the choice into this JSON file (read back through
      ``$JAXFUSE_ATTENTION_TUNING``).
    timer: ``timer(fn) -> seconds`` for one call; the default waits for the result.

  Returns:
    The fastest candidate.

  Raises:
    ImplementationUnavailableError: Pallas cannot run here (no GPU and no interpret mode).
    RuntimeError: no candidate ran.
  """
  from jaxfuse.ops.flash_attention import op as attention_op

  attention_op.ATTENTION.resolve("pallas")   # raises where Pallas cannot run
  arguments.check("attention.autotune", q, k, v, None, None, bias)
  candidates = list(candidates or default_candidates(q.shape[-1], q.dtype,
                                                     has_bias=bias is not None))
  timer = timer or _wall_time
  scale = arguments.default_scale(None, q.shape[-1])
  expanded = None if bias is None else arguments.expand_bias(bias, q.shape[1], k.shape[1])
  results = []
  errors = []
  for sizes in candidates:
    cfg = attention_op.ATTENTION.config(
        "pallas", attention_op.Config,
        causal=arguments.causal_alignment("attention.autotune", causal), scale=scale,
        blocks=sizes.clipped(q.shape[1], k.shape[1]), xla_block=0)

    def loss(q, k, v, cfg=cfg):
      o = attention_op.attention_vjp(q, k, v, None, None, None, expanded, cfg)
      return jnp.sum(o.astype(jnp.float32))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    try:
      jax.block_until_ready(step(q, k, v))
      seconds = sorted(timer(lambda step=step: step(q, k, v)) for _ in range(runs))[runs // 2]
    except Exception as e:  # noqa: BLE001 - a candidate that does not compile is skipped.
      errors.append(f"{sizes}: {type(e).__name__}: {e}")
      continue
    results.append((seconds, sizes))
  if not results:
    raise RuntimeError("attention.autotune: no candidate ran:\n" + "\n".join(errors[:5]))
  best = min(results, key=lambda r: r[0])[1]
  key = _tuning_key(q.shape, k.shape, q.dtype, causal is not False and causal is not None,
                    bias is not None)
  _AUTOTUNE_CACHE[key] = best
  if cache_path:
    _save_choice(cache_path, key, best)
  return best


def _wall_time(fn) -> float:
  start = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - start


def _save_choice(path: str, key: str, sizes: BlockSizes) -> None:
  try:
    with open(path) as f:
      entries = json.load(f)
  except (OSError, ValueError):
    entries = {}
  entries[key] = sizes.as_dict()
  with open(path, "w") as f:
    json.dump(entries, f, indent=1, sort_keys=True)

