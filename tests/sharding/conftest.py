"""The multi-device tests: 8 simulated CPU devices.

The device count is fixed when jax starts, so these tests run in a process of their own:
``XLA_FLAGS=--xla_force_host_platform_device_count=8 pytest tests/sharding`` (``make test``
does it). In a process with fewer devices they are skipped, unless ``JAXFUSE_REQUIRE_DEVICES``
asks for the devices, as ``make test`` does: then a missing device is an error.
"""

import os

import jax
import pytest

DEVICES = 8


def pytest_collection_modifyitems(config, items):
  if jax.device_count() >= DEVICES:
    return
  required = int(os.environ.get("JAXFUSE_REQUIRE_DEVICES", "0") or 0)
  if required:
    raise pytest.UsageError(
        f"tests/sharding needs {required} devices, jax sees {jax.device_count()}: set "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={DEVICES} before jax starts")
  skip = pytest.mark.skip(reason=f"needs {DEVICES} devices: run with XLA_FLAGS="
                                 f"--xla_force_host_platform_device_count={DEVICES}")
  for item in items:
    if "tests/sharding" in str(item.fspath):
      item.add_marker(skip)
