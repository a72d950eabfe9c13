#!/usr/bin/env bash
# Issue 10 measurements on the lent GPU machine, in one `run` call (run from the repo root; results under $OUT or
# ./issue10-out). Phase "tests": GPU tests (existing, torch.flex subset, NVIDIA extras and compile if present), the
# flex probe and the decode loop. Phase "sbs": the side-by-side table. Each step has its own timeout.
set -u
phase=${1:-tests}
out=${OUT:-issue10-out}
mkdir -p "$out" && out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir --target /tmp/site . || exit 1
repo=$(pwd)
cd /tmp  # import the installed package, not the checkout's folders
python3 - <<'PY' | tee "$out/environment.txt"
import platform, torch, triton
print("device:", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(),
      "triton", triton.__version__, "python", platform.python_version())
PY
t() { local secs=$1; shift; timeout "$secs" "$@"; echo "[exit $? after step: $*]" | cut -c1-200; }
if [ "$phase" = tests ]; then
  gpu=("$repo/tests/gpu/test_bound_plans.py" "$repo/tests/gpu/test_cuda_graphs.py" "$repo/tests/gpu/test_gpu_attention.py")
  for extra in test_nvidia_extras.py test_compile_gpu.py; do
    [ -f "$repo/tests/gpu/$extra" ] && gpu+=("$repo/tests/gpu/$extra")
  done
  t 200 python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider --rootdir "$repo" "${gpu[@]}" 2>&1 \
    | tee "$out/gpu-tests.txt" | tail -25
  t 200 python3 -m pytest -v -rfE --tb=short -p no:cacheprovider --rootdir "$repo" "$repo/tests/gpu/test_flex_gpu.py" \
    -k "(bf16 and (softcap_gqa4 or alibi_gqa4 or decode_gqa4 or d100 or varlen_causal)) or dispatch or long_call or (bitwise and causal)" \
    2>&1 | tee "$out/flex-tests.txt" | grep -E "PASS|FAIL|ERROR|Error|assert|passed|failed" | tail -30
  t 60 python3 "$repo/benchmarks/flex_probe.py" --sq 100 --sk 333 --alignment bottom_right 2>&1 | tail -4
  t 60 python3 "$repo/benchmarks/flex_probe.py" --sq 16 --sk 1000 --alignment bottom_right 2>&1 | tail -4
  t 120 python3 "$repo/benchmarks/decode_loop.py" --out "$out/decode_loop-gpu.json" 2>&1 | tail -22
  t 60 taskset -c 2 python3 "$repo/benchmarks/decode_loop.py" --device cpu --steps 500 \
    --out "$out/decode_loop-gpu-host-cpu.json" 2>&1 | tail -14
else
  t 560 python3 "$repo/benchmarks/side_by_side.py" --out "$out/side_by_side.json" 2>"$out/side_by_side.log" | tail -30
fi
