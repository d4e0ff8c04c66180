"""The host-RAM KV tier (`--kv-offload-memory SIZE`): full prompt blocks the device pool's
prefix cache evicts go down to host memory instead of vanishing, and a waiting request whose
prompt continues past its device-cached prefix into them gets them copied back into device
blocks, registered in the prefix cache, before the scheduler admits it: the scheduler then
sees an ordinary prefix hit and computes only the rest.

One step of an engine with the tier (LLMEngine.step, under the engine lock):

    promote(engine)   waiting requests' host-tier runs -> device blocks (cached, ref 0)
    schedule()        admission and chunks, as without a tier
    offload(engine)   blocks the allocations evicted: their KV read to host before the step
                      launched next overwrites them

Blocks are keyed by the engine's chained block hashes and verified token by token, like the
device cache. The tier is bounded in bytes (least recently used first out) and holds only
blocks a device pool once computed, so it never serves KV another prompt made. Both copies
are synchronous on the host thread, and happen only on steps that evict or promote.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from runtime.core.block_pool import BlockHash
from runtime.core.request import cacheable_blocks

if TYPE_CHECKING:
    from runtime.core.engine import LLMEngine

# Waiting requests (in admission order) whose prompts are looked up in the tier per step: the
# ones the scheduler may admit soon; the others wait for a later step.
PROMOTE_LOOKAHEAD = 8


@dataclass
class HostBlock:
    token_ids: tuple[int, ...]
    parent: BlockHash | None
    arrays: list[np.ndarray]  # per leaf of the KV cache: [L, 1, BS, ...] (runtime/model/runner.py read_blocks)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


class HostTier:
    """Blocks in host RAM under their hash, at most `capacity_bytes` (LRU)."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"kv_offload_memory: must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.blocks: OrderedDict[BlockHash, HostBlock] = OrderedDict()
        self.bytes = 0
        self.stored = 0     # blocks written down, ever
        self.dropped = 0    # blocks pushed out by newer ones
        self.promoted = 0   # blocks copied back up (prefix hits of this tier)

    def put(self, block_hash: BlockHash, block: HostBlock) -> None:
        if block.nbytes > self.capacity_bytes:
            return
        old = self.blocks.pop(block_hash, None)
        if old is not None:
            self.bytes -= old.nbytes
        while self.blocks and self.bytes + block.nbytes > self.capacity_bytes:
            _, out = self.blocks.popitem(last=False)
            self.bytes -= out.nbytes
            self.dropped += 1
        self.blocks[block_hash] = block
        self.bytes += block.nbytes
        self.stored += 1

    def get(self, block_hash: BlockHash, token_ids: Sequence[int]) -> HostBlock | None:
        """The block under `block_hash` if it holds exactly `token_ids` (most recently used now)."""
        block = self.blocks.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        self.blocks.move_to_end(block_hash)
        return block


def offload(engine: "LLMEngine") -> int:
    """Copy the KV of the cached blocks the pool evicted since the last call (it logged them
    before reusing them) into the host tier; their device contents are intact until the next
    launched step writes them. Returns the blocks copied."""
    from runtime.model.runner import read_blocks

    log, engine.pool.offload_log = engine.pool.offload_log, []
    if not log:
        return 0
    arrays = read_blocks(engine.runner, [b for b, *_ in log])
    for i, (_, block_hash, token_ids, parent) in enumerate(log):
        engine.host_tier.put(block_hash, HostBlock(token_ids, parent, [a[:, i:i + 1].copy() for a in arrays]))
    return len(log)


def promote(engine: "LLMEngine") -> int:
    """For the next waiting requests: the blocks of the prompt that follow its device-cached
    prefix and sit in the host tier, written into free device blocks and registered as cached
    (the allocation's own evictions offloaded first). Only into free blocks above the
    watermark, so a promotion never crowds out what admission would keep. Returns the blocks
    promoted."""
    from runtime.core import capacity
    from runtime.model.runner import write_blocks

    pool, tier, sched = engine.pool, engine.host_tier, engine.scheduler
    bs, total = pool.block_size, 0
    for req in sched.waiting_requests()[:PROMOTE_LOOKAHEAD]:
        if not req.uses_prefix_cache or req.num_computed_tokens:
            continue
        req.extend_block_hashes(bs)
        hashes = req.block_hashes[:cacheable_blocks(req.num_tokens, bs)]
        tokens = req.token_ids
        held = pool.lookup_prefix(hashes, tokens)
        start = len(held)
        run: list[HostBlock] = []
        for i in range(start, len(hashes)):
            block = tier.get(hashes[i], tokens[i * bs:(i + 1) * bs])
            if block is None:
                break
            run.append(block)
        if not run:
            continue
        pool.touch(held)  # the device prefix the run extends must not be what its allocation evicts
        room = pool.num_free_blocks - capacity.watermark_blocks(engine.policy, pool.num_blocks)
        run = run[:max(0, room)]
        if not run:
            pool.free(held)
            continue
        targets = pool.allocate(len(run))
        offload(engine)  # (what this allocation evicted, before it is overwritten)
        write_blocks(engine.runner, targets, [np.concatenate([b.arrays[k] for b in run], axis=1)
                                              for k in range(len(run[0].arrays))])
        for i, block_id in enumerate(targets, start):
            pool.cache_block(block_id, hashes[i], tokens[i * bs:(i + 1) * bs], hashes[i - 1] if i else None)
        pool.free(held + targets)  # cached now: the scheduler's lookup takes them as a prefix hit
        tier.promoted += len(run)
        total += len(run)
    return total


def stats(tier: HostTier | None) -> dict[str, Any]:
    """The tier's numbers for the console and /metrics (zeros without a tier)."""
    if tier is None:
        return {"enabled": False, "capacity_bytes": 0, "bytes": 0, "blocks": 0, "stored": 0, "dropped": 0,
                "promoted": 0}
    return {"enabled": True, "capacity_bytes": tier.capacity_bytes, "bytes": tier.bytes, "blocks": len(tier.blocks),
            "stored": tier.stored, "dropped": tier.dropped, "promoted": tier.promoted}
