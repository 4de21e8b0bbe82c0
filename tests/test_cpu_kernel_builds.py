"""The CPU kernels never break a default run: where they cannot be built or loaded (a compiler
that fails, one without C++20 or ``_Float16``, an unwritable or unsafe cache), every op runs on
XLA under ``implementation=None`` with one warning naming the cause, and
``implementation="cpu"`` raises it; processes that build at once compile once.

Each case runs in a fresh process (what a process has built or failed to build, it keeps), with
its own cache and compiler.
"""

import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jaxfuse.kernels import cpu

ROOT = Path(__file__).resolve().parent.parent
GXX = shutil.which("g++") or shutil.which("c++")
needs_gxx = pytest.mark.skipif(GXX is None, reason="needs a C++ compiler")

# Every op with CPU kernels, forward and gradient under jit, with implementation=None and with
# implementation="xla"; then implementation="cpu". Prints a JSON report.
DRIVER = textwrap.dedent("""
    import json, sys, warnings
    import jax, jax.numpy as jnp, numpy as np
    from jaxfuse.kernels import cpu
    from jaxfuse.ops import (add_layer_norm, add_rms_norm, attention, base, glu, layer_norm,
                             rms_norm)
    x = jax.random.normal(jax.random.key(0), (6, 32))
    r, s = x[::-1], 1.0 + 0.1 * x[0]
    q = jax.random.normal(jax.random.key(1), (1, 8, 2, 16))
    OPS = {
        "glu": lambda i: glu(x, r, "silu", implementation=i),
        "layer_norm": lambda i: layer_norm(x, s, s, implementation=i),
        "rms_norm": lambda i: rms_norm(x, s, implementation=i),
        "add_layer_norm": lambda i: add_layer_norm(x, r, s, s, implementation=i)[0],
        "add_rms_norm": lambda i: add_rms_norm(x, r, s, implementation=i)[0],
        "attention": lambda i: attention(q * x[0, 0], q, q, causal=True, implementation=i),
    }
    report = {"picked": {}, "same": {}}
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      for name, f in OPS.items():
        report["picked"][name] = base.REGISTRY[name].resolve(None)
        run = lambda impl: jax.jit(jax.value_and_grad(lambda t: jnp.sum(f(impl) * t)))(1.5)
        got, want = run(None), run("xla")
        report["same"][name] = bool(all(np.array_equal(a, b) for a, b in zip(got, want)))
    report["warnings"] = [str(w.message) for w in caught
                          if issubclass(w.category, cpu.CPUKernelWarning)]
    try:
      jax.jit(lambda: glu(x, r, "silu", implementation="cpu"))()
      report["cpu"] = None
    except Exception as e:
      report["cpu"] = f"{type(e).__name__}: {e}"
    print(json.dumps(report))
""")


def _child_env(tmp_path: Path, **extra) -> dict:
  env = {k: v for k, v in os.environ.items() if k not in ("CXX", "JAXFUSE_CPU_KERNELS")}
  env.update({"JAXFUSE_CACHE_DIR": str(tmp_path / "cache"), "JAX_PLATFORMS": "cpu",
              "XLA_FLAGS": "--xla_backend_optimization_level=0", **extra})
  return env


def _run_driver(env: dict) -> dict:
  done = subprocess.run([sys.executable, "-c", DRIVER], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-4000:]
  return json.loads(done.stdout.strip().splitlines()[-1])


def _script(path: Path, body: str) -> str:
  path.write_text("#!/bin/sh\n" + body)
  path.chmod(0o755)
  return str(path)


def _falls_back_to_xla(report: dict, cause: str, error: str) -> None:
  """Every op ran XLA, bit for bit, with one warning naming ``cause``; asked for by name, the
  kernels raised ``error``."""
  assert set(report["picked"].values()) == {"xla"}, report["picked"]
  assert all(report["same"].values()), report["same"]
  assert len(report["warnings"]) == 1, report["warnings"]
  assert cause in report["warnings"][0] and "JAXFUSE_CPU_KERNELS=0" in report["warnings"][0]
  assert report["cpu"] is not None and error in report["cpu"], report["cpu"]


@needs_gxx
def test_a_compiler_that_fails(tmp_path):
  cxx = _script(tmp_path / "broken-cxx",
                'echo "broken-cxx: internal error 42 in $*" >&2\nexit 3\n')
  report = _run_driver(_child_env(tmp_path, CXX=cxx))
  _falls_back_to_xla(report, "broken-cxx: internal error 42", "CompileError: ")
  assert "broken-cxx: internal error 42" in report["cpu"]


@needs_gxx
def test_a_compiler_without_cxx20(tmp_path):
  """``-std=c++17`` forced after the kernels' ``-std=c++20``: the probe fails on the template
  lambda, before any source is compiled."""
  cxx = _script(tmp_path / "cxx17", f'exec {GXX} "$@" -std=c++17\n')
  report = _run_driver(_child_env(tmp_path, CXX=cxx))
  _falls_back_to_xla(report, "the probe", "CompileError: ")
  assert "-std=c++20" in report["cpu"] or "c++20" in report["cpu"].lower()
  assert not list((tmp_path / "cache" / "cpu-kernels").glob("*.so"))


@needs_gxx
def test_a_compiler_without_float16(tmp_path):
  """A compiler that has no ``_Float16`` (stood in by one that rejects it by name)."""
  cxx = _script(tmp_path / "no-float16", textwrap.dedent(f"""\
      for arg in "$@"; do
        case "$arg" in *.cc) if grep -q _Float16 "$arg"; then
          echo "$arg: error: '_Float16' was not declared in this scope" >&2; exit 1; fi;;
        esac
      done
      exec {GXX} "$@"
      """))
  report = _run_driver(_child_env(tmp_path, CXX=cxx))
  _falls_back_to_xla(report, "'_Float16' was not declared", "'_Float16' was not declared")


