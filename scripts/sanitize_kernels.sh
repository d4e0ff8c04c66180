#!/usr/bin/env bash
# The C++ CPU kernels (runtime/kernels/cpu) under ThreadSanitizer and under AddressSanitizer +
# UndefinedBehaviorSanitizer: each build links the kernels' sources into tests/kernels/ffi_driver.cc,
# which calls their XLA FFI handlers directly from two caller threads sharing one thread pool
# (short calls back to back, so pool helpers linger and take the next call's work through the
# handoff slot, and long ones: chained phases, many rows), and compares every result with a
# one-thread baseline. Exit status: 0 clean; non-zero on any sanitizer report, wrong result or
# build failure; 77 when the compiler cannot link a sanitizer's runtime (the test skips).
#
#   scripts/sanitize_kernels.sh [thread|address|all]        (default: all)
#
# Environment: VARIANT (a runtime/kernels/cpu/build.py variant, default native), ITERATIONS (20),
# CALLERS (2), THREADS (3: workers per call and pool size), PAGEDJAX_LINGER_US (2000 here, not
# the default 100: the sanitizers slow each call down several times, and the helpers must still
# be lingering when the next call comes), CXX (g++), PYTHON (.venv/bin/python; for jaxlib's FFI
# headers). Builds are cached under .cache/sanitize by a hash of the sources and flags.
# Debian/Ubuntu: the runtimes are libtsan2, libasan8 and libubsan1 (installed with g++).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
CXX=${CXX:-g++}
VARIANT=${VARIANT:-native}
ITERATIONS=${ITERATIONS:-20}
CALLERS=${CALLERS:-2}
THREADS=${THREADS:-3}
which=${1:-all}
KDIR=runtime/kernels/cpu
DRIVER=tests/kernels/ffi_driver.cc
OUT=${SANITIZE_DIR:-.cache/sanitize}
case "$which" in thread|address|all) ;; *) echo "usage: $0 [thread|address|all]" >&2; exit 2 ;; esac
command -v "$CXX" >/dev/null || { echo "sanitize_kernels: skipped: no C++ compiler ($CXX)"; exit 77; }
INC=$("$PY" -c 'import jax; print(jax.ffi.include_dir())')
FLAGS=$("$PY" -m runtime.kernels.cpu.build --flags "$VARIANT")
mkdir -p "$OUT"

# prefix to run a sanitized binary with ("" or setarch -R: GCC 12's TSAN refuses some kernels'
# randomized memory layouts), or exit 77 when this sanitizer cannot link or run here
runner() {
  local tmp
  tmp=$(mktemp -d "$OUT/probe.XXXXXX")
  echo 'int main() { return 0; }' >"$tmp/p.cc"
  if ! "$CXX" "$@" "$tmp/p.cc" -o "$tmp/p" 2>"$tmp/log"; then
    echo "sanitize_kernels: skipped: $CXX cannot link $* ($(grep -m1 -o 'cannot find[^:]*' "$tmp/log" \
          || echo "see $tmp/log"))" >&2
    exit 77
  fi
  if "$tmp/p" >/dev/null 2>&1; then
    echo ""
  elif command -v setarch >/dev/null && setarch "$(uname -m)" -R "$tmp/p" >/dev/null 2>&1; then
    echo "setarch $(uname -m) -R"
  else
    echo "sanitize_kernels: skipped: a program built with $* does not run here" >&2
    exit 77
  fi
  rm -rf "$tmp"
}

# the driver built with the sanitizer flags "$@" (cached); prints its path
build() {
  local name=$1 key bin tmp src pids=()
  shift
  key=$( (cat $KDIR/*.cc $KDIR/*.h $DRIVER; echo "$CXX $FLAGS $* $INC"; "$CXX" --version | head -1) \
         | sha256sum | cut -c1-16)
  bin="$OUT/ffi_driver-$name-$VARIANT-$key"
  if [ ! -x "$bin" ]; then
    tmp=$(mktemp -d "$OUT/build.XXXXXX")
    for src in $KDIR/cpu_attention.cc $KDIR/cpu_matmul.cc $KDIR/cpu_linear_f32.cc $KDIR/cpu_linear_wq.cc \
               $KDIR/cpu_experts.cc $DRIVER; do
      # shellcheck disable=SC2086
      "$CXX" $FLAGS -O1 -g -fno-omit-frame-pointer "$@" -I"$INC" -I$KDIR -c "$src" \
        -o "$tmp/$(basename "$src" .cc).o" 2>"$tmp/$(basename "$src" .cc).log" &
      pids+=($!)
    done
    for pid in "${pids[@]}"; do
      wait "$pid" || { grep -h -B2 -A8 'error' "$tmp"/*.log >&2; exit 1; }
    done
    # shellcheck disable=SC2086
    "$CXX" $FLAGS -pthread "$@" "$tmp"/*.o -o "$tmp/ffi_driver"
    mv "$tmp/ffi_driver" "$bin"
    rm -rf "$tmp"
  fi
  echo "$bin"
}

run() {  # name, sanitizer flags...
  local name=$1 prefix bin t0
  shift
  prefix=$(runner "$@") || exit $?
  t0=$(date +%s)
  bin=$(build "$name" "$@")
  echo "sanitize_kernels: $name ($VARIANT): built in $(( $(date +%s) - t0 )) s: $bin"
  t0=$(date +%s)
  # shellcheck disable=SC2086
  PAGEDJAX_LINGER_US=${PAGEDJAX_LINGER_US:-2000} $prefix "$bin" "$ITERATIONS" "$CALLERS" "$THREADS"
  echo "sanitize_kernels: $name ($VARIANT): clean in $(( $(date +%s) - t0 )) s"
}

export TSAN_OPTIONS="halt_on_error=1 exitcode=66 second_deadlock_stack=1 ${TSAN_OPTIONS:-}"
export ASAN_OPTIONS="detect_leaks=1 halt_on_error=1 exitcode=67 ${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="print_stacktrace=1 halt_on_error=1 ${UBSAN_OPTIONS:-}"
if [ "$which" = thread ] || [ "$which" = all ]; then
  run tsan -fsanitize=thread
fi
if [ "$which" = address ] || [ "$which" = all ]; then
  run asan -fsanitize=address,undefined -fno-sanitize-recover=all
fi
