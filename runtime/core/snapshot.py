"""The engine's read model: point-in-time copies for the operator console, the
`/admin/*.json` routes and (later) the fleet page, as plain frozen data (no JAX).

Every function here holds the engine's lock only while copying the few fields it needs;
records are built, aggregated and formatted after the lock is released, so a console
viewer never stalls the engine thread. Reads stay cheap at 50k blocks: copying every
BlockInfo (pool.snapshot()) takes ~0.2 s, so the block map is one bytes object of state
codes, BlockViews are made only for a requested id range, and prefix chains copy only
hashed blocks.

This module never imports the engine (which imports it): functions take any object with
the engine's parts (`EngineParts`); LLMEngine is one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from runtime.core import capacity
from runtime.core.block_pool import BLOCK_STATES, BlockHash, block_state

if TYPE_CHECKING:
    from runtime.core.block_pool import BlockPool
    from runtime.config import AdmissionPolicy
    from runtime.core.metrics import EngineMetrics, StepSample
    from runtime.core.scheduler import Scheduler

__all__ = ["BLOCK_STATES", "BlockView", "EngineParts", "EngineSnapshot", "HashedBlock", "MetricsWindow",
           "ModelInfo", "RequestView", "block_states", "block_views", "hashed_blocks", "metrics_window",
           "model_info", "prefix_chains", "take_snapshot"]


class EngineParts(Protocol):
    """What the read model copies from."""

    lock: Any                    # the engine's RLock (reentrant: callers may hold it already)
    pool: BlockPool
    scheduler: Scheduler
    metrics: EngineMetrics

    @property
    def policy(self) -> AdmissionPolicy: ...


@dataclass(frozen=True)
class BlockView:
    block_id: int
    state: str                  # free | cached | used | shared (runtime.core.block_pool.block_state)
    ref_count: int
    owners: tuple[str, ...]     # request ids holding it
    cached_hash: bool           # holds a prefix-cache hash
    age_s: float                # since last use
    hits: int


@dataclass(frozen=True)
class RequestView:
    request_id: str
    state: str
    priority: str
    prompt_tokens: int
    generated_tokens: int
    cached_tokens: int
    blocks: int
    age_s: float
    ttft_s: float | None
    preemptions: int
    spec_proposed: int = 0      # speculative decoding: tokens proposed for it, verified
    spec_accepted: int = 0      # of which kept
    swapped: bool = False       # preempted with its KV in the host tier (swap preemption)
    latest: str = ""            # its ledger's latest decision, "kind: reason" (runtime/core/ledger.py)


@dataclass(frozen=True)
class EngineSnapshot:
    time: float
    num_blocks: int
    block_size: int
    used_blocks: int
    cached_blocks: int
    free_blocks: int            # neither used nor cached
    watermark_blocks: int       # kept free while the engine is busy (runtime/core/capacity.py)
    blocks: list[BlockView]
    requests: list[RequestView]
    policy: dict[str, Any]
    prefix_queries: int
    prefix_hits: int
    evictions: int
    preemptions: int
    rejections: dict[str, int] = field(default_factory=dict)
    evicted_ages: tuple[float, ...] = ()    # the most recent evictions' ages (bounded)
    evicted_age_total: float = 0.0          # sum over every eviction
    spec_proposed: int = 0                  # speculative decoding: proposed tokens verified
    spec_accepted: int = 0                  # of which kept
    swapped_out: int = 0                    # preemptions whose KV went to the host tier
    recomputed_tokens: int = 0              # tokens computed again because a preemption dropped their KV

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    @property
    def evicted_age_mean(self) -> float | None:
        return self.evicted_age_total / self.evictions if self.evictions else None


@dataclass(frozen=True)
class HashedBlock:
    """A block holding a prefix-cache hash, with its link to the previous block."""

    block_id: int
    block_hash: BlockHash
    parent_hash: BlockHash | None   # None: a prompt's first block
    token_ids: tuple[int, ...]
    hits: int
    ref_count: int


@dataclass(frozen=True)
class MetricsWindow:
    """The engine's recent history (runtime.core.metrics.RecentWindow), copied."""

    steps: tuple[StepSample, ...]
    ttft: tuple[tuple[float, float], ...]   # (monotonic time, seconds)
    itl: tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class ModelInfo:
    """What the model page shows beside the engine's config."""

    attention_backend: str
    attention_kernel: bool      # decode rows on the C++ kernel
    matmul_kernel: bool         # int8 products on the C++ kernel
    kv_cache_bytes: int
    compilations_at_ready: int
    warmup_s: float
    tensor_parallel: int = 1
    mesh: str = ""              # e.g. "tp=4 over cpu:0, cpu:1, cpu:2, cpu:3" (empty at TP 1)


def _owners(src: EngineParts) -> dict[int, tuple[str, ...]]:
    """block id -> ids of the running requests holding it (caller holds the lock)."""
    owners: dict[int, list[str]] = {}
    for r in src.scheduler.running:
        for b in r.held_blocks():  # (every KV group's pages)
            owners.setdefault(b, []).append(r.request_id)
    return {b: tuple(ids) for b, ids in owners.items()}


def _age(now: float, last_used: float) -> float:
    return max(0.0, now - last_used) if last_used else 0.0


