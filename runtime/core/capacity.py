"""The KV capacity rule: whether a request fits, written once.

The scheduler's admission (runtime/core/scheduler.py `_admit`), a disaggregated decode's
reservation (runtime/core/disagg.py `reserve`), the fleet's routing stats
(runtime/fleet/replica.py `replica_stats`) and the read model (runtime/core/snapshot.py) all
ask this module, so a reservation that succeeds is admitted and the router sees the room
the replica's own admission will see.

The rule. A request claims blocks for its tokens: prompt + max_tokens in `reserve` mode
(which never preempts, so it must hold its whole budget up front), the tokens it has now
in `optimistic` mode; its prefix-cache hits are already there. Those blocks come out of
the allocatable ones (free and evictable cached), less the cached hits that taking them
revives, plus the pinned blocks its admission frees, less the growth already promised to
running requests (reserve mode); and the watermark must stay free after it -- except on
an idle engine (never starve it) and for blocks reserved earlier (they passed the
watermark when they were reserved).

KV groups (runtime/kv_groups.py): blocks are counted per group and summed, as they all
come out of the one pool. A sliding group claims only what its window keeps: the blocks from
the window before its first computed token on (optimistic), or the most it ever holds at
once (reserve, `KVGroups.max_live_blocks`). `groups=None` is the one full group of a model
without sliding layers, whose arithmetic is exactly the per-block rule above.

Plain host arithmetic over the pool's counters: no JAX, cheap enough to run per admission.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

from runtime.kv_groups import KVGroups

if TYPE_CHECKING:
    from runtime.core.block_pool import BlockPool
    from runtime.config import AdmissionPolicy
    from runtime.core.request import Request

__all__ = ["Headroom", "blocks_for", "claim_blocks", "claim_tokens", "headroom", "never_fits", "promised_blocks",
           "promised_growth", "watermark_blocks"]


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def watermark_blocks(policy: "AdmissionPolicy", num_blocks: int) -> int:
    """Blocks admission keeps free while the engine is busy (room for running requests to grow)."""
    return math.ceil(policy.watermark * num_blocks)


def claim_tokens(num_tokens: int, max_total_tokens: int, admission_mode: str) -> int:
    """The tokens a request must find blocks for to be admitted."""
    return max_total_tokens if admission_mode == "reserve" else num_tokens


def claim_blocks(groups: KVGroups | None, block_size: int, *, start: int, num_tokens: int, max_total_tokens: int,
                 admission_mode: str, chunk: int) -> int:
    """Blocks (pages, all groups) a request must hold to be admitted, its prefix hits among
    them: `start` is its first token to compute (the hit point), `chunk` the most tokens
    one step computes for it. One full group: blocks for `claim_tokens`."""
    if groups is None:
        return blocks_for(claim_tokens(num_tokens, max_total_tokens, admission_mode), block_size)
    if admission_mode == "reserve":
        return groups.pages_for(max_total_tokens, chunk, block_size)
    # Optimistic: the prompt's blocks, each group counting what it holds at most while the
    # prompt is computed from `start` in chunks (a sliding group releases as it goes).
    return sum(min(groups.live_blocks(g, start, num_tokens, block_size),
                   groups.max_live_blocks(g, num_tokens, chunk, block_size)) for g in range(groups.num_groups))


def never_fits(max_total_tokens: int, max_model_len: int, pool: "BlockPool", groups: KVGroups | None = None,
               chunk: int = 0) -> str | None:
    """Why prompt + max_tokens can never run here ("context": past max_model_len; "cache":
    more blocks than the whole pool), or None. Checked when a request arrives, not at
    admission: waiting would not help."""
    if max_total_tokens > max_model_len:
        return "context"
    need = (blocks_for(max_total_tokens, pool.block_size) if groups is None
            else groups.pages_for(max_total_tokens, chunk, pool.block_size))
    if need > pool.num_blocks:
        return "cache"
    return None


def _held(r: "Request") -> int:
    return sum(1 for t in r.block_tables for b in t if b >= 0)


def promised_growth(running: Iterable["Request"], admission_mode: str, block_size: int,
                    groups: KVGroups | None = None, chunk: int = 0) -> int:
    """Blocks running requests may still grow into that admission must leave them: their
    whole budget in reserve mode; nothing in optimistic mode (which preempts instead)."""
    if admission_mode != "reserve":
        return 0
    return sum(max(0, claim_blocks(groups, block_size, start=0, num_tokens=0, max_total_tokens=r.max_total_tokens(),
                                   admission_mode="reserve", chunk=chunk) - _held(r)) for r in running)


def promised_blocks(running: Iterable["Request"], waiting: Iterable["Request"], admission_mode: str,
                    block_size: int, groups: KVGroups | None = None, chunk: int = 0) -> int:
    """Blocks already spoken for, for the router: the growth promised to running requests
    and what each waiting request claims (its hits not subtracted: they may be evicted
    before it is admitted)."""
    return promised_growth(running, admission_mode, block_size, groups, chunk) + sum(
        claim_blocks(groups, block_size, start=0, num_tokens=r.num_tokens, max_total_tokens=r.max_total_tokens(),
                     admission_mode=admission_mode, chunk=chunk)
        for r in waiting)


@dataclass(frozen=True)
class Headroom:
    need: int        # blocks to allocate beyond the prefix hits
    available: int   # blocks it may take them from (see `headroom`)
    kept_free: int   # blocks that must stay free after it (the watermark, or 0)

    @property
    def fits(self) -> bool:
        return self.available - self.need >= self.kept_free


def headroom(pool: "BlockPool", policy: "AdmissionPolicy", *, num_tokens: int, max_total_tokens: int,
             hits: Sequence[int], promised: int, engine_busy: bool, pinned: Sequence[int] = (),
             groups: KVGroups | None = None, hit_tokens: int | None = None, chunk: int = 0) -> Headroom:
    """The admission check for one request (see the module docstring). `hits`: its prefix
    hits (the block ids it takes, every group's); `promised`: `promised_growth` of the
    running requests (plus those admitted earlier in the same step); `pinned`: blocks
    reserved for it (runtime/core/disagg.py), which admission hands back to the pool except
    those its hits take over. With `groups`: `hit_tokens` is where its computation starts
    (the hit point) and `chunk` the most tokens a step computes for it."""
    start = len(hits) * pool.block_size if hit_tokens is None else hit_tokens
    need = claim_blocks(groups, pool.block_size, start=start, num_tokens=num_tokens, max_total_tokens=max_total_tokens,
                        admission_mode=policy.admission_mode, chunk=chunk) - len(hits)
    revived = sum(1 for b in hits if pool.ref_count(b) == 0)  # cached hits leave the free queue
    hit = set(hits)
    freed = sum(1 for b in pinned if b not in hit and pool.ref_count(b) == 1)  # (shared ones stay held)
    available = pool.num_free_blocks - revived + freed - promised
    kept_free = watermark_blocks(policy, pool.num_blocks) if engine_busy and not pinned else 0
    return Headroom(need, available, kept_free)
