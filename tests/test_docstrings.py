"""The examples in the docstrings run and print what they say."""

import doctest
import importlib
import pkgutil

import pytest

import jaxfuse


def _modules():
  names = [jaxfuse.__name__]
  for info in pkgutil.walk_packages(jaxfuse.__path__, prefix="jaxfuse."):
    names.append(info.name)
  return sorted(n for n in names if ".kernels.triton" not in n)


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name):
  module = importlib.import_module(name)
  result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
  assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
