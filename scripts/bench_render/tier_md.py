"""BENCHMARKS.md section for the host-RAM KV tier (issue #40): bench-results/kv_tier.json,
written by scripts/bench_kv_tier.py --json."""

from __future__ import annotations

import json
from pathlib import Path

from scripts.bench_render.md import table as _table


def render_kv_tier(results: str | Path) -> list[str]:
    L = ["## Host-RAM KV tier on a shared document (`scripts/bench_kv_tier.py`)", ""]
    try:
        r = json.loads((Path(results) / "kv_tier.json").read_text())
    except (OSError, ValueError):
        return L + ["_not run_", ""]
    m = r["machine"]
    L.append(f"SmolLM2-135M-Instruct float32: {r['requests']} requests of one shared {r['doc_tokens']}-token document "
             f"plus their own question, each followed by an unrelated {r['doc_tokens']}-token prompt (other traffic) "
             f"that evicts most of the document from a {r['pool_tokens']}-token device pool. Two engines alike but "
             f"for `--kv-offload-memory 1GiB`, the requests one at a time, alternating engines; TTFT is the "
             f"engine's own, the first (cold) request left out. {m['cpu_model']}, {m['cores']} cores, load "
             f"{r['load']:.2f} (1 min) at the end.")
    L.append("")
    rows = [[x["engine"], f"{x['ttft_p50_s']:.3f}", f"{x['ttft_mean_s']:.3f}", x["cached_tokens_p50"]] for x in r["rows"]]
    L += _table(("engine", "TTFT p50 s", "TTFT mean s", "cached prompt tokens (p50)"), rows)
    L += ["", f"Host tier against none: **{r['ratio']:.2f}x** the TTFT p50 (the issue's goal: at most 0.3x); the same "
              f"greedy tokens in {r['same']} of {r['requests']} requests; {r['promoted_blocks']} blocks served back "
              f"from host memory, {r['tier_bytes'] / 2**20:.0f} MiB held at the end.", ""]
    rs = r.get("restart")
    if rs:
        L += [f"A restart (`--kv-offload-dir`; the tiered engine stopped gracefully, which writes the prefixes still "
              f"on the device to disk): a fresh engine over the same directory answers the first document request "
              f"in **{rs['disk tier']:.3f} s** ({rs['cached_tokens']} prompt tokens read from disk) against "
              f"{rs['cold']:.3f} s for a cold prefill: **{rs['ratio']:.2f}x** (the issue's goal: at most 0.3x); "
              f"same tokens: {'yes' if rs['same'] else 'no'}.", ""]
    return L


def render_swap(results: str | Path) -> list[str]:
    """bench-results/swap.json, written by scripts/bench_swap.py --json."""
    L = ["## Swap preemption against recompute (`scripts/bench_swap.py`)", ""]
    try:
        r = json.loads((Path(results) / "swap.json").read_text())
    except (OSError, ValueError):
        return L + ["_not run_", ""]
    m = r["machine"]
    L.append(f"SmolLM2-135M-Instruct float32: {r['requests']} batch-tier requests, each its own "
             f"{r['prompt_tokens']}-token prompt and {r['max_tokens']} greedy tokens, queued at once on a "
             f"{r['pool_blocks']}-block device pool (about a third of what they grow to): decode growth preempts. "
             f"Three engines alike but for the policy: recompute without a tier, recompute with a 1 GiB host tier "
             f"(evicted prefix blocks come back as prefix hits), and swap (`--preemption-mode auto` with the same "
             f"tier). Whole runs timed, medians over {r['rounds']} alternating rounds; {m['cpu_model']}, "
             f"{m['cores']} cores, load {r['load']:.2f} (1 min) at the end, measured {r.get('measured_at', '?')} UTC.")
    L.append("")
    rows = [[x["engine"], x["preemptions"], x["swaps"], f"{x['recomputed_tokens']:,}", f"{x['wall_s']:.2f}",
             f"{x['same']}/{r['requests']}"] for x in r["rows"]]
    L += _table(("engine", "preemptions", "swaps", "prefill tokens recomputed", "wall s", "same tokens as recompute"),
                rows)
    L += ["", f"Swap recomputes **{r['cut']:.0%} fewer** prefill tokens than recompute (the issue's goal: at least "
              f"80% fewer), with the same greedy tokens.", ""]
    return L


