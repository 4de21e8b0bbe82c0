"""Cases of attention (its masks, alignments and options), dot_product_attention and
rotary_embedding."""

import jax.numpy as jnp
import torch
import torch.nn.attention

from jaxfuse import ops
from jaxfuse.testing.torch_ref import attention as ref
from tests.cases import Bad, Case, Mesh

_HEADS = ("data", None, "model", None)


def _math_backend(fn):
  """``fn`` on torch's math SDPA backend, the one with a double backward."""
  def run(*args):
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
      return fn(*args)
  return run


def _draw(rng):
  b, tq, tk = int(rng.integers(0, 3)), int(rng.integers(0, 40)), int(rng.integers(1, 40))
  hkv, groups = [(1, 1), (2, 2), (1, 3)][int(rng.integers(0, 3))]
  d = [1, 8, 12][int(rng.integers(0, 3))]
  return (b, tq, hkv * groups, d), (b, tk, hkv, d), (b, tk, hkv, d)


def _qkv(b, tq, tk, hq, hkv, d):
  return (b, tq, hq, d), (b, tk, hkv, d), (b, tk, hkv, d)


def _case(label, *, realistic=_qkv(2, 512, 512, 8, 2, 64), weird=_qkv(2, 77, 77, 4, 2, 24),
          draw=_draw, mesh=None, kernels=None, second_order=True, **options):
  def call(q, k, v, implementation):
    return ops.attention(q, k, v, implementation=implementation, **options)

  def twin(q, k, v):
    return ref.attention(q, k, v, causal=options.get("causal", False),
                         sliding_window=options.get("sliding_window"),
                         logit_softcap=options.get("logit_softcap"))

  def reference(q, k, v):
    return ops.attention_reference(q, k, v, **options)

  return Case("attention", label, call, twin, realistic, weird, reference=reference,
              draw=draw, second_order=second_order, second_order_twin=_math_backend(twin),
              mesh=mesh, kernels=kernels)


