"""On a GPU: the registers, spills and shared memory of the kernels XLA compiles, against what
:mod:`jaxfuse.metrics.kernel_resources` reports for them without a GPU.

``python -m benchmarks.xla_kernel_check OUT_DIR`` runs a few Pallas kernels (forward and
backward) with ``XLA_FLAGS=--xla_dump_to=OUT_DIR/xla_dump`` (set here before jax starts), reads
every entry function of the PTX that XLA dumps through ``ptxas -v`` (the ptxas Triton bundles,
for the GPU's arch), compiles the same kernels with :mod:`jaxfuse.metrics.kernel_resources`,
and prints both side by side; ``OUT_DIR/kernel_check.json`` keeps the figures. Where the
``triton`` package can load its own cubin on this GPU, the driver's register and spill counts
of that cubin are listed too. The figures differ where XLA's Triton (its passes, its ptxas)
differs from the ``triton`` package's; ``benchmarks/gpu_check.sh kernels`` runs this.

Importing this module loads nothing beyond the standard library; on a machine without a GPU
(or without the ``triton`` package) ``main`` says so and returns 0.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys


def _cases():
  """``(label, f, args)``: the kernels to run, with arrays on the GPU."""
  import jax
  import jax.numpy as jnp

  from jaxfuse import ops

  def attention(dtype, d, causal, bias=False):
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(key, (2, 1024, 8, d), dtype) for key in keys[:3])
    args = (q, k, v) + ((jax.random.normal(keys[3], (1, 8, 1024, 1024)),) if bias else ())

    def f(q, k, v, *b):
      return jax.grad(lambda q, k, v: jnp.sum(ops.attention(
          q, k, v, causal=causal, bias=b[0] if b else None,
          implementation="pallas").astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)
    label = f"attention {jnp.dtype(dtype).name} d={d} causal={causal}" + (" bias" if bias else "")
    return label, f, args

  def norm(dtype, h):
    x = jax.random.normal(jax.random.key(1), (4096, h), dtype)
    w = jnp.ones((h,), dtype)

    def f(x, w):
      return jax.grad(lambda x, w: jnp.sum(ops.rms_norm(
          x, w, implementation="pallas").astype(jnp.float32)), argnums=(0, 1))(x, w)
    return f"rms_norm {jnp.dtype(dtype).name} H={h}", f, (x, w)

  return [attention(jnp.float16, 128, True), attention(jnp.bfloat16, 64, True),
          attention(jnp.float16, 64, True, bias=True), attention(jnp.bfloat16, 64, False),
          attention(jnp.float32, 64, True), norm(jnp.bfloat16, 4096)]


def _capability() -> int:
  import jax

  return int(str(jax.devices()[0].compute_capability).replace(".", ""))


def _xla_figures(dump_dir: str, target) -> dict[str, dict]:
  """Entry function -> ``ptxas -v`` figures, over the PTX files XLA dumped."""
  import subprocess
  import tempfile

  from jaxfuse.metrics import kernel_resources as kr

  ptxas = kr.ptxas_path(target)
  gpu = target.name
  figures: dict[str, dict] = {}
  for path in sorted(glob.glob(os.path.join(dump_dir, "**", "*.ptx"), recursive=True)):
    with tempfile.TemporaryDirectory() as tmp:
      done = subprocess.run([ptxas, "-v", f"--gpu-name={gpu}", path, "-o",
                             os.path.join(tmp, "out.cubin")], capture_output=True, text=True,
                            check=False)
    log = done.stdout + done.stderr
    if done.returncode:
      print(f"ptxas rejected {path}: {log[-500:]}")
      continue
    for entry in sorted(set(re.findall(r"Compiling entry function '([^']+)'", log))):
      figures[entry] = {**kr.parse_ptxas_log(log, entry), "ptx": os.path.basename(path)}
  return figures


def _driver_figures(source, target) -> dict | None:
  """The driver's view of the ``triton`` package's cubin: registers and spills."""
  from jaxfuse.metrics import kernel_resources as kr

  try:
    compiled, _ = kr.triton_compile(source, target)
    compiled._init_handles()
    return {"registers": compiled.n_regs, "spills": compiled.n_spills}
  except Exception as e:  # noqa: BLE001 - a figure this check can do without
    return {"error": f"{type(e).__name__}: {e}"[:200]}


def main(out_dir: str) -> int:
  dump = os.path.join(out_dir, "xla_dump")
  flags = os.environ.get("XLA_FLAGS", "")
  given = re.search(r"--xla_dump_to=(\S+)", flags)
  if given:
    dump = given.group(1)
  else:
    if "jax" in sys.modules:
      print("xla_kernel_check: jax was imported before XLA_FLAGS was set: XLA may dump nothing")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_dump_to={dump}".strip()
  import jax

  from jaxfuse.metrics import kernel_resources as kr

  if jax.default_backend() != "gpu":
    print("xla_kernel_check: no GPU here; nothing to compare")
    return 0
  capability = _capability()
  target = kr.arch("sm_90a" if capability >= 90 else "sm_80")
  missing = kr.missing_toolchain(target)
  if missing:
    print(f"xla_kernel_check: cannot compile kernels here, missing {missing}")
    return 1
  ours: list[dict] = []
  with kr.triton_cache():
    for label, f, args in _cases():
      try:
        jax.block_until_ready(jax.jit(f)(*args))         # XLA compiles (and dumps) the kernels
      except Exception as e:  # noqa: BLE001 - reported, and the other cases still run
        print(f"{label}: XLA did not run it: {type(e).__name__}: {str(e)[:300]}")
        ours.append({"case": label, "name": "-", "error": f"XLA: {type(e).__name__}"})
        continue
      for source in kr.pallas_kernels(f, *args):
        try:
          r = kr.compile_kernel(source, target).as_dict()
        except RuntimeError as e:
          r = {"name": source.name, "error": str(e)[:300]}
        r["case"] = label
        r["driver"] = _driver_figures(source, target) if "error" not in r else None
        ours.append(r)
  xla = _xla_figures(dump, target)
  print(f"{'case':<34} {'kernel':<22} {'regs us/XLA':>12} {'spill us/XLA':>14} "
        f"{'stack us/XLA':>13} {'static smem us/XLA':>19}  driver")
  for r in ours:
    x = xla.get(r["name"], {})
    if "error" in r:
      print(f"{r['case']:<34} {r['name']:<22} {r['error']}")
      continue

    def pair(ours_value, key, x=x):
      return f"{ours_value}/{x.get(key, '?')}"

    spill = x.get("spill_stores", 0) + x.get("spill_loads", 0) if x else "?"
    print(f"{r['case']:<34} {r['name']:<22} {pair(r['registers'], 'registers'):>12} "
          f"{str(r['spill_bytes']) + '/' + str(spill):>14} "
          f"{pair(r['stack_bytes'], 'stack_bytes'):>13} "
          f"{pair(r['static_smem'], 'static_smem'):>19}  {r['driver']}")
  missing = sorted({r["name"] for r in ours} - set(xla))
  if missing:
    print(f"not found among the entries of XLA's dumped PTX: {missing} "
          f"(entries: {sorted(xla)[:20]})")
  with open(os.path.join(out_dir, "kernel_check.json"), "w") as f:
    json.dump({"arch": target.name, "ours": ours, "xla": xla}, f, indent=1, default=str)
  print(f"wrote {os.path.join(out_dir, 'kernel_check.json')}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
