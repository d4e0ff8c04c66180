#!/usr/bin/env bash
# README command (b): set up everything the suite needs and run it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test peer bench fleet otel
bash scripts/install_browser.sh || echo "warning: chromium could not be installed; browser tests will skip"
export PAGEDJAX_JAX_CACHE=${PAGEDJAX_JAX_CACHE:-$HOME/.cache/pagedjax/jax-tests}  # (tests/conftest.py: why)
# Lint the tree (ruff) and type-check the engine core (mypy; its modules are [tool.mypy]
# files in pyproject.toml) first: seconds, and a finding stops the run before the long part.
.venv/bin/ruff check .
.venv/bin/mypy
# Two workers, one test file each at a time (module fixtures -- servers, the Ray fleet -- start
# once): most of the suite waits on subprocess start-up and compiles, which overlap well.
# Files go out longest first (tests/conftest.py LONGEST_FIRST; xdist's own reorder, by test
# count, would hand out the 5-minute fleet file late). The 20 slowest steps are printed.
# Arguments go to pytest: `bash scripts/test.sh -m fast` is the inner loop (tests/conftest.py).
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout=900 -n "${PAGEDJAX_TEST_WORKERS:-2}" \
  --dist loadfile --no-loadscope-reorder --durations=20 "$@"
