#!/usr/bin/env bash
# GPU tests on the lent GPU machine (run from the repo root; log under $OUT or ./gpu-tests-out): installs the wheels
# the machine lacks (carried in .whl/) and opdispatch itself, prints device and versions, runs the given test files
# (default: tests/gpu) against the installed package.
set -u
out=${OUT:-gpu-tests-out}
mkdir -p "$out" && out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir --target /tmp/site . || exit 1
repo=$(pwd)
cd /tmp  # import the installed package, not the checkout's folders
python3 - <<'PY' | tee "$out/environment.txt"
import platform, torch, triton, opdispatch
print("device:", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(),
      "triton", triton.__version__, "python", platform.python_version())
PY
files=()
for f in "${@:-tests/gpu}"; do files+=("$repo/$f"); done
timeout ${GPU_TEST_TIMEOUT:-520} python3 -m pytest -q -rxXs -p no:cacheprovider --rootdir "$repo" "${files[@]}" 2>&1 \
  | tee "$out/gpu-tests.txt" | tail -40
