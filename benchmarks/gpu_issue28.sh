#!/usr/bin/env bash
# Issue 28 on the lent GPU machine (run from the repo root; results under $OUT or ./gpu-issue28-out): attention
# sinks on the fused paths, bf16, forward and training, against the same call without sinks and against torch's
# ways to express sinks (benchmarks/side_by_side.py's GPT-OSS cells), then the sinks GPU tests.
set -u
source "$(dirname "$0")/_gpu_setup.sh" gpu-issue28-out
timeout "${BENCH_TIMEOUT:-300}" python3 "$repo/benchmarks/side_by_side.py" --cells "${CELLS:-sinks,sinks_window}" \
  --out "$out/side_by_side-sinks-h100.json" > "$out/side_by_side-sinks-h100.log" 2>&1
echo "side_by_side exit $?" | tee -a "$out/side_by_side-sinks-h100.log"
cat "$out/side_by_side-sinks-h100.md"
timeout "${GPU_TEST_TIMEOUT:-200}" python3 -m pytest -q -rxXsf -p no:cacheprovider --rootdir "$repo" \
  "$repo/tests/gpu/test_sinks_gpu.py" > "$out/gpu-tests-sinks-h100.txt" 2>&1
tail -25 "$out/gpu-tests-sinks-h100.txt"
