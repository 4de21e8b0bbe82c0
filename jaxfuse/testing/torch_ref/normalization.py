"""Torch twins of jaxfuse's normalization ops: ``torch.nn.LayerNorm``, ``torch.nn.RMSNorm`` and
the pre-norm residual add followed by either (``z = x + residual``; ``norm(z)``, ``z``)."""

import torch
import torch.nn.functional as F


def layer_norm(x, scale=None, bias=None, eps=1e-5):
  """``torch.nn.LayerNorm`` carrying ``scale`` and ``bias`` (or neither: elementwise_affine=False).

  torch.nn.LayerNorm cannot hold a bias without a weight; that combination goes through
  ``F.layer_norm``, which the module calls.
  """
  hidden = x.shape[-1]
  if scale is None and bias is not None:
    return F.layer_norm(x, (hidden,), None, bias, eps)
  module = torch.nn.LayerNorm(hidden, eps=eps, elementwise_affine=scale is not None,
                              bias=bias is not None, dtype=x.dtype)
  _set_params(module, scale, bias)
  return module(x)


def rms_norm(x, scale=None, eps=1e-6):
  """``torch.nn.RMSNorm`` carrying ``scale`` (or none: elementwise_affine=False)."""
  module = torch.nn.RMSNorm(x.shape[-1], eps=eps, elementwise_affine=scale is not None,
                            dtype=x.dtype)
  _set_params(module, scale, None)
  return module(x)


def add_layer_norm(x, residual, scale=None, bias=None, eps=1e-5):
  z = x + residual
  return layer_norm(z, scale, bias, eps), z


def add_rms_norm(x, residual, scale=None, eps=1e-6):
  z = x + residual
  return rms_norm(z, scale, eps), z


def _set_params(module, scale, bias):
  """Makes the module compute with the given tensors themselves (so that their .grad fills),
  in place of the parameters it created."""
  for name, value in (("weight", scale), ("bias", bias)):
    if value is not None:
      delattr(module, name)
      setattr(module, name, value)


def qk_norm_rope(x, scale, cos, sin, eps=1e-6, scale_offset=0.0, over="head"):
  """Hugging Face's query/key norm then ``apply_rotary_pos_emb``: Qwen3's ``q_norm``
  (``over="head"``), Gemma 3's (``scale_offset=1``: ``x * (1 + w)``), OLMo 2's
  (``over="projection"``: one RMSNorm over the whole projection), on ``[batch, seq, heads,
  head_dim]`` with ``cos``/``sin`` ``[seq, head_dim // 2]`` (their halves, not repeated)."""
  heads, d = x.shape[-2:]
  if over == "projection":
    flat = x.reshape(*x.shape[:-2], heads * d)
    normed = (rms_norm(flat, None, eps) * (scale + scale_offset) if scale is not None
              else rms_norm(flat, None, eps)).reshape(x.shape)
  else:
    normed = rms_norm(x, None, eps)
    if scale is not None:
      normed = normed * (scale + scale_offset)
  c = torch.cat([cos, cos], dim=-1)[..., None, :].to(x.dtype)
  s = torch.cat([sin, sin], dim=-1)[..., None, :].to(x.dtype)
  rotated = torch.cat([-normed[..., d // 2:], normed[..., :d // 2]], dim=-1)
  return normed * c + rotated * s
