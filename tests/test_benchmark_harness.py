"""The benchmark harness: records and their sources, JSON, ratios, README blocks, shared steps."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxfuse
from benchmarks import cli, harness
from benchmarks import records as rec
from benchmarks.records import Record
from benchmarks.suites import seed


def _record(case="c", impl="jax-jit", median=None, dtype="float32", **kw):
  r = Record("seed", case, impl, "cpu", dtype, **kw)
  if median is not None:
    r.time_ms = {"median": median, "min": median, "max": median, "runs": 5}
  return r


# Records and JSON -------------------------------------------------------------------------------


def test_set_records_the_figure_and_its_source():
  r = _record()
  r.set("xla_bytes_accessed", 1024, rec.XLA_BYTES_SOURCE)
  r.set("temp_bytes", 0, rec.TEMP_BYTES_SOURCE)
  r.set("bytes_moved", None, rec.KERNEL_BYTES_SOURCE)
  assert (r.xla_bytes_accessed, r.temp_bytes, r.bytes_moved) == (1024, 0, None)
  assert r.sources == {"xla_bytes_accessed": rec.XLA_BYTES_SOURCE,
                       "temp_bytes": rec.TEMP_BYTES_SOURCE}
  with pytest.raises(ValueError, match="no field 'bytes'"):
    r.set("bytes", 1, "?")


def test_json_round_trip_keeps_every_field(tmp_path):
  r = _record(median=1.5, residual_bytes=8, bytes_moved=96, xla_bytes_accessed=128,
              temp_bytes=16, max_abs_err=1e-9, note="n")
  r.set("max_grad_err", 2e-9, "Pallas interpret mode against torch-fp64 (×2)")
  path = tmp_path / "out.json"
  rec.write_json([r], path)
  data = json.loads(path.read_text(encoding="utf-8"))
  assert {"xla_bytes_accessed", "temp_bytes", "sources"} <= set(data[0])
  assert rec.read_json(path) == [r]


def test_records_written_before_sources_are_upgraded(tmp_path):
  case = "add_act[gelu] n=8 fwd+bwd"
  old = [_record(case, "jaxfuse-xla", 2.0, bytes_moved=300, residual_bytes=0),
         _record(case, "jaxfuse-pallas", bytes_moved=200, residual_bytes=0),
         _record(case, "jax-unfused", 3.0, bytes_moved=500, residual_bytes=64)]
  rows = []
  for r in old:
    row = r.as_dict()
    for field in ("xla_bytes_accessed", "temp_bytes", "sources"):
      del row[field]
    rows.append(row)
  path = tmp_path / "old.json"
  path.write_text(json.dumps(rows))
  xla, pallas, unfused = rec.read_json(path)
  # XLA's cost analysis leaves bytes_moved; the Pallas count stays.
  assert (xla.bytes_moved, xla.xla_bytes_accessed) == (None, 300)
  assert (pallas.bytes_moved, pallas.xla_bytes_accessed) == (200, None)
  assert "xla_cost" in xla.sources["xla_bytes_accessed"]
  assert "copied from the jaxfuse-xla row" in pallas.sources["residual_bytes"]
  assert unfused.sources["residual_bytes"].startswith("modelled")
  assert all("recorded before" in s for s in unfused.sources.values())


# Ratios -----------------------------------------------------------------------------------------


def test_ratio_to_the_fastest_peer_per_case_and_dtype():
  records = [_record("a", "jax-jit", 4.0), _record("a", "torch-eager", 2.0),
             _record("a", "torch-compile", 3.0), _record("a", "jaxfuse-xla", 1.0),
             _record("a", "jaxfuse-pallas"),
             _record("a", "jax-jit", 8.0, dtype="bfloat16"),
             _record("b", "jaxfuse-xla", 1.0)]
  harness.ratio_to_fastest(records, ("jax-jit", "torch-eager", "torch-compile"))
  ratios = [(r.ratio_to, r.ratio) for r in records]
  assert ratios[:4] == [("torch-eager", 2.0), ("torch-eager", 1.0), ("torch-eager", 1.5),
                        ("torch-eager", 0.5)]
  assert ratios[4] == (None, None)           # not timed
  assert ratios[5] == ("jax-jit", 1.0)       # its own dtype's peers
  assert ratios[6] == (None, None)           # no timed peer in the case
  assert "fastest of jax-jit, torch-eager, torch-compile" in records[3].sources["ratio"]


# README blocks ----------------------------------------------------------------------------------


def test_replace_block_between_markers_only(tmp_path):
  path = tmp_path / "README.md"
  path.write_text("intro\n<!-- bench:seed:start -->\nold\n<!-- bench:seed:end -->\noutro\n"
                  "<!-- bench:seed:headline:start -->\nold\n<!-- bench:seed:headline:end -->\n")
  assert rec.replace_block(path, "seed", "new")
  assert rec.replace_block(path, "seed", "short", part="headline")
  assert path.read_text() == (
      "intro\n<!-- bench:seed:start -->\nnew\n<!-- bench:seed:end -->\noutro\n"
      "<!-- bench:seed:headline:start -->\nshort\n<!-- bench:seed:headline:end -->\n")
  assert not rec.replace_block(path, "norm", "x")
  assert "x" not in path.read_text()


def test_tables_show_ratio_to_only_when_it_varies_and_dtype_only_when_it_does():
  same = [_record("a", "jax-jit", 1.0, ratio_to="jax-jit", ratio=1.0)]
  assert rec.table_columns(same, rec.COLUMNS) == [c for c in rec.COLUMNS if c != "dtype"]
  mixed = same + [_record("b", "torch-eager", 1.0, dtype="bfloat16", ratio_to="torch-eager",
                          ratio=1.0)]
  columns = rec.table_columns(mixed, rec.COLUMNS)
  assert "dtype" in columns and columns.index("ratio to") == columns.index("ratio") + 1
  assert "XLA bytes" in columns


def test_table_block_lists_the_sources():
  r = _record(median=1.0)
  r.set("residual_bytes", 64, rec.JAX_RESIDUAL_SOURCE)
  block = rec.table_block([r], "Generated by `x`")
  assert block.startswith("Generated by `x` on cpu, float32.")
  assert f"- `residual_bytes` (jax-jit): {rec.JAX_RESIDUAL_SOURCE}" in block
  assert "| 64 B |" in block


def test_default_headline_is_the_case_with_most_timed_rows():
  records = [_record("a", "x", 1.0), _record("b", "x", 1.0), _record("b", "y", 1.0),
             _record("b", "z"), _record("c", "x", 1.0)]
  assert [(r.case, r.impl) for r in rec.default_headline(records)] == [
      ("b", "x"), ("b", "y"), ("b", "z")]


def test_seed_headline_is_the_fused_gelu_step_and_simple_nn():
  records = [_record("add_act[gelu] n=8 fwd+bwd", "jax-jit"),
             _record("add_act[gelu] n=8 fwd+bwd", "jax-jit", dtype="bfloat16"),
             _record("add_act[gelu] n=8 fwd", "jax-jit"),
             _record("simple_nn recompute=fc1 B=2 1->2->1", "torch-eager")]
  assert seed.headline(records) == [records[0], records[3]]


def test_cli_rewrites_tables_from_saved_records(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  r = _record("add_act[gelu] n=8 fwd+bwd", "jax-jit", 2.0, ratio_to="jax-jit", ratio=1.0)
  r.set("residual_bytes", 96, rec.JAX_RESIDUAL_SOURCE)
  rec.write_json([r], "results.json")
  (tmp_path / "benchmarks").mkdir()
  full = tmp_path / "benchmarks" / "README.md"
  full.write_text("<!-- bench:seed:start -->\n<!-- bench:seed:end -->\n")
  top = tmp_path / "README.md"
  top.write_text("# x\n<!-- bench:seed:headline:start -->\n<!-- bench:seed:headline:end -->\n")
  argv = ["seed", "--from-json", "results.json", "--readme", "benchmarks/README.md",
          "--headline", "README.md"]
  assert cli.main(argv) == 0
  command = "`python -m benchmarks seed --from-json results.json`"
  assert f"Written by {command} from a run recorded on cpu" in full.read_text()
  assert "| 96 B |" in full.read_text() and rec.JAX_RESIDUAL_SOURCE in full.read_text()
  headline = top.read_text()
  assert "| 96 B |" in headline and "[benchmarks/README.md](benchmarks/README.md)" in headline
  top.write_text("no markers")
  assert cli.main(argv) == 1


# Shared helpers ---------------------------------------------------------------------------------


def test_to_numpy_keeps_float64_and_widens_low_precision_exactly():
  exact = torch.tensor([1.0 + 1e-12, 1e-300], dtype=torch.float64)
  np.testing.assert_array_equal(harness.to_numpy(exact), exact.numpy())
  half = torch.tensor([1.0 / 3.0], dtype=torch.bfloat16)
  assert harness.to_numpy(half)[0] == float(half.float()[0])
  assert harness.max_abs_err([torch.ones(2, dtype=torch.float64)],
                             [torch.ones(2, dtype=torch.float64) + 1e-12]) > 0


def test_to_torch_holds_the_same_values():
  x = jnp.asarray([1.0 / 3.0, -2.5], jnp.bfloat16)
  t = harness.to_torch(x, device="cpu", requires_grad=True)
  assert t.dtype == torch.bfloat16 and t.requires_grad
  np.testing.assert_array_equal(harness.to_numpy(t), harness.to_numpy(x))
  labels = harness.to_torch(jnp.arange(3), dtype=torch.long, device="cpu")
  assert labels.dtype == torch.long
  assert harness.torch_dtype(jnp.bfloat16) == torch.bfloat16


def _add_gelu(a, b):
  return jax.nn.gelu(a + b, approximate=False)


def _torch_add_gelu(a, b):
  return torch.nn.functional.gelu(a + b)


def test_jax_and_torch_steps_agree():
  a, b, g = (jax.random.normal(jax.random.key(i), (64,)) for i in range(3))
  out, grads = harness.jax_step(_add_gelu)((a, b), g)
  assert len(grads) == 2 and grads[0] is grads[1]  # one array for both, as torch returns
  t_args = [harness.to_torch(x, device="cpu") for x in (a, b)]
  want = harness.torch_step(_torch_add_gelu)(t_args, harness.to_torch(g, device="cpu"))
  out_err, grad_err = harness.errors((out, grads), want)
  assert out_err < 1e-6 and grad_err < 1e-6
  forward = harness.jax_step(_add_gelu, grad=False)((a, b))
  assert forward[1] == [] and harness.errors(forward, (want[0], []))[1] is None


def test_steps_differentiate_the_leading_arguments_of_a_scalar_loss():
  h, w = jnp.ones((4, 3)), jnp.full((3,), 2.0)
  loss = lambda h, w, scale: scale * jnp.sum(h @ w)  # noqa: E731
  value, grads = harness.jax_step(loss, n_diff=2)((h, w, 0.5))
  assert float(value) == 12.0 and len(grads) == 2
  np.testing.assert_allclose(grads[1], jnp.full((3,), 2.0))
  torch_loss = lambda h, w, scale: scale * torch.sum(h @ w)  # noqa: E731
  t_value, t_grads = harness.torch_step(torch_loss, n_diff=2)(
      [torch.ones(4, 3), torch.full((3,), 2.0), 0.5])
  assert float(t_value.detach()) == 12.0
  np.testing.assert_allclose(harness.to_numpy(t_grads[1]), np.full(3, 2.0))


def test_matmul_precision_reaches_forward_and_backward():
  loss = lambda x, w: jnp.sum(jnp.dot(x, w))  # noqa: E731
  x, w = jnp.ones((4, 8)), jnp.ones((8, 2))
  step = harness.jax_step(loss, matmul_precision="highest")
  text = jax.jit(lambda x, w: step((x, w))).lower(x, w).as_text()
  dots = [line for line in text.splitlines() if "dot_general" in line]
  assert len(dots) >= 2 and all("HIGHEST" in line for line in dots)


def test_residual_figures():
  a, b = jnp.ones(256), jnp.ones(256)
  # sin keeps cos(a + b); the second argument is not differentiated.
  assert harness.residual_bytes(lambda a, b: jnp.sin(a + b), (a, b), n_diff=1) == 1024
  ta = torch.ones(256)
  assert harness.torch_residual_bytes(torch.exp, [ta]) == 1024  # exp keeps its output
  with jaxfuse.pallas_interpret():
    kept = harness.residual_bytes(
        lambda a, b: jaxfuse.ops.add_act(a, b, "gelu", implementation="pallas"), (a, b))
  assert kept == 0


def test_kernel_and_compiled_figures():
  a, b, g = jnp.ones(1024), jnp.ones(1024), jnp.ones(1024)
  moved = harness.step_bytes_moved(
      lambda a, b: jaxfuse.ops.add_act(a, b, "relu", implementation="pallas"), (a, b), g)
  assert isinstance(moved, int) and moved > 0
  assert harness.step_bytes_moved(_add_gelu, (a, b), g) is None
  r = _record()
  harness.record_compiled_figures(r, harness.jax_step(_add_gelu), (a, b), g)
  assert r.xla_bytes_accessed > 0 and r.temp_bytes >= 0
  assert set(r.sources) == {"xla_bytes_accessed", "temp_bytes"}


def test_time_source_names_the_rounds():
  assert harness.time_source({"median": 1, "min": 1, "max": 1, "runs": 9}).startswith(
      "median of 9 interleaved rounds")


# The seed suite ---------------------------------------------------------------------------------


def test_seed_rows_measure_their_own_figures():
  ctx = harness.Context(suite="seed", runs=1)
  n = 4096
  records = {r.impl: r for r in seed._add_act_case(ctx, "gelu", n, jnp.float32, True)}
  assert list(records) == list(seed.ORDER)
  assert records["jax-unfused"].residual_bytes == 4 * n   # a + b, kept for gelu's backward
  assert records["jaxfuse-unfused"].residual_bytes == 4 * n
  assert records["jaxfuse-pallas"].residual_bytes == 0
  assert records["jax-jit"].residual_bytes > 0
  for r in records.values():
    assert not any("copied" in source for source in r.sources.values())
    if r.impl.startswith("jax-") or r.impl == "jaxfuse-xla":
      assert r.bytes_moved is None and r.xla_bytes_accessed > 0
      assert r.sources["xla_bytes_accessed"].startswith(rec.XLA_BYTES_SOURCE)
  if not ctx.native("triton"):
    assert records["jaxfuse-triton"].residual_bytes is None
    assert "needs a GPU" in records["jaxfuse-triton"].note
  fastest = min(("jax-jit", "torch-eager", "torch-compile"),
                key=lambda impl: records[impl].time_ms["median"])
  assert {r.ratio_to for r in records.values() if r.time_ms} == {fastest}
  assert records[fastest].ratio == 1.0


def test_triton_bytes_are_counted_in_the_interpreter():
  pytest.importorskip("triton")
  if not harness.Context(suite="seed").native("triton"):
    a, b, g = (torch.ones(1000) for _ in range(3))
    # Forward: a and b read, the output written; backward: a, b and g read, the gradient written.
    assert seed._triton_counted_bytes(a, b, g, "relu", True) == (3 + 4) * 4000
    assert seed._triton_counted_bytes(a, b, g, "relu", False) == 3 * 4000
