"""Two processes train as one: ``python -m jaxfuse.train`` on JAX's distributed runtime.

Each process has 4 simulated CPU devices; they join over localhost (``--coordinator``, gloo
collectives) into one ``data=2,fsdp=2,tensor=2`` mesh of 8 devices. Their losses equal one
process with 8 devices, step by step; a checkpoint both wrote at ``--stop-at 3`` resumes in both
(the second time with the ``JAXFUSE_*`` variables instead of the options) and continues with
the uninterrupted run's losses; ``place_batch_rows`` asks each process only for its rows. A
partial or inconsistent set of the options is refused by name before anything starts.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jaxfuse import train
from jaxfuse.train import config, distributed

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 300   # seconds a launch may run before its processes are killed
# The programs are tiny and run a few times: skip LLVM's optimizations.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"

TINY = ["--steps", "6", "--batch", "8", "--seq", "32", "--d-model", "32", "--layers", "2",
        "--heads", "4", "--kv-heads", "2", "--mlp", "64", "--warmup", "2", "--eval-every", "3",
        "--eval-batches", "1", "--sample-tokens", "0", "--save-every", "3",
        "--mesh", "data=2,fsdp=2,tensor=2"]

# Runs each (name, argv) of argv[2] (JSON) in this process and writes the history of each, and
# the rows place_batch_rows asked this process for, to argv[1]/NAME-PROCESS.json.
DRIVER = """
import json, sys
import jax
import numpy as np
from jaxfuse import train
from jaxfuse.train import corpus, placement
report, runs = sys.argv[1], json.loads(sys.argv[2])
for name, argv in runs:
  cfg = train.parse_args(argv)
  history = train.train(cfg, log=lambda *_: None)["history"]
  whole, asked = corpus.batch_at(corpus.stdlib_corpus()[1], 0, cfg.batch, cfg.seq, cfg.seed), []
  def rows(lo, hi):
    asked.append([lo, hi])
    return tuple(a[lo:hi] for a in whole)
  mesh = placement.make_mesh(cfg)
  for got, want in zip(placement.place_batch_rows(rows, whole[0].shape, mesh),
                       placement.place_batch(whole, mesh)):
    for a, b in zip(got.addressable_shards, want.addressable_shards):
      assert a.device == b.device and np.array_equal(a.data, b.data), (a.index, b.index)
  with open(f"{report}/{name}-{jax.process_index()}.json", "w") as f:
    json.dump({"history": history, "rows": asked, "processes": jax.process_count()}, f)
