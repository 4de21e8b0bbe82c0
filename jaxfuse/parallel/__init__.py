"""Parallelism on JAX's SPMD: the mesh, the logical-axis rules, ring attention.

- :func:`make_mesh` / :func:`parse_mesh`: the ``data``, ``fsdp``, ``expert``, ``context`` and
  ``tensor`` axes (:mod:`.mesh`);
- :data:`RULES`, :func:`annotate`, :func:`constrain`, :func:`place`: logical axes of
  parameters and activations mapped onto them (:mod:`.rules`);
- :func:`embed`: the vocab-parallel embedding lookup (:mod:`.embedding`);
- :func:`ring_attention`, :func:`context_parallel_attention`, :func:`zigzag_order`: attention
  over a sequence split across devices (:mod:`.ring_attention`);
- :mod:`.experts`: a Mixture-of-Experts layer's token-expert pairs sent to the devices of their
  experts by all-to-all and back (expert parallelism).

The ops of :mod:`jaxfuse.ops` partition themselves (:mod:`jaxfuse.ops.partitioning`); this
package is what a model adds on top: where its parameters and activations live.
"""

from jaxfuse.parallel.embedding import embed
from jaxfuse.parallel.mesh import MESH_AXES, make_mesh, parse_mesh
from jaxfuse.parallel.ring_attention import (context_parallel_attention, ring_attention,
                                             zigzag_order)
from jaxfuse.parallel.rules import (RULES, annotate, axis_rules, constrain, current_rules,
                                    logical_spec, mesh_size, param_specs, place)

__all__ = [
    "MESH_AXES",
    "RULES",
    "annotate",
    "axis_rules",
    "constrain",
    "context_parallel_attention",
    "current_rules",
    "embed",
    "logical_spec",
    "make_mesh",
    "mesh_size",
    "param_specs",
    "parse_mesh",
    "place",
    "ring_attention",
    "zigzag_order",
]
