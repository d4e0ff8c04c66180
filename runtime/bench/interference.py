"""`pagedjax bench interference`: what long prompts do to streams that are decoding.

N streams decode (ignore_eos, so they keep going) while a long prompt arrives every few
seconds. Reports the streams' inter-token latency (p50, p99, max: a prefill that shares
the streams' device shows up as a stall in their ITL), the long prompts' TTFT, and output
throughput, with the CPU model and load beside them. Any OpenAI-compatible server: run it
against colocated and disaggregated (prefill/decode pools) setups on the same machine
(scripts/bench_disagg.sh runs them one after another) to compare them side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from runtime.bench.machine import machine_info
from runtime.bench.loadgen import RequestRecord, RequestSpec, discover_model, random_text, root_url, send_one


@dataclass(frozen=True)
class InterferenceConfig:
    url: str
    streams: int = 16
    stream_tokens: int = 400          # each decoding stream's length
    long_prompt_words: int = 2000     # ~2k SmolLM2 tokens (~1 token a word; the report gives the real count)
    long_max_tokens: int = 8
    long_interval_s: float = 4.0
    num_long: int = 6
    api_key: str | None = None
    model: str | None = None
    timeout_s: float = 600.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("streams", "stream_tokens", "long_prompt_words", "long_max_tokens", "num_long"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        if self.long_interval_s <= 0:
            raise ValueError("long_interval_s: must be positive")


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1e3, 2)


def _pct_ms(xs: list[float], q: float) -> float | None:
    return _ms(float(np.percentile(xs, q))) if xs else None


async def run_async(cfg: InterferenceConfig) -> dict[str, Any]:
    rng = random.Random(cfg.seed)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    root = root_url(cfg.url)
    limits = httpx.Limits(max_connections=cfg.streams + cfg.num_long + 4)
    async with httpx.AsyncClient(headers=headers, timeout=cfg.timeout_s, limits=limits) as client:
        model = cfg.model or await discover_model(client, root)
        t0 = time.perf_counter()
        live = [RequestRecord(i) for i in range(cfg.streams)]
        streams = [asyncio.create_task(send_one(
            client, root, model, RequestSpec(i, None, f"Stream {i} {rng.randrange(10**6)}: " + random_text(rng, 24),
                                             cfg.stream_tokens), t0, cfg.timeout_s, {"ignore_eos": True}, live[i]))
            for i in range(cfg.streams)]
        # Long prompts start once every stream decodes (and stop arriving before the streams end).
        while time.perf_counter() - t0 < cfg.timeout_s and not all(r.chunk_times or r.error for r in live):
            await asyncio.sleep(0.05)
        window_start = time.perf_counter() - t0
        longs = []
        for k in range(cfg.num_long):
            spec = RequestSpec(1000 + k, None, f"Document {k} {rng.randrange(10**6)}: "
                               + random_text(rng, cfg.long_prompt_words), cfg.long_max_tokens)
            longs.append(asyncio.create_task(send_one(client, root, model, spec, t0, cfg.timeout_s)))
            await asyncio.sleep(cfg.long_interval_s)
        long_recs: list[RequestRecord] = list(await asyncio.gather(*longs))
        window_end = time.perf_counter() - t0
        stream_recs: list[RequestRecord] = list(await asyncio.gather(*streams))
        wall = time.perf_counter() - t0
    # ITL of the streams while long prompts were arriving (the gaps that end in the window).
    gaps = [b - a for r in stream_recs for a, b in zip(r.chunk_times, r.chunk_times[1:])
            if window_start <= b <= window_end]
    ttft = [r.ttft for r in long_recs if r.ok and r.ttft is not None]
    ok = [r for r in stream_recs + long_recs if r.ok]
    errors = [r.error for r in stream_recs + long_recs if r.error]
    return {
        "kind": "interference", "config": cfg.__dict__ | {"api_key": None}, "machine": machine_info(),
        "load_avg_1m": os.getloadavg()[0], "wall_s": round(wall, 2),
        "window_s": round(window_end - window_start, 2),
        "streams_ok": sum(r.ok for r in stream_recs), "long_ok": sum(r.ok for r in long_recs), "errors": errors[:5],
        "long_prompt_tokens": max((r.prompt_tokens for r in long_recs if r.ok), default=0),
        "itl_ms": {"n": len(gaps), "p50": _pct_ms(gaps, 50), "p99": _pct_ms(gaps, 99),
                   "max": _ms(max(gaps) if gaps else None)},
        "long_ttft_ms": {"n": len(ttft), "p50": _pct_ms(ttft, 50), "p99": _pct_ms(ttft, 99)},
        "output_tokens_per_s": round(sum(r.output_tokens for r in ok) / wall, 1) if wall else 0.0,
    }


def format_report(r: dict[str, Any], label: str = "") -> str:
    m = r["machine"]
    itl, ttft = r["itl_ms"], r["long_ttft_ms"]
    return "\n".join([
        f"interference{' (' + label + ')' if label else ''}: {r['config']['streams']} streams decoding, "
        f"{r['config']['num_long']} prompts of {r['long_prompt_tokens']} tokens every {r['config']['long_interval_s']:g} s",
        f"  machine      {m['cpu_model']}, {m['cores']} cores, load {r['load_avg_1m']:.2f}",
        f"  stream ITL   p50 {itl['p50']} ms, p99 {itl['p99']} ms, max {itl['max']} ms ({itl['n']} gaps in the "
        f"{r['window_s']} s window)",
        f"  long TTFT    p50 {ttft['p50']} ms, p99 {ttft['p99']} ms ({ttft['n']} prompts)",
        f"  throughput   {r['output_tokens_per_s']} output tokens/s; {r['streams_ok']}/{r['config']['streams']} "
        f"streams and {r['long_ok']}/{r['config']['num_long']} prompts ok"
        + (f"; errors: {r['errors']}" if r["errors"] else ""),
    ])


def add_interference_parser(sub: Any) -> None:
    s = sub.add_parser("interference", help="decoding streams' ITL while long prompts arrive (colocated vs "
                                            "disaggregated)")
    s.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    s.add_argument("--streams", type=int, default=16)
    s.add_argument("--stream-tokens", type=int, default=400)
    s.add_argument("--long-prompt-words", type=int, default=2000, help="~2k SmolLM2 tokens (reported exactly)")
    s.add_argument("--long-max-tokens", type=int, default=8)
    s.add_argument("--long-interval", type=float, default=4.0, help="seconds between long prompts")
    s.add_argument("--num-long", type=int, default=6)
    s.add_argument("--api-key", default=os.environ.get("PAGEDJAX_API_KEY"))
    s.add_argument("--model", default=None)
    s.add_argument("--label", default="", help="name of the setup, printed and stored with the result")
    s.add_argument("--out", default=None, help="write the JSON result here")
    s.set_defaults(func=cmd_interference)


def cmd_interference(args: argparse.Namespace) -> int:
    cfg = InterferenceConfig(args.url, args.streams, args.stream_tokens, args.long_prompt_words,
                             args.long_max_tokens, args.long_interval, args.num_long, args.api_key, args.model)
    report = asyncio.run(run_async(cfg))
    report["label"] = args.label
    print(format_report(report, args.label))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.out}")
    return 0 if report["streams_ok"] == cfg.streams and report["long_ok"] == cfg.num_long else 1
