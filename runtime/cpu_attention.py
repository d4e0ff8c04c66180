"""The CPU decode-attention kernel (runtime/cpu_attention.cc) as an XLA FFI custom call.

Built on first use with the system C++ compiler against jaxlib's FFI headers, cached under
~/.cache/pagedjax/kernels by a hash of the source, compiler and jaxlib version, and
registered once per process. Where it cannot be built (no compiler, another platform) or
PAGEDJAX_CPU_KERNELS=0, `enabled()` is False and attention stays on the XLA path: same
numbers, slower. runtime/attention.py uses it for the last query token of every sequence
(all of a decode step) when the cache is float32 or int8.
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
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("cpu_attention.cc")
TARGET = "pagedjax_decode_attention"
TARGET_INT8 = "pagedjax_decode_attention_int8"
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++20", "-shared", "-fPIC")
_lock = threading.Lock()
_state: dict[str, object] = {}


def _cache_dir() -> Path:
    root = os.environ.get("PAGEDJAX_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagedjax", "kernels")
    return Path(root)


def _build() -> Path:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    import jaxlib

    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + " ".join((cxx, *FLAGS, jaxlib.__version__)).encode()).hexdigest()[:16]
    out = _cache_dir() / f"cpu_attention-{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_so = Path(tmp) / out.name
        cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(tmp_so)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr.strip()[-600:]}")
        os.replace(tmp_so, out)  # atomic: a concurrent build of the same key is harmless
    return out


def available() -> bool:
    """True when the kernel is built and registered for this process (CPU backend only)."""
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        ok = False
        if jax.default_backend() == "cpu":
            try:
                lib = ctypes.cdll.LoadLibrary(str(_build()))
                jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.PagedjaxDecodeAttention), platform="cpu")
                jax.ffi.register_ffi_target(TARGET_INT8, jax.ffi.pycapsule(lib.PagedjaxDecodeAttentionInt8),
                                            platform="cpu")
                ok = True
            except Exception as exc:  # noqa: BLE001 -- any build/load failure means: use XLA
                log.warning("CPU attention kernel unavailable (%s); decode attention runs as plain XLA",
                            str(exc).splitlines()[0][:300])
        _state["ok"] = ok
        return ok


def enabled() -> bool:
    """available(), unless PAGEDJAX_CPU_KERNELS=0 asks for the plain XLA path (read each time
    an engine is built, so one process can compare both)."""
    return os.environ.get("PAGEDJAX_CPU_KERNELS", "1") != "0" and available()


def num_threads() -> int:
    """Workers per call: the caller plus pool helpers, one per core XLA may use."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


def supports(cache: object) -> bool:
    """Caches the kernel reads: float32 arrays and int8 QuantizedPages."""
    from runtime.attention import QuantizedPages

    if isinstance(cache, QuantizedPages):
        return cache.values.dtype == jnp.int8
    return getattr(cache, "dtype", None) == jnp.float32


def decode_attention(q: jax.Array, k_cache: object, v_cache: object, kv_lens: jax.Array,
                     block_tables: jax.Array, shared: "SharedPrefix | None" = None) -> jax.Array:
    """q [S, Hkv, G, D] (scaled) against caches [NB, BS, Hkv, D] (float32, or int8
    QuantizedPages: dequantized block by block inside the kernel) through block_tables [S, MB]
    up to kv_lens [S] -> normalized [S, Hkv, G, D] float32 (zeros where kv_lens is 0). With
    `shared` (runtime.attention.SharedPrefix, tables padded alike), the members' common
    leading blocks are read once for all of them (cascade) before each sequence's own."""
    S, mb = block_tables.shape
    if shared is None:
        blocks, length, start = jnp.zeros((mb,), jnp.int32), jnp.zeros((1,), jnp.int32), jnp.zeros((S,), jnp.int32)
    else:
        blocks, length, start = shared.blocks, shared.length, shared.suffix_start
    from runtime.attention import QuantizedPages

    i32 = lambda a: a.astype(jnp.int32)
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    tail = (i32(kv_lens), i32(block_tables), i32(blocks), i32(length.reshape(1)), i32(start))
    if isinstance(k_cache, QuantizedPages):
        call = jax.ffi.ffi_call(TARGET_INT8, out, vmap_method="sequential")
        return call(q.astype(jnp.float32), k_cache.values, v_cache.values, k_cache.scales, v_cache.scales, *tail,
                    num_threads=np.int64(num_threads()))
    call = jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")
    return call(q.astype(jnp.float32), k_cache, v_cache, *tail, num_threads=np.int64(num_threads()))
