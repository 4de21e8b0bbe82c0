"""benchmarks/compare_paths.py: the Pallas-against-Triton table gpu_check.sh prints, on synthetic
records."""

import json

from benchmarks import compare_paths
from benchmarks import records as rec
from benchmarks.records import Record


def _record(case, impl, median=None, suite="norm", dtype="bfloat16"):
  r = Record(suite, case, impl, "gpu", dtype)
  if median is not None:
    r.set("time_ms", {"median": median, "min": median, "max": median, "runs": 5}, "timed")
  return r


RECORDS = [
    _record("rms_norm 4096x1024", "jaxfuse-pallas", 2.0),
    _record("rms_norm 4096x1024", "jaxfuse-triton", 1.0),
    _record("rms_norm 4096x1024", "torch-eager", 0.5),
    _record("layer_norm 4096x1024", "jaxfuse-triton", 3.0),
    _record("layer_norm 4096x1024", "jaxfuse-pallas", 1.5),
    _record("softmax 4096x1024", "jaxfuse-pallas", 1.0),            # no Triton row
    _record("N=8192 D=1024 V=32000", "jaxfuse-pallas", 4.0, suite="xent", dtype="float32"),
    _record("N=8192 D=1024 V=32000", "jaxfuse-triton", None, suite="xent", dtype="float32"),
    _record("N=8192 D=1024 V=32000", "jaxfuse-xla", 9.0, suite="xent", dtype="float32"),
    _record("causal T=256 H=8 D=64", "jax-nn", 1.0, suite="attention"),  # no kernel rows
    _record("add_act[gelu] n=8 fwd", "jaxfuse-pallas", 1.0, suite="seed"),
    _record("add_act[gelu] n=8 fwd", "jaxfuse-triton", 1.0, suite="seed"),
]


def test_one_row_per_case_with_a_kernel_record():
  rows = compare_paths.compare(RECORDS)
  assert [(r.suite, r.case) for r in rows] == [
      ("norm", "rms_norm 4096x1024"), ("norm", "layer_norm 4096x1024"),
      ("norm", "softmax 4096x1024"), ("xent", "N=8192 D=1024 V=32000"),
      ("seed", "add_act[gelu] n=8 fwd")]
  by_case = {r.case: r for r in rows}
  rms = by_case["rms_norm 4096x1024"]
  assert (rms.pallas_ms, rms.triton_ms, rms.faster, rms.ratio, rms.note) == (
      2.0, 1.0, "triton", 0.5, None)
  layer = by_case["layer_norm 4096x1024"]
  assert (layer.faster, layer.ratio) == ("pallas", 2.0)
  assert by_case["add_act[gelu] n=8 fwd"].faster == "tie"


def test_a_side_without_a_time_is_not_compared_and_says_why():
  by_case = {r.case: r for r in compare_paths.compare(RECORDS)}
  softmax = by_case["softmax 4096x1024"]
  assert (softmax.pallas_ms, softmax.triton_ms, softmax.faster, softmax.ratio) == (
      1.0, None, None, None)
  assert softmax.note == "no jaxfuse-triton record"
  xent = by_case["N=8192 D=1024 V=32000"]
  assert (xent.faster, xent.note) == (None, "jaxfuse-triton not timed")
  assert compare_paths.compare([]) == []


def test_the_same_case_in_two_dtypes_gives_two_rows():
  rows = compare_paths.compare([_record("c", "jaxfuse-pallas", 1.0, dtype="float32"),
                                _record("c", "jaxfuse-pallas", 2.0, dtype="bfloat16"),
                                _record("c", "jaxfuse-triton", 4.0, dtype="bfloat16")])
  assert [(r.dtype, r.faster) for r in rows] == [("float32", None), ("bfloat16", "pallas")]


def test_markdown_table_and_summary():
  text = compare_paths.markdown(compare_paths.compare(RECORDS))
  lines = text.splitlines()
  assert lines[0] == "| " + " | ".join(compare_paths.COLUMNS) + " |"
  assert "| norm | rms_norm 4096x1024 | bfloat16 | 2.000 | 1.000 | triton | 0.50× |" in lines
  assert "| norm | softmax 4096x1024 | bfloat16 | 1.000 | — | — | — (no jaxfuse-triton record) |" \
      in lines
  assert lines[-1] == "3 cases compared: Pallas faster in 1, Triton in 1, 1 ties"
  assert compare_paths.summary([]).startswith("no case has timed Pallas and Triton rows")


def test_main_reads_files_and_folders_and_skips_what_it_cannot_read(tmp_path, capsys):
  rec.write_json(RECORDS[:2], tmp_path / "norm-gpu.json")
  rec.write_json(RECORDS[6:8], tmp_path / "runs" / "xent-gpu.json")
  (tmp_path / "broken-gpu.json").write_text("{not json", encoding="utf-8")
  (tmp_path / "kernel_check.json").write_text(json.dumps({"kernels": []}), encoding="utf-8")
  out, rows_json = tmp_path / "table.md", tmp_path / "rows.json"
  status = compare_paths.main([str(tmp_path), str(tmp_path / "runs"),
                               str(tmp_path / "missing-gpu.json"), "--out", str(out),
                               "--json", str(rows_json)])
  assert status == 0
  printed = capsys.readouterr()
  assert out.read_text(encoding="utf-8") == printed.out
  assert "| norm | rms_norm 4096x1024 |" in printed.out and "| xent |" in printed.out
  assert printed.err.count("compare_paths: skipped") == 3
  rows = json.loads(rows_json.read_text(encoding="utf-8"))
  assert [(r["case"], r["faster"]) for r in rows] == [("rms_norm 4096x1024", "triton"),
                                                      ("N=8192 D=1024 V=32000", None)]


def test_main_with_nothing_to_read_still_prints_a_table(tmp_path, capsys):
  assert compare_paths.main([str(tmp_path / "nothing-gpu.json")]) == 0
  assert "no case has timed Pallas and Triton rows" in capsys.readouterr().out
