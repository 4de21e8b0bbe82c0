#!/usr/bin/env bash
# One command for a GPU machine (no network): install offline, run the tests with compiled
# kernels, then the benchmark suites with real kernels. Everything lands under $OUT.
#
#   bash benchmarks/gpu_check.sh [tests|bench|kernels|all] [suite ...]
#
# `kernels` runs a few Pallas kernels with XLA_FLAGS=--xla_dump_to=$OUT/xla_dump and compares
# the registers, spills and shared memory of the kernels XLA compiled (ptxas -v of its dumped
# PTX) with what `python -m benchmarks kernels` reports without a GPU
# (benchmarks/xla_kernel_check.py; figures in $OUT/kernel_check.json).
#
# jax-triton is not on the GPU machine: to test the Triton implementations, carry its wheel in
# .wheels/ (pip download jax-triton==0.3.1 --no-deps -d .wheels). Without it the Triton rows
# and tests report themselves unavailable.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
STAGE=${1:-all}
shift || true
SUITES=${*:-seed norm attention xent}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
status=0

{
  date
  nvidia-smi || true
  $PY -m pip install --no-deps --no-build-isolation -e . 2>&1 | tail -n 2
  if ls .wheels/*.whl >/dev/null 2>&1; then
    $PY -m pip install --no-deps .wheels/*.whl 2>&1 | tail -n 1
  fi
  $PY -c "import jax, jaxfuse; print('jax', jax.__version__, jax.devices());
from jaxfuse.ops import dispatch; print({i: dispatch.runs_natively(i) for i in dispatch.IMPLEMENTATIONS})"
} > "$OUT/setup.log" 2>&1 || status=1
cat "$OUT/setup.log"

if [[ $STAGE == tests || $STAGE == all ]]; then
  timeout 420 $PY -m pytest -q -x -p no:cacheprovider --junitxml="$OUT/pytest.xml" tests \
    > "$OUT/pytest.log" 2>&1 || status=1
  tail -n 25 "$OUT/pytest.log"
fi

if [[ $STAGE == bench || $STAGE == all ]]; then
  for suite in $SUITES; do
    timeout 300 $PY -m benchmarks "$suite" --quick --json "$OUT/$suite-gpu.json" \
      --plot "$OUT/$suite-gpu.png" > "$OUT/$suite.log" 2>&1 || status=1
    tail -n 40 "$OUT/$suite.log"
  done
  # Pallas against jax-triton, per case: which kernel set is faster, and by how much.
  $PY -m benchmarks.compare_paths "$OUT"/*-gpu.json --out "$OUT/pallas_vs_triton.md" \
    --json "$OUT/pallas_vs_triton.json" > "$OUT/compare_paths.log" 2>&1 || status=1
  cat "$OUT/compare_paths.log"
fi
if [[ $STAGE == kernels || $STAGE == all ]]; then
  timeout 420 $PY -m benchmarks.xla_kernel_check "$OUT" > "$OUT/kernel_check.log" 2>&1 || status=1
  tail -n 40 "$OUT/kernel_check.log"
fi
echo "gpu_check: status $status, results in $OUT"
exit $status
