"""Building, caching and loading the C++ CPU kernels (cpu_attention.cc, cpu_matmul.cc,
cpu_linear_f32.cc, cpu_linear_wq.cc, cpu_experts.cc, cpu_lora.cc with cpu_parallel.h, cpu_exp.h and cpu_norm.h, in this package) as
XLA FFI targets.

Built with the system C++ compiler against jaxlib's FFI headers into one shared library per
instruction-set variant, cached under ~/.cache/pagedjax/kernels (PAGEDJAX_KERNEL_CACHE) by a
hash of the sources, compiler, flags and jaxlib version: at install time (scripts/setup.sh runs
`python -m runtime.kernels.cpu.build`), else at first use. `library()` loads one variant and
registers its targets once per process. Where it cannot be built (no compiler, another
platform) or PAGEDJAX_CPU_KERNELS=0, `enabled()` is False and the step stays plain XLA (same
numbers, slower); the reason is logged once, in one line.

Variants (`VARIANTS`): the runtime loads "native" (-march=native: every extension this CPU
has). The named ones pin one branch of the kernels' `#if` ladders, so every branch can be
compiled and tested on one x86 machine (tests/runtime/test_cpu_kernel_variants.py):

    avx512-amx   x86-64-v4 + AVX512-VNNI + AMX-INT8   int8 on AMX tiles (Sapphire Rapids and later)
    avx512-vnni  x86-64-v4 + AVX512-VNNI              int8 on vpdpbusd (Ice Lake, Zen 4)
    avx2         x86-64-v3, no AVX-512                AVX2 + FMA float paths; int8 scalar
    scalar       x86-64 (SSE2)                        the plain C++ loops everywhere

Each build reports what it was compiled with (`compiled_paths`): PagedjaxAttentionPath,
PagedjaxF32LinearPath, PagedjaxInt8LinearPath, PagedjaxWqLinearPath, and the switches cpu_matmul.py reads
(PagedjaxInt8LinearVectorized, PagedjaxF32LinearVectorized, PagedjaxInt8LinearAmx).

Environment:
    PAGEDJAX_CPU_KERNELS=0               plain XLA (read each time an engine is built)
    PAGEDJAX_CPU_KERNEL_VARIANT=<name>   load this variant instead of "native" (tests, A/B);
                                         refused, with the XLA fallback, where this CPU lacks
                                         one of its features
    PAGEDJAX_KERNEL_CACHE=<dir>          where built libraries are kept
    CXX=<compiler>                       the compiler (default: g++, then c++ on PATH)
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import jax

from runtime.config import KernelConfig

log = logging.getLogger(__name__)
HERE = Path(__file__).parent
SOURCES = (HERE / "cpu_attention.cc", HERE / "cpu_matmul.cc", HERE / "cpu_linear_f32.cc", HERE / "cpu_linear_wq.cc",
           HERE / "cpu_experts.cc", HERE / "cpu_lora.cc")
HEADERS = (HERE / "cpu_parallel.h", HERE / "cpu_exp.h", HERE / "cpu_norm.h")
# FFI target name -> exported handler symbol
TARGETS = {
    "pagedjax_decode_attention": "PagedjaxDecodeAttention",
    "pagedjax_decode_attention_int8": "PagedjaxDecodeAttentionInt8",
    "pagedjax_int8_linear": "PagedjaxInt8Linear",
    "pagedjax_int8_linear_g32": "PagedjaxInt8LinearG32",
    "pagedjax_f32_linear": "PagedjaxF32Linear",
    "pagedjax_f32_layer_tail": "PagedjaxF32LayerTail",
    "pagedjax_wq_linear": "PagedjaxWqLinear",
    "pagedjax_wq_layer_tail": "PagedjaxWqLayerTail",
    "pagedjax_kv_write": "PagedjaxKvWrite",
    "pagedjax_expert_products": "PagedjaxExpertProducts",
    "pagedjax_lora_products": "PagedjaxLoraProducts",
    "pagedjax_lora_products_bf16": "PagedjaxLoraProductsBf16",
}
# Flags every variant shares (its -march/-m flags come after).
FLAGS = ("-O3", "-fopenmp-simd", "-std=c++20", "-fPIC")
VARIANT_ENV = "PAGEDJAX_CPU_KERNEL_VARIANT"

# /proc/cpuinfo flags of the x86-64 micro-architecture levels the variants build on
_V2 = ("cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3")
_V3 = (*_V2, "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")
_V4 = (*_V3, "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One instruction-set build: its compiler flags, the CPU flags (as /proc/cpuinfo names
    them) a CPU needs to run it, and the paths its library must report (`compiled_paths`)."""

    name: str
    flags: tuple[str, ...]
    needs: tuple[str, ...] = ()
    paths: dict[str, str] | None = None  # None: whatever this CPU has (native)


