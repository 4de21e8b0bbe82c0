"""The vocab-parallel embedding lookup (Megatron's): each device holds a slice of the table.

``embed(table, tokens)`` is ``table[tokens]``. Under a mesh that splits the ``"vocab"`` axis
(tensor parallelism), each device looks up the tokens that fall in its slice of the table
(zeros for the others), and the devices' lookups are summed; with sequence parallelism the sum
is a reduce-scatter over the sequence, so the result arrives in the residual stream's layout.
The table is never gathered (a table split over ``"embed"`` by FSDP is gathered over that axis
only, as FSDP gathers every parameter for its use). Without a mesh it is ``jnp.take``.

Example:
  >>> import jax.numpy as jnp
  >>> from jaxfuse.parallel import embed
  >>> embed(jnp.arange(6.0).reshape(3, 2), jnp.array([[2, 0]])).tolist()
  [[[4.0, 5.0], [0.0, 1.0]]]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from jaxfuse.ops import partitioning
from jaxfuse.parallel import rules

OP = "embed"


def _entry(axes: tuple[str, ...]):
  return None if not axes else axes[0] if len(axes) == 1 else axes


def _names(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def embed(table: jax.Array, tokens: jax.Array,
          out_axes: tuple = ("batch", "residual_seq", "act_embed")) -> jax.Array:
  """``table[tokens]`` for a ``[vocab, features]`` table and ``[batch, seq]`` integer tokens,
  vocab-parallel under a mesh that splits the vocabulary; the result is laid out as the
  logical ``out_axes`` say (the residual stream: sequence-parallel where the rules make it)."""
  if not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise TypeError(f"{OP}: tokens must be integers, got {tokens.dtype}")
  mesh = rules._context_mesh()
  vocab_spec = None if mesh is None else rules.logical_spec(("vocab",), mesh, table.shape[:1])[0]
  if vocab_spec is None or tokens.ndim != len(out_axes) - 1:
    return jnp.take(table, tokens, axis=0)
  vocab_axes = _names(vocab_spec)
  table_spec = rules.logical_spec(("vocab", "embed"), mesh, table.shape)
  token_spec = rules.logical_spec(out_axes[:2], mesh, tokens.shape)
  # The token layout the lookup starts from: the output's, less the vocabulary axes, which the
  # lookup's sum over the slices scatters over (or, if the output does not split them, sums).
  seq_axes = _names(token_spec[1])
  kept = tuple(a for a in seq_axes if a not in vocab_axes)
  scatter = seq_axes[len(kept):] if seq_axes[:len(kept)] == kept else ()
  if set(scatter) != set(vocab_axes):   # the output does not split the sequence that way
    scatter, seq_axes = (), kept
  ids_spec = PartitionSpec(token_spec[0], _entry(kept))
  out_spec = PartitionSpec(token_spec[0], _entry(seq_axes), None)
  gathered = _names(table_spec[1])

  def lookup(table, ids):
    table, ids = partitioning.match_vma(table, ids)
    if gathered:
      table = lax.all_gather(table, gathered, axis=1, tiled=True)
    rows = table.shape[0]
    rel = ids - lax.axis_index(vocab_axes) * rows
    # Tokens of other slices read zeros (an index past the end, filled), so that the backward
    # keeps only the indices and scatters into this slice alone.
    rel = jnp.where((rel >= 0) & (rel < rows), rel, rows)
    x = jnp.take(table, rel, axis=0, mode="fill", fill_value=0)
    if scatter:
      return lax.psum_scatter(x, scatter, scatter_dimension=1, tiled=True)
    return lax.psum(x, vocab_axes)

  with jax.named_scope(f"jaxfuse.{OP}[vocab-parallel]"):
    return jax.shard_map(lookup, mesh=mesh, in_specs=(table_spec, ids_spec),
                         out_specs=out_spec)(table, tokens)