def render_ledger(results: str | Path) -> list[str]:
    """bench-results/ledger.json, written by scripts/bench_ledger.py --json."""
    L = ["## Decision ledger: its cost per step (`scripts/bench_ledger.py`)", ""]
    try:
        r = json.loads((Path(results) / "ledger.json").read_text())
    except (OSError, ValueError):
        return L + ["_not run_", ""]
    m = r["machine"]
    L.append(f"SmolLM2-135M-Instruct float32, every row decoding; two engines alike but for `--no-request-ledger`, "
             f"{r['steps']} timed steps per engine and round, {r['rounds']} alternating rounds, medians; "
             f"{m['cpu_model']}, {m['cores']} cores, load {r['load']:.2f} (1 min) at the end, measured "
             f"{r.get('measured_at', '?')} UTC. The issue's goal: on within 1% of off.")
    L.append("")
    L += _table(("batch", "step ms, ledger on", "step ms, ledger off", "on / off"),
                [[x["batch"], f"{x['on_ms']:.2f}", f"{x['off_ms']:.2f}", f"{x['ratio']:.3f}"] for x in r["rows"]])
    return L + [""]


def render_quote(results: str | Path) -> list[str]:
    """bench-results/quote.json, written by scripts/bench_quote.py --json."""
    L = ["## Admission quote: predicted against measured TTFT (`scripts/bench_quote.py`)", ""]
    try:
        r = json.loads((Path(results) / "quote.json").read_text())
    except (OSError, ValueError):
        return L + ["_not run_", ""]
    m = r["machine"]
    L.append(f"SmolLM2-135M-Instruct float32 at steady load: {r['requests']} requests arriving as a Poisson process at "
             f"{r['rate']}/s (prompts 64-800 tokens, half behind one shared 200-token system prompt; 16-128 greedy "
             f"tokens), each quoted just before it is added; {m['cpu_model']}, {m['cores']} cores, load "
             f"{r['load']:.2f} (1 min) at the end, measured {r.get('measured_at', '?')} UTC. Measured TTFT p50 "
             f"{r['ttft_p50_s']:.3f} s.")
    L += ["", f"Quotes within +-30% of the measured TTFT: **{r['within_30']:.1%}** (the issue's goal: at least 80%); "
              f"median relative error {r['median_error']:+.1%}, median absolute {r['median_abs_error']:.1%}.", ""]
    return L


def render_prefill_profile(results: str | Path) -> list[str]:
    """bench-results/prefill_profile.json, written by scripts/bench_prefill_profile.py --json."""
    L = ["## Long prefill: where the time goes (`scripts/bench_prefill_profile.py`)", ""]
    try:
        r = json.loads((Path(results) / "prefill_profile.json").read_text())
    except (OSError, ValueError):
        return L + ["_not run_", ""]
    m = r["machine"]
    L.append(f"SmolLM2-135M-Instruct float32, one prompt computed in chunks of {r['chunk']} tokens (the engine's "
             f"default token budget); each chunk's step timed as the engine runs it and with an attention stand-in "
             f"that reads no KV (the decode breakdown's), best of two rounds; {m['cpu_model']}, {m['cores']} cores, "
             f"load {r['load']:.2f} (1 min) at the end, measured {r.get('measured_at', '?')} UTC.")
    L.append("")
    L += _table(("prompt tokens", "chunks", "prefill s", "attention s", "attention share"),
                [[p["tokens"], p["chunks"], f"{p['prefill_ms'] / 1e3:.2f}", f"{p['attention_ms'] / 1e3:.2f}",
                  f"{p['attention_share']:.0%}"] for p in r["prompts"]])
    L += ["", "Per chunk (its start position = the context it attends to):", ""]
    L += _table(("chunk start", "step ms", "without attention ms", "attention ms"),
                [[c["start"], f"{c['step_ms']:.1f}", f"{c['no_attention_ms']:.1f}",
                  f"{max(0.0, c['step_ms'] - c['no_attention_ms']):.1f}"] for c in r["chunks"]])
    return L + [""]
