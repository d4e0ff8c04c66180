"""Engine metrics (prometheus_client, vLLM-compatible meanings under `pagedjax:`) and
snapshot records the console renders.

Each engine owns its CollectorRegistry, so several engines (tests) never collide.
Gauges that mirror scheduler state are refreshed once per step by the engine thread.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from collections import deque
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                   1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
P = "pagedjax:"


class EngineMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.num_requests_running = Gauge(P + "num_requests_running", "Requests in the running batch", registry=r)
        self.num_requests_waiting = Gauge(P + "num_requests_waiting", "Requests waiting (incl. preempted)",
                                          registry=r)
        self.num_requests_preempted = Gauge(P + "num_requests_preempted", "Preempted requests waiting to resume",
                                            registry=r)
        self.kv_cache_usage_perc = Gauge(P + "kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)",
                                         registry=r)
        self.kv_blocks = Gauge(P + "kv_blocks", "KV blocks by state", ["state"], registry=r)
        self.prefix_cache_queries = Counter(P + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                            registry=r)
        self.prefix_cache_hits = Counter(P + "prefix_cache_hits", "Prompt tokens served by the prefix cache",
                                         registry=r)
        self.prefix_cache_evictions = Counter(P + "prefix_cache_evictions", "Cached blocks reused for new data",
                                              registry=r)
        self.evicted_block_age = Histogram(P + "prefix_cache_evicted_block_age_seconds",
                                           "Time an evicted block sat cached", buckets=LATENCY_BUCKETS, registry=r)
        self.num_preemptions = Counter(P + "num_preemptions", "Preemptions (recompute)", registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prefill tokens processed", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Generated tokens", registry=r)
        self.request_success = Counter(P + "request_success", "Finished requests", ["finished_reason"], registry=r)
        self.admission_rejections = Counter(P + "admission_rejections", "Requests refused at admission",
                                            ["reason"], registry=r)
        self.compilations = Gauge(P + "compilations_total", "XLA programs built for the engine step", registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Inter-token latency", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(P + "request_queue_time_seconds", "Time waiting before first scheduled",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.step_time = Histogram(P + "step_time_seconds", "Engine step wall time", buckets=LATENCY_BUCKETS,
                                   registry=r)
        self.step_tokens = Histogram(P + "step_tokens", "Tokens per step",
                                     buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048), registry=r)
        # Disaggregated prefill/decode (runtime/disagg.py): bytes out of a prefill replica and
        # into a decode one; seconds per stage (export: device -> host, transfer: the
        # connector, import: host -> device and prefix-cache registration).
        self.kv_transfer_bytes = Counter(P + "kv_transfer_bytes", "KV bytes transferred between replicas",
                                         ["direction"], registry=r)
        self.kv_transfer_seconds = Histogram(P + "kv_transfer_seconds", "KV transfer time by stage", ["stage"],
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.kv_transfer_failures = Counter(P + "kv_transfer_failures", "KV transfers that failed or timed out",
                                            registry=r)
        self.kv_reservations = Counter(P + "kv_reservations", "Decode-side KV reservations by outcome",
                                       ["outcome"], registry=r)
        # The model-server protocol series llm-d's endpoint picker scrapes (vLLM's names),
        # beside our own; LLMEngine keeps them equal to the pagedjax: gauges.
        V = "vllm:"
        self.vllm_waiting = Gauge(V + "num_requests_waiting", "Requests waiting (model-server protocol)", registry=r)
        self.vllm_running = Gauge(V + "num_requests_running", "Requests running (model-server protocol)", registry=r)
        self.vllm_kv_usage = Gauge(V + "kv_cache_usage_perc", "KV cache usage 0-1 (model-server protocol)",
                                   registry=r)
        self.vllm_cache_config = Gauge(V + "cache_config_info", "KV cache configuration (model-server protocol)",
                                       ["block_size", "num_gpu_blocks"], registry=r)
        self.window = RecentWindow()

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass
class RecentWindow:
    """Short in-memory history for the console's charts and percentiles."""

    horizon_s: float = 300.0
    ttft: deque = field(default_factory=lambda: deque(maxlen=2048))         # (t, seconds)
    itl: deque = field(default_factory=lambda: deque(maxlen=8192))          # (t, seconds)
    steps: deque = field(default_factory=lambda: deque(maxlen=4096))        # StepSample

    def add_step(self, sample: "StepSample") -> None:
        self.steps.append(sample)

    def recent(self, series: deque, seconds: float) -> list:
        cutoff = time.monotonic() - seconds
        return [x for x in series if x[0] >= cutoff]


@dataclass(frozen=True)
class StepSample:
    t: float
    step_time: float
    num_tokens: int
    num_running: int
    num_waiting: int
    new_tokens: int           # generated tokens this step
    prefix_queries: int       # cumulative
    prefix_hits: int          # cumulative
    evictions: int            # cumulative
    used_blocks: int
    cached_blocks: int

    def __getitem__(self, i: int):  # (t, ...) tuple-like access for RecentWindow.recent
        return (self.t,)[i]


def percentile(values: Sequence[float], q: float) -> float | None:
    """q-th percentile (0..100) with linear interpolation between closest ranks (the
    numpy default); None for no values. The one definition: console and benchmarks."""
    if not 0 <= q <= 100:
        raise ValueError(f"q: must be within 0..100, got {q}")
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
