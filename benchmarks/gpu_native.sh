#!/usr/bin/env bash
# The compiled per-call fast path on the lent GPU machine (run from the repo root; results under $OUT or
# ./gpu-native-out): installs opdispatch (wheels it lacks carried in .whl/), builds the extension with
# `opdispatch build` for that machine's torch, runs the compiled-vs-Python tests and the GPU fast-path tests on it,
# then times benchmarks/dispatch_overhead.py (GPU and that machine's CPU; the "(py)" columns are the Python path
# in the same rounds) and benchmarks/decode_loop.py.
set -u
source "$(dirname "$0")/_gpu_setup.sh" gpu-native-out
export OPDISPATCH_CACHE_DIR=/tmp/opdispatch-cache
start=$(date +%s)
python3 -c "import sys; from opdispatch.tools import _cli; sys.argv = ['opdispatch', 'build']; sys.exit(_cli.main())" \
  2>&1 | tee "$out/build.txt"
echo "build took $(( $(date +%s) - start )) s" | tee -a "$out/build.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider --rootdir "$repo" "$repo/tests/test_native.py" \
  "$repo/tests/test_fast_path.py" "$repo/tests/gpu/test_bound_plans.py" "$repo/tests/gpu/test_cuda_graphs.py" \
  "$repo/tests/gpu/test_compat_gpu.py" "$repo/tests/gpu/test_kv_cache_gpu.py" 2>&1 | tail -5 | tee "$out/gpu-tests.txt"
taskset -c 2 python3 "$repo/benchmarks/dispatch_overhead.py" --device cuda --device cpu --repeat 31 \
  --out "$out/dispatch_overhead.md" > /dev/null 2>&1
cat "$out/dispatch_overhead.md"
taskset -c 2 python3 "$repo/benchmarks/decode_loop.py" --steps 2000 --out "$out/decode_loop.json" 2>&1 | tail -25
