"""The machine a benchmark ran on (CPU model and vector units, cores, RAM, jax) and how busy
it was, recorded in every result JSON; `python -m runtime.bench.machine` gives the same to
the benchmark scripts. (BENCHMARKS.md is rendered from those JSON files by
scripts/render_benchmarks.py, which is not part of the package.)"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from runtime.bench.report import write_json


def machine_info() -> dict[str, Any]:
    cpu, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == "unknown":
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    # The vector units beside the name: "AMD EPYC" has been both a Zen 3 (AVX2) and a Zen 4
    # (AVX-512) here, and the kernels differ between them.
    isa = ([x for x, f in (("avx512", "avx512f"), ("vnni", "avx512_vnni"), ("bf16", "avx512_bf16"),
                           ("amx", "amx_tile")) if f in flags] if "avx512f" in flags
           else ["avx2"] if "avx2" in flags else [])
    if isa:
        cpu = f"{cpu} ({' '.join(isa)})"
    ram = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram = int(line.split()[1]) * 1024
    except OSError:
        pass
    info: dict[str, Any] = {"cpu_model": cpu, "cores": os.cpu_count(), "ram_bytes": ram,
                            "python": platform.python_version(), "platform": platform.platform()}
    try:
        import jax
        info["jax"] = jax.__version__
        info["jax_backend"] = jax.default_backend()
    except ImportError:
        pass
    return info


def loadavg_1m() -> float | None:
    """The 1-minute load average (how busy a shared machine was), or None off Linux."""
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def cpu_busy_pct(seconds: float = 2.0) -> float | None:
    """Share of all cores' time spent busy over the next `seconds` (from /proc/stat): unlike
    the load average, it does not remember the previous minute's benchmark."""
    import time

    def sample() -> tuple[int, int]:
        vals = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
        return sum(vals), idle

    try:
        t0, i0 = sample()
        time.sleep(seconds)
        t1, i1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return 100.0 * (1 - (i1 - i0) / (t1 - t0)) if t1 > t0 else None


def annotate_peer(path: str | Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Add the peer run's facts to a `bench serve` JSON: which system, its start-up, and the
    machine (CPU model, cores) with how loaded it was, so a side-by-side row can be judged."""
    p = Path(path)
    d = json.loads(p.read_text())
    machine = machine_info()
    for key in ("loadavg_1m", "loadavg_1m_bench_start", "cpu_busy_pct_before"):
        if meta.get(key) is not None:
            machine[key] = meta.pop(key)
    d["peer"] = meta
    # when: rows from different sessions (a noisy shared machine) must not pass for one run
    machine["measured_at"] = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    d["machine"] = machine
    write_json(d, p)
    return d


def _main(argv: list[str]) -> int:
    """`python -m runtime.bench.machine machine OUT.json` (scripts/run_benchmarks.sh)
    | `loadavg` | `cpu-busy SECONDS` | `peer RESULT.json META_JSON` (scripts/bench_peers.sh)."""
    import datetime

    if argv[:1] == ["machine"] and len(argv) == 2:
        info = machine_info()
        info["date"] = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
        info["shared"] = os.environ.get("BENCH_SHARED_MACHINE", "") == "1"
        write_json(info, argv[1])
        return 0
    if argv[:1] == ["loadavg"] and len(argv) == 1:
        print(f"{loadavg_1m() or 0:.2f}")
        return 0
    if argv[:1] == ["cpu-busy"] and len(argv) == 2:
        busy = cpu_busy_pct(float(argv[1]))
        print("" if busy is None else f"{busy:.1f}")
        return 0
    if argv[:1] == ["peer"] and len(argv) == 3:
        meta = json.loads(argv[2])
        annotate_peer(argv[1], meta)
        return 0
    print(_main.__doc__, file=__import__("sys").stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(_main(__import__("sys").argv[1:]))


def announce() -> dict[str, Any]:
    """A benchmark script's start: the persistent compilation cache on, and the machine line
    printed (CPU, cores, jax, load) before any number. Returns machine_info()."""
    from runtime.jax_setup import enable_compilation_cache

    enable_compilation_cache()
    info = machine_info()
    print(f"# {info['cpu_model']}, {info['cores']} cores; jax {info.get('jax')}; "
          f"load {os.getloadavg()[0]:.2f} at start", flush=True)
    return info


def engine_from_flags(checkpoint: str | Path, flags: list[str], num_blocks: int | None = None) -> Any:
    """An LLMEngine built as `pagedjax serve FLAGS` would build it (engine flags only);
    `num_blocks`: the KV pool sized in blocks instead (prefix cache on), for workloads that
    need a pool of an exact size."""
    import argparse
    import dataclasses

    from runtime.config import CacheConfig
    from runtime.core.engine import LLMEngine
    from runtime.core.engine_args import add_engine_arguments, engine_config_from_args

    ap = argparse.ArgumentParser()
    add_engine_arguments(ap)
    build = engine_config_from_args(ap.parse_args(flags))

    def sized(model: Any) -> Any:
        cfg = build(model)
        if num_blocks is None:
            return cfg
        return dataclasses.replace(cfg, cache=CacheConfig(cfg.cache.block_size, num_blocks, cfg.cache.kv_dtype, True))

    return LLMEngine.from_checkpoint(Path(checkpoint), sized, progress=False)
