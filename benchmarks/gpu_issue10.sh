#!/usr/bin/env bash
# Issue 10 measurements on the lent GPU machine, in one `run` call (run from the repo root; results under $OUT or
# ./issue10-out): the cost of a first call at a new shape, the decode loop, the GPU tests of the NVIDIA extras and
# compile (when present), two torch.flex cases, and the side-by-side table.
set -u
source "$(dirname "$0")/_gpu_setup.sh" issue10-out
t() { local secs=$1; shift; timeout "$secs" "$@"; echo "[exit $? after step: $*]" | cut -c1-200; }
# Each step has a timeout so one slow step cannot eat the call. $1 = measure (default), sbs (the table alone) or
# backward (the compiled backward from saved out/LSE and cuDNN ALiBi: their GPU tests, compiled_training.py, the
# ALiBi cells of the table).
phase=${1:-measure}
if [ "$phase" = measure ]; then
t 45 python3 "$repo/benchmarks/new_shape_cost.py" --out "$out/new_shape_cost.json" 2>&1 | tail -9
t 100 python3 "$repo/benchmarks/decode_loop.py" --budget 3 --out "$out/decode_loop.json" 2>&1 | tail -16
extra=()
for f in test_issue10_gpu.py test_nvidia_extras.py test_compile_gpu.py; do [ -f "$repo/tests/gpu/$f" ] && extra+=("$repo/tests/gpu/$f"); done
if [ ${#extra[@]} -gt 0 ]; then
  t 120 python3 -m pytest -q -s -rfE --tb=short -p no:cacheprovider --rootdir "$repo" "${extra[@]}" 2>&1 \
    | tee "$out/gpu-tests-extra.txt" | tail -15
fi
t 60 python3 -m pytest -q -rfE --tb=short -p no:cacheprovider --rootdir "$repo" "$repo/tests/gpu/test_flex_gpu.py" \
  -k "bf16 and (bottom_right_sq or top_left_sq)" 2>&1 | tee "$out/flex-sq-lt-sk.txt" | grep -E "Error|assert|passed|failed" | tail -8
fi
if [ "$phase" = sbs ]; then
t 100 python3 -m pytest -q -rfE --tb=short -p no:cacheprovider --rootdir "$repo" "$repo/tests/gpu/test_issue10_gpu.py" \
  -k "padded or alibi" 2>&1 | tee "$out/gpu-tests-padding.txt" | tail -8
t ${SBS_SECONDS:-370} python3 "$repo/benchmarks/side_by_side.py" --reps 8 --warmup 2 --out "$out/side_by_side.json" \
  2>"$out/side_by_side.log" | tail -32
fi
if [ "$phase" = backward ]; then
t 150 python3 -m pytest -q -rfE --tb=short -p no:cacheprovider --rootdir "$repo" \
  "$repo/tests/gpu/test_compiled_backward_gpu.py" "$repo/tests/gpu/test_issue10_gpu.py" -k "backward or alibi or padded" \
  2>&1 | tee "$out/gpu-tests-backward.txt" | tail -12
t 200 python3 "$repo/benchmarks/compiled_training.py" --reps 10 --out "$out/compiled_training.json" \
  2>"$out/compiled_training.log" | tail -9
t 150 python3 "$repo/benchmarks/side_by_side.py" --reps 8 --warmup 2 --cells alibi,alibi_gqa \
  --out "$out/side_by_side_alibi.json" 2>"$out/side_by_side_alibi.log" | tail -8
fi
if [ "$phase" = d64 ]; then  # head_dim 64 training: the default pick, then with nvidia.flash preferred
t 100 python3 "$repo/benchmarks/side_by_side.py" --reps 10 --warmup 3 --cells hd64,hd72,dense \
  --out "$out/side_by_side_d64.json" 2>"$out/side_by_side_d64.log" | tail -8
OPDISPATCH_PREFER=nvidia.flash t 100 python3 "$repo/benchmarks/side_by_side.py" --reps 10 --warmup 3 \
  --cells hd64,hd72,dense --out "$out/side_by_side_d64_flash.json" 2>"$out/side_by_side_d64_flash.log" | tail -8
fi
