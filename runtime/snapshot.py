"""Point-in-time views of the engine for the operator console (plain data, no JAX)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.engine import LLMEngine


@dataclass(frozen=True)
class BlockView:
    block_id: int
    state: str                  # free | cached | used | shared
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


@dataclass(frozen=True)
class EngineSnapshot:
    time: float
    num_blocks: int
    block_size: int
    used_blocks: int
    cached_blocks: int
    free_blocks: int            # neither used nor cached
    watermark_blocks: int
    blocks: list[BlockView]
    requests: list[RequestView]
    policy: dict[str, Any]
    prefix_queries: int
    prefix_hits: int
    evictions: int
    preemptions: int
    rejections: dict[str, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


def take_snapshot(engine: "LLMEngine", with_blocks: bool = True) -> EngineSnapshot:
    """Caller holds engine.lock."""
    now = time.monotonic()
    sched, pool = engine.scheduler, engine.pool
    owners: dict[int, list[str]] = {}
    for r in sched.running:
        for b in r.block_ids:
            owners.setdefault(b, []).append(r.request_id)
    blocks = []
    if with_blocks:
        for info in pool.snapshot():
            if info.ref_count > 1:
                state = "shared"
            elif info.ref_count == 1:
                state = "used"
            elif info.block_hash is not None:
                state = "cached"
            else:
                state = "free"
            blocks.append(BlockView(info.block_id, state, info.ref_count, tuple(owners.get(info.block_id, ())),
                                    info.block_hash is not None, max(0.0, now - info.last_used)
                                    if info.last_used else 0.0, info.hits))
    reqs = [RequestView(r.request_id, r.status.value, r.priority, len(r.prompt_ids), len(r.output_ids),
                        max(r.num_cached_tokens, 0), len(r.block_ids), now - r.arrival_time,
                        (r.first_token_time - r.arrival_time) if r.first_token_time else None, r.num_preemptions)
            for r in [*sched.running, *sched.waiting_requests()]]
    policy = engine.policy
    c = sched.counters
    import math
    return EngineSnapshot(
        time=time.time(), num_blocks=pool.num_blocks, block_size=pool.block_size,
        used_blocks=pool.num_used_blocks, cached_blocks=pool.num_cached_blocks,
        free_blocks=pool.num_free_blocks - pool.num_cached_blocks,
        watermark_blocks=math.ceil(policy.watermark * pool.num_blocks), blocks=blocks, requests=reqs,
        policy=policy.to_json(), prefix_queries=c.prefix_queries, prefix_hits=c.prefix_hits,
        evictions=pool.num_evictions, preemptions=c.preemptions, rejections=dict(c.rejections))
