#!/usr/bin/env bash
# Per-call dispatch overhead on a CUDA machine (run from the repo root; writes into $OUT or ./gpu-overhead-out):
# installs opdispatch and the wheels the machine lacks (carried in .whl/: pydantic and its needs), checks the
# bound plans, the fast path and CUDA graphs on the GPU, then times benchmarks/dispatch_overhead.py on the GPU
# and on that machine's CPU.
set -u
out=${OUT:-gpu-overhead-out}
mkdir -p "$out" && out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir --target /tmp/site . || exit 1
repo=$(pwd)
cd /tmp  # from here on, import the installed package, not the checkout's folders
python3 - <<'PY' | tee "$out/environment.txt"
import platform, torch, opdispatch
print("device:", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(),
      "python", platform.python_version(), "opdispatch", opdispatch.__version__, "from", opdispatch.__file__)
print("cpu:", platform.processor() or platform.machine(), open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0])
PY
python3 -m pytest -q -p no:cacheprovider --rootdir "$repo" "$repo/tests/gpu/test_bound_plans.py" \
  "$repo/tests/gpu/test_cuda_graphs.py" "$repo/tests/test_fast_path.py" 2>&1 | tail -3 | tee "$out/gpu-tests.txt"
taskset -c 2 python3 "$repo/benchmarks/dispatch_overhead.py" --device cuda --device cpu \
  --out "$out/dispatch_overhead.md" 2>&1 | tail -16
