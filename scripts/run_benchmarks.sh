#!/usr/bin/env bash
# Regenerates every number in BENCHMARKS.md: writes JSON (and plots) under bench-results/,
# then renders BENCHMARKS.md from that JSON. Bounded: each step has a timeout and fixed
# request counts; about 15 minutes on a 2-core CPU machine.
#
#   bash scripts/run_benchmarks.sh            # everything
#   BENCH_SKIP_PEER=1 BENCH_SKIP_GUIDELLM=1 bash scripts/run_benchmarks.sh
#
# Needs: the project venv (.venv), matplotlib (pip install -e .[bench]); optional: the
# transformers peer (pip install -e .[peer]) and guidellm, which this script installs into
# its own venv ($GUIDELLM_VENV, default /tmp/guidellm-venv) because it would downgrade
# packages of the project venv.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-$ROOT/.venv/bin/python}
OUT=${BENCH_RESULTS:-$ROOT/bench-results}
CKPT=${BENCH_CHECKPOINT:-$ROOT/checkpoints/smollm2-135m-instruct}
MODEL_NAME=smollm2-135m-instruct
PORT=${BENCH_PORT:-18431}
URL=http://127.0.0.1:$PORT
GUIDELLM_VENV=${GUIDELLM_VENV:-/tmp/guidellm-venv}
BENCH_MD=${BENCH_MD:-$ROOT/BENCHMARKS.md}
export PAGEDJAX_JAX_CACHE=${PAGEDJAX_JAX_CACHE:-$ROOT/.cache/jax}
export TF_CPP_MIN_LOG_LEVEL=2
# One engine envelope for the offline runs and the server: the compiled shapes are the
# same, so the server reuses the persistent compilation cache.
ENVELOPE=(--max-num-seqs 64 --max-num-batched-tokens 512 --max-model-len 1024 --kv-cache-memory 1536MiB)
# Request counts (BENCH_QUICK=1: a smoke run of the whole pipeline with tiny counts).
if [[ -n ${BENCH_QUICK:-} ]]; then
  N_OFFLINE=8 MAX_TOKENS=8 N_SEQUENTIAL=2 ITERS=2 N_SERVE=8 N_SWEEP=4 N_GUIDELLM=4 PEER_BATCHES=8
else
  N_OFFLINE=64 MAX_TOKENS=64 N_SEQUENTIAL=8 ITERS=10 N_SERVE=32 N_SWEEP=16 N_GUIDELLM=24 PEER_BATCHES=8,16
fi

mkdir -p "$OUT"
COMMANDS=$OUT/commands.txt
: > "$COMMANDS"
START=$(date +%s)

