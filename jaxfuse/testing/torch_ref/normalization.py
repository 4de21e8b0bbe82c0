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
