#!/usr/bin/env bash
# Second issue-6 pass on a CUDA machine: GPU tests (bound plans, CUDA graphs, every impl vs the reference),
# per-call dispatch overhead, and the regret of the default and the tuned policy on shapes between the tuned
# buckets, reusing the committed tuned table benchmarks/results/tuned-h200.yaml (tuned on the same device).
set -u
out=${OUT:-gpu-perf-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pytest -q -p no:cacheprovider tests/gpu/test_bound_plans.py tests/gpu/test_cuda_graphs.py 2>&1 | tail -4 \
  | tee "$out/gpu-tests.txt"
for impl in nvidia.cudnn nvidia.flash nvidia.mem_efficient flagos.triton; do
  GPU_ATTN_IMPL=$impl python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_attention.py 2>&1 | tail -1 \
    | sed "s/^/$impl: /" | tee -a "$out/gpu-tests.txt"
done
python3 benchmarks/dispatch_overhead.py --device cuda --out "$out/dispatch_overhead-cuda.md" 2>&1 | tail -8
printf 'ops:\n  attention:\n    autotune: %s\n' "$(pwd)/benchmarks/results/tuned-h200.yaml" > /tmp/policy-tuned.yaml
python3 -m opdispatch bench --shapes benchmarks/shapes-between-buckets.yaml --reps 20 --quiet \
  --out-dir "$out/default" 2>&1 | tail -1
OPDISPATCH_POLICY=/tmp/policy-tuned.yaml python3 -m opdispatch bench --shapes benchmarks/shapes-between-buckets.yaml \
  --reps 20 --quiet --out-dir "$out/tuned" 2>&1 | tail -1
