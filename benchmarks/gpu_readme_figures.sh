#!/usr/bin/env bash
# The README's performance figures on the lent GPU machine, in one run per part (run from the repo root; results
# under $OUT or ./gpu-readme-figures-out). Parts (arguments; default: all):
#   side     benchmarks/side_by_side.py, every cell, forward and forward+backward (issue 29: each cell >= 1.0x of
#            torch's best way, or explained)
#   overhead per-call overhead (benchmarks/dispatch_overhead.py)
#   serving  a growing-cache decode loop
#            (benchmarks/decode_loop.py: first pass and later passes) and transformers' generate() of a ~100M
#            Llama-shaped model, bf16, batch 1/8/32 (benchmarks/generate_bench.py) (issues 29 and 31);
#            GENERATE_ARGS passes more (e.g. "--copies 4 --host-time", or "--copies 4 --control" for the A/A check)
#   flex     torch.flex against torch's own compiled flex_attention, softcap spellings (benchmarks/flex_variants.py)
#   door     the same kernel through torch's SDPA, the aten op, plan() and attention() (door_vs_kernel.py)
#   flagos   a growing decode pinned to flagos.triton (benchmarks/flagos_growing_decode.py)
#   fp8      FP8 (e4m3, nvidia.cudnn_frontend; carry nvidia-cudnn-frontend in .whl) vs the best bf16 kernel
#   te       TransformerEngine-style calls through compat.te: the kernel each lands on, the module's cost
#            (benchmarks/te_module.py; issue 33)
#   masked   a padded batch's decode with a boolean mask vs torch's SDPA (benchmarks/masked_decode.py; issue 31)
#   decode   the growing-cache decode loop alone (the first half of serving)
#   kvtests  the GPU tests of KV-cache index checks (tests/gpu/test_kv_index_checks_gpu.py)
#   profile  where a growing decode loop's first pass spends its host time (benchmarks/first_pass_profile.py)
#   flexlong the long-sequence flex GPU test (16k softcap must stay fused; issue 29: it did not finish in 170 s)
#   kvc      flash_attn_with_kvcache decode vs the raw kernel with its append, dense and 256-key pages
#            (benchmarks/kvcache_decode.py; issue 31)
#   kv       KV-cache calls: decode over dense and paged caches, and paged varlen (chunked prefill) against
#            torch's best way, batch 8 (benchmarks/kv_cache.py; issue 29); then the decode rows alone at batch 1
#            and 32 for the pick, FA2, cuDNN and nvidia.cudnn_frontend (carry nvidia-cudnn-frontend in .whl: the
#            policy's KV-cache decode rule; issue 32)
#   trace    one profiled training step of a Llama-shaped layer: the trimmed Chrome trace and what each opdispatch
#            range launched (benchmarks/trace_layer.py; issue 34). Draw the README's picture from it anywhere:
#            python benchmarks/render_trace.py $out/trace-h100.json.gz --out docs/images/trace-h100.png
#   determinism  the GPU tests of deterministic backwards under torch's flag (tests/gpu/test_issue10_gpu.py)
# BENCH_COMMIT names the commit the copy was made from (the machine's .git may be stale).
set -u
source "$(dirname "$0")/_gpu_setup.sh" gpu-readme-figures-out
parts=${*:-side serving}