def block_states(src: EngineParts) -> bytes:
    """Every block's state code (index into BLOCK_STATES), one byte per block."""
    with src.lock:
        return bytes(block_state(i.ref_count, i.block_hash is not None) for i in src.pool.infos)


def block_views(src: EngineParts, start: int, stop: int) -> list[BlockView]:
    """BlockViews for ids [start, stop), without copying the rest of the pool."""
    now = time.monotonic()
    with src.lock:
        owners = _owners(src)
        rows = [(i.block_id, i.ref_count, i.block_hash is not None, i.last_used, i.hits)
                for i in src.pool.infos[max(0, start):max(0, stop)]]
    return [BlockView(b, BLOCK_STATES[block_state(rc, h)], rc, owners.get(b, ()), h, _age(now, lu), hits)
            for b, rc, h, lu, hits in rows]


def hashed_blocks(src: EngineParts) -> list[HashedBlock]:
    """Every block holding a prefix-cache hash (cached, or used and reusable) in KV group 0:
    the other groups cache the same hashes in their own pages, and a prefix chain follows
    one group's links."""
    with src.lock:
        rows = [(i.block_id, i.block_hash, i.parent_hash, i.token_ids, i.hits, i.ref_count)
                for i in src.pool.infos if i.block_hash is not None and i.group == 0]
    return [HashedBlock(*r) for r in rows]


def prefix_chains(blocks: Sequence[HashedBlock], k: int = 10, max_len: int = 4096
                  ) -> list[tuple[HashedBlock, ...]]:
    """The k most-hit reused prompt prefixes: from each first block hit at least once,
    follow the parent links forward to the most-hit child while that child was hit too
    (the part later prompts reused). A block whose parent was evicted is never reached,
    so no prefix is shown starting mid-prompt."""
    best_child: dict[BlockHash, HashedBlock] = {}
    for b in blocks:
        if b.parent_hash is not None:
            cur = best_child.get(b.parent_hash)
            if cur is None or (b.hits, -b.block_id) > (cur.hits, -cur.block_id):
                best_child[b.parent_hash] = b
    roots = sorted((b for b in blocks if b.parent_hash is None and b.hits > 0), key=lambda b: (-b.hits, b.block_id))
    chains = []
    for root in roots[:k]:
        chain = [root]
        # max_len bounds a (hash-collision) cycle; real chains end at max_model_len.
        while len(chain) < max_len:
            nxt = best_child.get(chain[-1].block_hash)
            if nxt is None or nxt.hits == 0:
                break
            chain.append(nxt)
        chains.append(tuple(chain))
    return chains


def metrics_window(src: EngineParts) -> MetricsWindow:
    w = src.metrics.window
    with src.lock:
        return MetricsWindow(tuple(w.steps), tuple(w.ttft), tuple(w.itl))


def model_info(src: Any) -> ModelInfo:
    """From an engine's runner and warm-up record (immutable after start-up: no lock)."""
    r = src.runner
    mesh = getattr(r, "mesh", None)
    where = "" if mesh is None else f"tp={mesh.devices.size} over " + ", ".join(
        f"{d.platform}:{d.id}" for d in mesh.devices.flat)
    return ModelInfo(r.attention_backend, bool(r.attention_kernel), bool(r.matmul_kernel), r.kv_cache_bytes(),
                     src.compilations_at_ready, src.warmup_seconds, getattr(r, "tp", 1), where)


def take_snapshot(src: EngineParts, with_blocks: bool = True) -> EngineSnapshot:
    """Counts, requests, policy and prefix-cache counters; with_blocks adds a BlockView per
    block (every block: for tests and small pools; the console uses block_states)."""
    now = time.monotonic()
    with src.lock:
        sched, pool = src.scheduler, src.pool
        reqs = [(r.request_id, r.status.value, r.priority, len(r.prompt_ids), len(r.output_ids),
                 max(r.num_cached_tokens, 0), len(r.held_blocks()), now - r.arrival_time,
                 (r.first_token_time - r.arrival_time) if r.first_token_time else None, r.num_preemptions,
                 r.spec.proposed, r.spec.accepted, r.swap is not None,
                 f"{r.ledger.entries[-1].kind}: {r.ledger.entries[-1].reason}" if r.ledger.entries else "")
                for r in [*sched.running, *sched.waiting_requests()]]
        policy = src.policy
        c = sched.counters
        counts = dict(num_blocks=pool.num_blocks, block_size=pool.block_size, used_blocks=pool.num_used_blocks,
                      watermark_blocks=capacity.watermark_blocks(policy, pool.num_blocks),
                      cached_blocks=pool.num_cached_blocks,
                      free_blocks=pool.num_free_blocks - pool.num_cached_blocks,
                      prefix_queries=c.prefix_queries, prefix_hits=c.prefix_hits, evictions=pool.num_evictions,
                      preemptions=c.preemptions, rejections=dict(c.rejections),
                      evicted_ages=tuple(pool.evicted_ages), evicted_age_total=pool.evicted_age_total,
                      spec_proposed=c.spec_proposed, spec_accepted=c.spec_accepted,
                      swapped_out=c.swapped_out, recomputed_tokens=c.recomputed_tokens)
        blocks = block_views(src, 0, pool.num_blocks) if with_blocks else []
    return EngineSnapshot(time=time.time(), blocks=blocks, requests=[RequestView(*r) for r in reqs],
                          policy=policy.to_json(), **counts)
