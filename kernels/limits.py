"""What both kernel sets (Pallas and Triton) share outside their kernel bodies: their limits,
told to an op's registry entry through ``refuses`` (:class:`jaxfuse.ops.base.Op`), and the
shape arithmetic of their wrappers. Plain Python: it imports neither jax nor triton.
"""

from __future__ import annotations

# The widest attention head the tiles take (both kernel sets share the tile sizes of
# jaxfuse.ops.flash_attention.tuning).
MAX_HEAD_DIM = 256


def too_large(what: str, size: int | None, limit: int) -> str | None:
  """``"takes <what> of at most <limit>, got <size>"`` when ``size`` exceeds ``limit``, else
  None: the reason a ``refuses`` hook gives."""
  if size is not None and size > limit:
    return f"takes {what} of at most {limit}, got {size}"
  return None


def refuses_head_dim(*, head_dim: int | None = None, **_) -> str | None:
  """The attention kernels' ``refuses``: a head dim wider than their tiles hold."""
  return too_large("a head dim", head_dim, MAX_HEAD_DIM)


def matmul_sizes(a_shape, b_shape, a_layout: str, b_layout: str) -> tuple[int, int, int]:
  """``(I, J, K)`` of ``C[I, J] = sum_K A[I, K] B[J, K]`` with ``A`` stored ``[I, K]``
  (``"ik"``) or ``[K, I]`` (``"ki"``) and ``B`` ``[J, K]`` (``"jk"``) or ``[K, J]``
  (``"kj"``); raises ValueError for another layout or contracted sizes that differ."""
  if a_layout not in ("ik", "ki") or b_layout not in ("jk", "kj"):
    raise ValueError(f"layouts must be ik|ki and jk|kj, got {a_layout!r}, {b_layout!r}")
  size_i, size_k = a_shape if a_layout == "ik" else a_shape[::-1]
  size_j, size_kb = b_shape if b_layout == "jk" else b_shape[::-1]
  if size_k != size_kb:
    raise ValueError(f"contracted sizes differ: {size_k} (a) and {size_kb} (b)")
  return size_i, size_j, size_k
