#!/usr/bin/env bash
# Issue 27 on the lent GPU machine (run from the repo root; results under $OUT or ./gpu-issue27-out):
#   bash benchmarks/gpu_issue27.sh validate   the full conformance matrix over every available implementation,
#                                             merged into configs/quarantine.yaml (copied to the results)
#   bash benchmarks/gpu_issue27.sh checks     flagos windowed KV decode against the float64 reference, and the
#                                             GPU tests of the KV-index checks, sinks, the breaker's binds, flex
set -u
step=${1:-validate}
source "$(dirname "$0")/_gpu_setup.sh" gpu-issue27-out
python3 - <<'PY' | tee -a "$out/environment.txt"
import importlib.metadata as m
for name in ("flag_gems", "pydantic", "transformers"):
    try:
        print(name, m.version(name.replace("_", "-")))
    except m.PackageNotFoundError:
        print(name, "not installed")
PY
if [ "$step" = validate ]; then
  cp "$repo/configs/quarantine.yaml" "$out/quarantine-before.yaml"
  timeout "${VALIDATE_TIMEOUT:-540}" python3 -m opdispatch.tools._cli validate --on cuda --jobs "${JOBS:-4}" --split "${SPLIT:-1}" \
    --timeout "${CASE_TIMEOUT:-120}" ${IMPLS:+--impl "$IMPLS"} \
    --budget "$(( ${VALIDATE_TIMEOUT:-540} - 40 ))" \
    --quarantine "$repo/configs/quarantine.yaml" --report "$out/validate-h100.md" --json "$out/validate-h100.json" \
    > "$out/validate-h100.log" 2>&1
  echo "validate exit $?" | tee -a "$out/validate-h100.log"
  cp "$repo/configs/quarantine.yaml" "$out/quarantine.yaml"
  tail -40 "$out/validate-h100.log"
else
  timeout 150 python3 "$repo/benchmarks/flagos_window_kv_check.py" > "$out/flagos_window_kv-h100.txt" 2>&1
  echo "flagos check exit $?" | tee -a "$out/flagos_window_kv-h100.txt"
  tail -15 "$out/flagos_window_kv-h100.txt"
  tests=(tests/gpu/test_kv_index_checks_gpu.py tests/gpu/test_sinks_gpu.py tests/gpu/test_trust_gpu.py
         tests/gpu/test_bound_plans.py tests/gpu/test_kv_cache_gpu.py tests/gpu/test_flex_retain_graph_gpu.py
         ${EXTRA_TESTS:-})
  files=(); for f in "${tests[@]}"; do files+=("$repo/$f"); done
  timeout "${GPU_TEST_TIMEOUT:-360}" python3 -m pytest -q -rxXsf -p no:cacheprovider --rootdir "$repo" "${files[@]}" \
    > "$out/gpu-tests-issue27-h100.txt" 2>&1
  tail -30 "$out/gpu-tests-issue27-h100.txt"
fi
