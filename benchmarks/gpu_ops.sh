#!/usr/bin/env bash
# rms_norm and rotary_embedding on the lent GPU machine, in one `run` call (run from the repo root; results under
# $OUT or ./ops-out): their GPU tests, then benchmarks/op_bench.py.
set -u
source "$(dirname "$0")/_gpu_setup.sh" ops-out
t() { local secs=$1; shift; timeout "$secs" "$@"; echo "[exit $? after step: $*]" | cut -c1-200; }
t ${TEST_SECONDS:-200} python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider --rootdir "$repo" \
  "$repo/tests/gpu/test_ops_gpu.py" 2>&1 | tee "$out/gpu-tests-ops.txt" | tail -15
t ${BENCH_SECONDS:-300} python3 "$repo/benchmarks/op_bench.py" --out "$out/op_bench.json" 2>"$out/op_bench.log" \
  | tee "$out/op_bench.md"
