"""The examples in the docstrings run and print what they say."""

import doctest
import importlib
import pkgutil

import jax
import pytest

import jaxfuse


def _modules():
  names = [jaxfuse.__name__]
  for info in pkgutil.walk_packages(jaxfuse.__path__, prefix="jaxfuse."):
    names.append(info.name)
  return sorted(n for n in names if ".kernels.triton" not in n)


@pytest.fixture
def fast_compiles():
  """The examples compile many small programs and run each once: XLA skips most of its
  optimizations meanwhile, which changes how fast they run, not what they compute."""
  before = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", True)
  try:
    yield
  finally:
    jax.config.update("jax_disable_most_optimizations", before)


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name, fast_compiles):
  module = importlib.import_module(name)
  result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
  assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