"""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _launch(tmp_path: Path, name: str, runs, *, processes: int, devices: int,
            by: str = "options") -> list[dict]:
  """Runs ``runs`` ([(name, argv)]) in ``processes`` processes of ``devices`` CPU devices each,
  joined by ``--coordinator`` options (``by="options"``) or ``JAXFUSE_*`` variables
  (``by="environment"``); the report of each run of each process. A process that fails kills
  the others; so does a launch that takes over ``TIMEOUT`` seconds."""
  report = tmp_path / name
  report.mkdir()
  coordinator = f"127.0.0.1:{_free_port()}"
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("JAXFUSE_", "JAX_COORDINATOR")) and k != "XLA_FLAGS"}
  env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}",
             JAX_PLATFORMS="cpu")
  children, logs = [], []
  try:
    for i in range(processes):
      joined, child_env = [], dict(env)
      if processes > 1 and by == "options":
        joined = ["--coordinator", coordinator, "--num-processes", str(processes),
                  "--process-id", str(i)]
      elif processes > 1:
        child_env.update(JAXFUSE_COORDINATOR=coordinator, JAXFUSE_NUM_PROCESSES=str(processes),
                         JAXFUSE_PROCESS_ID=str(i))
      argvs = [[run, [*argv, *joined]] for run, argv in runs]
      logs.append(report / f"process-{i}.log")
      with open(logs[-1], "w") as log:
        children.append(subprocess.Popen(
            [sys.executable, "-c", DRIVER, str(report), json.dumps(argvs)], cwd=ROOT,
            env=child_env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + TIMEOUT
    while any(c.poll() is None for c in children):
      assert all(c.returncode in (None, 0) for c in children), "a process failed"
      assert time.monotonic() < deadline, f"no result after {TIMEOUT} s"
      time.sleep(0.2)
    assert all(c.returncode == 0 for c in children), "a process failed"
  except AssertionError as e:
    tails = "\n".join(
        f"--- {log.name} ({'killed' if c.returncode is None else f'exit {c.returncode}'}):\n"
        f"{log.read_text()[-3000:]}" for c, log in zip(children, logs))
    raise AssertionError(f"{name}: {e}\n{tails}") from None
  finally:
    for child in children:
      if child.poll() is None:
        child.kill()
        child.wait()
  return [{run: json.loads((report / f"{run}-{i}.json").read_text()) for run, _ in runs}
          for i in range(processes)]


def test_two_processes_train_and_resume_as_one_process_on_their_devices(tmp_path):
  out = tmp_path / "out"
  [single] = _launch(tmp_path, "single", [("whole", [*TINY, "--out", str(out / "single")])],
                     processes=1, devices=8)
  first = _launch(tmp_path, "first", [("whole", [*TINY, "--out", str(out / "whole")]),
                                      ("stopped", [*TINY, "--out", str(out / "resumed"),
                                                   "--stop-at", "3"])],
                  processes=2, devices=4)
  resumed = _launch(tmp_path, "resumed", [("resumed", [*TINY, "--out", str(out / "resumed"),
                                                       "--resume"])],
                    processes=2, devices=4, by="environment")
  want = single["whole"]["history"]
  assert single["whole"]["processes"] == 1
  for process in range(2):
    whole = first[process]["whole"]
    assert whole["processes"] == 2
    assert whole["history"]["step"] == want["step"] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "val_loss"):
      np.testing.assert_allclose(whole["history"][key], want[key], rtol=1e-5, atol=0,
                                 err_msg=f"process {process}: {key}")
    assert first[process]["stopped"]["history"]["step"] == [1, 2, 3]
    assert resumed[process]["resumed"]["history"] == whole["history"]
  # Both processes wrote their shards of the checkpoint they resumed from.
  state = out / "resumed" / "checkpoints" / "3" / "state"
  assert sorted(p.name for p in state.glob("ocdbt.process_*")) == ["ocdbt.process_0",
                                                                     "ocdbt.process_1"]
  # Each process materialized only the rows of the batch its 4 devices hold.
  asked = [first[process]["whole"]["rows"] for process in range(2)]
  assert sorted(asked) == [[[0, 4]], [[4, 8]]]
  assert single["whole"]["rows"] == [[0, 8]]


JOIN = ["--coordinator", "10.0.0.1:1234", "--num-processes", "4", "--process-id", "3"]


@pytest.mark.parametrize("argv,environ,message", [
    (["--process-id", "1"], {},
     "--process-id without --coordinator and --num-processes: give all three"),
    (["--coordinator", "h:1", "--num-processes", "2"], {},
     "--coordinator and --num-processes without --process-id"),
    (["--coordinator", "h"], {"JAXFUSE_NUM_PROCESSES": "2", "JAXFUSE_PROCESS_ID": "0"},
     "--coordinator must be HOST:PORT"),
    (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"], {},
     "--process-id must be in [0, 2) (--num-processes 2), got 2"),
    (["--num-processes", "0", "--coordinator", "h:1", "--process-id", "0"], {},
     "--num-processes must be >= 1"),
    ([*JOIN, "--distributed"], {},
     "drop --coordinator and --num-processes and --process-id, or drop --distributed"),
    (["--coordinator", "h:1"], {"JAXFUSE_NUM_PROCESSES": "2", "JAXFUSE_PROCESS_ID": "-1"},
     "JAXFUSE_PROCESS_ID must be in [0, 2) (JAXFUSE_NUM_PROCESSES 2), got -1"),
    ([], {"JAXFUSE_PROCESS_ID": "one"}, "JAXFUSE_PROCESS_ID must be an integer, got 'one'"),
    ([], {"JAXFUSE_COORDINATOR": "h:1"}, "JAXFUSE_COORDINATOR without --num-processes"),
])
def test_a_partial_or_inconsistent_set_of_processes_is_refused_by_name(argv, environ, message):
  cfg = train.parse_args(argv)
  with pytest.raises(ValueError) as raised:
    config.processes(cfg, environ)
  assert message in str(raised.value)


def test_the_options_come_first_then_the_environment():
  assert config.processes(train.parse_args([])) is None   # one process: nothing to join
  assert config.processes(train.parse_args(JOIN), {"JAXFUSE_PROCESS_ID": "0"}) == (
      "10.0.0.1:1234", 4, 3)
  environ = {"JAXFUSE_COORDINATOR": "[::1]:80", "JAXFUSE_NUM_PROCESSES": "2",
             "JAXFUSE_PROCESS_ID": "1"}
  assert config.processes(train.parse_args(["--process-id", "0"]), environ) == ("[::1]:80", 2, 0)
  assert not distributed.initialize(train.parse_args([]))   # no options: no jax.distributed


def test_processes_train_on_a_mesh_over_all_their_devices():
  for argv, option in ((JOIN, "--coordinator"), (["--distributed"], "--distributed")):
    with pytest.raises(ValueError, match=f"{option} trains on the devices of every process: "
                                         f"give --mesh"):
      train.check_config(train.parse_args(argv))
  train.check_config(train.parse_args([*JOIN, "--mesh", "data=16"]))


def test_the_command_line_refuses_a_partial_set_before_it_starts(tmp_path, capsys):
  assert train.main(["--process-id", "1", "--out", str(tmp_path / "run")]) == 2
  assert "--process-id without --coordinator" in capsys.readouterr().err
  assert not (tmp_path / "run").exists()


# SIGTERM reaching one of two processes ---------------------------------------------------------

LONG = [*TINY, "--steps", "80", "--save-every", "1000", "--eval-every", "1000", "--log-every",
        "1"]


def _cli_processes(out: Path, *extra) -> list[subprocess.Popen]:
  """``python -m jaxfuse.train`` in two processes of 4 CPU devices, joined by
  ``--coordinator``."""
  coordinator = f"127.0.0.1:{_free_port()}"
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("JAXFUSE_", "JAX_COORDINATOR")) and k != "XLA_FLAGS"}
  env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count=4 {FAST_COMPILE}",
             JAX_PLATFORMS="cpu")
  return [subprocess.Popen(
      [sys.executable, "-m", "jaxfuse.train", *LONG, "--out", str(out), "--coordinator",
       coordinator, "--num-processes", "2", "--process-id", str(i), *extra], cwd=ROOT, env=env,
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(2)]


def _finish(processes: list[subprocess.Popen]) -> list[tuple[int, str]]:
  try:
    return [(p.wait(timeout=TIMEOUT), p.stderr.read()) for p in processes]
  finally:
    for p in processes:
      if p.poll() is None:
        p.kill()


def test_sigterm_to_one_process_saves_the_same_step_on_both(tmp_path):
  """SIGTERM reaches process 1 only: both stop after the same step, both write their shards of
  its checkpoint, and two processes resuming from it get the uninterrupted run's losses."""
  stopped = _cli_processes(tmp_path / "stopped")
  metrics = tmp_path / "stopped" / "metrics.jsonl"
  deadline = time.monotonic() + TIMEOUT
  try:
    while not (metrics.is_file() and metrics.read_text().count('"train/loss"') >= 3):
      assert all(p.poll() is None for p in stopped), "a process ended early"
      assert time.monotonic() < deadline, f"no step after {TIMEOUT} s"
      time.sleep(0.05)
    stopped[1].send_signal(signal.SIGTERM)
  finally:
    ended = _finish(stopped)
  assert [code for code, _ in ended] == [128 + signal.SIGTERM] * 2, [e[-2000:] for _, e in ended]
  at = json.loads((tmp_path / "stopped" / "train_log.json").read_text())["preempted_at"]
  assert 3 <= at < 80 and all(f"after step {at}" in err for _, err in ended)
  state = tmp_path / "stopped" / "checkpoints" / str(at) / "state"
  assert sorted(p.name for p in state.glob("ocdbt.process_*")) == ["ocdbt.process_0",
                                                                     "ocdbt.process_1"]
  whole = _finish(_cli_processes(tmp_path / "whole"))
  resumed = _finish(_cli_processes(tmp_path / "stopped", "--resume"))
  assert [code for code, _ in whole + resumed] == [0] * 4, [e[-2000:] for _, e in whole + resumed]
  want = json.loads((tmp_path / "whole" / "train_log.json").read_text())["history"]
  got = json.loads((tmp_path / "stopped" / "train_log.json").read_text())["history"]
  assert got["step"] == want["step"] == list(range(1, 81))
  assert got["loss"] == want["loss"]
