"""Fused attention with recomputation: ``softmax(q kᵀ · scale + bias) v`` in O(N) memory.

The forward never materializes the ``[Tq, Tk]`` score matrix. It walks the keys in tiles and
keeps a running row maximum, row sum and output (the online softmax), and it saves only the
output ``o`` and the row log-sum-exp ``lse`` for the backward (``q``, ``k`` and ``v`` are inputs
and exist anyway). The backward recomputes the probabilities tile by tile from ``lse``:
``p = exp(s - lse)``, ``ds = p * (do vᵀ - rowsum(do * o))``, then ``dq = ds k · scale``,
``dk = dsᵀ q · scale``, ``dv = pᵀ do``. Tiles that the causal mask excludes are skipped, not
masked.

Four implementations share that contract:

- ``"pallas"``: FlashAttention-style kernels for GPUs (:mod:`jaxfuse.kernels.pallas.
  flash_attention`): one forward kernel, one ``dq`` kernel and one ``dk/dv`` kernel, plus a
  ``dbias`` kernel when a bias is given. Tile sizes come from :mod:`.tuning`.
- ``"triton"``: the same kernels written in Triton and called through jax-triton
  (:mod:`jaxfuse.kernels.triton.flash_attention`), on the same tile sizes.
- ``"cpu"``: C++ kernels for CPUs called through XLA's FFI (:mod:`jaxfuse.kernels.cpu.
  flash_attention`): one forward and one backward call, on 64-wide tiles in registers; every
  option but a bias.
- ``"xla"``: the same algorithm in plain ``jax.lax`` (:mod:`.xla`), for a bias on CPUs and
  where there is no C++ compiler.

Layout is ``[batch, seq, heads, head_dim]``, as in :func:`jax.nn.dot_product_attention` and
flax. Grouped-query attention: ``k`` and ``v`` may have fewer heads than ``q`` (their number
must divide ``q``'s); query head ``h`` uses kv head ``h // (q_heads // kv_heads)``, as torch's
``scaled_dot_product_attention(..., enable_gqa=True)`` does.

Masks (all optional, combined with AND):

- ``causal``: query ``i`` sees keys ``j <= i + offset``; ``True`` (or ``"top_left"``) aligns
  at the top-left corner (offset 0, as torch's ``is_causal=True`` when the lengths differ),
  ``"bottom_right"`` at the bottom-right (offset ``kv_len - q_len``, with ``kv_len`` the valid
  keys: ``kv_lengths[b]`` when given), as FlashAttention's causal and as decoding with a cache
  needs: the queries are the last ``q_len`` positions of the sequence.
- ``sliding_window``: with a causal mask, query ``i`` sees only the ``W`` keys
  ``i + offset - W < j <= i + offset`` (Mistral). Key tiles wholly outside the window are
  skipped, not masked.
- ``segment_ids``: ``[batch, seq]`` integers when ``q`` and ``k`` have one length, or a pair
  ``(q_segment_ids, kv_segment_ids)``; a query sees the keys of its own segment.
- ``kv_lengths``: ``[batch]`` integers; keys at positions ``>= kv_lengths[b]`` are padding.
- ``bias``: a float array added to the scaled scores, of shape
  ``[batch | 1, q_heads | 1, Tq | 1, Tk | 1]``; it is differentiable.

``logit_softcap=c`` replaces the scaled scores ``s`` by ``c · tanh(s / c)`` before the bias and
the masks (Gemma 2).

A query row that sees no key at all gets a zero output and zero gradients (not NaN).

Second-order gradients (``grad`` of ``grad``, Hessian-vector products) differentiate the
backward pass; both implementations take that derivative from :func:`attention_reference`,
which holds the ``[Tq, Tk]`` scores: second order costs O(N²) memory. Forward mode on the op
itself (``jax.jvp(attention)``) is not supported: JAX does not run forward mode through a
``custom_vjp``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxfuse.kernels.pallas.flash_attention import BlockSizes
from jaxfuse.ops import base, dispatch, names, partitioning
from jaxfuse.ops.flash_attention import arguments, reference, tuning, xla

ATTENTION = base.Op("attention", "flash_attention", base.KERNEL_GPU_ORDER)


@dataclasses.dataclass(frozen=True)
class Config(base.Config):
  causal: str | None          # None, "top_left" or "bottom_right"
  scale: float
  blocks: BlockSizes | None   # the Pallas and Triton kernels' tiles
  xla_block: int              # the XLA path's tile
  sliding_window: int | None = None
  softcap: float | None = None


# The op -----------------------------------------------------------------------------------------


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool | str = False,
              scale: float | None = None, segment_ids=None, kv_lengths: jax.Array | None = None,
              bias: jax.Array | None = None, sliding_window: int | None = None,
              logit_softcap: float | None = None,
              implementation: str | None = None) -> jax.Array:
  """Scaled dot-product attention that saves only ``o`` and the row log-sum-exp.

  Args:
    q: queries ``[batch, q_len, heads, head_dim]``, float32, bfloat16 or float16.
    k: keys ``[batch, kv_len, kv_heads, head_dim]``; ``kv_heads`` divides ``heads``.
    v: values, the shape and dtype of ``k``.
    causal: ``False``; ``True`` or ``"top_left"``: query ``i`` sees keys ``j <= i``;
      ``"bottom_right"``: keys ``j <= i + kv_len - q_len`` (``kv_len``: ``kv_lengths[b]`` if
      given, else k's length).
    scale: multiplies ``q kᵀ``; default ``1 / sqrt(head_dim)``.
    segment_ids: ``[batch, seq]`` integer ids (one length for q and kv) or a pair
      ``(q_segment_ids [batch, q_len], kv_segment_ids [batch, kv_len])``: queries see only
      keys with the same id.
    kv_lengths: ``[batch]`` integers: keys at positions ``>= kv_lengths[b]`` are padding.
    bias: added to the scaled scores; shape ``[batch | 1, heads | 1, q_len | 1, kv_len | 1]``,
      any float dtype. Differentiable.
    sliding_window: with ``causal``, each query sees at most this many keys, itself included.
    logit_softcap: scores become ``c · tanh(scores / c)`` before the bias and the masks.
    implementation: ``None`` (the fastest here: Pallas on GPUs, the CPU kernels on CPUs, XLA
      with a bias or without a C++ compiler), ``"pallas"``, ``"triton"``, ``"cpu"`` or
      ``"xla"``.

  Returns:
    ``[batch, q_len, heads, head_dim]`` in the dtype of ``q``. Rows that see no key are zero.
    Low-precision inputs are multiplied with float32 accumulation and the softmax runs in
    float32.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxfuse.ops import attention
    >>> q = k = v = jax.random.normal(jax.random.key(0), (2, 77, 4, 64))
    >>> o = attention(q, k, v, causal=True)
    >>> o.shape
    (2, 77, 4, 64)
    >>> g = jax.grad(lambda q: attention(q, k, v, causal=True).sum())(q)
  """
  op = ATTENTION.name
  arguments.check(op, q, k, v, segment_ids, kv_lengths, bias)
  causal = arguments.causal_alignment(op, causal)
  arguments.check_window_and_softcap(op, sliding_window, logit_softcap, causal)
  ATTENTION.resolve(implementation)   # an implementation that cannot run here raises
  tq, tk = q.shape[1], k.shape[1]
  scale = arguments.default_scale(scale, q.shape[-1])
  segments = arguments.segments(segment_ids, tq, tk)
  if math.prod(q.shape) == 0 or tk == 0:  # Nothing to attend to: zeros (rows without keys).
    return jnp.zeros(q.shape, q.dtype)
  q_seg, kv_seg = segments if segments is not None else (None, None)
  if kv_lengths is not None:
    kv_lengths = jnp.asarray(kv_lengths, jnp.int32)
  if bias is not None:
    bias = arguments.expand_bias(bias, tq, tk)
  cfg = make_config(q, k, causal=causal, scale=scale, implementation=implementation,
                    has_bias=bias is not None, sliding_window=sliding_window,
                    logit_softcap=logit_softcap)
  with jax.named_scope(f"jaxfuse.attention[{cfg.impl}]"):
    return attention_vjp(q, k, v, q_seg, kv_seg, kv_lengths, bias, cfg)


def make_config(q, k, *, causal: str | None, scale: float, implementation: str | None,
                has_bias: bool = False, sliding_window: int | None = None,
                logit_softcap: float | None = None) -> Config:
  """The static configuration of attention of ``q`` over ``k`` (checked arguments; ``causal``
  None, ``"top_left"`` or ``"bottom_right"``): the implementation and its tiles."""
  impl = ATTENTION.resolve(implementation, {"head_dim": q.shape[-1], "has_bias": has_bias,
                                            "dtype": q.dtype})
  kernels = ATTENTION.module_name(impl) is not None
  blocks = (tuning.block_sizes_for(q, k, causal=causal is not None, has_bias=has_bias)
            if kernels and "gpu" in dispatch.KINDS[impl].platforms else None)
  return ATTENTION.config(impl, Config, causal=causal, scale=scale, blocks=blocks,
                          xla_block=0 if kernels else xla.xla_block_size(q.shape[1], k.shape[1]),
                          sliding_window=sliding_window,
                          softcap=None if logit_softcap is None else float(logit_softcap))


def lse_in_base2(cfg: Config) -> bool:
  """Whether the log-sum-exp of ``cfg``'s kernels is in base 2 (the Pallas and Triton
  kernels') rather than natural; rows that see no key have ``+inf`` in either."""
  return cfg.on_kernels


def forward_with_lse(q, k, v, cfg: Config):
  """``(o, lse)`` of attention without segments, lengths or bias: the kernels' forward, for
  callers that combine several (ring attention). ``lse`` is float32 ``[batch, heads, q_len]``
  in the base :func:`lse_in_base2` says."""
  return _forward(q, k, v, None, None, None, None, cfg)


def backward_from_lse(q, k, v, o, lse, do, cfg: Config):
  """``(dq, dk, dv)`` of attention without segments, lengths or bias, from the output ``o``
  and log-sum-exp ``lse`` of the whole row (which may span more keys than ``k``: the
  gradients are then this block's share)."""
  return _backward(q, k, v, None, None, None, None, o, lse, do, cfg)[:3]


# Forward and backward ---------------------------------------------------------------------------


def _kernel_options(cfg):
  """The Pallas and Triton kernels' static arguments."""
  return dict(causal=cfg.causal, window=cfg.sliding_window, softcap=cfg.softcap,
              scale=cfg.scale, blocks=cfg.blocks)

#
# Every implementation's kernels are differentiated (for second order only) as the reference:
# the XLA path's loops have data-dependent bounds, which reverse mode cannot differentiate.


def _reference_backward(q, k, v, q_seg, kv_seg, kv_lengths, bias, o, lse, do, *, cfg):
  """``(dq, dk, dv, dbias)`` by autodiff of the reference (``o`` and ``lse`` are recomputed)."""
  del o, lse
  segments = None if q_seg is None else (q_seg, kv_seg)

  def forward(q, k, v, bias):
    return reference._attend(q, k, v, segments, kv_lengths, bias, causal=cfg.causal,
                             scale=cfg.scale, window=cfg.sliding_window, softcap=cfg.softcap)[0]

  _, vjp = jax.vjp(forward, q, k, v, bias)
  return vjp(do)


def _rule(q, k, bias, *, backward: bool = False, with_lse: bool = True):
  """How the kernels partition: over the batch and the kv heads (each device holds whole
  groups of query heads), the sequences and the head dim whole. A bias axis of size 1 is
  broadcast; a bias's gradient is summed over the batch or heads it is broadcast along."""
  groups = q.shape[2] // k.shape[2]
  heads = ("k", "g") if groups > 1 else "k"   # Shardy takes no compound with a factor of 1
  qmap, kmap = ("b", "t", heads, "d"), ("b", "s", "k", "d")
  bmap = None
  if bias is not None:
    bmap = tuple(f if n > 1 else one for f, one, n in
                 zip(("b", heads, "t", "s"), ("b1", "h1", "t1", "s1"), bias.shape))
  lse = ("b", heads, "t")
  operands = (qmap, kmap, kmap, ("b", "t"), ("b", "s"), ("b",), bmap)
  if backward:
    operands += (qmap, lse, qmap)
    results = (qmap, kmap, kmap, bmap)
  else:
    results = (qmap, lse) if with_lse else (qmap,)
  return partitioning.Rule(operands, results,
                           whole=("t", "s", "d", "g", "b1", "h1", "t1", "s1"),
                           sizes=(("g", groups),) if groups > 1 else ())


def _forward(q, k, v, q_seg, kv_seg, kv_lengths, bias, cfg):
  """``(o, lse)``, the log-sum-exp in the base :func:`lse_in_base2` says."""
  twin = functools.partial(reference.forward_with_lse, causal=cfg.causal, scale=cfg.scale,
                           window=cfg.sliding_window, softcap=cfg.softcap,
                           base2=lse_in_base2(cfg))
  return cfg.run("forward", twin, q, k, v, q_seg, kv_seg, kv_lengths, bias,
                 rule=_rule(q, k, bias), xla_kernel=functools.partial(xla.forward, cfg=cfg),
                 **_kernel_options(cfg))


def _output(q, k, v, q_seg, kv_seg, kv_lengths, bias, cfg):
  """The output alone: the kernels then write no log-sum-exp."""
  twin = functools.partial(reference.forward_with_lse, causal=cfg.causal, scale=cfg.scale,
                           window=cfg.sliding_window, softcap=cfg.softcap,
                           base2=lse_in_base2(cfg))
  return cfg.run("forward_output", lambda *a: twin(*a)[0], q, k, v, q_seg, kv_seg, kv_lengths,
                 bias, rule=_rule(q, k, bias, with_lse=False),
                 xla_kernel=lambda *a: xla.forward(*a, cfg=cfg)[0], **_kernel_options(cfg))


def _backward(q, k, v, q_seg, kv_seg, kv_lengths, bias, o, lse, do, cfg):
  twin = functools.partial(_reference_backward, cfg=cfg)
  return cfg.run("backward", twin, q, k, v, q_seg, kv_seg, kv_lengths, bias, o, lse, do,
                 rule=_rule(q, k, bias, backward=True),
                 xla_kernel=functools.partial(xla.backward, cfg=cfg), **_kernel_options(cfg))


# The custom VJP ---------------------------------------------------------------------------------


@partitioning.matching_vma
@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def attention_vjp(q, k, v, q_seg, kv_seg, kv_lengths, bias, cfg):
  """The differentiable core of :func:`attention`, on checked and normalized arguments."""
  # The primal alone: the output, without the log-sum-exp.
  return _output(q, k, v, q_seg, kv_seg, kv_lengths, bias, cfg)


def _attention_fwd(q, k, v, q_seg, kv_seg, kv_lengths, bias, cfg):
  # Residuals: the inputs (free), the output and one float32 per query row and head, each
  # under its name (jaxfuse.ops.names) for recomputation policies. The inputs are named before
  # the forward reads them, so that a policy keeping them spares their producers' recompute.
  q, k, v = (checkpoint_name(x, n) for x, n in ((q, names.ATTN_Q), (k, names.ATTN_K),
                                               (v, names.ATTN_V)))
  o, lse = _forward(q, k, v, q_seg, kv_seg, kv_lengths, bias, cfg)
  o, lse = checkpoint_name(o, names.ATTN_OUT), checkpoint_name(lse, names.ATTN_LSE)
  return o, (q, k, v, q_seg, kv_seg, kv_lengths, bias, o, lse)


def _attention_bwd(cfg, residuals, do):
  dq, dk, dv, dbias = _backward(*residuals, do, cfg)
  return dq, dk, dv, None, None, None, dbias


attention_vjp.defvjp(_attention_fwd, _attention_bwd)


# A jax.nn-style entry point --------------------------------------------------------------------


def dot_product_attention(query: jax.Array, key: jax.Array, value: jax.Array,
                          bias: jax.Array | None = None, mask: jax.Array | None = None, *,
                          scale: float | None = None, is_causal: bool | str = False,
                          segment_ids=None, kv_lengths: jax.Array | None = None,
                          sliding_window: int | None = None,
                          logit_softcap: float | None = None,
                          implementation: str | None = None, dropout_rng=None,
                          dropout_rate: float = 0.0, broadcast_dropout: bool = True,
                          deterministic: bool = False, dtype=None, precision=None,
                          module=None) -> jax.Array:
  """:func:`attention` with the argument names of :func:`jax.nn.dot_product_attention`.

  It is also a drop-in ``attention_fn`` for ``flax.nnx.MultiHeadAttention`` and
  ``flax.linen.MultiHeadDotProductAttention``, which pass ``dropout_rng``, ``dropout_rate``,
  ``broadcast_dropout``, ``deterministic``, ``dtype``, ``precision`` and ``module``: ``dtype``
  casts the inputs; ``precision`` is taken as given (float32 products are always full
  precision here); attention dropout (``dropout_rate > 0`` when not ``deterministic``) and
  sowing the attention weights (``module``) are refused with an error, since the weights never
  exist.

  ``query`` is ``[batch..., q_len, heads, head_dim]`` with any number of batch axes (``key``
  and ``value`` share them). A boolean ``mask`` (True = attend), broadcastable to
  ``[batch..., heads, q_len, kv_len]``, becomes a ``-inf`` bias, which costs a
  ``[q_len, kv_len]`` array per head that it varies over; prefer ``is_causal``,
  ``segment_ids`` and ``kv_lengths``, which cost nothing. Unlike jax.nn, a row that every
  mask excludes gives zeros.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxfuse.ops import dot_product_attention
    >>> x = jax.random.normal(jax.random.key(0), (2, 3, 10, 4, 16))
    >>> dot_product_attention(x, x, x, is_causal=True).shape
    (2, 3, 10, 4, 16)
  """
  op = "dot_product_attention"
  del precision, broadcast_dropout, dropout_rng
  if dropout_rate and not deterministic:
    raise NotImplementedError(f"{op}: attention dropout (dropout_rate={dropout_rate}) is not "
                              f"supported: the attention weights are never materialized")
  if module is not None:
    raise NotImplementedError(f"{op}: sowing the attention weights (sow_weights=True) is not "
                              f"supported: they are never materialized")
  if dtype is not None:
    query, key, value = (x.astype(dtype) for x in (query, key, value))
  batch = query.shape[:-3]
  if key.shape[:-3] != batch or value.shape[:-3] != batch:
    raise ValueError(f"dot_product_attention: query, key and value must share their batch "
                     f"axes, got {query.shape}, {key.shape} and {value.shape}")
  n = math.prod(batch)

  def flat(x):
    return x.reshape((n,) + x.shape[-3:])

  if mask is not None:
    mask_bias = jnp.where(mask, 0.0, -jnp.inf).astype(jnp.float32)
    bias = mask_bias if bias is None else bias.astype(jnp.float32) + mask_bias
  if bias is not None:
    full = jnp.broadcast_shapes(bias.shape, batch + (1, 1, 1))
    bias = jnp.broadcast_to(bias, full)
    per_batch = any(s != 1 for s in bias.shape[:-3])
    if per_batch:
      bias = jnp.broadcast_to(bias, batch + bias.shape[-3:])
    bias = bias.reshape((n if per_batch else 1,) + bias.shape[-3:])
  if segment_ids is not None:
    if isinstance(segment_ids, (tuple, list)):
      segment_ids = tuple(s.reshape(n, -1) for s in segment_ids)
    else:
      segment_ids = segment_ids.reshape(n, -1)
  if kv_lengths is not None:
    kv_lengths = jnp.broadcast_to(kv_lengths, batch).reshape(n)
  out = attention(flat(query), flat(key), flat(value), causal=is_causal, scale=scale,
                  segment_ids=segment_ids, kv_lengths=kv_lengths, bias=bias,
                  sliding_window=sliding_window, logit_softcap=logit_softcap,
                  implementation=implementation)
  return out.reshape(query.shape)