def _segments(q, k, v, implementation):
  ids = (jnp.arange(q.shape[1]) * 3 // q.shape[1])[None].repeat(q.shape[0], 0)
  return ops.attention(q, k, v, causal=True, segment_ids=ids, implementation=implementation)


def _segments_twin(q, k, v):
  ids = (torch.arange(q.shape[1]) * 3 // q.shape[1])[None].repeat(q.shape[0], 1)
  return ref.attention(q, k, v, causal=True, segment_ids=ids)


def _bias(q, k, v, bias, implementation):
  return ops.attention(q, k, v, bias=bias, implementation=implementation)


CASES = [
    _case("", kernels=("attention_bwd_dkdv", "attention_bwd_dq", "attention_fwd_res")),
    _case("causal", causal=True,
          mesh=Mesh(((4, 8, 8, 16), (4, 8, 4, 16), (4, 8, 4, 16)), (_HEADS,) * 3, (0, 1, 2)),
          kernels=("attention_bwd_dkdv", "attention_bwd_dq", "attention_fwd_res")),
    _case("causal q<kv", causal=True, realistic=_qkv(2, 256, 512, 8, 8, 64),
          weird=_qkv(1, 33, 70, 3, 1, 40)),
    _case("bottom_right q<kv", causal="bottom_right", realistic=_qkv(2, 256, 512, 8, 8, 64),
          weird=_qkv(1, 33, 70, 3, 1, 40)),
    _case("window=24", causal=True, sliding_window=24, weird=_qkv(1, 100, 100, 2, 1, 32)),
    _case("softcap=5", logit_softcap=5.0, weird=_qkv(1, 45, 45, 2, 2, 16)),
    _case("causal window=16 softcap=10", causal=True, sliding_window=16, logit_softcap=10.0,
          weird=_qkv(1, 70, 70, 4, 2, 16)),
    _case("head_dim=256", causal=True, realistic=_qkv(1, 256, 256, 4, 4, 256),
          weird=_qkv(1, 19, 19, 2, 1, 256), draw=None, second_order=False),
    Case("attention", "segments", _segments, _segments_twin, _qkv(2, 512, 512, 8, 2, 64),
         _qkv(2, 40, 40, 2, 1, 16), second_order_twin=_math_backend(_segments_twin)),
    Case("attention", "bias", _bias,
         lambda q, k, v, bias: ref.attention(q, k, v, bias=bias),
         _qkv(2, 256, 256, 8, 8, 64) + ((1, 8, 256, 256),),
         _qkv(2, 21, 30, 2, 1, 16) + ((2, 1, 21, 30),),
         # The kernels round ds to the inputs' dtype before the dq and dk products, as
         # FlashAttention's do: measured 2.15x the twin's bfloat16 error at this shape.
         low_precision_k=3.0,
         implementations=("pallas", "triton", "xla"),   # the CPU kernels take no bias
         second_order_twin=_math_backend(lambda q, k, v, bias: ref.attention(q, k, v,
                                                                               bias=bias))),
    Case("attention", "dot_product_attention causal",
         lambda q, k, v, implementation: ops.dot_product_attention(
             q, k, v, is_causal=True, implementation=implementation),
         lambda q, k, v: ref.attention(q, k, v, causal=True), _qkv(2, 512, 512, 8, 8, 64),
         _qkv(2, 23, 23, 4, 4, 16), second_order=False,
         mesh=Mesh(((4, 8, 8, 16),) * 3, (_HEADS,) * 3, (0, 1, 2),
                   implementations=("xla",))),
    Case("rotary_embedding", "",
         lambda x, pos, implementation: ops.rotary_embedding(x, pos,
                                                             implementation=implementation),
         lambda x, pos: ref.rotary(x, pos), ((2, 512, 8, 64), (512,)), ((3, 37, 5, 24), (37,)),
         ints=((1, 64),), second_order=False,
         mesh=Mesh(((4, 8, 8, 16), (8,)), (_HEADS, ()), implementations=("xla",))),
]

Q, KV = jnp.ones((2, 8, 4, 16)), jnp.ones((2, 8, 2, 16))
I32, BF16 = jnp.int32, jnp.bfloat16

# Each raises, with the same error on every implementation, before any kernel runs.
BAD = [
    Bad("attention", "rank",
        lambda i: ops.attention(Q[0], KV, KV, implementation=i),
        ValueError, r"^attention: q must have rank 4, got shape \(8, 4, 16\)"),
    Bad("attention", "int",
        lambda i: ops.attention(Q, KV.astype(I32), KV, implementation=i),
        TypeError, r"^attention: k must have a floating dtype \(float32, bfloat16,"),
    Bad("attention", "dtypes",
        lambda i: ops.attention(Q, KV.astype(BF16), KV.astype(BF16), implementation=i),
        TypeError, r"^attention: q, k, v must share one dtype, got q: float32, k:"),
    Bad("attention", "k v shapes",
        lambda i: ops.attention(Q, KV, KV[:, :4], implementation=i),
        ValueError, r"^attention: k, v must have the same shape \(broadcasting is"),
    Bad("attention", "kv heads",
        lambda i: ops.attention(Q, jnp.ones((2, 8, 3, 16)), jnp.ones((2, 8, 3, 16)),
                                implementation=i),
        ValueError, r"^attention: the kv heads of k \(axis 2, 3\) must divide the"),
    Bad("attention", "head dim",
        lambda i: ops.attention(Q, jnp.ones((2, 8, 2, 8)), jnp.ones((2, 8, 2, 8)),
                                implementation=i),
        ValueError, r"^attention: k must have size 16 on axis 3 \(the head dim of"),
    Bad("attention", "batch",
        lambda i: ops.attention(Q, KV[:1], KV[:1], implementation=i),
        ValueError, r"^attention: k must have size 2 on axis 0 \(the batch size of"),
    Bad("attention", "segments",
        lambda i: ops.attention(Q, KV, KV, segment_ids=jnp.zeros((2, 7), I32), implementation=i),
        ValueError, r"^attention: segment_ids must have shape \(2, 8\), got \(2, 7\)"),
    Bad("attention", "kv_lengths",
        lambda i: ops.attention(Q, KV, KV, kv_lengths=jnp.array([1.0, 2.0]), implementation=i),
        TypeError, r"^attention: kv_lengths must be an integer array, got float32"),
    Bad("attention", "bias",
        lambda i: ops.attention(Q, KV, KV, bias=jnp.zeros((2, 3, 8, 8)), implementation=i),
        ValueError, r"^attention: bias must have shape \[batch \| 1, heads \| 1,"),
    Bad("attention", "scale",
        lambda i: ops.attention(Q, KV, KV, scale="big", implementation=i),
        TypeError, r"^attention: scale must be a Python float or None, got str"),
    Bad("attention", "causal",
        lambda i: ops.attention(Q, KV, KV, causal="left", implementation=i),
        ValueError, r"^attention: causal must be a bool, 'top_left' or"),
    Bad("attention", "window",
        lambda i: ops.attention(Q, KV, KV, sliding_window=3, implementation=i),
        ValueError, r"^attention: sliding_window needs a causal mask \(causal=True"),
    Bad("attention", "softcap",
        lambda i: ops.attention(Q, KV, KV, logit_softcap=0.0, implementation=i),
        ValueError, r"^attention: logit_softcap must be None or a positive float,"),
    Bad("attention", "window without causal",
        lambda i: ops.attention(Q, KV, KV, sliding_window=4, implementation=i), ValueError,
        r"^attention: sliding_window needs a causal mask"),
    Bad("rotary_embedding", "odd head dim",
        lambda i: ops.rotary_embedding(jnp.ones((1, 3, 2, 5)), jnp.arange(3), implementation=i),
        ValueError, r"^rotary_embedding: x must have an even head dim"),
    Bad("rotary_embedding", "positions",
        lambda i: ops.rotary_embedding(jnp.ones((1, 3, 2, 4)), jnp.arange(4), implementation=i),
        ValueError, r"^rotary_embedding: positions must cover the 3 positions"),
]