decode_loop() {  # the growing-cache decode loop: part decode, and the first half of part serving
  timeout 150 python3 "$repo/benchmarks/decode_loop.py" --device cuda --dtype bf16 \
    --out "$out/decode_loop-h100.json" > "$out/decode_loop-h100.log" 2>&1
  echo "decode_loop exit $?"; tail -16 "$out/decode_loop-h100.log"
}
for part in $parts; do
  case $part in
    side)
      timeout "${SIDE_TIMEOUT:-420}" python3 "$repo/benchmarks/side_by_side.py" ${CELLS:+--cells "$CELLS"} \
        --out "$out/side_by_side-h100.json" > "$out/side_by_side-h100.log" 2>&1
      echo "side_by_side exit $?" | tee -a "$out/side_by_side-h100.log"
      cat "$out/side_by_side-h100.md" ;;
    serving)
      decode_loop
      timeout "${GENERATE_TIMEOUT:-240}" python3 "$repo/benchmarks/generate_bench.py" --size 100m \
        --batches "${GENERATE_BATCHES:-1,8,32}" --reps "${GENERATE_REPS:-9}" ${GENERATE_ARGS:-} --out "$out/generate-h100.md" > "$out/generate-h100.log" 2>&1
      echo "generate_bench exit $?"; tail -20 "$out/generate-h100.log" ;;
    flex)
      timeout 300 python3 "$repo/benchmarks/flex_variants.py" --out "$out/flex_variants-h100.json" --profile "$out/flexprof" \
        > "$out/flex_variants-h100.log" 2>&1
      echo "flex_variants exit $?"; tail -14 "$out/flex_variants-h100.log" ;;
    determinism)
      timeout 200 python3 -m pytest -q -rxXsf -p no:cacheprovider --rootdir "$repo" \
        "$repo/tests/gpu/test_issue10_gpu.py" -k "deterministic" > "$out/gpu-tests-determinism-h100.txt" 2>&1
      tail -8 "$out/gpu-tests-determinism-h100.txt" ;;
    door)
      timeout 150 python3 "$repo/benchmarks/door_vs_kernel.py" --out "$out/door_vs_kernel-h100.json" \
        > "$out/door_vs_kernel-h100.log" 2>&1
      echo "door_vs_kernel exit $?"; tail -20 "$out/door_vs_kernel-h100.log" ;;
    flagos)
      timeout 200 python3 "$repo/benchmarks/flagos_growing_decode.py" --steps ${FLAGOS_STEPS:-64} > "$out/flagos_growing_decode-h100.txt" 2>&1
      echo "flagos_growing_decode exit $?"; tail -15 "$out/flagos_growing_decode-h100.txt" ;;
    overhead)
      timeout 300 python3 "$repo/benchmarks/dispatch_overhead.py" --device cuda \
        --out "$out/dispatch_overhead-h100.md" > "$out/dispatch_overhead-h100.log" 2>&1
      echo "dispatch_overhead exit $?"; tail -12 "$out/dispatch_overhead-h100.md" | cut -c1-300 ;;
    fp8)
      timeout "${FP8_TIMEOUT:-420}" python3 "$repo/benchmarks/fp8_attention.py" --out "$out/fp8_attention-h100.json" \
        > "$out/fp8_attention-h100.log" 2>&1
      echo "fp8_attention exit $?"; grep -E '^### |^\| (bf16|fp8)[^|]*\| [0-9]' "$out/fp8_attention-h100.md" \
        | cut -c1-200; tail -3 "$out/fp8_attention-h100.log" | cut -c1-300 ;;
    te)
      timeout 300 python3 "$repo/benchmarks/te_module.py" --out "$out/te_module-h100.json" > "$out/te_module-h100.log" 2>&1
      echo "te_module exit $?"; cat "$out/te_module-h100.md" ;;
    flexlong)
      timeout 240 python3 -m pytest -q -rxXsf -p no:cacheprovider --rootdir "$repo" --durations=3 \
        -o faulthandler_timeout=${FLEXLONG_DUMP:-150} \
        "$repo/tests/gpu/test_flex_gpu.py" -k "long_call_stays_fused" > "$out/gpu-tests-flex-long-h100.txt" 2>&1
      echo "flexlong exit $?"; tail -8 "$out/gpu-tests-flex-long-h100.txt" ;;
    decode)
      decode_loop ;;
    kvtests)
      timeout 150 python3 -m pytest -q -rxXsf -p no:cacheprovider --rootdir "$repo" \
        "$repo/tests/gpu/test_kv_index_checks_gpu.py" > "$out/gpu-tests-kv-index-checks-h100.txt" 2>&1
      tail -6 "$out/gpu-tests-kv-index-checks-h100.txt" ;;
    profile)
      timeout 150 python3 "$repo/benchmarks/first_pass_profile.py" --device cuda --dtype bf16 \
        > "$out/first_pass_profile-h100.txt" 2>&1
      echo "first_pass_profile exit $?"; head -40 "$out/first_pass_profile-h100.txt" | cut -c1-160
      tail -16 "$out/first_pass_profile-h100.txt" ;;
    kvc)
      # The default (the check and append fused into one Triton kernel), then the same check as torch ops.
      for append in ${KVC_APPENDS:-triton torch}; do
        for paged in 0 256; do
          name=kvcache_decode-paged$paged$([ $append = torch ] && echo -torch-ops)-h100
          OPDISPATCH_KV_APPEND=$([ $append = torch ] && echo torch) timeout 120 python3 \
            "$repo/benchmarks/kvcache_decode.py" --device cuda --dtype bf16 --batch 8 --capacity 4096 --start 2048 \
            --paged $paged --out "$out/$name.json" --profile "$out/$name-profile.txt" > "$out/$name.log" 2>&1
          echo "$name exit $?"; grep -E "^\||index checks" "$out/$name.log" | tail -6
        done
      done ;;
    kv)
      timeout 240 python3 "$repo/benchmarks/kv_cache.py" > "$out/kv_cache-h100.md" 2>&1
      echo "kv_cache exit $?"; grep -E "^\| " "$out/kv_cache-h100.md" | cut -c1-160
      for b in 1 32; do
        timeout 150 python3 "$repo/benchmarks/kv_cache.py" --batch $b --decode-only \
          --impls nvidia.flash,nvidia.cudnn,nvidia.cudnn_frontend > "$out/kv_cache-b$b-h100.md" 2>&1
        echo "kv_cache batch $b exit $?"; grep -E "^\| " "$out/kv_cache-b$b-h100.md" | cut -c1-160
      done ;;
    trace)
      timeout 150 python3 "$repo/benchmarks/trace_layer.py" --device cuda --trace "$out/trace-h100.json.gz" \
        --summary "$out/trace-h100.md" > "$out/trace-h100.log" 2>&1
      echo "trace_layer exit $?"; grep -E "^(In the profiled step|Device time|\| [0-9])" "$out/trace-h100.md" | cut -c1-300
      tail -3 "$out/trace-h100.log" | cut -c1-300 ;;
    masked)
      timeout 240 python3 "$repo/benchmarks/masked_decode.py" --batch 32 --pin nvidia.cudnn --pin nvidia.mem_efficient > "$out/masked_decode-h100.txt" 2>&1
      echo "masked_decode exit $?"; tail -12 "$out/masked_decode-h100.txt" ;;
    *) echo "unknown part $part (side, serving, flex, determinism, door, flagos, overhead, fp8, te, masked, kv, kvc, flexlong, profile, decode, kvtests, trace)"; exit 2 ;;
  esac
done
