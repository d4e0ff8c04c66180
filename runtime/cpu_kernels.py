"""The C++ CPU kernels (runtime/cpu_attention.cc, runtime/cpu_matmul.cc,
runtime/cpu_linear_f32.cc) as XLA FFI targets.

Built on first use into one library with the system C++ compiler against jaxlib's FFI
headers, cached under ~/.cache/pagedjax/kernels (PAGEDJAX_KERNEL_CACHE) by a hash of the
sources, compiler and jaxlib version, and registered once per process. Where they cannot
be built (no compiler, another platform) or PAGEDJAX_CPU_KERNELS=0, `enabled()` is False
and the step stays plain XLA: same numbers, slower.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax

log = logging.getLogger(__name__)
HERE = Path(__file__).parent
SOURCES = (HERE / "cpu_attention.cc", HERE / "cpu_matmul.cc", HERE / "cpu_linear_f32.cc")
HEADERS = (HERE / "cpu_parallel.h", HERE / "cpu_exp.h")
# FFI target name -> exported handler symbol
TARGETS = {
    "pagedjax_decode_attention": "PagedjaxDecodeAttention",
    "pagedjax_decode_attention_int8": "PagedjaxDecodeAttentionInt8",
    "pagedjax_int8_linear": "PagedjaxInt8Linear",
    "pagedjax_int8_linear_g32": "PagedjaxInt8LinearG32",
    "pagedjax_f32_linear": "PagedjaxF32Linear",
    "pagedjax_f32_layer_tail": "PagedjaxF32LayerTail",
    "pagedjax_kv_write": "PagedjaxKvWrite",
}
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++20", "-shared", "-fPIC")
_lock = threading.Lock()
_state: dict[str, object] = {}


def _cache_dir() -> Path:
    root = os.environ.get("PAGEDJAX_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagedjax", "kernels")
    return Path(root)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        import platform

        return platform.processor()


def _build() -> Path:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    import jaxlib

    src = b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS))
    # -march=native: a library built on one CPU (AVX-512, AMX) would die with an illegal
    # instruction on another, so the CPU's feature flags are part of the key
    key = hashlib.sha256(src + " ".join((cxx, *FLAGS, jaxlib.__version__, _cpu_flags())).encode()).hexdigest()[:16]
    out = _cache_dir() / f"cpu_kernels-{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_so = Path(tmp) / out.name
        cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", f"-I{HERE}", *map(str, SOURCES), "-o", str(tmp_so)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr.strip()[-600:]}")
        os.replace(tmp_so, out)  # atomic: a concurrent build of the same key is harmless
    return out


def library() -> ctypes.CDLL | None:
    """The loaded library with every target registered (CPU backend only), or None."""
    with _lock:
        if "lib" in _state:
            return _state["lib"]  # type: ignore[return-value]
        lib = None
        if jax.default_backend() == "cpu":
            try:
                lib = ctypes.cdll.LoadLibrary(str(_build()))
                for target, symbol in TARGETS.items():
                    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
            except Exception as exc:  # noqa: BLE001 -- any build/load failure means: use XLA
                log.warning("CPU kernels unavailable (%s); the step runs as plain XLA",
                            str(exc).splitlines()[0][:300])
                lib = None
        _state["lib"] = lib
        return lib


def available() -> bool:
    """True when the kernels are built and registered for this process."""
    return library() is not None


def enabled() -> bool:
    """available(), unless PAGEDJAX_CPU_KERNELS=0 asks for the plain XLA path (read each time
    an engine is built, so one process can compare both)."""
    return os.environ.get("PAGEDJAX_CPU_KERNELS", "1") != "0" and available()


def num_threads() -> int:
    """Workers per call: the caller plus pool helpers, one per core XLA may use."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
