"""The C++ CPU kernels and their thread handoff (runtime/kernels/cpu/cpu_parallel.h) under
ThreadSanitizer and under AddressSanitizer + UBSan: scripts/sanitize_kernels.sh builds the
kernels into tests/kernels/ffi_driver.cc, which calls their XLA FFI handlers from two threads
sharing one pool (short calls back to back, so lingering helpers take work through the slot,
and long chained ones) and compares every result with a one-thread baseline. Python and JAX
stay out of the sanitized process. Builds are cached under .cache/sanitize (the first one
takes a minute or two on two cores; a run takes seconds)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("sanitizer", ["thread", "address"])
def test_kernels_run_clean_under_the_sanitizer(sanitizer):
    if not shutil.which(os.environ.get("CXX") or "g++"):
        pytest.skip("no C++ compiler: the kernels are not built here (XLA serves)")
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "sanitize_kernels.sh"), sanitizer], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=880)
    if proc.returncode == 77:  # the compiler cannot link or run this sanitizer's runtime here
        pytest.skip((proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    summary = next(line for line in proc.stdout.splitlines() if "handed to a lingering helper" in line)
    assert summary.endswith(" 0 failures"), summary
    assert int(summary.split(" calls, ")[1].split()[0]) > 0, "the handoff path did not run: " + summary