step() { echo; echo "=== $* (+$(( $(date +%s) - START )) s)"; }
# Run a command and record it (with paths shortened) for the Commands section of BENCHMARKS.md.
run() {
  local shown="$*"
  shown=${shown//$PY -m runtime.cli/pagedjax}
  shown=${shown//$PY/python}
  shown=${shown//$GUIDELLM_VENV\/bin\//}
  shown=${shown//$ROOT\//}
  shown=${shown#timeout [0-9]* }
  echo "$shown" >> "$COMMANDS"
  echo "+ $shown" >&2
  "$@"
}
PAGEDJAX=("$PY" -m runtime.cli)

step "checkpoint + machine"
"${PAGEDJAX[@]}" pull >/dev/null
BENCH_SHARED_MACHINE=${BENCH_SHARED_MACHINE:-0} "$PY" -m runtime.bench.machine machine "$OUT/machine.json"

step "offline: host step, throughput (64 shared-prefix chats), decode split"
rm -f "$OUT/offline.json"
run timeout 900 "${PAGEDJAX[@]}" bench offline --checkpoint "$CKPT" --part all --num-requests $N_OFFLINE \
  --max-tokens $MAX_TOKENS --sequential-requests $N_SEQUENTIAL --batches 1,8,32,64 --context-len 350 --iters $ITERS \
  --no-progress \
  --out "$OUT/offline.json" "${ENVELOPE[@]}"

step "planner prediction"
run "${PAGEDJAX[@]}" plan --device cpu --checkpoint "$CKPT" --context-len 350 --weight-dtype float32 \
  --kv-dtype float32 --json > "$OUT/plan.json"

step "peer: Hugging Face transformers, static batches"
rm -f "$OUT/peer.json"
if [[ -n ${BENCH_SKIP_PEER:-} ]]; then
  echo "skipped (BENCH_SKIP_PEER)"
elif "$PY" -c 'import transformers, torch' 2>/dev/null; then
  run timeout 900 "$PY" scripts/peer_transformers.py --checkpoint "$CKPT" --num-requests $N_OFFLINE \
    --max-tokens $MAX_TOKENS --batch-sizes $PEER_BATCHES --time-budget "${BENCH_PEER_BUDGET:-60}" --offline-json "$OUT/offline.json" \
    --out "$OUT/peer.json" 2> >(grep -v -i -E "warn|de-quantiz|loading weights" >&2) || echo "peer failed"
else
  echo "transformers/torch not installed (pip install -e .[peer]): skipped"
fi

step "online: pagedjax serve + bench serve / sweep + guidellm"
SERVER_LOG=${TMPDIR:-/tmp}/pagedjax-bench-serve.log  # not in $OUT: it prints the admin token
"${PAGEDJAX[@]}" serve --checkpoint "$CKPT" --host 127.0.0.1 --port "$PORT" --served-model-name "$MODEL_NAME" \
  --no-access-log "${ENVELOPE[@]}" > "$SERVER_LOG" 2>&1 &
SERVER_PID=$!
trap 'kill "$SERVER_PID" 2>/dev/null || true' EXIT
echo "pagedjax serve --checkpoint ${CKPT#$ROOT/} --port $PORT --served-model-name $MODEL_NAME ${ENVELOPE[*]} &" \
  >> "$COMMANDS"
"$PY" - "$URL" "$SERVER_PID" "$SERVER_LOG" <<'EOF'
import os, sys, time, httpx
url, pid = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 600
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("pagedjax serve exited during start-up (see its log: " + sys.argv[3] + ")")
    try:
        if httpx.get(url + "/health", timeout=2).status_code == 200:
            sys.exit(0)
    except httpx.TransportError:
        pass
    time.sleep(1)
sys.exit("pagedjax serve not ready after 600 s")
EOF
echo "server ready (+$(( $(date +%s) - START )) s)"

run timeout 600 "${PAGEDJAX[@]}" bench serve --url "$URL" --scenario shared-prefix --num-requests $N_SERVE \
  --concurrency 8 --max-tokens 32 --timeout 300 --max-duration 500 --no-progress \
  --out "$OUT/serve-shared-prefix.json" --plot "$OUT/serve-shared-prefix.png"
run timeout 600 "${PAGEDJAX[@]}" bench sweep --url "$URL" --scenario shared-prefix --concurrencies 1,4,16 --seed 1 \
  --num-requests $N_SWEEP --max-tokens 24 --timeout 300 --max-duration 180 --no-progress \
  --out "$OUT/sweep-concurrency.json" --plot "$OUT/sweep-concurrency.png"

rm -f "$OUT/guidellm-summary.json" "$OUT/guidellm.json"
if [[ -n ${BENCH_SKIP_GUIDELLM:-} ]]; then
  echo "guidellm skipped (BENCH_SKIP_GUIDELLM)"
else
  if [[ ! -x $GUIDELLM_VENV/bin/guidellm ]]; then
    echo "installing guidellm into $GUIDELLM_VENV"
    (python3 -m venv "$GUIDELLM_VENV" && timeout 600 "$GUIDELLM_VENV/bin/pip" install -q guidellm) \
      || echo "guidellm install failed"
  fi
  if [[ -x $GUIDELLM_VENV/bin/guidellm ]]; then
    # guidellm builds its synthetic prompts with a Hugging Face tokenizer; no hub is reachable,
    # so it gets a local one: the checkpoint's tokenizer.json + a minimal tokenizer_config.json.
    TOKDIR=$OUT/guidellm-tokenizer
    mkdir -p "$TOKDIR"
    cp "$CKPT/tokenizer.json" "$TOKDIR/"
    echo '{"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 8192}' > "$TOKDIR/tokenizer_config.json"
    DESC="concurrency 4, $N_GUIDELLM requests, synthetic prompts of 128 tokens, 32 output tokens, streaming chat completions"
    if (cd "$OUT" && HF_HUB_OFFLINE=1 GUIDELLM__LOGGING__LOG_FILE="$OUT/guidellm.log" run timeout 600 \
          "$GUIDELLM_VENV/bin/guidellm" run --backend "kind=openai_http,target=$URL,model=$MODEL_NAME" \
          --profile kind=concurrent,streams=4 --constraint kind=max_requests,count=$N_GUIDELLM \
          --data kind=synthetic_text,prompt_tokens=128,output_tokens=32 \
          --tokenizer "kind=hf_auto,model=$TOKDIR" --output "kind=json,path=$OUT/guidellm.json" \
          --disable-progress > "$OUT/guidellm-console.txt" 2>&1); then
      "$PY" scripts/render_benchmarks.py guidellm "$OUT/guidellm.json" "$OUT/guidellm-summary.json" "$DESC"
      grep -A 12 "Request Latency Statistics" "$OUT/guidellm-console.txt" || true
    else
      tail -5 "$OUT/guidellm-console.txt"
      "$PY" scripts/render_benchmarks.py guidellm-failed "$OUT/guidellm-summary.json" \
        "guidellm run failed: $(tail -1 "$OUT/guidellm-console.txt")"
    fi
    rm -rf "$TOKDIR"  # scratch: a copy of the checkpoint's tokenizer
  else
    "$PY" scripts/render_benchmarks.py guidellm-failed "$OUT/guidellm-summary.json" "guidellm could not be installed"
  fi
fi

kill "$SERVER_PID" 2>/dev/null || true
wait "$SERVER_PID" 2>/dev/null || true
trap - EXIT

step "speculative decoding: n-gram prompt lookup against plain decoding"
run timeout 1800 "$PY" scripts/bench_spec.py --batches 1 2 4 8 64 --speculative-config '{"method": "ngram"}' \
    '{"method": "ngram", "disable_by_batch_size": 1000}' --json "$OUT/speculative.json"
# (BENCHMARKS.md's suffix and draft-model rows came from two more runs of the same script, merged in:
# bench-results/commands.txt)

step "render BENCHMARKS.md"
"$PY" scripts/render_benchmarks.py --results "$OUT" --commands "$COMMANDS" --out "$BENCH_MD"
echo "done in $(( $(date +%s) - START )) s"