def test_an_unwritable_cache(tmp_path):
  (tmp_path / "a-file").write_text("")
  report = _run_driver(_child_env(tmp_path, JAXFUSE_CACHE_DIR=str(tmp_path / "a-file" / "x")))
  _falls_back_to_xla(report, "cannot create the CPU kernels' cache", "CacheError: ")


def test_a_cache_writable_by_others_is_refused(tmp_path):
  cache = tmp_path / "cache"
  (cache / "cpu-kernels").mkdir(parents=True)
  cache.chmod(0o777)
  with pytest.raises(cpu.CacheError, match="is writable by others"):
    cpu.check_private(cache)
  report = _run_driver(_child_env(tmp_path))
  _falls_back_to_xla(report, "is writable by others", "CacheError: ")


@pytest.mark.skipif(os.getuid() != 0, reason="giving a folder to another user needs root")
def test_a_cache_of_another_user_is_refused(tmp_path):
  cache = tmp_path / "cache"
  (cache / "cpu-kernels").mkdir(parents=True, mode=0o700)
  os.chown(cache / "cpu-kernels", 65534, 65534)
  with pytest.raises(cpu.CacheError, match="belongs to user 65534"):
    cpu.check_private(cache / "cpu-kernels")
  report = _run_driver(_child_env(tmp_path))
  _falls_back_to_xla(report, "belongs to user 65534", "CacheError: ")


def test_a_cache_is_created_private(tmp_path, monkeypatch):
  monkeypatch.setenv("JAXFUSE_CACHE_DIR", str(tmp_path / "new" / "cache"))
  directory = cpu.private_cache_dir()
  for folder in (directory, directory.parent):
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700


BUILD = textwrap.dedent("""
    import sys, time
    from jaxfuse.kernels import cpu
    while time.time() < float(sys.argv[1]):   # start together
      time.sleep(0.01)
    print(cpu.build("normalization"))
""")


@needs_gxx
def test_three_processes_building_at_once_compile_once(tmp_path):
  calls = tmp_path / "calls.log"
  cxx = _script(tmp_path / "logging-cxx", f'echo "$*" >> {calls}\nexec {GXX} "$@"\n')
  env = _child_env(tmp_path, CXX=f"{cxx} -DJAXFUSE_TEST_ARGUMENT=1")   # CXX with an argument
  import time
  start = str(time.time() + 8)
  children = [subprocess.Popen([sys.executable, "-c", BUILD, start], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(3)]
  outs = [c.communicate(timeout=600) for c in children]
  assert all(c.returncode == 0 for c in children), [err[-2000:] for _, err in outs]
  paths = {out.strip() for out, _ in outs}
  assert len(paths) == 1 and Path(paths.pop()).is_file()
  compiles = [line for line in calls.read_text().splitlines() if "normalization.cc" in line]
  assert len(compiles) == 1, compiles
  assert "-DJAXFUSE_TEST_ARGUMENT=1" in compiles[0]
  # And the ops run on the kernels so built, without a warning.
  report = _run_driver(env)
  assert report["picked"]["layer_norm"] == "cpu" and report["warnings"] == []
  assert report["cpu"] is None


X86 = "processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse avx2\ncpu MHz\t: 2000\n"
ARM = ("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm\n"
       "CPU implementer\t: 0x41\nCPU part\t: 0xd0c\n")


@pytest.mark.parametrize("text,other", [
    (X86, X86.replace("avx2", "avx2 avx512f")),
    (ARM, ARM.replace("evtstrm", "evtstrm sve")),
    (ARM, ARM.replace("0xd0c", "0xd40")),
])
def test_the_cache_key_holds_the_cpu(tmp_path, monkeypatch, text, other):
  """The key changes with the CPU's flags (x86) or features and part (aarch64), and not with
  what does not change the code (the clock)."""
  source = cpu.SOURCE_DIR / "normalization.cc"
  monkeypatch.setattr(cpu, "_identity", lambda command: "a compiler")
  keys = []
  for i, info in enumerate((text, other, text.replace("2000", "2500").replace("50.00", "60"))):
    (tmp_path / f"cpuinfo{i}").write_text(info)
    monkeypatch.setattr(cpu, "CPUINFO", tmp_path / f"cpuinfo{i}")
    cpu._host.cache_clear()
    keys.append(cpu._key(source, ["c++"]))
  cpu._host.cache_clear()
  assert keys[0] != keys[1] and keys[0] == keys[2]


@needs_gxx
def test_the_command_line_builds_ahead_of_time(tmp_path, monkeypatch, capsys):
  """``python -m jaxfuse.kernels.cpu``: builds into the cache (a later process loads it), names
  an unknown family, and exits 1 with the compiler's message."""
  from jaxfuse.kernels.cpu import __main__ as build_cli

  monkeypatch.setenv("JAXFUSE_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.delenv("CXX", raising=False)
  assert build_cli.main(["normalization"]) == 0
  built = list((tmp_path / "cache" / "cpu-kernels").glob("normalization-*.so"))
  assert len(built) == 1 and str(built[0]) in capsys.readouterr().out
  with pytest.raises(SystemExit):
    build_cli.main(["no_such_family"])
  assert "no CPU kernel family no_such_family" in capsys.readouterr().err
  monkeypatch.setenv("CXX", _script(tmp_path / "broken", 'echo "broken: no way" >&2\nexit 1\n'))
  assert build_cli.main(["gated_linear"]) == 1
  assert "broken: no way" in capsys.readouterr().err
