"""``place_batch_rows`` on 8 simulated devices: the arrays ``place_batch`` makes of the whole
batch, from rows asked for once per contiguous run a process holds (across processes:
``tests/test_multiprocess.py``)."""

import numpy as np
import pytest

from jaxfuse import train
from jaxfuse.train import placement

BATCH = np.arange(8 * 16, dtype=np.int32).reshape(8, 16)


@pytest.mark.parametrize("mesh", [None, "data=8", "data=2,context=2,tensor=2", "tensor=8"])
def test_rows_place_as_the_whole_batch(mesh):
  mesh = placement.make_mesh(train.parse_args(["--batch", "8", "--seq", "16"] +
                                              (["--mesh", mesh] if mesh else [])))
  asked = []

  def rows(lo, hi):
    asked.append((lo, hi))
    return BATCH[lo:hi], BATCH[lo:hi] + 1

  got = placement.place_batch_rows(rows, BATCH.shape, mesh)
  want = placement.place_batch((BATCH, BATCH + 1), mesh)
  assert asked == [(0, 8)]   # one process holds every row
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert mesh is None or g.sharding == w.sharding


def test_rows_of_the_wrong_count_are_refused():
  mesh = placement.make_mesh(train.parse_args(["--batch", "8", "--mesh", "data=8"]))
  with pytest.raises(ValueError, match=r"rows\(0, 8\) returned arrays of \[7\] rows, expected 8"):
    placement.place_batch_rows(lambda lo, hi: (BATCH[lo:hi - 1],), BATCH.shape, mesh)
