"""Cases of linear_distillation_loss: TRL's generalized JSD between a student's and a teacher's
LM heads (a fifth of the tokens masked), its three regimes of beta, its reductions, the
temperature and the soft-caps; the teacher's arrays are inputs but not differentiated."""

import jax.numpy as jnp
import torch

from jaxfuse import ops
from jaxfuse.testing.torch_ref import distillation as ref
from tests.cases import Bad, Case

IGNORE = -100


def _ignoring(y):
  """Every label divisible by 5 ignored (jax or torch)."""
  if isinstance(y, torch.Tensor):
    return torch.where(y % 5 == 0, IGNORE, y).long()
  return jnp.where(y % 5 == 0, IGNORE, y)


def _case(label, *, bias=True, draw=True, as_mask=False, chunk_size=None, **options):
  """Arguments ``(h_student, w_student, student_bias, h_teacher, w_teacher, teacher_bias,
  labels)``; ``as_mask`` passes the tokens that count as a boolean mask instead of labels."""
  def select(y):
    labels = _ignoring(y)
    return {"mask": labels != IGNORE} if as_mask else {"labels": labels}

  def biases(bs, bt):
    return {"student_bias": bs, "teacher_bias": bt} if bias else {}

  def call(hs, ws, bs, ht, wt, bt, y, implementation):
    return ops.linear_distillation_loss(hs, ws, ht, wt, **select(y), **biases(bs, bt),
                                        chunk_size=chunk_size, implementation=implementation,
                                        **options)

  def twin(hs, ws, bs, ht, wt, bt, y):
    sel = select(y)
    return ref.linear_distillation_loss(hs, ws, ht, wt, sel.get("mask"), bs if bias else None,
                                        bt if bias else None, labels=sel.get("labels"),
                                        **options)

  def reference(hs, ws, bs, ht, wt, bt, y):
    return ops.linear_distillation_loss_reference(hs, ws, ht, wt, **select(y),
                                                  **biases(bs, bt), **options)

  def random_shapes(rng):
    lead = tuple(int(n) for n in rng.integers(1, 20, rng.integers(1, 3)))
    ds, dt, v = (int(rng.integers(1, 40)), int(rng.integers(1, 40)), int(rng.integers(2, 300)))
    return lead + (ds,), (v, ds), (v,), lead + (dt,), (v, dt), (v,), lead

  return Case("linear_distillation_loss", label, call, twin,
              ((256, 768), (32000, 768), (32000,), (256, 1024), (32000, 1024), (32000,), (256,)),
              ((5, 37, 64), (1000, 64), (1000,), (5, 37, 48), (1000, 48), (1000,), (5, 37)),
              ints=((6, lambda shapes: shapes[1][0]),), wrt=(0, 1, 2) if bias else (0, 1),
              scale=(1.0, 0.125, 0.1, 1.0, 0.125, 0.1), reference=reference,
              draw=random_shapes if draw else None,
              small=((11, 6), (13, 6), (13,), (11, 5), (13, 5), (13,), (11,)))


CASES = [
    _case("", beta=0.5),
    _case("forward kl temperature sum", beta=0.0, temperature=2.0, reduction="sum"),
    _case("reverse kl softcaps mean", beta=1.0, reduction="mean", bias=False,
          student_logit_softcap=3.0, teacher_logit_softcap=5.0),
    _case("beta 0.3 none mask chunked", beta=0.3, temperature=0.7, reduction="none",
          as_mask=True, chunk_size=4, draw=False),
]

_OP = "linear_distillation_loss"
HS, WS, HT, WT = jnp.ones((4, 8)), jnp.ones((10, 8)), jnp.ones((4, 6)), jnp.ones((10, 6))
Y = jnp.array([0, 1, -100, 3])


def _bad(label, error, match, **kwargs):
  """A call with the arguments above, ``kwargs`` replacing or adding some."""
  def call(i):
    args = {"h_student": HS, "w_student": WS, "h_teacher": HT, "w_teacher": WT, "labels": Y,
            **kwargs}
    heads = [args.pop(k) for k in ("h_student", "w_student", "h_teacher", "w_teacher")]
    return ops.linear_distillation_loss(*heads, implementation=i, **args)

  return Bad(_OP, label, call, error, match)


# Each raises, with the same error on every implementation, before anything runs.
BAD = [
    _bad("vocabulary", ValueError,
         r"^linear_distillation_loss: w_teacher scores 12 words .* a teacher whose vocabulary "
         r"differs from the student's", w_teacher=jnp.ones((12, 6))),
    _bad("beta", ValueError, r"^linear_distillation_loss: beta must be a number in \[0, 1\]",
         beta=1.5),
    _bad("temperature", ValueError,
         r"^linear_distillation_loss: temperature must be a finite number > 0, got 0\.0",
         temperature=0.0),
    _bad("reduction", ValueError, r"^linear_distillation_loss: reduction must be one of",
         reduction="avg"),
    _bad("teacher tokens", ValueError,
         r"^linear_distillation_loss: h_teacher must have the tokens' shape",
         h_teacher=jnp.ones((5, 6))),
    _bad("teacher width", ValueError,
         r"^linear_distillation_loss: w_teacher must have size 6 on axis 1",
         w_teacher=jnp.ones((10, 7))),
    _bad("student bias", ValueError,
         r"^linear_distillation_loss: student_bias must have shape \(V,\) = \(10,\)",
         student_bias=jnp.ones(9)),
    _bad("teacher dtypes", TypeError,
         r"^linear_distillation_loss: h_teacher, w_teacher must share one dtype",
         w_teacher=WT.astype(jnp.bfloat16)),
    _bad("mask dtype", TypeError, r"^linear_distillation_loss: mask must be boolean",
         labels=None, mask=Y),
    _bad("mask and labels", ValueError, r"^linear_distillation_loss: pass mask or labels",
         mask=Y != -100),
    _bad("labels shape", ValueError,
         r"^linear_distillation_loss: labels must have shape h_student\.shape\[:-1\]",
         labels=Y[:3]),
    _bad("softcap", ValueError,
         r"^linear_distillation_loss: teacher_logit_softcap must be None or a finite number",
         teacher_logit_softcap=0.0),
    _bad("chunk", ValueError, r"^linear_distillation_loss: chunk_size must be None or a positive",
         chunk_size=0),
]
