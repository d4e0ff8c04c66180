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
