#!/usr/bin/env bash
# lm-evaluation-harness against `pagedjax serve`: a small loglikelihood task (scripts/lm_eval/)
# through its local-completions model (echo + logprobs on /v1/completions, the remote
# tokenizer on /tokenize, /detokenize, /tokenizer_info). lm-eval gets its own venv (.lmeval).
# Usage: bash scripts/lm_eval.sh [serve flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .lmeval/bin/lm_eval ] || { python3 -m venv .lmeval && .lmeval/bin/pip install -q "lm-eval[api]>=0.4.9"; }
PORT=${PORT:-18777}
.venv/bin/pagedjax serve --port "$PORT" --kv-cache-memory 256MiB "$@" > .lmeval/serve.log 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 300); do
  curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
  kill -0 $SERVER 2>/dev/null || { cat .lmeval/serve.log; exit 1; }
  sleep 1
done
MODEL=$(curl -sf "http://127.0.0.1:$PORT/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
cd scripts/lm_eval  # the task's data_files path is relative to here
HF_DATASETS_OFFLINE=1 ../../.lmeval/bin/lm_eval --model local-completions \
  --model_args "model=$MODEL,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer_backend=remote,num_concurrent=4,max_retries=1" \
  --tasks pagedjax_capitals --include_path . --batch_size 1
