#!/usr/bin/env bash
# Tensor parallelism on this machine: `pagedjax bench tp` (the decode step at TP 1 and TP N on
# forced host devices that share the cores: an overhead figure, not a speed-up) and the
# planner's TP tables for Llama-3-70B on H100 and H200. Writes bench-results/tp/; then
# `python scripts/render_benchmarks.py` puts them in BENCHMARKS.md.
#
#   bash scripts/bench_tp.sh            # TP 3 (SmolLM2: 9 query, 3 KV heads; BENCH_TP_SIZE to change)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$PWD/.venv/bin/python
OUT=${BENCH_RESULTS:-$PWD/bench-results}/tp
N=${BENCH_TP_SIZE:-3}
mkdir -p "$OUT"
XLA_FLAGS="--xla_force_host_platform_device_count=$N ${XLA_FLAGS:-}" "$PY" -m runtime.cli bench tp \
  --tensor-parallel-size "$N" --out "$OUT/tp-step.json"
for dev in h100 h200; do
  "$PY" -m runtime.cli plan --model llama-3-70b --device $dev --context-len 2000 --tensor-parallel-size 8 \
    --json > "$OUT/plan-$dev.json"
done
