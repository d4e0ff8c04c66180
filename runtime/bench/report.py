"""Benchmark statistics, JSON reports, text tables, plots and the BENCHMARKS.md renderer.

Everything here works from plain data (lists of floats, the report dicts written as
JSON), so plots and BENCHMARKS.md can be regenerated from bench-results/*.json alone.
"""

from __future__ import annotations

import json
import math
import os
import platform
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

PERCENTILES = (50, 90, 99)


# --- statistics --------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float | None:
    """q-th percentile (0..100) with linear interpolation between closest ranks (the
    numpy default); None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"q: must be within 0..100, got {q}")
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Iterable[float]) -> dict[str, float | int | None]:
    xs = [float(v) for v in values if v is not None]
    out: dict[str, float | int | None] = {"count": len(xs), "mean": sum(xs) / len(xs) if xs else None}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(xs, q)
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


MATPLOTLIB_MISSING = ("plots need matplotlib, which is not installed "
                      "(pip install matplotlib, or pip install -e .[bench])")


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


# --- machine and BENCHMARKS.md -----------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
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


def _load(d: Path, name: str) -> dict[str, Any] | None:
    p = d / name
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except ValueError:
        return None


def _table(head: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out


def _serve_rows(label: str, r: dict[str, Any]) -> list[Any]:
    srv = r.get("server") or {}
    return [label, f"{r['successful_requests']}/{r['failed_requests']}", f"{r['request_throughput']:.2f}",
            f"{r['output_throughput']:,.1f}", _ms(r["ttft_s"]["p50"]), _ms(r["ttft_s"]["p99"]),
            _ms(r["itl_s"]["p50"]), _ms(r["itl_s"]["p99"]), _ms(r["e2e_s"]["p50"]),
            _pct(srv.get("prefix_cache_hit_rate")), _num(srv.get("preemptions"), ",.0f")]


SERVE_HEAD = ("run", "ok/failed", "req/s", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
              "ITL p99 ms", "E2E p50 ms", "prefix hit rate", "preemptions")


def render_benchmarks(results: str | Path, commands: str | None = None) -> str:
    """BENCHMARKS.md from bench-results/*.json (missing parts say so)."""
    d = Path(results)
    machine = _load(d, "machine.json") or machine_info()
    off = _load(d, "offline.json") or {}
    peer = _load(d, "peer.json")
    plan = _load(d, "plan.json")
    serve = _load(d, "serve-shared-prefix.json")
    sweep = _load(d, "sweep-concurrency.json")
    guide = _load(d, "guidellm-summary.json")
    L: list[str] = [
        "# Benchmarks", "",
        "Generated by `scripts/run_benchmarks.sh` from the JSON in `bench-results/` "
        "(renderer: `pagedjax bench render`). Do not edit by hand; rerun the script.", "",
        "## Machine", "",
        f"- CPU: {machine.get('cpu_model')}, {machine.get('cores')} cores"
        f"{' (shared with other work while measured)' if machine.get('shared') else ''}",
        f"- RAM: {(machine.get('ram_bytes') or 0) / 2**30:.1f} GiB",
        f"- jax {machine.get('jax')} ({machine.get('jax_backend')}), Python {machine.get('python')}",
        f"- {machine.get('platform')}",
    ]
    if machine.get("date"):
        L.append(f"- measured {machine['date']}")
    L += ["", "## Commands", "", "```sh", commands or "bash scripts/run_benchmarks.sh", "```", ""]

    model = off.get("checkpoint")
    tp = off.get("throughput")
    L += ["## Offline throughput: pagedjax vs Hugging Face transformers", ""]
    if tp:
        L.append(f"{tp['num_requests']} chat requests sharing a {tp['system_prompt_tokens']}-token system prompt "
                 f"(prompts {tp['prompt_tokens_min']}-{tp['prompt_tokens_max']} tokens), greedy, "
                 f"{tp['max_tokens']} output tokens each (ignore_eos), {model or tp['model']} in float32 on this CPU. "
                 f"Engine envelope: {tp['max_num_seqs']} sequences, {tp['max_num_batched_tokens']} tokens per "
                 "step. Warm-up (compilation) excluded.")
        L.append("")
        rows = [["pagedjax, continuous batching + prefix cache", f"{tp['output_tokens']:,}",
                 f"{tp['seconds']:.1f}", f"{tp['output_tokens_per_s']:,.1f}", _pct(tp["prefix_cache_hit_rate"])],
                ["pagedjax, one request at a time "
                 f"({tp['sequential']['num_requests']} requests)", f"{tp['sequential']['output_tokens']:,}",
                 f"{tp['sequential']['seconds']:.1f}", f"{tp['sequential']['output_tokens_per_s']:,.1f}",
                 _pct(tp["sequential"]["prefix_cache_hit_rate"])]]
        for b in (peer or {}).get("batches", []):
            served = b.get("num_requests", peer["num_requests"])
            part = "" if served == peer["num_requests"] else f", first {served} of {peer['num_requests']} requests"
            rows.append([f"transformers {peer['transformers_version']}, static batches of {b['batch_size']} "
                         f"(left padding{part})", f"{b['output_tokens']:,}", f"{b['seconds']:.1f}",
                         f"{b['output_tokens_per_s']:,.1f}", "-"])
        head = ["system", "output tokens", "seconds", "output tok/s", "prefix hit rate"]
        loads = [tp.get("loadavg_1m")] + [b.get("loadavg_1m") for b in (peer or {}).get("batches", [])]
        if any(x is not None for x in loads):  # a shared machine: say how busy it was
            head.append("load avg (1 min) at start")
            for row, load in zip(rows[:1] + rows[2:], loads):
                row.append("-" if load is None else f"{load:.1f}")
            rows[1].append("")
        L += _table(head, rows)
        L.append("")
        L.append(f"Continuous batching vs one at a time: "
                 f"**{tp['output_tokens_per_s'] / tp['sequential']['output_tokens_per_s']:.1f}x**.")
        if peer and peer.get("batches"):
            best = max(peer["batches"], key=lambda b: b["output_tokens_per_s"])
            L.append(f"pagedjax vs the best transformers batch size ({best['batch_size']}): "
                     f"**{tp['output_tokens_per_s'] / best['output_tokens_per_s']:.2f}x** "
                     f"(transformers loads the same GGUF with `gguf_file=`, dequantized to float32; "
                     f"same prompt token ids, {peer.get('torch_threads')} torch threads). transformers "
                     "recomputes the shared system prompt for every request (prefill is compute-bound on a "
                     "CPU); pagedjax computes it once and serves it from the prefix cache, and keeps the "
                     "batch full as requests finish.")
        elif peer is None:
            L.append("The transformers peer was not run (`pip install -e .[peer]`).")
    else:
        L.append("_not measured_ (run `pagedjax bench offline --part throughput`).")
    L.append("")

    host = off.get("host")
    L += ["## Host-side scheduling cost", ""]
    if host:
        L.append(f"`Scheduler.schedule()` + `commit()` with {host['num_seqs']} running sequences "
                 f"(block pool of {host['num_blocks']} blocks, prefix cache on, fake runner, "
                 f"{host['steps']} decode steps):")
        L.append("")
        L += _table(("part", "mean µs/step", "p99 µs/step"),
                    [["schedule + commit", f"{host['schedule_commit_us']['mean']:,.0f}",
                      f"{host['schedule_commit_us']['p99']:,.0f}"],
                     ["build_step_input (padded host arrays)", f"{host['build_input_us']['mean']:,.0f}",
                      f"{host['build_input_us']['p99']:,.0f}"]])
        L.append("")
        ok = host["schedule_commit_us"]["mean"] <= host["target_us"]
        L.append(f"Target: <= {host['target_us']:,.0f} µs per step for schedule + commit: "
                 f"**{'met' if ok else 'not met'}**.")
    else:
        L.append("_not measured_")
    L.append("")

    dec = off.get("decode")
    L += ["## Decode step: matmuls vs attention", ""]
    if dec:
        L.append(f"{model or dec['model']}, float32, one jitted decode step (S == T) with a context of "
                 f"{dec['context_len']} tokens per sequence; 'no attention' is the same step with the "
                 "paged-attention call replaced by a no-op of the same shapes (KV write kept), so "
                 "attention = full - no-op. Median of "
                 f"{dec['iters']} runs of each, interleaved.")
        L.append("")
        rows = []
        for row in dec["rows"]:
            mins = (f"{row['full_min_ms']:.2f} / {row['no_attention_min_ms']:.2f}"
                    if "full_min_ms" in row else "-")
            rows.append([row["batch"], f"{row['full_ms']:.2f}", f"{row['no_attention_ms']:.2f}",
                         f"{row['attention_ms']:.2f}", f"{row['attention_share'] * 100:.0f}%",
                         f"{row['tokens_per_s']:,.0f}", mins])
        L += _table(("batch", "full step ms", "no-attention ms (matmuls etc.)", "attention ms", "attention share",
                     "tokens/s", "min full / no-attention ms"), rows)
        L.append("")
        bw = dec["bandwidth"]
        L.append(f"Memory-bandwidth limit at batch 1: weights {bw['weight_bytes'] / 1e6:,.0f} MB / measured read "
                 f"bandwidth {bw['read_bandwidth_gb_s']:.1f} GB/s = **{bw['limit_ms']:.2f} ms** per step; "
                 f"measured {bw['measured_ms']:.2f} ms, i.e. **{bw['achieved_pct']:.0f}%** of the limit.")
    else:
        L.append("_not measured_")
    L.append("")

    L += ["## Planner prediction vs measured", ""]
    if plan and dec:
        by_b = {r["batch"]: r for r in plan["rows"]}
        meas = {r["batch"]: r for r in dec["rows"]}
        rows = []
        for b in (1, 32):
            if b in by_b and b in meas:
                pred, got = by_b[b]["step_time_s"] * 1e3, meas[b]["full_ms"]
                rows.append([b, f"{pred:.2f}", f"{got:.2f}", f"{got / pred:.2f}x"])
        L.append(f"`pagedjax plan --device cpu --checkpoint ... --context-len {plan['context_len']} "
                 f"--weight-dtype {plan['weight_dtype']} --kv-dtype {plan['kv_dtype']}` (measured bandwidth "
                 f"{plan['device']['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s) against the measured full decode step:")
        L.append("")
        L += _table(("batch", "predicted step ms", "measured step ms", "measured / predicted"), rows)
        L.append("")
        L.append("The formula counts only the bytes a step must read (weights + KV); the measured step also "
                 "pays XLA's gathers, the attention loop's compute, sampling over the 49k vocabulary and "
                 "dispatch, so the ratio says how far the CPU path is from bandwidth-bound.")
    else:
        L.append("_not measured_")
    L.append("")

    L += ["## Online serving (`pagedjax serve` + `pagedjax bench serve`)", ""]
    if serve or sweep:
        cfg = (serve or sweep["runs"][0])["config"]
        L.append(f"`pagedjax serve` on {cfg.get('model')} (this CPU), driven over HTTP with streaming: "
                 f"scenario {cfg['scenario']}, max_tokens {cfg['max_tokens']}.")
        L.append("")
        rows = []
        if serve:
            c = serve["config"]
            load = f"rate {c['rate']:g}/s" if c.get("rate") else f"concurrency {c.get('concurrency')}"
            rows.append(_serve_rows(f"{serve['num_requests']} req, {load}", serve))
        for v, r in zip([p["value"] for p in (sweep or {}).get("points", [])], (sweep or {}).get("runs", [])):
            rows.append(_serve_rows(f"sweep: {r['num_requests']} req, {sweep['mode']} {v:g}", r))
        L += _table(SERVE_HEAD, rows)
        L.append("")
        L.append("Plots: `bench-results/serve-shared-prefix.png` (latency distributions, throughput over "
                 "time), `bench-results/sweep-concurrency.png` (throughput vs latency).")
    else:
        L.append("_not measured_")
    L.append("")

    L += ["## Independent client: guidellm", "",
          "guidellm runs from its own venv (`$GUIDELLM_VENV`, default /tmp/guidellm-venv): installing it into the "
          "project venv would downgrade click and multidict there. No model hub is reachable, so it gets a local "
          "tokenizer directory (the checkpoint's tokenizer.json plus a minimal tokenizer_config.json) for its "
          "synthetic prompts, with HF_HUB_OFFLINE=1. Its token counts come from the server's usage.", ""]
    if guide:
        if guide.get("ok"):
            L.append(f"guidellm {guide.get('version')} (its own venv), {guide.get('description')}:")
            L.append("")
            L += _table(("metric", "value"), [[k, v] for k, v in guide.get("metrics", {}).items()])
        else:
            L.append(f"guidellm could not be run: {guide.get('reason')}")
        if guide.get("note"):
            L.append("")
            L.append(guide["note"])
    else:
        L.append("_not run_")
    L.append("")
    return "\n".join(L)


# --- guidellm (the independent client) ---------------------------------------------------------------
def guidellm_summary(path: str | Path, description: str) -> dict[str, Any]:
    """The headline numbers of a guidellm JSON report (first benchmark)."""
    d = json.loads(Path(path).read_text())
    b = d["benchmarks"][0]
    m = b["metrics"]

    def stat(key: str, field: str) -> float | None:
        s = (m.get(key) or {}).get("successful") or {}
        if field in ("p50", "p90", "p99"):
            return (s.get("percentiles") or {}).get(field)
        return s.get(field)

    tot = m["request_totals"]
    metrics = {
        "requests ok / errored / incomplete": f"{tot['successful']} / {tot['errored']} / {tot['incomplete']}",
        "duration s": f"{b['duration']:.1f}",
        "requests/s (mean)": _num(stat("requests_per_second", "mean")),
        "output tokens/s (mean)": _num(stat("output_tokens_per_second", "mean"), ",.1f"),
        "prompt tokens per request (median)": _num(stat("prompt_token_count", "median"), ",.0f"),
        "output tokens per request (median)": _num(stat("output_token_count", "median"), ",.0f"),
    }
    for key, label in (("time_to_first_token_ms", "TTFT ms"), ("inter_token_latency_ms", "ITL ms"),
                       ("request_latency", "request latency s")):
        metrics[f"{label} mean / p50 / p99"] = " / ".join(
            _num(stat(key, f), ",.1f" if "ms" in label else ",.2f") for f in ("mean", "p50", "p99"))
    return {"ok": True, "version": d.get("metadata", {}).get("guidellm_version"), "description": description,
            "metrics": metrics}


def _main(argv: list[str]) -> int:
    """`python -m runtime.bench.report machine OUT.json` | `guidellm IN.json OUT.json DESCRIPTION`
    | `guidellm-failed OUT.json REASON` (helpers for scripts/run_benchmarks.sh)."""
    import datetime

    if argv[:1] == ["machine"] and len(argv) == 2:
        info = machine_info()
        info["date"] = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
        info["shared"] = os.environ.get("BENCH_SHARED_MACHINE", "") == "1"
        write_json(info, argv[1])
        return 0
    if argv[:1] == ["guidellm"] and len(argv) == 4:
        write_json(guidellm_summary(argv[1], argv[3]), argv[2])
        return 0
    if argv[:1] == ["guidellm-failed"] and len(argv) == 3:
        write_json({"ok": False, "reason": argv[2]}, argv[1])
        return 0
    print(_main.__doc__, file=__import__("sys").stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(_main(__import__("sys").argv[1:]))
