#!/usr/bin/env bash
# Colocated vs disaggregated serving, side by side on this machine, one setup at a time, all
# driven by `pagedjax bench interference` (16 streams decoding while ~2k-token prompts
# arrive) against SmolLM2-135M-Instruct:
#   serve        one engine on every core, chunked prefill (the default)
#   fleet-2      two colocated replicas (one core each) behind the prefix-aware router
#   disagg-1p1d  one prefill replica + one decode replica (one core each), reserve-then-transfer
#
#   bash scripts/bench_disagg.sh                        # all three
#   SETUPS=serve,disagg-1p1d bash scripts/bench_disagg.sh
#
# Writes bench-results/disagg/<setup>.json (the interference report: ITL p50/p99/max of the
# streams, TTFT of the long prompts, throughput, CPU model and load) and plan-h200.json (the
# planner's split for an H200 pair); `python scripts/render_benchmarks.py` puts both in BENCHMARKS.md. Environment: SETUPS,
# BENCH_DISAGG_FLAGS (more `bench interference` flags), BENCH_DISAGG_PORT (default 18561).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=$ROOT/.venv/bin/python
OUT=${BENCH_RESULTS:-$ROOT/bench-results/disagg}
CKPT=${BENCH_CHECKPOINT:-$ROOT/checkpoints/smollm2-135m-instruct}
SETUPS=${SETUPS:-serve,fleet-2,disagg-1p1d}
PORT=${BENCH_DISAGG_PORT:-18561}
LOGS=$ROOT/.peers/logs
read -ra EXTRA <<< "${BENCH_DISAGG_FLAGS:-}"
mkdir -p "$OUT" "$LOGS"
STATE=$(mktemp -d)  # a throwaway state dir: the runs must not inherit a tuned policy
COMMON=(--checkpoint "$CKPT" --host 127.0.0.1 --port "$PORT" --max-model-len 4096 --kv-cache-memory 1GiB
        --state-dir "$STATE")

for setup in ${SETUPS//,/ }; do
  case $setup in
    serve) cmd=("$PY" -m runtime.cli serve "${COMMON[@]}") ;;
    fleet-2) cmd=("$PY" -m runtime.cli fleet serve --replicas 2 --threads-per-replica 1 "${COMMON[@]}") ;;
    disagg-1p1d) cmd=("$PY" -m runtime.cli fleet serve --prefill-replicas 1 --decode-replicas 1
                       --threads-per-replica 1 "${COMMON[@]}") ;;
    *) echo "unknown setup $setup (serve, fleet-2, disagg-1p1d)" >&2; exit 2 ;;
  esac
  echo "== $setup: ${cmd[*]}"
  RAY_ADDRESS= "${cmd[@]}" > "$LOGS/disagg-$setup.log" 2>&1 &
  pid=$!
  for _ in $(seq 900); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
    kill -0 $pid 2> /dev/null || { echo "$setup: server exited (see $LOGS/disagg-$setup.log)" >&2; break; }
    sleep 1
  done
  if curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; then
    # one warm-up long prompt so the first measured one does not pay for a cold path
    "$PY" -m runtime.cli bench interference --url "http://127.0.0.1:$PORT" --streams 1 --stream-tokens 16 \
      --num-long 1 --long-interval 0.1 > /dev/null || true
    "$PY" -m runtime.cli bench interference --url "http://127.0.0.1:$PORT" --label "$setup" \
      --out "$OUT/$setup.json" "${EXTRA[@]}" || echo "$setup: some requests failed (see the report)" >&2
  fi
  kill -TERM $pid 2> /dev/null || true
  wait $pid 2> /dev/null || true
done
rm -rf "$STATE"
# What the planner predicts for the same workload on a pair of H200s (BENCHMARKS.md shows it
# beside the measured rows).
"$PY" -m runtime.cli plan --checkpoint "$CKPT" --device h200 --disagg --prompt-tokens 2000 --rps 20 \
  --ttft-ms 500 --itl-ms 20 --context-len 2400 --output-tokens 400 --json > "$OUT/plan-h200.json"
