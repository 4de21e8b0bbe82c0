"""Every op under the transformations a Flax user applies: vmap (against a loop over the
mapped axis), scan (as layers are stacked), jit of grad, and remat; on the XLA path."""

import jax
import jax.numpy as jnp
import pytest

from jaxfuse import ops
from tests import helpers


def _normal(shape, seed):
  return helpers.normal(seed, shape)


# (op on one example, its example arguments); the mapped axis is added in front.
CASES = {
    "add_act": (lambda a, b: ops.add_act(a, b, "gelu"), [(5, 33), (5, 33)]),
    "bias_act": (lambda x, b: ops.bias_act(x, b, "silu"), [(5, 33), (33,)]),
    "glu": (lambda a, b: ops.glu(a, b, "silu"), [(5, 33), (5, 33)]),
    "softmax": (lambda x: ops.softmax(x, axis=0), [(5, 33)]),
    "rms_norm": (lambda x, s: ops.rms_norm(x, s), [(5, 33), (33,)]),
    "add_layer_norm": (lambda x, r, s: ops.add_layer_norm(x, r, s)[0], [(5, 33), (5, 33), (33,)]),
    "recompute_linear": (lambda x, w: ops.recompute_linear(x, w), [(5, 33), (7, 33)]),
    "dense": (lambda x, k: ops.dense(x, k), [(5, 33), (33, 7)]),
    "linear_cross_entropy": (
        lambda h, w: ops.linear_cross_entropy(h, w, jnp.arange(5) % 11, chunk_size=3),
        [(5, 16), (11, 16)]),
    "attention": (lambda q, k: ops.attention(q, k, k, causal=True, sliding_window=3),
                  [(1, 9, 4, 8), (1, 9, 2, 8)]),
}


def _args(shapes, batch, seed=0):
  return [_normal((batch, *s), seed + i) for i, s in enumerate(shapes)]


def _loss(fn):
  return lambda *args: jnp.sum(fn(*args) ** 2)


@pytest.mark.parametrize("name", sorted(CASES))
def test_vmap_of_value_and_grad_equals_a_loop(name):
  fn, shapes = CASES[name]
  args = _args(shapes, 3)
  step = jax.value_and_grad(_loss(fn), argnums=tuple(range(len(args))))
  mapped = jax.jit(jax.vmap(step), compiler_options=helpers.FAST_COMPILE)(*args)
  one_step = jax.jit(step, compiler_options=helpers.FAST_COMPILE)
  for i in range(3):
    one = one_step(*[a[i] for a in args])
    for got, want in zip(jax.tree.leaves(mapped), jax.tree.leaves(one)):
      helpers.assert_close(got[i], want, what=f"{name} example {i}")


@pytest.mark.parametrize("name", sorted(CASES))
def test_scan_over_stacked_arguments_and_remat(name):
  """Scanning the op over a stacked leading axis, with its body rematerialized, gives the same
  values and gradients as applying it to each slice."""
  fn, shapes = CASES[name]
  args = _args(shapes, 3, seed=10)

  def scanned(*args):
    def body(total, xs):
      return total + jax.checkpoint(_loss(fn))(*xs), None
    return jax.lax.scan(body, 0.0, tuple(args))[0]

  def looped(*args):
    return sum(_loss(fn)(*[a[i] for a in args]) for i in range(3))

  argnums = tuple(range(len(args)))
  got = jax.jit(jax.value_and_grad(scanned, argnums=argnums),
                compiler_options=helpers.FAST_COMPILE)(*args)
  want = jax.jit(jax.value_and_grad(looped, argnums=argnums),
                 compiler_options=helpers.FAST_COMPILE)(*args)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    helpers.assert_close(a, b, what=name)
