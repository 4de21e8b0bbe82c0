"""Test set-up: Pallas interpret mode and Triton's interpreter on machines without a GPU."""

import os

import jax

# XLA's compile time grows steeply with the Python stack recorded in each operation's location
# (pytest's own frames come first): a sharded decoder's gradient that compiles in 2 s in a script
# took over 10 minutes under pytest at jax's default of 100 frames.
jax.config.update("jax_traceback_in_locations_limit", 10)

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
