"""Test set-up: Pallas interpret mode and Triton's interpreter on machines without a GPU."""

import os

import jax

ON_GPU = jax.default_backend() == "gpu"
if not ON_GPU:
  # Must be set before triton is imported: @triton.jit then builds interpreted kernels, which
  # run on torch CPU tensors.
  os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import jaxfuse  # noqa: E402


@pytest.fixture
def pallas_mode():
  """Pallas kernels in interpret mode on CPU; compiled on a GPU."""
  with jaxfuse.pallas_interpret(not ON_GPU):
    yield
