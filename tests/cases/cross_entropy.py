"""Cases of the ops on the LM head, linear_cross_entropy and linear_log_probs: their options and
modes (a fifth of the labels ignored)."""

import jax.numpy as jnp
import torch

from jaxfuse import ops
from jaxfuse.testing.torch_ref import cross_entropy as ref
from tests.cases import Bad, Case, Mesh

IGNORE = -100


def _ignoring(y):
  """Every label divisible by 5 ignored (jax or torch)."""
  if isinstance(y, torch.Tensor):
    return torch.where(y % 5 == 0, IGNORE, y).long()
  return jnp.where(y % 5 == 0, IGNORE, y)


def _case(label, *, reduction="mean", bias=True, draw=True, mesh=None, second_order=True,
          kernels=None, **options):
  # grad_in_forward is an XLA mode: the kernels compute the gradients in the backward pass.
  implementations = ("xla",) if options.get("grad_in_forward") else None
  def call(h, w, b, y, implementation):
    return ops.linear_cross_entropy(h, w, _ignoring(y), bias=b if bias else None,
                                    reduction=reduction, implementation=implementation, **options)

  def twin(h, w, b, y):
    return ref.linear_cross_entropy(h, w, _ignoring(y), b if bias else None, reduction=reduction,
                                    **{k: v for k, v in options.items()
                                       if k not in ("grad_in_forward", "chunk_size")})

  def reference(h, w, b, y):
    return ops.linear_cross_entropy_reference(
        h, w, _ignoring(y), bias=b if bias else None, reduction=reduction,
        **{k: v for k, v in options.items() if k not in ("grad_in_forward", "chunk_size")})

  def random_shapes(rng):
    lead = tuple(int(n) for n in rng.integers(1, 20, rng.integers(1, 3)))
    d, v = int(rng.integers(1, 40)), int(rng.integers(2, 300))
    return lead + (d,), (v, d), (v,), lead

  return Case("linear_cross_entropy", label, call, twin,
              ((256, 1024), (32000, 1024), (32000,), (256,)),
              ((5, 37, 64), (1000, 64), (1000,), (5, 37)), ints=((3, lambda shapes: shapes[1][0]),),
              wrt=(0, 1, 2) if bias else (0, 1), scale=(1.0, 0.125, 0.1),
              reference=reference, draw=random_shapes if draw else None,
              second_order=second_order, mesh=mesh, kernels=kernels,
              implementations=implementations,
              small=((11, 6), (13, 6), (13,), (11,)))


_V = 64
CASES = [
    _case("", kernels=("linear_xent_bwd_logit_grad", "linear_xent_fwd")),
    _case("sum smoothing z_loss", reduction="sum", label_smoothing=0.1, z_loss=1e-3),
    _case("none softcap", reduction="none", logit_softcap=3.0, bias=False),
    _case("chunked", chunk_size=4, bias=False, draw=False),
    _case("grad_in_forward", grad_in_forward=True, bias=False),
    _case("vocab-parallel", reduction="sum", bias=False, draw=False,
          mesh=Mesh(((4, 8, 32), (_V, 32), (_V,), (4, 8)),
                    (("data", None, None), ("model", None), (), ("data", None)), local=False)),
    _case("grad_in_forward vocab-parallel", reduction="sum", grad_in_forward=True,
          label_smoothing=0.1, bias=False, draw=False,
          mesh=Mesh(((4, 8, 32), (_V, 32), (_V,), (4, 8)),
                    (("data", None, None), ("model", None), (), ("data", None)), local=False,
                    implementations=("xla",))),
]



def _log_probs_case(label, *, bias=True, draw=True, mesh=None, kernels=None,
                    return_entropy=True, **options):
  def call(h, w, b, y, implementation):
    return ops.linear_log_probs(h, w, _ignoring(y), bias=b if bias else None,
                                return_entropy=return_entropy, implementation=implementation,
                                **options)

  def twin(h, w, b, y):
    return ref.linear_log_probs(h, w, _ignoring(y), b if bias else None,
                                return_entropy=return_entropy,
                                **{k: v for k, v in options.items() if k != "chunk_size"})

  def reference(h, w, b, y):
    return ops.linear_log_probs_reference(
        h, w, _ignoring(y), bias=b if bias else None, return_entropy=return_entropy,
        **{k: v for k, v in options.items() if k != "chunk_size"})

  def random_shapes(rng):
    lead = tuple(int(n) for n in rng.integers(1, 20, rng.integers(1, 3)))
    d, v = int(rng.integers(1, 40)), int(rng.integers(2, 300))
    return lead + (d,), (v, d), (v,), lead

  return Case("linear_log_probs", label, call, twin,
              ((256, 1024), (32000, 1024), (32000,), (256,)),
              ((5, 37, 64), (1000, 64), (1000,), (5, 37)), ints=((3, lambda shapes: shapes[1][0]),),
              wrt=(0, 1, 2) if bias else (0, 1), scale=(1.0, 0.125, 0.1),
              reference=reference, draw=random_shapes if draw else None, mesh=mesh,
              kernels=kernels, small=((11, 6), (13, 6), (13,), (11,)))


CASES += [
    _log_probs_case("entropy temperature", temperature=0.7,
                    kernels=("linear_xent_bwd_logit_grad", "linear_xent_fwd")),
    _log_probs_case("softcap", logit_softcap=3.0, return_entropy=False, bias=False),
    _log_probs_case("entropy softcap temperature chunked", logit_softcap=3.0, temperature=1.3,
                    chunk_size=4, draw=False),
    _log_probs_case("entropy vocab-parallel", bias=False, draw=False, temperature=0.9,
                    mesh=Mesh(((4, 8, 32), (_V, 32), (_V,), (4, 8)),
                              (("data", None, None), ("model", None), (), ("data", None)),
                              local=False)),
]

