#!/usr/bin/env bash
# README command (a): set up, pull + convert SmolLM2-135M-Instruct, serve it on :8000.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh  # (re)installs this checkout, so .venv/bin/pagedjax runs the current code
.venv/bin/pagedjax pull smollm2
exec .venv/bin/pagedjax serve "$@"
