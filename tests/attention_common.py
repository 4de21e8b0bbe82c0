"""What the attention tests share: inputs, the jitted jaxfuse step, the torch twin's step."""

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jaxfuse.ops import attention
from jaxfuse.testing.torch_ref import attention as ref
from tests import helpers


def inputs(b, tq, tk, hq, hkv, d, dtype=jnp.float32, seed=0):
  """Random q, k, v and an output cotangent g in the [batch, seq, heads, head_dim] layout."""
  return helpers.normals(seed, (b, tq, hq, d), (b, tk, hkv, d), (b, tk, hkv, d), (b, tq, hq, d),
                         dtype=dtype)


FAST_COMPILE = helpers.FAST_COMPILE


def jax_step(q, k, v, g, impl, bias=None, **kw):
  """Output and gradients (dq, dk, dv, and dbias with a bias) in one jitted program."""
  def value_and_grads(q, k, v, g, *bias):
    f = lambda q, k, v, *b: attention(q, k, v, implementation=impl,  # noqa: E731
                                      bias=b[0] if b else None, **kw)
    out, vjp = jax.vjp(f, q, k, v, *bias)
    return (out, *vjp(g))

  step = jax.jit(value_and_grads, compiler_options=FAST_COMPILE)
  return step(q, k, v, g, *(() if bias is None else (bias,)))


def _to_torch_kw(kw):
  out = dict(kw)
  if "segment_ids" in kw:
    seg = kw["segment_ids"]
    out["segment_ids"] = (tuple(torch.from_numpy(np.array(s)) for s in seg)
                          if isinstance(seg, tuple) else torch.from_numpy(np.array(seg)))
  if "kv_lengths" in kw:
    out["kv_lengths"] = torch.from_numpy(np.array(kw["kv_lengths"]))
  return out


def torch_step(q, k, v, g, dtype=None, bias=None, **kw):
  """The torch twin's output and gradients, in ``dtype`` (default: the inputs')."""
  tensors = [helpers.to_torch(x, dtype, requires_grad=True) for x in (q, k, v)]
  tb = None if bias is None else helpers.to_torch(bias, dtype, requires_grad=True)
  out = ref.attention(*tensors, bias=tb, **_to_torch_kw(kw))
  out.backward(helpers.to_torch(g, dtype))
  return (out, *(t.grad for t in tensors), *(() if tb is None else (tb.grad,)))


NAMES = ("out", "dq", "dk", "dv", "dbias")


def assert_matches_torch(got, want, what=""):
  """The float32 rule on the output and every gradient, and no NaN anywhere."""
  for x, y, name in zip(got, want, NAMES):
    helpers.assert_close(x, y, what=f"{what} {name}")
    assert not np.isnan(helpers.to_numpy(x)).any(), f"{what} {name} has NaN"
