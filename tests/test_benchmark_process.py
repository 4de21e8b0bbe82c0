"""``python -m benchmarks`` restarts itself once with its process settings, and never again."""

import importlib
import os
import sys

import pytest

main_module = importlib.import_module("benchmarks.__main__")


class _Exec(Exception):
  pass


@pytest.fixture
def calls(monkeypatch):
  seen = []

  def fake_execve(path, argv, env):
    seen.append((path, argv, env))
    raise _Exec

  monkeypatch.setattr(os, "execve", fake_execve)
  for key in main_module.SETTINGS:
    monkeypatch.delenv(key, raising=False)
  return seen


def test_restarts_with_the_settings_and_the_same_arguments(calls, monkeypatch):
  monkeypatch.setattr(sys, "argv", ["benchmarks", "norm", "--quick"])
  monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # a value the caller chose is kept
  with pytest.raises(_Exec):
    main_module._restart_with_settings()
  (path, argv, env), = calls
  assert path == sys.executable and argv[1:] == ["-m", "benchmarks", "norm", "--quick"]
  assert env["MALLOC_MMAP_MAX_"] == "0" and env["MALLOC_ARENA_MAX"] == "1"
  assert env["OMP_WAIT_POLICY"] == "ACTIVE"


def test_no_restart_once_set_or_when_asked(calls, monkeypatch):
  monkeypatch.setattr(sys, "argv", ["benchmarks", "seed", "--system-env"])
  main_module._restart_with_settings()
  monkeypatch.setattr(sys, "argv", ["benchmarks", "seed"])
  for key, value in main_module.SETTINGS.items():
    monkeypatch.setenv(key, value)
  main_module._restart_with_settings()
  assert calls == []
