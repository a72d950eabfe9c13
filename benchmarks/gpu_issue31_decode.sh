#!/usr/bin/env bash
# Issue 31 on the lent GPU machine (run from the repo root; results under $OUT or ./gpu-issue31-out): installs
# opdispatch (wheels it lacks carried in .whl/), builds the compiled fast path, then times the growing-cache decode
# loop (first pass vs repeated signature), a padded batch's masked decode (batch 8 and 32) and — where transformers
# is installed — generate() of the ~100M Llama-shaped model against sdpa.
set -u
source "$(dirname "$0")/_gpu_setup.sh" gpu-issue31-out
export OPDISPATCH_CACHE_DIR=/tmp/opdispatch-cache
python3 -c "import sys; from opdispatch.tools import _cli; sys.argv = ['opdispatch', 'build']; sys.exit(_cli.main())" \
  2>&1 | tail -2 | tee "$out/build.txt"
taskset -c 2 python3 "$repo/benchmarks/decode_loop.py" --device cuda --dtype bf16 --out "$out/decode_loop.json" \
  2>&1 | tail -16
for batch in 8 32; do
  taskset -c 2 python3 "$repo/benchmarks/masked_decode.py" --batch "$batch" --out "$out/masked_decode_b$batch.json" \
    2>&1 | tail -8
done
if python3 -c "import transformers" 2>/dev/null; then
  taskset -c 2 python3 "$repo/benchmarks/generate_bench.py" --size 100m --batches 1,8,32 \
    --out "$out/generate-100m.md" 2>&1 | tail -8
else
  echo "transformers is not installed here: generate_bench skipped"
fi
