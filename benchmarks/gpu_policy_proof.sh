#!/usr/bin/env bash
# Issue 29 on the lent GPU machine (run from the repo root; results under $OUT or ./gpu-policy-proof-out): the
# attention policy proof (benchmarks/policy_proof.py). A cold run does not fit one 9-minute job (torch.flex and
# FlagGems compile per new shape), so it resumes: it continues the report in $PROOF_DIR (default: the checkout's
# benchmarks/results/policy-proof, which travels with the working tree once copied back there) and copies the
# report to $out. Repeat until it prints no "INCOMPLETE". PROOF_ARGS adds arguments (e.g. "--quick", "--cases ...").
set -u
source "$(dirname "$0")/_gpu_setup.sh" gpu-policy-proof-out
dir=${PROOF_DIR:-$repo/benchmarks/results/policy-proof}
mkdir -p "$dir"
BENCH_COMMIT=${BENCH_COMMIT:-$(git -C "$repo" rev-parse --short HEAD 2>/dev/null)} \
  timeout "${BENCH_TIMEOUT:-530}" python3 "$repo/benchmarks/policy_proof.py" --out "$dir" --resume \
  --budget "${PROOF_BUDGET:-450}" ${PROOF_ARGS:-} > "$out/policy_proof.log" 2>&1
echo "policy_proof exit $? (0 pass, 1 fail, 2 incomplete: run again)" | tee -a "$out/policy_proof.log"
cp "$dir"/policy_proof.json "$dir"/policy_proof.md "$out"/ 2>/dev/null
grep -E "^(PASS|FAIL|UNMEASURED|geomean|  rule|--budget)" "$out/policy_proof.log" | tail -60
