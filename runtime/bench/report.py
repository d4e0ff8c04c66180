"""Benchmark statistics, JSON reports, text tables and plots.

Everything here works from plain data (lists of floats, the report dicts written as
JSON), so plots and BENCHMARKS.md (scripts/render_benchmarks.py) can be regenerated
from bench-results/*.json alone.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


# --- statistics --------------------------------------------------------------------------
def summarize(values: Iterable[float]) -> dict[str, float | int | None]:
    xs = [float(v) for v in values if v is not None]
    out: dict[str, float | int | None] = {"count": len(xs), "mean": sum(xs) / len(xs) if xs else None}
    for q in PERCENTILES:
        out[f"p{q}"] = float(np.percentile(xs, q)) if xs else None
    out["min"] = min(xs) if xs else None
    out["max"] = max(xs) if xs else None
    return out


def timeline(records: Sequence[Any], duration: float, bin_s: float | None = None) -> dict[str, Any]:
    """Output chunks and completed requests per second, in bins over the run."""
    bin_s = bin_s or max(0.01, duration / 30.0)
    n = max(1, math.ceil(duration / bin_s))
    chunks, done = [0] * n, [0] * n
    for r in records:
        if not r.ok:
            continue
        # Spread the request's reported output tokens over its content chunks.
        per = r.output_tokens / len(r.chunk_times) if r.chunk_times else 0.0
        for t in r.chunk_times:
            chunks[min(n - 1, int(t / bin_s))] += per
        if r.e2e is not None:
            done[min(n - 1, int((r.start + r.e2e) / bin_s))] += 1
    return {"bin_s": bin_s, "output_tokens_per_s": [c / bin_s for c in chunks],
            "requests_per_s": [d / bin_s for d in done]}


def build_report(records: Sequence[Any], duration: float, *, config: dict[str, Any],
                 server: dict[str, Any] | None) -> dict[str, Any]:
    """records: runtime.bench.loadgen.RequestRecord list; server: counter deltas or None."""
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    duration = max(duration, 1e-9)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [x for r in ok for x in r.itl]
    e2e = [r.e2e for r in ok if r.e2e is not None]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok
            if r.ttft is not None and r.e2e is not None and r.output_tokens > 1]
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    errors: dict[str, int] = {}
    for r in failed:
        errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    return {
        "kind": "serve",
        "config": config,
        "duration_s": duration,
        "num_requests": len(records),
        "successful_requests": len(ok),
        "failed_requests": len(failed),
        "errors": errors,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_s": summarize(ttft),
        "itl_s": summarize(itl),
        "tpot_s": summarize(tpot),
        "e2e_s": summarize(e2e),
        "client_cached_token_rate": (sum(cached) / in_tokens) if cached and in_tokens else None,
        "server": server,
        "timeline": timeline(records, duration),
        "samples": {"ttft_s": ttft, "itl_s": itl, "e2e_s": e2e},
    }


# --- text ------------------------------------------------------------------------------------
def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:,.1f}"


def _num(v: float | None, fmt: str = ",.2f") -> str:
    return "-" if v is None else format(v, fmt)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.1f}%"


def format_report(r: dict[str, Any]) -> str:
    c = r["config"]
    load = (f"rate {c['rate']:g} req/s (Poisson)" if c.get("rate") else
            f"concurrency {c['concurrency']}" if c.get("concurrency") else "all requests at once")
    lines = [
        f"== bench serve: {c['scenario']}, {r['num_requests']} requests, {load}, max_tokens {c['max_tokens']}, "
        f"model {c.get('model')} ==",
        f"  successful / failed requests   {r['successful_requests']} / {r['failed_requests']}",
        f"  duration                       {r['duration_s']:.2f} s",
        f"  request throughput             {r['request_throughput']:.2f} req/s",
        f"  output token throughput        {r['output_throughput']:,.1f} tok/s",
        f"  total token throughput         {r['total_token_throughput']:,.1f} tok/s",
        f"  {'latency (ms)':<28} {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9}",
    ]
    for key, label in (("ttft_s", "TTFT"), ("itl_s", "ITL"), ("tpot_s", "TPOT"), ("e2e_s", "end-to-end")):
        s = r[key]
        lines.append(f"  {label:<28} {_ms(s['mean']):>9} {_ms(s['p50']):>9} {_ms(s['p90']):>9} {_ms(s['p99']):>9}")
    srv = r.get("server")
    if srv:
        lines.append(f"  prefix-cache hit rate          {_pct(srv.get('prefix_cache_hit_rate'))} "
                     f"({srv.get('prefix_cache_hits', 0):,.0f} of {srv.get('prefix_cache_queries', 0):,.0f} "
                     f"prompt tokens, server /metrics)")
        lines.append(f"  preemptions during the run     {srv.get('preemptions', 0):,.0f}")
    else:
        lines.append("  server counters                not available (no pagedjax/vLLM /metrics)")
    for err, n in list(r["errors"].items())[:5]:
        lines.append(f"  error x{n}: {err}")
    return "\n".join(lines)


def sweep_point(value: float, r: dict[str, Any]) -> dict[str, Any]:
    return {"value": value, "successful_requests": r["successful_requests"],
            "failed_requests": r["failed_requests"], "request_throughput": r["request_throughput"],
            "output_throughput": r["output_throughput"],
            **{f"{k}_{p}": r[f"{k}_s"][p] for k in ("ttft", "itl", "e2e") for p in ("p50", "p99")},
            "prefix_cache_hit_rate": (r.get("server") or {}).get("prefix_cache_hit_rate"),
            "preemptions": (r.get("server") or {}).get("preemptions")}


def build_sweep(mode: str, runs: list[tuple[float, dict[str, Any]]]) -> dict[str, Any]:
    return {"kind": "sweep", "mode": mode, "points": [sweep_point(v, r) for v, r in runs],
            "runs": [{k: v for k, v in r.items() if k != "samples"} for _, r in runs]}


def format_sweep(s: dict[str, Any]) -> str:
    head = f"{s['mode']:>12} {'ok/fail':>8} {'req/s':>7} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} " \
           f"{'ITL p50':>8} {'ITL p99':>8} {'E2E p50':>9} {'E2E p99':>9}"
    lines = [f"== bench sweep over {s['mode']} (latencies in ms) ==", head]
    for p in s["points"]:
        lines.append(f"{p['value']:>12g} {p['successful_requests']:>4}/{p['failed_requests']:<3} "
                     f"{p['request_throughput']:>7.2f} {p['output_throughput']:>10,.1f} {_ms(p['ttft_p50']):>9} "
                     f"{_ms(p['ttft_p99']):>9} {_ms(p['itl_p50']):>8} {_ms(p['itl_p99']):>8} "
                     f"{_ms(p['e2e_p50']):>9} {_ms(p['e2e_p99']):>9}")
    return "\n".join(lines)


def write_json(data: dict[str, Any], path: str | Path) -> None:
    """Atomic: nothing half-written is left behind."""
    p = Path(path)
    if p.parent != Path(""):
        p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=float) + "\n")
    os.replace(tmp, p)


# --- plots -------------------------------------------------------------------------------------
def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
        return True
    except ImportError:
        return False


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_report(r: dict[str, Any], path: str | Path) -> None:
    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, key, label in zip(axes.flat, ("ttft_s", "itl_s", "e2e_s"), ("TTFT", "inter-token latency",
                                                                         "end-to-end latency")):
        xs = [v * 1e3 for v in r["samples"][key]]
        if xs:
            lo, hi = min(xs), max(xs)
            if hi - lo <= 1e-6 * max(1.0, abs(hi)):  # all alike: one bar
                ax.hist(xs, bins=1, range=(lo - 0.5, hi + 0.5), color="tab:blue", alpha=0.8)
            else:
                ax.hist(xs, bins=min(50, max(5, len(xs) // 4)), color="tab:blue", alpha=0.8)
            for q, c in (("p50", "green"), ("p99", "red")):
                v = r[key][q]
                ax.axvline(v * 1e3, color=c, ls="--", label=f"{q} {v * 1e3:,.1f} ms")
            ax.legend()
        ax.set(title=label, xlabel="ms", ylabel="count")
    tl = r["timeline"]
    ax = axes.flat[3]
    t = [(i + 0.5) * tl["bin_s"] for i in range(len(tl["output_tokens_per_s"]))]
    ax.plot(t, tl["output_tokens_per_s"], ".-", label="output tokens/s")
    ax.set(title="throughput over time", xlabel="seconds since start", ylabel="output tokens/s")
    ax2 = ax.twinx()
    ax2.plot(t, tl["requests_per_s"], ".:", color="tab:orange", label="completed req/s")
    ax2.set_ylabel("completed requests/s")
    ax.legend(loc="upper left")
    ax2.legend(loc="upper right")
    c = r["config"]
    fig.suptitle(f"{c['scenario']} - {r['successful_requests']} ok / {r['failed_requests']} failed - "
                 f"{r['output_throughput']:,.1f} output tok/s - {c.get('model')}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_sweep(s: dict[str, Any], path: str | Path) -> None:
    plt = _plt()
    pts = s["points"]
    x = [p["output_throughput"] for p in pts]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for ax, key, label in zip(axes, ("ttft", "itl", "e2e"), ("TTFT", "inter-token latency", "end-to-end")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ys = [(p[f"{key}_{q}"] or 0) * 1e3 for p in pts]
            ax.plot(x, ys, style, label=q)
            if q == "p50":
                for xi, yi, p in zip(x, ys, pts):
                    ax.annotate(f"{p['value']:g}", (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set(title=f"{label} vs throughput", xlabel="output tokens/s", ylabel="ms")
        ax.legend()
    fig.suptitle(f"throughput vs latency, labels = {s['mode']}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
