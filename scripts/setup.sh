#!/usr/bin/env bash
# Create .venv and install pagedjax (and optional extras: scripts/setup.sh test peer).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
extras=$(IFS=,; echo "$*")
spec="."
[ -n "$extras" ] && spec=".[${extras}]"
# A regular install, not an editable one: .venv/bin/pagedjax runs the installed copy, which
# carries templates/ and the static files the way a wheel does. pip reinstalls a local
# directory on every run, so rerunning this script (scripts/serve.sh does) picks up changed
# code; tests and `.venv/bin/python -m runtime.cli` from the repository root run the checkout.
# build/ goes first: setuptools packs whatever an earlier build left in build/lib.
rm -rf build
.venv/bin/python -m pip install -q --disable-pip-version-check "$spec"
# The C++ CPU kernels (runtime/kernels/cpu: attention, float32 and w8a8 products) are built
# here for this CPU (else on first use); without a C++ compiler the step runs as
# plain XLA (same outputs, slower). Install one when this machine can (Debian/Ubuntu as
# root), and build them now so the first request does not pay for it.
if ! command -v g++ >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  apt-get install -y -q g++ >/dev/null 2>&1 || echo "setup: g++ not installed; the step stays plain XLA" >&2
fi
.venv/bin/python -m runtime.kernels.cpu.build 2>/dev/null || true  # (prints the library, or why not: then plain XLA)
