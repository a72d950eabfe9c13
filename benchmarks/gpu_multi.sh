#!/usr/bin/env bash
# Beyond one GPU on the lent multi-GPU machine (run from the repo root; results under $OUT or ./gpu-multi-out):
# rank-consistent decisions over NCCL (benchmarks/agreement_nccl.py) and context-parallel attention against one
# GPU and torch's context_parallel (benchmarks/context_parallel.py). NVLink multicast stays off.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source "$(dirname "$0")/_gpu_setup.sh" gpu-multi-out
nvidia-smi --query-gpu=name,memory.total --format=csv | tee -a "$out/environment.txt"
timeout 150 python3 "$repo/benchmarks/agreement_nccl.py" --out "$out/agreement_nccl.md" 2>&1 | tail -15
timeout ${CP_TIMEOUT:-400} python3 "$repo/benchmarks/context_parallel.py" --out "$out/context_parallel.md" "$@" 2>&1 \
  | tail -40
