"""Applying a stack of layers with a recomputation policy per layer, unrolled or scanned, with
optional √L segments.

``apply_layers(step, layers, carry, policies=...)`` runs ``carry = step(layer, carry, i)`` for
every layer ``i``, in order (``i`` a Python int for unrolled layers, a traced one under a
scan):

- ``layers`` is a list of NNX modules (one traced call each: compile time grows with L) or
  one NNX module whose parameters are stacked on a leading layer axis (made with
  ``nnx.vmap``, see :func:`stacked`): the layers then run as ``jax.lax.scan`` over that axis,
  one traced body however many layers there are. Consecutive layers with the same policy share
  one scan.
- ``policies[i]`` is what layer ``i``'s backward keeps: ``None`` (no recomputation: the layer
  keeps what its ops keep) or any policy :func:`jaxfuse.remat.resolve_policy` takes.
- ``segments`` (``"sqrt"`` or a size ``s``) adds the segment checkpointing of Chen et al.
  (2016): the layers are grouped into segments of about √L layers; each segment keeps only its
  input carry, and its layers' residuals exist only while the backward pass recomputes that
  segment. The residual bytes fall from ``L`` layers' worth to ``L / s`` carries plus one
  segment's layers, at the cost of one more forward pass.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from flax import nnx
  >>> from jaxfuse.remat.layers import apply_layers, stacked
  >>> layers = stacked(lambda rngs: nnx.Linear(8, 8, rngs=rngs), 6, nnx.Rngs(0))
  >>> step = lambda layer, h, i: jnp.tanh(layer(h))
  >>> apply_layers(step, layers, jnp.ones((2, 8)), policies=["nothing"] * 6,
  ...              segments="sqrt").shape
  (2, 8)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import jax
from flax import nnx

from jaxfuse.remat.policies import PolicySpec, resolve_policy


def stacked(make: Callable[[nnx.Rngs], nnx.Module], count: int, rngs: nnx.Rngs) -> nnx.Module:
  """``count`` layers made by ``make(rngs)``, as one module whose parameters carry a leading
  layer axis (``nnx.vmap`` over split rngs: one trace however many layers)."""

  @nnx.split_rngs(splits=count)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def create(rngs):
    return make(rngs)

  return create(rngs)


def segment_size(num_layers: int, segments: str | int | None) -> int | None:
  """The layers per segment: ``"sqrt"`` gives ``round(sqrt(L))``; an int is taken as given."""
  if segments is None:
    return None
  if segments == "sqrt":
    return max(1, round(math.sqrt(num_layers)))
  if isinstance(segments, int) and not isinstance(segments, bool) and segments >= 1:
    return segments
  raise ValueError(f"segments must be None, 'sqrt' or a positive int, got {segments!r}")


def equal_runs(items: Sequence) -> list[tuple[int, int]]:
  """``[(start, stop)]`` of consecutive equal items (layers with equal policies or costs)."""
  runs, start = [], 0
  for i in range(1, len(items) + 1):
    if i == len(items) or items[i] != items[start]:
      runs.append((start, i))
      start = i
  return runs


def _checkpointed(fn, policy):
  return fn if policy is None else jax.checkpoint(fn, policy=resolve_policy(policy))


def apply_layers(step: Callable, layers, carry, *, policies: Sequence[PolicySpec],
                 segments: str | int | None = None):
  """Runs ``carry = step(layer, carry, i)`` over ``layers``; see the module docstring."""
  if isinstance(layers, (list, tuple, nnx.List)):
    return _apply_unrolled(step, list(layers), carry, policies, segments)
  return _apply_scanned(step, layers, carry, policies, segments)


def _apply_unrolled(step, layers, carry, policies, segments):
  if len(policies) != len(layers):
    raise ValueError(f"apply_layers: {len(policies)} policies for {len(layers)} layers")
  size = segment_size(len(layers), segments)

  def run(blocks, carry, pols, first):
    for i, (block, policy) in enumerate(zip(blocks, pols)):
      layer_step = functools.partial(_at, step, first + i)
      fn = layer_step if policy is None else nnx.remat(layer_step,
                                                       policy=resolve_policy(policy))
      carry = fn(block, carry)
    return carry

  if size is None:
    return run(layers, carry, policies, 0)
  def segment(pols, first):
    def call(blocks, carry):
      return run(blocks, carry, pols, first)
    return nnx.remat(call, policy=resolve_policy("nothing"))

  for a in range(0, len(layers), size):
    carry = segment(list(policies[a:a + size]), a)(nnx.List(layers[a:a + size]), carry)
  return carry


def _at(step, index, block, carry):
  """``step`` of the layer at ``index``."""
  return step(block, carry, index)


_SLICES = frozenset({"dynamic_slice", "slice", "gather", "squeeze"})


def _without_slices(policy):
  """``policy`` (None: keep everything) that never keeps a slice of the stacked parameters:
  a layer's slice is recomputed in the backward pass instead of kept as a copy."""
  base = None if policy is None else resolve_policy(policy)

  def keep(prim, *args, **params):
    if prim.name in _SLICES:
      return False
    return True if base is None else base(prim, *args, **params)

  return keep


