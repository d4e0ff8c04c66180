"""Engine metrics (prometheus_client, vLLM-compatible meanings under `pagedjax:`) and
snapshot records the console renders.

Each engine owns its CollectorRegistry, so several engines (tests) never collide. Events
(tokens, latencies, finished requests) are counted where they happen; the scheduler's and
block pool's state (queue lengths, KV blocks, prefix-cache and preemption totals, compiled
programs) is read when Prometheus scrapes, by `EngineStateCollector`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from collections.abc import Sequence

    import numpy as np

    from runtime.config import EvictionAlert

    from runtime.core.block_pool import BlockPool
    from runtime.core.scheduler import Scheduler

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                   1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
P = "pagedjax:"
V = "vllm:"  # the model-server protocol series llm-d's endpoint picker scrapes (vLLM's names)


@dataclass(frozen=True)
class EngineState:
    """What the collector reports: the scheduler's and pool's live values at one scrape."""

    running: int
    waiting: int              # incl. preempted
    preempted: int
    kv_usage: float           # 0-1
    used_blocks: int
    cached_blocks: int
    free_blocks: int          # free and not holding cached data
    prefix_queries: int       # cumulative totals from here on
    prefix_hits: int
    evictions: int
    preemptions: int
    compilations: int
    swapped_out: int = 0          # preemptions whose KV went to the host tier
    recomputed_tokens: int = 0    # tokens recomputed because a preemption dropped their KV

    @classmethod
    def read(cls, scheduler: "Scheduler", pool: "BlockPool", compilations: Callable[[], int]) -> "EngineState":
        """Without the engine lock: each value is one attribute read, so a scrape (on the web
        server's event loop) never waits for a step; values may straddle a step, as any scrape does."""
        s, c = scheduler, scheduler.counters
        used, cached = pool.num_used_blocks, pool.num_cached_blocks
        return cls(len(s.running), s.num_waiting, len(s.resumed), pool.usage(), used, cached,
                   max(0, pool.num_free_blocks - cached), c.prefix_queries, c.prefix_hits, pool.num_evictions,
                   c.preemptions, compilations(), c.swapped_out, c.recomputed_tokens)


class EngineStateCollector(Collector):
    """A prometheus_client collector: reads the engine's state when scraped (nothing to keep
    in step with it). The `vllm:` series repeat the `pagedjax:` ones under vLLM's names."""

    def __init__(self, read: Callable[[], EngineState]) -> None:
        self.read = read
        self.created = time.time()  # the counters' _created, as prometheus_client's Counter has it

    def collect(self) -> Iterator[Metric]:
        st = self.read()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=value, created=self.created)

        yield gauge(P + "num_requests_running", "Requests in the running batch", st.running)
        yield gauge(P + "num_requests_waiting", "Requests waiting (incl. preempted)", st.waiting)
        yield gauge(P + "num_requests_preempted", "Preempted requests waiting to resume", st.preempted)
        yield gauge(P + "kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)", st.kv_usage)
        blocks = GaugeMetricFamily(P + "kv_blocks", "KV blocks by state", labels=["state"])
        for state, n in (("used", st.used_blocks), ("cached", st.cached_blocks), ("free", st.free_blocks)):
            blocks.add_metric([state], n)
        yield blocks
        yield counter(P + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache", st.prefix_queries)
        yield counter(P + "prefix_cache_hits", "Prompt tokens served by the prefix cache", st.prefix_hits)
        yield counter(P + "prefix_cache_evictions", "Cached blocks reused for new data", st.evictions)
        yield counter(P + "num_preemptions", "Preemptions (recompute or swap)", st.preemptions)
        yield counter(P + "preemption_swaps", "Preemptions whose KV went to the host tier and back", st.swapped_out)
        yield counter(P + "preemption_recomputed_tokens", "Tokens computed again because a preemption dropped "
                      "their KV", st.recomputed_tokens)
        yield gauge(P + "compilations_total", "XLA programs built for the engine step", st.compilations)
        yield gauge(V + "num_requests_waiting", "Requests waiting (model-server protocol)", st.waiting)
        yield gauge(V + "num_requests_running", "Requests running (model-server protocol)", st.running)
        yield gauge(V + "kv_cache_usage_perc", "KV cache usage 0-1 (model-server protocol)", st.kv_usage)


class LoraCollector(Collector):
    """LoRA adapters at scrape time (runtime/core/lora.py LoraSlots.snapshot plus the scheduler's
    running and waiting adapters): vLLM's lora_requests_info and per-adapter totals."""

    def __init__(self, read: Callable[[], dict]) -> None:
        self.read = read
        self.created = time.time()

    def collect(self) -> Iterator[Metric]:
        v = self.read()
        info = GaugeMetricFamily(V + "lora_requests_info", "Running and waiting LoRA adapters (vLLM's)",
                                 labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        info.add_metric([str(v["max_loras"]), ",".join(v["running_adapters"]), ",".join(v["waiting_adapters"])],
                        time.time())
        yield info
        reqs = CounterMetricFamily(P + "lora_requests", "Requests that named each LoRA adapter", labels=["adapter"],
                                   created=self.created)
        toks = CounterMetricFamily(P + "lora_generation_tokens", "Tokens generated under each LoRA adapter (finished "
                                   "requests)", labels=["adapter"], created=self.created)
        for a in v["adapters"]:
            reqs.add_metric([a["name"]], a["requests"])
            toks.add_metric([a["name"]], a["tokens"])
        yield reqs
        yield toks
        yield GaugeMetricFamily(P + "lora_adapters_loaded", "LoRA adapters served", value=len(v["adapters"]))
        yield GaugeMetricFamily(P + "lora_slots_used", "Device slots holding an adapter",
                                value=sum(s["adapter"] is not None for s in v["slots"]))
        yield CounterMetricFamily(P + "lora_slot_loads", "Adapters written into a device slot", value=v["swaps_in"],
                                  created=self.created)


class EngineMetrics:
    def __init__(self, read_state: Callable[[], EngineState] | None = None) -> None:
        r = self.registry = CollectorRegistry()
        if read_state is not None:
            r.register(EngineStateCollector(read_state))
        self.evicted_block_age = Histogram(P + "prefix_cache_evicted_block_age_seconds",
                                           "Time an evicted block sat cached", buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prefill tokens processed", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Generated tokens", registry=r)
        self.request_success = Counter(P + "request_success", "Finished requests", ["finished_reason"], registry=r)
        self.admission_rejections = Counter(P + "admission_rejections", "Requests refused at admission",
                                            ["reason"], registry=r)
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
        # Disaggregated prefill/decode (runtime/core/disagg.py): bytes out of a prefill replica and
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
        # Speculative decoding (runtime/core/speculative.py), per method, under both names.
        self.spec_drafts = [Counter(x + "spec_decode_num_drafts", "Verifications of one or more proposals",
                                    ["method"], registry=r) for x in (P, V)]
        self.spec_draft_tokens = [Counter(x + "spec_decode_num_draft_tokens", "Proposed tokens verified",
                                          ["method"], registry=r) for x in (P, V)]
        self.spec_accepted_tokens = [Counter(x + "spec_decode_num_accepted_tokens", "Proposed tokens kept",
                                             ["method"], registry=r) for x in (P, V)]
        self.spec_accepted_per_pos = [Counter(x + "spec_decode_num_accepted_tokens_per_pos",
                                              "Proposed tokens kept, by their position in the proposal",
                                              ["method", "position"], registry=r) for x in (P, V)]
        # The eviction rate over its window (runtime/core/metrics.py eviction_signal) and its state.
        self.eviction_series = EvictionSeries()
        self.eviction_rate = Gauge(P + "kv_eviction_rate", "Blocks of in-flight or recently used prefixes lost / "
                                   "blocks allocated, over the eviction window", registry=r)
        self.eviction_state = Gauge(P + "kv_eviction_state", "0 ok, 1 warn, 2 alert (the eviction rate against "
                                    "its thresholds)", registry=r)
        # The host KV tier (runtime/core/kv_tiers.py): what it holds and the prefix hits it served.
        self.tier_bytes = Gauge(P + "kv_tier_bytes", "Bytes held by a lower KV tier", ["tier"], registry=r)
        self.tier_blocks = Gauge(P + "kv_tier_blocks", "Blocks held by a lower KV tier", ["tier"], registry=r)
        self.tier_hit_blocks = Gauge(P + "kv_tier_hit_blocks", "Blocks a lower KV tier served back (prefix hits "
                                     "of that tier), since start", ["tier"], registry=r)
        # A mixture of experts (runtime/model/families/moe.py): routing balance per step.
        self.expert_imbalance = Gauge(P + "moe_expert_load_imbalance",
                                      "Last step's max / mean tokens per expert, averaged over the expert layers "
                                      "(1 = even)", registry=r)
        self.expert_tokens = Counter(P + "moe_expert_tokens", "(token, layer) pairs routed to each expert",
                                     ["expert"], registry=r)
        # Service-level targets (AdmissionPolicy.slo_*_s) and the admission quote's self-check.
        self.slo_attainment = Gauge(P + "slo_attainment", "Share of requests (ttft) or tokens (itl) meeting the "
                                    "tier's target over the window", ["tier", "metric", "window"], registry=r)
        self.quote_within = Gauge(P + "admission_quote_ttft_within_30", "Share of recent requests whose TTFT was "
                                  "within 30% of the admission quote's prediction (an average)", registry=r)
        self.quote_calibration = Gauge(P + "admission_quote_ttft_bias", "Measured / predicted TTFT of recent "
                                       "requests (a geometric average)", registry=r)
        self.vllm_cache_config = Gauge(V + "cache_config_info", "KV cache configuration (model-server protocol)",
                                       ["block_size", "num_gpu_blocks"], registry=r)
        self.window = RecentWindow()

    def count_speculation(self, method: str, proposed: int, accepted: int) -> None:
        for c in self.spec_drafts:
            c.labels(method).inc()
        for c in self.spec_draft_tokens:
            c.labels(method).inc(proposed)
        for c in self.spec_accepted_tokens:
            c.labels(method).inc(accepted)
        for c in self.spec_accepted_per_pos:  # (kept proposals are a leading run: positions 0..accepted-1)
            for pos in range(accepted):
                c.labels(method, str(pos)).inc()

    def count_expert_load(self, load: ExpertLoad) -> None:
        """After a step of a mixture of experts: its balance, and the tokens each expert took."""
        value = load.imbalance()
        if value is not None:  # (a step too small to say leaves the last value)
            self.expert_imbalance.set(value)
        for e, n in enumerate(load.last[list(load.moe_layers)].sum(axis=0).tolist()):
            if n:
                self.expert_tokens.labels(str(e)).inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)


EVICTION_STATES = ("ok", "warn", "alert")
EVICTION_ADVICE = {
    "ok": "",
    "warn": "KV blocks of live prefixes are being evicted: watch TTFT; raise the KV budget (--kv-cache-memory) "
            "or tighten admission (watermark, max sequences) before it reaches the alert level.",
    "alert": "Underprovisioned for this context-length mix: raise the KV budget (--kv-cache-memory), tighten "
             "admission (watermark, max sequences, reserve mode), or add a replica.",
}


@dataclass(frozen=True)
class EvictionSignal:
    rate: float | None   # lost / allocated over the window; None: nothing allocated in it
    lost: int
    allocated: int
    state: str           # EVICTION_STATES

    @property
    def advice(self) -> str:
        return EVICTION_ADVICE[self.state]


class EvictionSeries:
    """The pool's (allocated, lost) totals sampled at most once a second, kept as far back as
    the eviction window reaches (one sample before it): what eviction_signal reads, whatever
    the step rate."""

    def __init__(self) -> None:
        self.samples: deque[tuple[float, int, int]] = deque()

    def add(self, t: float, allocated: int, lost: int, window_s: float) -> None:
        if not self.samples or t - self.samples[-1][0] >= 1.0:
            self.samples.append((t, allocated, lost))
        while len(self.samples) > 1 and self.samples[1][0] < t - window_s:
            self.samples.popleft()


def eviction_signal(samples: "Sequence[tuple[float, int, int]]", now: float, allocated: int, lost: int,
                    alert: "EvictionAlert") -> EvictionSignal:
    """The eviction rate over the last alert.window_s seconds: the blocks lost since the last
    (t, allocated, lost) sample before the window (the oldest if none is that old) over the
    blocks allocated since then, the totals now being `allocated` and `lost`; and its state
    against alert.warn / alert.alert."""
    if not samples:
        return EvictionSignal(None, 0, 0, "ok")
    base = next((x for x in reversed(samples) if x[0] < now - alert.window_s), samples[0])
    lost, allocated = lost - base[2], allocated - base[1]
    rate = lost / allocated if allocated > 0 else None
    state = ("alert" if rate is not None and rate >= alert.alert else
             "warn" if rate is not None and rate >= alert.warn else "ok")
    return EvictionSignal(rate, lost, allocated, state)


class ExpertLoad:
    """A mixture of experts' routing, as the steps report it (runtime/model/runner.py
    expert_load): tokens per expert of each layer in the last step and since start, and the
    balance the console and the `moe_expert_load_imbalance` gauge show. Host-side numpy,
    updated under the engine lock at each step's read-back."""

    def __init__(self, num_layers: int, num_experts: int, moe_layers: tuple[int, ...]) -> None:
        import numpy as np

        self.moe_layers = moe_layers
        self.last = np.zeros((num_layers, num_experts), np.int64)
        self.total = np.zeros((num_layers, num_experts), np.int64)
        self.steps = 0

    def add(self, load: "np.ndarray") -> None:
        self.last = load.astype(self.total.dtype)
        self.total += self.last
        self.steps += 1

    def imbalance(self, load: "np.ndarray | None" = None) -> float | None:
        """max / mean tokens per expert, averaged over the expert layers (1.0: perfectly even;
        E / k at worst, every token on the same k experts). Layers that routed fewer (token,
        expert) pairs than they have experts are left out: there max / mean cannot fall below
        E / pairs however even the routing (one decoding token: E / k). None when no layer
        routed enough."""
        import numpy as np

        rows = (self.last if load is None else load)[list(self.moe_layers)]
        ok = rows.sum(axis=1) >= rows.shape[1]
        return float(np.mean(rows.max(axis=1)[ok] / rows.mean(axis=1)[ok])) if ok.any() else None

    def view(self) -> dict:
        """Copies for the console (under the engine lock): per expert layer its last-step
        and total balance, and every expert's total over the layers."""
        per_layer = [(layer, self.imbalance_row(self.last[layer]), self.imbalance_row(self.total[layer]))
                     for layer in self.moe_layers]  # (None where a layer routed too few pairs to say)
        return {"steps": self.steps, "last": self.imbalance(), "total": self.imbalance(self.total),
                "per_layer": per_layer, "per_expert": self.total[list(self.moe_layers)].sum(axis=0).tolist()}

    @staticmethod
    def imbalance_row(row: "np.ndarray") -> float | None:
        return float(row.max()) / float(row.mean()) if row.sum() >= len(row) else None


SLO_WINDOWS = (60.0, 300.0)  # seconds the dashboard and /metrics report attainment over


@dataclass
class SLOSample:
    t: float          # monotonic
    tier: str         # interactive | batch
    kind: str         # ttft | itl
    seconds: float


def slo_attainment(samples: Any, policy: Any, now: float, window_s: float) -> dict[tuple[str, str], tuple[int, int]]:
    """(tier, "ttft" | "itl") -> (met, total) over the last `window_s` seconds, for the tiers
    and kinds with a target in `policy` (AdmissionPolicy.slo_*_s > 0): the one place the rule
    lives. A request's TTFT is met when it is at most the target; each token gap likewise."""
    out: dict[tuple[str, str], list[int]] = {}
    targets = {(tier, kind): getattr(policy, f"slo_{kind}_{tier}_s") for tier in ("interactive", "batch")
               for kind in ("ttft", "itl")}
    for key, target in targets.items():
        if target > 0:
            out[key] = [0, 0]
    cutoff = now - window_s
    for s in reversed(samples):
        if s.t < cutoff:
            break
        acc = out.get((s.tier, s.kind))
        if acc is not None:
            acc[1] += 1
            acc[0] += s.seconds <= targets[(s.tier, s.kind)]
    return {k: (v[0], v[1]) for k, v in out.items()}


@dataclass
class RecentWindow:
    """Short in-memory history for the console's charts and percentiles."""

    horizon_s: float = 300.0
    ttft: deque = field(default_factory=lambda: deque(maxlen=2048))         # (t, seconds)
    itl: deque = field(default_factory=lambda: deque(maxlen=8192))          # (t, seconds)
    steps: deque = field(default_factory=lambda: deque(maxlen=4096))        # StepSample
    slo: deque = field(default_factory=lambda: deque(maxlen=65536))         # SLOSample (TTFTs and token gaps by tier)

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