VARIANTS = {
    "native": Variant("native", ("-march=native",)),
    # -march=x86-64-v4 plus the named extensions, not -march=sapphirerapids / icelake-server:
    # those would let the compiler use every other extension of that CPU (AVX512-FP16, ...)
    # and the build would need exactly that CPU; this needs only what the branch uses.
    "avx512-amx": Variant("avx512-amx", ("-march=x86-64-v4", "-mavx512vnni", "-mamx-tile", "-mamx-int8",
                                         "-mtune=sapphirerapids"),
                          (*_V4, "avx512_vnni", "amx_tile", "amx_int8"),
                          {"attention": "avx512", "f32_linear": "avx512", "int8_linear": "amx", "wq_linear": "avx512"}),
    "avx512-vnni": Variant("avx512-vnni", ("-march=x86-64-v4", "-mavx512vnni", "-mtune=icelake-server"),
                           (*_V4, "avx512_vnni"),
                           {"attention": "avx512", "f32_linear": "avx512", "int8_linear": "avx512-vnni",
                            "wq_linear": "avx512"}),
    "avx2": Variant("avx2", ("-march=x86-64-v3", "-mno-avx512f", "-mno-avxvnni", "-mtune=generic"), _V3,
                    {"attention": "avx2", "f32_linear": "avx2", "int8_linear": "scalar", "wq_linear": "avx2"}),
    "scalar": Variant("scalar", ("-march=x86-64", "-mtune=generic"), (),
                      {"attention": "scalar", "f32_linear": "scalar", "int8_linear": "scalar",
                       "wq_linear": "scalar"}),
}

_lock = threading.Lock()
_state: dict[str, object] = {}


def cache_dir() -> Path:
    root = os.environ.get("PAGEDJAX_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagedjax", "kernels")
    return Path(root)


def compiler() -> str | None:
    """The C++ compiler's path: $CXX (a name on PATH or a path), else g++, else c++."""
    if cxx := os.environ.get("CXX"):
        return shutil.which(cxx)
    return shutil.which("g++") or shutil.which("c++")


