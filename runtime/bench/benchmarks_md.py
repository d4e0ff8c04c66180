"""BENCHMARKS.md: machine facts, the renderer over bench-results/*.json, and the guidellm
summary (helpers for scripts/run_benchmarks.sh)."""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from runtime.bench.report import _ms, _num, _pct, write_json  # noqa: F401  (shared formatting)


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
    d["machine"] = machine
    write_json(d, p)
    return d


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


# --- side by side: pagedjax vs vLLM-CPU vs llama.cpp (scripts/bench_peers.sh) ---------------------
PEER_LABELS = {"pagedjax": "pagedjax float32", "pagedjax-w8a8": "pagedjax w8a8 (int8; accuracy: see below)",
               "vllm-fp32": "vLLM-CPU float32", "vllm-bf16": "vLLM-CPU bfloat16", "llamacpp": "llama.cpp"}


def load_peers(results: str | Path) -> dict[str, dict[str, Any]]:
    """{system: report} from peers-<system>.json, pagedjax first, then vLLM, llama.cpp, others."""
    d = Path(results)
    found = {}
    for p in sorted(d.glob("peers-*.json")):
        r = _load(d, p.name)
        if r and "output_throughput" in r:
            found[(r.get("peer") or {}).get("system") or p.stem.removeprefix("peers-")] = r
    order = [k for k in PEER_LABELS if k in found] + sorted(k for k in found if k not in PEER_LABELS)
    return {k: found[k] for k in order}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def render_peers(results: str | Path) -> list[str]:
    """The "Side by side" section of BENCHMARKS.md from bench-results/peers-*.json."""
    peers = load_peers(results)
    L = ["## Side by side: pagedjax vs vLLM-CPU vs llama.cpp", ""]
    if not peers:
        return L + ["_not run_ (`bash scripts/bench_peers.sh`; install the peers with "
                    "`bash scripts/peers/vllm_cpu.sh install` and `bash scripts/peers/llama_cpp.sh install`).", ""]
    first = next(iter(peers.values()))
    c = first["config"]
    L.append(f"The same workload against each server, one server at a time on this machine (each gets every core), "
             f"driven by the same client (`pagedjax bench serve`, streaming): scenario {c['scenario']}, "
             f"{first['num_requests']} chat requests, concurrency {min(c.get('concurrency') or first['num_requests'], first['num_requests'])}, "
             f"max_tokens {c['max_tokens']}, "
             f"greedy{', ignore_eos' if c.get('ignore_eos') else ''}. Every server is started fresh, answers one warm-up "
             "chat, is measured and stopped (`scripts/bench_peers.sh`). Same model everywhere: SmolLM2-135M-Instruct "
             "from the same GGUF (vLLM loads it exported to a Hugging Face folder by `scripts/peers/export_hf.py`).")
    keys = ("scenario", "concurrency", "max_tokens", "ignore_eos", "seed")
    differ = [k for k, r in peers.items()
              if r["num_requests"] != first["num_requests"] or any(r["config"].get(x) != c.get(x) for x in keys)]
    if differ:
        L.append("")
        L.append(f"**Not comparable:** {', '.join(differ)} ran a different workload than "
                 f"{next(iter(peers))} (see each JSON's config).")
    cpus = {((r.get("machine") or {}).get("cpu_model"), (r.get("machine") or {}).get("cores")) for r in peers.values()}
    same_cpu = len(cpus) == 1
    if same_cpu:
        cpu, cores = next(iter(cpus))
        L += ["", f"Measured on: {cpu}, {cores} cores."]
    L.append("")

    base = (peers.get("pagedjax") or {}).get("output_throughput")
    head = ["system", "version", "ok/failed", "output tokens", "output tok/s", "tok/s vs pagedjax", "TTFT p50 ms",
            "TTFT p99 ms", "ITL p50 ms", "prefix hit rate", "start-up s", "load avg 1m at start",
            "CPU busy before run"]
    if not same_cpu:
        head.append("CPU")
    rows = []
    for k, r in peers.items():
        peer, m = r.get("peer") or {}, r.get("machine") or {}
        row = [PEER_LABELS.get(k, k), peer.get("version") or "-",
               f"{r['successful_requests']}/{r['failed_requests']}", f"{r['total_output_tokens']:,}",
               f"{r['output_throughput']:,.1f}", _x(_ratio(r["output_throughput"], base)),
               _ms(r["ttft_s"]["p50"]), _ms(r["ttft_s"]["p99"]), _ms(r["itl_s"]["p50"]),
               _pct((r.get("server") or {}).get("prefix_cache_hit_rate")), _num(peer.get("startup_s"), ",.0f"),
               _num(m.get("loadavg_1m"), ".2f"),
               "-" if m.get("cpu_busy_pct_before") is None else f"{m['cpu_busy_pct_before']:.0f}%"]
        if not same_cpu:
            row.append(f"{m.get('cpu_model')}, {m.get('cores')} cores")
        rows.append(row)
    L += _table(head, rows)
    L.append("")

    if base:
        lines = []
        vllm = {k: peers[k]["output_throughput"] for k in ("vllm-fp32", "vllm-bf16") if k in peers}
        if "vllm-fp32" in vllm:
            lines.append(f"pagedjax vs vLLM-CPU float32 (same weights dtype): "
                         f"**{_x(_ratio(base, vllm['vllm-fp32']))}** output tok/s")
        if vllm:
            fast = max(vllm, key=lambda k: vllm[k])
            lines.append(f"pagedjax vs the faster vLLM-CPU ({PEER_LABELS[fast]}): **{_x(_ratio(base, vllm[fast]))}**")
        if "llamacpp" in peers:
            lines.append(f"pagedjax vs llama.cpp: **{_x(_ratio(base, peers['llamacpp']['output_throughput']))}**")
        L += [f"- {x}" for x in lines] + ([""] if lines else [])
    else:
        L += ["pagedjax was not measured in this set, so there are no ratios.", ""]

    if len({r["total_output_tokens"] for r in peers.values()}) > 1 and not c.get("ignore_eos"):
        L += ["Output tokens differ between systems: without ignore_eos each stops at its own end-of-sequence "
              "(greedy decoding, but different kernels and dtypes), so compare tok/s with the token counts in view.", ""]
    busy = [k for k, r in peers.items() if ((r.get("machine") or {}).get("cpu_busy_pct_before") or 0) > 25]
    if busy:
        L += [f"The machine was not quiet before {', '.join(PEER_LABELS.get(k, k) for k in busy)} "
              "(CPU busy > 25% over the 3 s before the run, idle server included): its throughput there is a lower "
              "bound and its latencies upper bounds.", ""]
    L.append("Load avg is the 1-minute load average when the server was started (it still remembers the previous "
             "system's run); CPU busy is sampled over the 3 s just before the measured run.")
    L += ["", "Commands:", "", "```sh"]
    for k, r in peers.items():
        peer = r.get("peer") or {}
        if peer.get("server_cmd"):
            L.append(f"{peer['server_cmd']} &")
        if peer.get("bench_cmd"):
            L.append(peer["bench_cmd"])
    L += ["```", ""]
    replies = [(k, (r.get("peer") or {}).get("warmup_reply")) for k, r in peers.items()]
    if any(v for _, v in replies):
        L.append("Warm-up answers to \"What is the capital of France?\": " +
                 "; ".join(f"{PEER_LABELS.get(k, k)}: \"{v}\"" for k, v in replies if v) + ".")
        L.append("")
    return L


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

    L += render_peers(d)
    from runtime.bench.engine_md import render_engine_sections

    L += render_engine_sections(d)

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
    """`python -m runtime.bench.benchmarks_md machine OUT.json` | `guidellm IN.json OUT.json DESCRIPTION`
    | `guidellm-failed OUT.json REASON` (helpers for scripts/run_benchmarks.sh)
    | `loadavg` | `cpu-busy SECONDS` | `peer RESULT.json META_JSON` (helpers for scripts/bench_peers.sh)."""
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