H, W, Y = jnp.ones((4, 8)), jnp.ones((10, 8)), jnp.array([0, 1, 2, 3])
Y_OUTSIDE = jnp.array([0, 1, 10, 3])  # concrete: labels are checked only where they are
F32, BF16 = jnp.float32, jnp.bfloat16

# Each raises, with the same error on every implementation, before any kernel runs.
BAD = [
    Bad("linear_cross_entropy", "weight size",
        lambda i: ops.linear_cross_entropy(H, W[:, :7], Y, implementation=i),
        ValueError, r"^linear_cross_entropy: weight must have size 8 on axis 1"),
    Bad("linear_cross_entropy", "weight rank",
        lambda i: ops.linear_cross_entropy(H, W[None], Y, implementation=i),
        ValueError, r"^linear_cross_entropy: weight must have rank 2, got shape"),
    Bad("linear_cross_entropy", "labels shape",
        lambda i: ops.linear_cross_entropy(H, W, Y[:, None], implementation=i),
        ValueError, r"^linear_cross_entropy: labels must have shape h\.shape\[:-1\] ="),
    Bad("linear_cross_entropy", "labels dtype",
        lambda i: ops.linear_cross_entropy(H, W, Y.astype(F32), implementation=i),
        TypeError, r"^linear_cross_entropy: labels must have an integer dtype,"),
    Bad("linear_cross_entropy", "dtypes",
        lambda i: ops.linear_cross_entropy(H, W.astype(BF16), Y, implementation=i),
        TypeError, r"^linear_cross_entropy: h, weight must share one dtype, got"),
    Bad("linear_cross_entropy", "bias",
        lambda i: ops.linear_cross_entropy(H, W, Y, bias=jnp.ones(9), implementation=i),
        ValueError, r"^linear_cross_entropy: bias must have shape \(V,\) = \(10,\),"),
    Bad("linear_cross_entropy", "labels range",
        lambda i: ops.linear_cross_entropy(H, W, Y_OUTSIDE, implementation=i),
        ValueError, r"^linear_cross_entropy: labels must be in \[0, 10\) \(V ="),
    Bad("linear_cross_entropy", "empty vocabulary",
        lambda i: ops.linear_cross_entropy(H, W[:0], Y, implementation=i),
        ValueError, r"^linear_cross_entropy: the vocabulary \(weight\.shape\[0\], V\)"),
    Bad("linear_cross_entropy", "reduction",
        lambda i: ops.linear_cross_entropy(H, W, Y, reduction="avg", implementation=i),
        ValueError, r"^linear_cross_entropy: reduction must be one of \('mean',"),
    Bad("linear_cross_entropy", "smoothing",
        lambda i: ops.linear_cross_entropy(H, W, Y, label_smoothing=1.5, implementation=i),
        ValueError, r"^linear_cross_entropy: label_smoothing must be in \[0, 1\],"),
    Bad("linear_cross_entropy", "z_loss",
        lambda i: ops.linear_cross_entropy(H, W, Y, z_loss=-1.0, implementation=i),
        ValueError, r"^linear_cross_entropy: z_loss must be >= 0, got -1\.0"),
    Bad("linear_cross_entropy", "softcap",
        lambda i: ops.linear_cross_entropy(H, W, Y, logit_softcap=0.0, implementation=i),
        ValueError, r"^linear_cross_entropy: logit_softcap must be None or > 0,"),
    Bad("linear_cross_entropy", "chunk",
        lambda i: ops.linear_cross_entropy(H, W, Y, chunk_size=0, implementation=i),
        ValueError, r"^linear_cross_entropy: chunk_size must be None or a positive"),
    Bad("linear_cross_entropy", "grad_in_forward without a scalar loss",
        lambda i: ops.linear_cross_entropy(H, W, Y, reduction="none", grad_in_forward=True,
                                           implementation=i),
        ValueError, r"^linear_cross_entropy: grad_in_forward=True needs a scalar loss"),
]

BAD += [
    Bad("linear_log_probs", "tokens dtype",
        lambda i: ops.linear_log_probs(H, W, Y.astype(F32), implementation=i),
        TypeError, r"^linear_log_probs: tokens must have an integer dtype,"),
    Bad("linear_log_probs", "tokens shape",
        lambda i: ops.linear_log_probs(H, W, Y[:, None], implementation=i),
        ValueError, r"^linear_log_probs: tokens must have shape h\.shape\[:-1\] ="),
    Bad("linear_log_probs", "tokens range",
        lambda i: ops.linear_log_probs(H, W, Y_OUTSIDE, implementation=i),
        ValueError, r"^linear_log_probs: tokens must be in \[0, 10\) \(V ="),
    Bad("linear_log_probs", "temperature",
        lambda i: ops.linear_log_probs(H, W, Y, temperature=0.0, implementation=i),
        ValueError, r"^linear_log_probs: temperature must be a finite number > 0, got 0\.0"),
    Bad("linear_log_probs", "softcap",
        lambda i: ops.linear_log_probs(H, W, Y, logit_softcap=-1.0, implementation=i),
        ValueError, r"^linear_log_probs: logit_softcap must be None or > 0,"),
    Bad("linear_log_probs", "weight size",
        lambda i: ops.linear_log_probs(H, W[:, :7], Y, implementation=i),
        ValueError, r"^linear_log_probs: weight must have size 8 on axis 1"),
]
