"""The op tables (``tests/cases``) cover every op of the registry: a new op is tested by the
shared tests (twins, second order, properties, errors, lowering, mesh) once it has an entry."""

import jaxfuse.ops  # noqa: F401 - fills the registry
from jaxfuse.ops import base
from tests import cases


def test_every_registered_op_has_cases_and_bad_arguments():
  ops_with_cases = {c.op for c in cases.CASES}
  ops_with_bad = {b.op for b in cases.BAD}
  assert set(base.REGISTRY) <= ops_with_cases, set(base.REGISTRY) - ops_with_cases
  assert set(base.REGISTRY) <= ops_with_bad, set(base.REGISTRY) - ops_with_bad
  assert ops_with_cases <= set(base.REGISTRY), ops_with_cases - set(base.REGISTRY)


def test_every_case_gives_a_shape_per_argument_and_a_twin():
  for case in cases.CASES:
    n = len(case.shapes)
    for shapes in (case.weird, case.small or case.weird) + ((case.mesh.shapes,) if case.mesh
                                                             else ()):
      assert len(shapes) == n, (case.id, shapes)
    assert case.twin is not None, case.id
    assert set(case.diff_args) <= set(case.float_args), case.id


def test_case_ids_are_unique():
  for ids in ([c.id for c in cases.CASES], [b.id for b in cases.BAD]):
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
