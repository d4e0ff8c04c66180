"""Workloads and the OpenAI streaming load generator behind `pagedjax bench serve`.

Works against any OpenAI-compatible server: requests go to /v1/chat/completions (chat
scenarios) or /v1/completions with `stream: true` and `stream_options.include_usage`;
/metrics is read before and after the run when the server exposes pagedjax (or vLLM)
Prometheus counters. Arrivals are Poisson at a rate, or a fixed number of concurrent
clients. Every request has a timeout and the whole run a deadline, so it always ends.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from runtime.corpus import (DESKS, NAMES, SYSTEM_PROMPT, USER_TOPICS, WORDS,  # noqa: F401  (the workloads' text)
                            shared_prefix_messages, system_prompt)

SCENARIOS = ("shared-prefix", "multi-prefix", "random", "long-prompt")
# multi-prefix: this many system prompts, interleaved request by request (fleet routing).
NUM_PREFIXES = 4
@dataclass(frozen=True)
class RequestSpec:
    index: int
    messages: list[dict[str, str]] | None  # chat request
    prompt: str | None                     # completions request
    max_tokens: int


def random_text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, n_words))).capitalize() + "."


def messages_as_text(messages: list[dict[str, str]]) -> str:
    """A chat as one plain prompt, for base models without a chat template: the same text
    reaches every server through /v1/completions, so no server's own template choice enters
    the comparison."""
    parts = [m["content"] if m["role"] == "system" else f"{m['role'].capitalize()}: {m['content']}"
             for m in messages]
    return "\n\n".join(parts) + "\n\nAssistant:"


def build_workload(scenario: str, num_requests: int, *, max_tokens: int = 64, seed: int = 0,
                   input_len: int | None = None, prefix_words: int | None = None,
                   as_text: bool = False) -> list[RequestSpec]:
    """Requests of a scenario. `input_len` is approximate prompt tokens (one word ~ one
    token): the mean for `random` (uniform 0.25x..1.75x), the length for `long-prompt`.
    `as_text`: chat scenarios go out as plain /v1/completions prompts (messages_as_text)."""
    if scenario not in SCENARIOS:
        raise ValueError(f"scenario: must be one of {', '.join(SCENARIOS)}, got {scenario!r}")
    if num_requests < 1 or max_tokens < 1:
        raise ValueError("num_requests/max_tokens: must be >= 1")
    rng = random.Random(seed)
    if scenario in ("shared-prefix", "multi-prefix"):
        msgs = shared_prefix_messages(num_requests, seed, prefix_words,
                                      NUM_PREFIXES if scenario == "multi-prefix" else 1)
        if as_text:
            return [RequestSpec(i, None, messages_as_text(m), max_tokens) for i, m in enumerate(msgs)]
        return [RequestSpec(i, m, None, max_tokens) for i, m in enumerate(msgs)]
    if scenario == "random":
        mean = input_len or 256
        lens = [rng.randint(max(1, mean // 4), max(1, mean * 7 // 4)) for _ in range(num_requests)]
    else:
        lens = [input_len or 1536] * num_requests
    # A distinct first word per request: no accidental cross-request prefix sharing.
    return [RequestSpec(i, None, f"Request {i} {rng.randrange(10**6)}: " + random_text(rng, n), max_tokens)
            for i, n in enumerate(lens)]


# --- the client ---------------------------------------------------------------------------
@dataclass
class RequestRecord:
    index: int
    ok: bool = False
    start: float = 0.0                     # send time, seconds from the run start
    ttft: float | None = None              # to the first content chunk
    e2e: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # content chunks, seconds from run start
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None       # usage.prompt_tokens_details.cached_tokens, if reported
    error: str | None = None

    @property
    def itl(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]


@dataclass(frozen=True)
class LoadConfig:
    url: str
    scenario: str = "shared-prefix"
    model: str | None = None
    num_requests: int = 64
    rate: float | None = None          # requests/s, Poisson; None with concurrency None = all at once
    concurrency: int | None = None     # fixed number of clients
    max_tokens: int = 64
    seed: int = 0
    api_key: str | None = None
    timeout_s: float = 120.0           # per request
    max_duration_s: float = 900.0      # whole run; unfinished requests then count as failed
    input_len: int | None = None
    prefix_words: int | None = None    # shared-prefix: shorten the system prompt to this many words
    ignore_eos: bool = False           # send the vLLM/pagedjax `ignore_eos` extension
    as_text: bool = False              # chat scenarios as plain completions prompts (base models)
    progress: bool = True

    def __post_init__(self) -> None:
        if self.rate is not None and self.concurrency is not None:
            raise ValueError("rate/concurrency: give one of --rate or --concurrency, not both")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate: must be positive, got {self.rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency: must be >= 1, got {self.concurrency}")
        if self.timeout_s <= 0 or self.max_duration_s <= 0:
            raise ValueError("timeout: must be positive")

    def describe(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("api_key")
        d.pop("progress")
        return d


def root_url(url: str) -> str:
    """'http://h:8000/v1/' -> 'http://h:8000' (routes are added with /v1/...)."""
    u = url.rstrip("/")
    return u.removesuffix("/v1")


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum of each metric's samples over labels: {'name': value}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            name_part, value = line.rsplit(None, 1) if "}" not in line else (
                line[:line.rindex("}") + 1], line[line.rindex("}") + 1:].split()[0])
            name = name_part.split("{", 1)[0].strip()
            out[name] = out.get(name, 0.0) + float(value)
        except (ValueError, IndexError):
            continue
    return out


SERVER_COUNTERS = {  # our key -> metric names (pagedjax, then vLLM)
    "prefix_cache_hits": ("pagedjax:prefix_cache_hits_total", "vllm:prefix_cache_hits_total"),
    "prefix_cache_queries": ("pagedjax:prefix_cache_queries_total", "vllm:prefix_cache_queries_total"),
    "preemptions": ("pagedjax:num_preemptions_total", "vllm:num_preemptions_total"),
    # pagedjax only: programs compiled during the run (must stay 0 after warm-up), and the
    # engine's step time (its sum against the wall time says whether the engine is the bottleneck)
    "compilations": ("pagedjax:compilations_total",),
    "engine_steps": ("pagedjax:step_time_seconds_count",),
    "engine_step_seconds": ("pagedjax:step_time_seconds_sum",),
}


def server_counters(metrics: dict[str, float]) -> dict[str, float]:
    out = {}
    for key, names in SERVER_COUNTERS.items():
        for n in names:
            if n in metrics:
                out[key] = metrics[n]
                break
    return out


def counter_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any] | None:
    if not before or not after:
        return None
    d = {k: after[k] - before[k] for k in SERVER_COUNTERS if k in before and k in after}
    if not d:
        return None
    q = d.get("prefix_cache_queries")
    d["prefix_cache_hit_rate"] = (d.get("prefix_cache_hits", 0.0) / q) if q else None
    return d


async def fetch_metrics(client: httpx.AsyncClient, root: str) -> dict[str, float] | None:
    try:
        r = await client.get(f"{root}/metrics", timeout=10.0)
        if r.status_code != 200:
            return None
        c = server_counters(parse_prometheus(r.text))
        return c or None
    except httpx.HTTPError:
        return None


async def discover_model(client: httpx.AsyncClient, root: str) -> str:
    try:
        r = await client.get(f"{root}/v1/models", timeout=10.0)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"model: could not list {root}/v1/models ({exc}); pass --model") from None


def _error_text(status: int, body: bytes) -> str:
    try:
        msg = json.loads(body).get("error", {}).get("message") or body.decode(errors="replace")
    except (ValueError, AttributeError):
        msg = body.decode(errors="replace")
    return f"HTTP {status}: {str(msg)[:200]}"


async def send_one(client: httpx.AsyncClient, root: str, model: str, spec: RequestSpec, t0: float,
                   timeout_s: float, extra: dict[str, Any] | None = None,
                   rec: RequestRecord | None = None) -> RequestRecord:
    """One streaming request; `rec` (optional) is filled as chunks arrive, for callers that
    watch progress while it runs."""
    rec = rec or RequestRecord(spec.index)
    rec.start = time.perf_counter() - t0
    body: dict[str, Any] = {"model": model, "max_tokens": spec.max_tokens, "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}, **(extra or {})}
    if spec.messages is not None:
        path, body["messages"] = "/v1/chat/completions", spec.messages
    else:
        path, body["prompt"] = "/v1/completions", spec.prompt
    sent = time.perf_counter()
    usage = None

    async def stream() -> None:
        nonlocal usage
        async with client.stream("POST", root + path, json=body) as resp:
            if resp.status_code != 200:
                rec.error = _error_text(resp.status_code, await resp.aread())
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("error"):
                    err = obj["error"]
                    rec.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
                    return
                if obj.get("usage"):
                    usage = obj["usage"]
                for ch in obj.get("choices") or ():
                    text = (ch.get("delta") or {}).get("content") if "delta" in ch else ch.get("text")
                    if text:
                        now = time.perf_counter()
                        if rec.ttft is None:
                            rec.ttft = now - sent
                        rec.chunk_times.append(now - t0)

    try:
        await asyncio.wait_for(stream(), timeout_s)
    except TimeoutError:
        rec.error = f"timeout after {timeout_s:g} s"
    except (httpx.HTTPError, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:200]
    if rec.error is None:
        rec.e2e = time.perf_counter() - sent
        if usage:
            rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            rec.output_tokens = int(usage.get("completion_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                rec.cached_tokens = int(details["cached_tokens"])
        if not rec.output_tokens:
            rec.output_tokens = len(rec.chunk_times)  # no usage: one token per chunk
        rec.ok = True
    return rec


async def run_load_async(cfg: LoadConfig, specs: list[RequestSpec]) -> tuple[list[RequestRecord], float, dict]:
    """-> (records in request order, duration s, {'model', 'server': counter deltas or None})."""
    from tqdm import tqdm

    root = root_url(cfg.url)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    width = cfg.concurrency or len(specs)
    limits = httpx.Limits(max_connections=width + 4, max_keepalive_connections=width + 4)
    timeout = httpx.Timeout(cfg.timeout_s, connect=10.0)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        model = cfg.model or await discover_model(client, root)
        before = await fetch_metrics(client, root)
        bar = tqdm(total=len(specs), desc=f"{cfg.scenario}", unit="req", disable=not cfg.progress, leave=False)
        records: dict[int, RequestRecord] = {}
        extra = {"ignore_eos": True} if cfg.ignore_eos else None
        t0 = time.perf_counter()

        async def run(spec: RequestSpec) -> None:
            rec = await send_one(client, root, model, spec, t0, cfg.timeout_s, extra)
            records[spec.index] = rec
            bar.update(1)

        async def rate_mode() -> None:
            rng = random.Random(cfg.seed + 1)
            tasks, next_t = [], 0.0
            for spec in specs:
                delay = t0 + next_t - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(run(spec)))
                if cfg.rate is not None:
                    next_t += rng.expovariate(cfg.rate)
            await asyncio.gather(*tasks)

        async def concurrency_mode() -> None:
            queue = list(reversed(specs))

            async def worker() -> None:
                while queue:
                    await run(queue.pop())

            await asyncio.gather(*(worker() for _ in range(min(cfg.concurrency or 1, len(specs)))))

        try:
            await asyncio.wait_for(concurrency_mode() if cfg.concurrency else rate_mode(), cfg.max_duration_s)
        except TimeoutError:
            pass
        duration = time.perf_counter() - t0
        bar.close()
        after = await fetch_metrics(client, root)
    for spec in specs:
        if spec.index not in records:
            records[spec.index] = RequestRecord(spec.index, error=f"not finished within the run deadline "
                                                                  f"({cfg.max_duration_s:g} s)")
    return [records[s.index] for s in specs], duration, {"model": model, "server": counter_delta(before, after)}


def run_load(cfg: LoadConfig) -> dict[str, Any]:
    """Run one benchmark and return its report (see runtime.bench.report.build_report)."""
    from runtime.bench.report import build_report

    for name in ("httpx", "httpcore"):  # one INFO line per request would bury the progress bar
        logging.getLogger(name).setLevel(logging.WARNING)
    specs = build_workload(cfg.scenario, cfg.num_requests, max_tokens=cfg.max_tokens, seed=cfg.seed,
                           input_len=cfg.input_len, prefix_words=cfg.prefix_words, as_text=cfg.as_text)
    records, duration, info = asyncio.run(run_load_async(cfg, specs))
    return build_report(records, duration, config={**cfg.describe(), "model": info["model"]},
                        server=info["server"])
