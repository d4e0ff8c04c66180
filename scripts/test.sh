#!/usr/bin/env bash
# README command (b): set up everything the suite needs and run it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test peer bench fleet
bash scripts/install_browser.sh || echo "warning: chromium could not be installed; browser tests will skip"
export PAGEDJAX_JAX_CACHE=${PAGEDJAX_JAX_CACHE:-$PWD/.cache/jax}
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout=900 "$@"