def _apply_scanned(step, layers, carry, policies, segments):
  graphdef, state = nnx.split(layers)
  count = jax.tree_util.tree_leaves(state)[0].shape[0]
  if len(policies) != count:
    raise ValueError(f"apply_layers: {len(policies)} policies for {count} stacked layers")
  size = segment_size(count, segments)

  def call(carry, layer_state, index):
    return step(nnx.merge(graphdef, layer_state), carry, index)

  def scan_all(carry, states, policy, offset):
    """Every layer of ``states`` (stacked, the first being layer ``offset``), each under
    ``policy``: a scan over them."""
    body = _checkpointed(call, policy)
    n = jax.tree_util.tree_leaves(states)[0].shape[0]
    return jax.lax.scan(lambda c, xs: (body(c, *xs), None), carry,
                        (states, offset + jax.numpy.arange(n)))[0]

  def scan_range(carry, states, lo, hi, policy, offset):
    """Layers [lo, hi) of ``states``: a scan over their indices that slices each layer inside
    its (checkpointed) body, so that no copy of the parameters is kept."""
    def body(carry, i):
      layer_state = jax.tree_util.tree_map(
          lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), states)
      return call(carry, layer_state, offset + i)
    body = jax.checkpoint(body, policy=_without_slices(policy))
    return jax.lax.scan(lambda c, i: (body(c, i), None), carry, jax.numpy.arange(lo, hi))[0]

  def run(carry, states, a, b, offset=0):
    """Layers [a, b) of ``states`` (whose first is layer ``offset``), one scan per run of
    equal policies."""
    n = jax.tree_util.tree_leaves(states)[0].shape[0]
    for lo, hi in equal_runs(policies[a:b]):
      policy = policies[a + lo]
      if lo == 0 and hi == n and a == 0:
        carry = scan_all(carry, states, policy, offset)
      else:
        carry = scan_range(carry, states, a + lo, a + hi, policy, offset)
    return carry

  if size is None:
    return run(carry, state, 0, count)
  # Segments: the full ones in an outer scan when their policies agree, the others one by one;
  # each keeps only its input carry.
  full = count // size
  start = 0
  if full > 1 and all(policies[i] == policies[i % size] for i in range(full * size)):
    def segment(carry, j):   # slices its layers inside: no copy of the parameters is kept
      seg = jax.tree_util.tree_map(
          lambda x: jax.lax.dynamic_slice_in_dim(x, j * size, size), state)
      return run(carry, seg, 0, size, j * size)

    segment = _checkpointed(segment, "nothing")
    carry = jax.lax.scan(lambda c, j: (segment(c, j), None), carry, jax.numpy.arange(full))[0]
    start = full * size
  for a in range(start, count, size):
    b = min(a + size, count)
    carry = _checkpointed(lambda c, st, a=a, b=b: run(c, st, a, b), "nothing")(carry, state)
  return carry


class LayerStack:
  """What a model with a stack of layers needs for recomputation; mixed into
  :class:`jaxfuse.models.Decoder` and :class:`jaxfuse.models.MLPStack`.

  The model holds ``self.layers`` (an ``nnx.List`` of blocks, or one block with stacked
  parameters when ``self.scan_layers``), and each block has ``step(carry, *args)``. It gets
  ``num_layers``, ``layer(i)``, ``set_remat(remat, segments)``, ``remat``, ``segments`` and
  ``layer_policies``, and runs its blocks with :meth:`apply_blocks`. Blocks with an ``mlp``
  whose ``recompute`` is ``"activation"`` recompute nothing by themselves under a policy: the
  policy decides.
  """

  @property
  def num_layers(self) -> int:
    if self.scan_layers:
      return jax.tree_util.tree_leaves(nnx.state(self.layers))[0].shape[0]
    return len(self.layers)

  def set_remat(self, remat=None, segments: str | int | None = None) -> None:
    """Sets what each block's backward keeps: ``remat`` is None (no recomputation), ``"block"``
    (only the block's input), a policy for every block or a :class:`jaxfuse.remat.Plan`;
    ``segments`` is None, ``"sqrt"`` or a size. Checked here, used by the next call."""
    from jaxfuse.remat.planner import layer_policies
    from jaxfuse.remat.policies import freeze_policy

    policies = layer_policies(remat, self.num_layers, type(self).__name__)
    segment_size(self.num_layers, segments)   # checks it before anything changes
    self.layer_policies = policies
    self.remat = freeze_policy(remat)
    self.segments = segments
    recompute = "activation" if remat is None else None
    for block in ([self.layers] if self.scan_layers else list(self.layers)):
      mlp = getattr(block, "mlp", None)
      if mlp is not None and hasattr(mlp, "recompute"):
        mlp.recompute = recompute

  def layer(self, i: int):
    """Block ``i`` (for stacked layers, a module holding that block's slice)."""
    if not self.scan_layers:
      return self.layers[i]
    graphdef, state = nnx.split(self.layers)
    return nnx.merge(graphdef, jax.tree_util.tree_map(lambda x: x[i], state))

  def apply_blocks(self, carry, *args):
    """``carry = block.step(carry, *args, index)`` over the blocks, under the model's
    policies."""
    return apply_layers(lambda block, c, i: block.step(c, *args, i), self.layers, carry,
                        policies=self.layer_policies, segments=self.segments)
