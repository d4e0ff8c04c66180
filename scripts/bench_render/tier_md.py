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


def render_lora(results: str | Path) -> list[str]:
    """bench-results/lora.json, written by scripts/bench_lora.py --json."""
    L = ["## Multi-LoRA: 1, 4 and 16 adapters in one batch (`scripts/bench_lora.py`)", ""]
    try:
        r = json.loads((Path(results) / "lora.json").read_text())
    except (OSError, ValueError):
        return L + ["_not run_", ""]
    m = r["machine"]
    L.append(f"SmolLM2-135M-Instruct float32: {r['requests']} greedy requests of {r['prompt_tokens']} prompt + "
             f"{r['max_tokens']} output tokens queued at once (decode steps of {r['requests']} rows), round-robin "
             f"over the adapters: random PEFT LoRAs of rank {r['rank']} on all seven projections. `base` has no "
             f"LoRA; the others are one engine with `--enable-lora --max-loras 16 --max-lora-rank {r['rank']}` "
             f"(its base rows lose the fused layer-tail kernel: an adapter's delta goes between its products); "
             f"the last row stores the slots as bfloat16 (`--lora-dtype bfloat16`). Whole runs (prefill and "
             f"decode) timed, medians of {r['rounds']} alternating rounds; then one {r['requests']}-row decode step "
             f"per setting replayed, alternating, medians. {m['cpu_model']}, {m['cores']} cores, load "
             f"{r['load']:.2f} (1 min) at the end, measured {r.get('measured_at', '?')} UTC.")
    L.append("")
    L += _table(("setting", "wall s", "output tok/s", "vs base", "decode step ms", "step vs base"),
                [[x["setting"], f"{x['wall_s']:.2f}", f"{x['tok_s']:.0f}", f"{x['vs_base']:.2f}x",
                  f"{x['step_ms']:.1f}", f"{x['step_vs_base']:.2f}x"] for x in r["rows"]])
    c = r["compiled_after_warmup"]
    L += ["", f"Adapter swap into a device slot: **{r['swap_ms']:.1f} ms** (mean of {r['swaps']}); reading one from "
              f"disk: {r['read_ms']:.1f} ms. Step programs compiled after warm-up while adapters were loaded and "
              f"swapped: **{c[0]}** (slot writes: {c[1]}). Base rows on the LoRA engine give the base engine's tokens: "
              f"{'yes' if r['same_base_tokens'] else 'no'}; bfloat16 slots give float32 slots' tokens on "
              f"{r['same_bf16_tokens']}/{r['requests']} requests.", "",
          "The issue's goal is 16 adapters at 0.8x the base's throughput. A 16-adapter step reads every adapter's "
          "matrices once (rank 16 on all projections of a 135M model: 20 MB each in float32, 313 MB for 16, more "
          "than half the model's weights again), which is what the 16-adapter row pays over the 1-adapter row; "
          "bfloat16 slots halve those bytes. The whole-run ratio moves with the load between runs; the decode "
          "step is the steadier number.", ""]
    return L
