#!/usr/bin/env bash
# w4a16 measured as BENCHMARKS.md shows it ("4-bit weights (w4a16)"), on a quiet machine:
#   1. the decode step, float32 and w4a16 alternating (two pairs), bench-results/w4a16/;
#   2. the answer gate of the Q4_1 GGUF's own 4-bit weights against the float32 checkpoint
#      converted from the same file, bench-results/accuracy-w4a16.json;
#   3. batch-1 serving against llama.cpp (and float32, w8a8), bench-results/w4a16-batch1/;
#   4. the shared-prefix workload against llama.cpp, bench-results/w4a16-shared/.
# Then `python scripts/render_benchmarks.py ...` (README) puts them in BENCHMARKS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${BENCH_RESULTS:-bench-results}
CKPT=checkpoints/smollm2-135m-instruct
mkdir -p "$OUT/w4a16"
$PY -m runtime.cli pull smollm2 >/dev/null
W4=$($PY -m runtime.cli pull smollm2 --quantize w4a16 | tail -1)
for pair in 1 2; do
  for q in float32 w4a16; do
    ckpt=$CKPT; [[ $q == w4a16 ]] && ckpt=$W4
    $PY -m runtime.cli bench offline --checkpoint "$ckpt" --part decode --batches 1,8,64 --no-progress \
      --out "$OUT/w4a16/decode-$q-$pair.json" | grep -v '^== \|bandwidth' || true
  done
done
$PY -m runtime.cli bench accuracy --checkpoint "$CKPT" --quantization w4a16 --served "$W4" \
  --out "$OUT/accuracy-w4a16.json" --show-changed 3 || true  # (exit 1: a gate failed; the JSON says which)
BENCH_RESULTS=$OUT/w4a16-batch1 BENCH_PEERS_CONCURRENCY=1 BENCH_PEERS_N=${BENCH_W4_N:-8} \
  PEERS=${BENCH_W4_PEERS:-pagedjax,pagedjax-w8a8,pagedjax-w4a16,llamacpp} bash scripts/bench_peers.sh
# 4. the shared-prefix workload (64 requests, concurrency 64) against llama.cpp
BENCH_RESULTS=$OUT/w4a16-shared PEERS=${BENCH_W4_SHARED_PEERS:-pagedjax,pagedjax-w4a16,llamacpp} \
  bash scripts/bench_peers.sh
