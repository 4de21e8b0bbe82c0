"""Torch twin of jaxfuse.ops.attention: ``scaled_dot_product_attention`` in the [b, t, h, d]
layout, with jaxfuse's masks (causal top-left, segment ids, kv lengths, additive bias) and its
rule that a query row seeing no key gives zeros."""

import torch
import torch.nn.functional as F


def attention(q, k, v, *, causal=False, scale=None, segment_ids=None, kv_lengths=None,
              bias=None, sliding_window=None, logit_softcap=None):
  """Tensors in [batch, seq, heads, head_dim]; ``segment_ids`` a tensor or a (q, kv) pair.

  ``causal``: False, True or ``"top_left"`` (torch's ``is_causal``), ``"bottom_right"`` (the
  queries are the last positions: FlashAttention's and decoding's); ``sliding_window`` W: a
  query sees the W keys up to itself; ``logit_softcap`` c: scores ``c * tanh(s / c)`` before
  the bias and the masks (Gemma 2's attention, written out: SDPA has no soft-cap).
  """
  b, tq, hq, _ = q.shape
  tk, hkv = k.shape[1], k.shape[2]
  qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
  gqa = hq != hkv
  plain = causal in (False, None, True, "top_left") and sliding_window is None
  if (segment_ids is None and kv_lengths is None and bias is None and plain
      and logit_softcap is None):
    out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=bool(causal), scale=scale,
                                         enable_gqa=gqa)
    return out.transpose(1, 2)
  mask = torch.ones(b, 1, tq, tk, dtype=torch.bool)
  if causal:
    # Query i sees keys j <= i + offset; bottom-right: the offset of the valid keys.
    valid = kv_lengths if kv_lengths is not None else torch.full((b,), tk)
    offset = (valid - tq) if causal == "bottom_right" else torch.zeros(b, dtype=torch.long)
    i = torch.arange(tq)[None, :, None] + offset[:, None, None]
    j = torch.arange(tk)[None, None, :]
    seen = j <= i
    if sliding_window is not None:
      seen &= j > i - sliding_window
    mask &= seen[:, None]
  if logit_softcap is not None:
    return _softcapped(qt, kt, vt, mask, scale, bias, logit_softcap, gqa, segment_ids,
                       kv_lengths).transpose(1, 2)
  if segment_ids is not None:
    q_seg, kv_seg = segment_ids if isinstance(segment_ids, tuple) else (segment_ids,) * 2
    mask &= (q_seg[:, :, None] == kv_seg[:, None, :])[:, None]
  if kv_lengths is not None:
    mask &= (torch.arange(tk)[None, :] < kv_lengths[:, None])[:, None, None, :]
  attn_mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, float("-inf"))
  if bias is not None:
    attn_mask = attn_mask + bias
  # Rows that see no key: torch gives NaN there; attend anywhere and zero the row instead.
  empty = torch.isneginf(attn_mask).all(dim=-1, keepdim=True)
  attn_mask = attn_mask.masked_fill(empty, 0.0)
  out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=attn_mask, scale=scale,
                                       enable_gqa=gqa)
  out = out * (~empty).to(out.dtype)
  return out.transpose(1, 2)


def rotary(x, positions, base=10000.0):
  """RoPE, rotate-half convention, on [batch..., seq, heads, head_dim] tensors."""
  d = x.shape[-1]
  inv_freq = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
  angles = positions.to(torch.float64)[..., :, None, None] * inv_freq
  cos, sin = torch.cos(angles).to(x.dtype), torch.sin(angles).to(x.dtype)
  x1, x2 = x[..., : d // 2], x[..., d // 2:]
  return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _softcapped(qt, kt, vt, mask, scale, bias, cap, gqa, segment_ids, kv_lengths):
  """Attention in [b, h, t, d] with soft-capped scores, written out (rows without a key: 0)."""
  b, _, tq, d = qt.shape
  tk = kt.shape[2]
  if gqa:
    rep = qt.shape[1] // kt.shape[1]
    kt, vt = kt.repeat_interleave(rep, dim=1), vt.repeat_interleave(rep, dim=1)
  if segment_ids is not None:
    q_seg, kv_seg = segment_ids if isinstance(segment_ids, tuple) else (segment_ids,) * 2
    mask = mask & (q_seg[:, :, None] == kv_seg[:, None, :])[:, None]
  if kv_lengths is not None:
    mask = mask & (torch.arange(tk)[None, :] < kv_lengths[:, None])[:, None, None, :]
  s = qt @ kt.transpose(-1, -2) * (scale if scale is not None else d ** -0.5)
  s = cap * torch.tanh(s / cap)
  if bias is not None:
    s = s + bias
  s = s.masked_fill(~mask, float("-inf"))
  empty = torch.isneginf(s).all(dim=-1, keepdim=True)
  p = torch.softmax(s.masked_fill(empty, 0.0), dim=-1) * (~empty).to(s.dtype)
  return p @ vt
