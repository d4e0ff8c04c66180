#!/usr/bin/env bash
# Create .venv and install pagedjax (and optional extras: scripts/setup.sh test peer).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
extras=$(IFS=,; echo "$*")
spec="."
[ -n "$extras" ] && spec=".[${extras}]"
.venv/bin/python -m pip install -q --disable-pip-version-check -e "$spec"
# The CPU decode-attention kernel (runtime/cpu_attention.cc) is compiled on first use; without
# a C++ compiler attention runs as plain XLA (same outputs, slower decode). Install one when
# this machine can (Debian/Ubuntu as root), and build the kernel now so the first request
# does not pay for it.
if ! command -v g++ >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  apt-get install -y -q g++ >/dev/null 2>&1 || echo "setup: g++ not installed; CPU attention stays on the XLA path" >&2
fi
.venv/bin/python -c 'from runtime import cpu_attention as c; c.available() or print("setup: CPU attention kernel not built; XLA path")' 2>/dev/null || true
