#!/usr/bin/env bash
# Issue-6 measurements on a CUDA machine (run from the repo root; writes into $OUT or ./gpu-perf-out):
#   CUDA-graph tests, per-call dispatch overhead, a tuned table for this device, and the regret of the
#   default policy vs the tuned policy on shapes between the tuned buckets.
set -u
out=${OUT:-gpu-perf-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 - <<'PY' | tee "$out/demo.txt"
import torch, platform
print("device:", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(),
      "python", platform.python_version())
try:
    import triton; print("triton", triton.__version__)
except Exception as e: print("triton: n/a", e)
PY
python3 -m opdispatch demo 2>&1 | tee -a "$out/demo.txt"
python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_graphs.py 2>&1 | tail -15 | tee "$out/cuda-graphs.txt"
python3 benchmarks/dispatch_overhead.py --device cuda --out "$out/dispatch_overhead-cuda.md" 2>&1 | tail -30
timeout 240 python3 -m opdispatch tune --preset all --reps 10 --quiet --out "$out/tuned.yaml" 2>&1 | tail -5
printf 'ops:\n  attention:\n    autotune: %s\n' "$(cd "$out" && pwd)/tuned.yaml" > /tmp/policy-tuned.yaml
python3 -m opdispatch bench --shapes benchmarks/shapes-between-buckets.yaml --reps 10 --quiet \
  --out-dir "$out/default" 2>&1 | tail -3
OPDISPATCH_POLICY=/tmp/policy-tuned.yaml python3 -m opdispatch bench --shapes benchmarks/shapes-between-buckets.yaml \
  --reps 10 --quiet --out-dir "$out/tuned" 2>&1 | tail -3
ls -R "$out"
