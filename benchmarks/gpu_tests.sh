#!/usr/bin/env bash
# GPU tests on the lent GPU machine (run from the repo root; log under $OUT or ./gpu-tests-out): installs the wheels
# the machine lacks (carried in .whl/) and opdispatch itself, prints device and versions, runs the given test files
# (default: tests/gpu) against the installed package; GPU_TEST_K selects tests by pytest -k expression.
set -u
source "$(dirname "$0")/_gpu_setup.sh" gpu-tests-out
files=()
for f in "${@:-tests/gpu}"; do files+=("$repo/$f"); done
timeout ${GPU_TEST_TIMEOUT:-520} python3 -m pytest -q -rxXs -p no:cacheprovider --rootdir "$repo" ${GPU_TEST_K:+-k "$GPU_TEST_K"} "${files[@]}" 2>&1 \
  | tee "$out/gpu-tests.txt" | tail -40