def cpu_flags() -> set[str]:
    """This CPU's feature flags as /proc/cpuinfo names them (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


def missing_features(variant: str) -> list[str]:
    """The CPU features `variant` needs that this machine lacks ([] = it runs here). Named
    variants are x86-64 builds: on another architecture they lack "x86_64"."""
    v = VARIANTS[variant]
    if v.name == "native":
        return []
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ["x86_64"]
    have = cpu_flags()
    return [f for f in v.needs if f not in have]


def selected_variant() -> str:
    """The variant `library()` loads: PAGEDJAX_CPU_KERNEL_VARIANT, else "native"."""
    return os.environ.get(VARIANT_ENV, "").strip() or "native"


def build(variant: str = "native") -> Path:
    """Compile `variant` (a name in VARIANTS) into its cached library, if not there yet, and
    return its path. Raises RuntimeError (one line first) when it cannot."""
    if variant not in VARIANTS:
        raise RuntimeError(f"unknown CPU kernel variant {variant!r} (one of: {', '.join(VARIANTS)})")
    cxx = compiler()
    if not cxx:
        raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX') or 'g++'}) on PATH")
    import jaxlib

    v = VARIANTS[variant]
    flags = (*FLAGS, *v.flags)
    src = b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS))
    # -march=native: a library built on one CPU (AVX-512, AMX) would die with an illegal
    # instruction on another, so the native build's key holds the CPU's feature flags
    cpu = (" ".join(sorted(cpu_flags())) or platform.processor()) if v.name == "native" else ""
    key = hashlib.sha256(src + " ".join((cxx, *flags, jaxlib.__version__, cpu)).encode()).hexdigest()[:16]
    out = cache_dir() / f"cpu_kernels-{variant}-{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    include = (f"-I{jax.ffi.include_dir()}", f"-I{HERE}")
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        # one compiler per source, side by side (each takes seconds), then one link
        objs = [Path(tmp) / f"{s.stem}.o" for s in SOURCES]
        cmds = [[cxx, *flags, *include, "-c", str(s), "-o", str(o)] for s, o in zip(SOURCES, objs)]
        try:
            procs = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for c in cmds]
        except OSError as exc:
            raise RuntimeError(f"the C++ compiler {cxx} cannot run: {exc}") from exc
        errs = [p.communicate()[1] for p in procs]
        for cmd, p, err in zip(cmds, procs, errs):
            if p.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed: {err.strip()[-600:]}")
        tmp_so = Path(tmp) / out.name
        cmd = [cxx, *flags, "-shared", *map(str, objs), "-o", str(tmp_so)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr.strip()[-600:]}")
        os.replace(tmp_so, out)  # atomic: a concurrent build of the same key is harmless
    return out


def compiled_paths(lib: ctypes.CDLL) -> dict[str, object]:
    """What a loaded library was compiled with: each kernel's instruction-set path and the
    switches runtime/kernels/cpu/matmul.py reads."""
    def text(symbol: str) -> str:
        fn = getattr(lib, symbol)
        fn.restype = ctypes.c_char_p
        return fn().decode()

    return {"attention": text("PagedjaxAttentionPath"), "f32_linear": text("PagedjaxF32LinearPath"),
            "int8_linear": text("PagedjaxInt8LinearPath"), "wq_linear": text("PagedjaxWqLinearPath"),
            "int8_vectorized": bool(lib.PagedjaxInt8LinearVectorized()),
            "f32_vectorized": bool(lib.PagedjaxF32LinearVectorized()),
            "amx": bool(lib.PagedjaxInt8LinearAmx())}


def library() -> ctypes.CDLL | None:
    """The loaded library (`selected_variant()`) with every target registered (CPU backend
    only), or None."""
    with _lock:
        if "lib" in _state:
            return _state["lib"]  # type: ignore[return-value]
        lib = None
        if jax.default_backend() == "cpu":
            variant = selected_variant()
            try:
                if variant in VARIANTS and (lacks := missing_features(variant)):
                    raise RuntimeError(f"variant {variant!r} ({VARIANT_ENV}) needs CPU features this machine "
                                       f"lacks: {' '.join(lacks)}")
                lib = ctypes.cdll.LoadLibrary(str(build(variant)))
                for target, symbol in TARGETS.items():
                    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
                _state["variant"] = variant
            except Exception as exc:  # noqa: BLE001 -- any build/load failure means: use XLA
                log.warning("CPU kernels unavailable (%s); the step runs as plain XLA",
                            str(exc).splitlines()[0][:300])
                lib = None
        _state["lib"] = lib
        return lib


def available() -> bool:
    """True when the kernels are built and registered for this process."""
    return library() is not None


def enabled(kernels: KernelConfig | None = None) -> bool:
    """available(), unless the kernel switches (EngineConfig.kernels, with its environment
    overrides: runtime/config.KernelConfig) ask for the plain XLA path."""
    return (kernels or KernelConfig().with_env()).cpu_kernels and available()


def configure(kernels: KernelConfig) -> None:
    """Hand the library's process-wide knobs (AMX, the pool's linger) the engine's switches.
    The library's own defaults (environment variables read by the C++, for the standalone
    sanitizer driver) hold until an engine is built."""
    lib = library()
    if lib is not None:
        lib.PagedjaxSetAmx(ctypes.c_int(int(kernels.amx)))
        lib.PagedjaxSetLingerUs(ctypes.c_int64(kernels.linger_us))


def num_threads() -> int:
    """Workers per call: the caller plus pool helpers, one per core XLA may use."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


def main(argv: list[str] | None = None) -> int:
    """Build variants ahead of use (scripts/setup.sh): prints each one's library and paths, or
    one line saying why it was not built (the step then runs as plain XLA). Exit status 1 when
    a requested variant that this CPU can run did not build."""
    ap = argparse.ArgumentParser(prog="python -m runtime.kernels.cpu.build", description=main.__doc__)
    ap.add_argument("variants", nargs="*", help=f"variants to build ({', '.join(VARIANTS)}, or all; "
                                                "default: the one the runtime loads)")
    ap.add_argument("--flags", action="store_true", help="print the variant's compiler flags and exit")
    args = ap.parse_args(argv)
    names = list(VARIANTS) if args.variants == ["all"] else (args.variants or [selected_variant()])
    if unknown := [n for n in names if n not in VARIANTS]:
        ap.error(f"unknown variant(s) {', '.join(unknown)} (one of: {', '.join(VARIANTS)})")
    if args.flags:
        for n in names:
            print(" ".join((*FLAGS, *VARIANTS[n].flags)))
        return 0
    status = 0
    for n in names:
        try:
            path = build(n)
        except RuntimeError as exc:
            print(f"CPU kernels ({n}) not built: {str(exc).splitlines()[0][:300]}; the step runs as plain XLA")
            status = 1
            continue
        if lacks := missing_features(n):
            detail = f"(not loadable on this CPU: it lacks {' '.join(lacks)})"
        else:
            detail = " ".join(f"{k}={v}" for k, v in compiled_paths(ctypes.CDLL(str(path))).items())
        print(f"CPU kernels ({n}): {path} {detail}")
    return status


if __name__ == "__main__":
    sys.exit(main())
