"""Host-side KV block accounting: ref counts, LRU free queue and the prefix cache.

The device holds KV arrays indexed by block id; this module only decides which ids
are in use, which can be reused on a prefix hit, and which to evict next.
See DESIGN.md, "KV cache and prefix cache".

Block states (derived, never stored; `block_state` is the one definition, which the
pool's counters, the console and the read model in runtime/core/snapshot.py all follow):
  used   -- ref_count == 1
  shared -- ref_count > 1 (a prefix hit: several requests read it)
  cached -- ref_count == 0 and has a hash (reusable on a prefix hit until evicted)
  free   -- ref_count == 0 and no hash
"Used" in the pool's counters means ref_count > 0 (used or shared).
Cached and free blocks share one free queue in LRU order: allocation takes the head,
freeing appends to the tail, so the block untouched for longest is evicted first.

KV groups (runtime/kv_groups.py): a model with sliding-window layers keeps one block
table per group of layers, all drawing pages from this one pool. A page caches under
(group, hash): the same prompt block has one page per group, each reusable on its own (a
sliding group's early pages are released while the full groups' stay). `group` defaults to
0, the only group of a model without sliding layers.

Residency events: with `record_events()` the pool logs every change to what its prefix
cache can serve (a block stored under a hash, a hash evicted or flushed) so a fleet
router can keep an exact view of which prefixes live on which replica
(runtime/core/kv_events.py turns them into vLLM's KV-event format).
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Sequence

BlockHash = bytes

# Evicted-age samples kept for metrics (percentiles); the total is unbounded.
EVICTED_AGES_MAXLEN = 1024

_struct_cache: dict[int, struct.Struct] = {}


def _pack_tokens(token_ids: Sequence[int]) -> bytes:
    # Fixed little-endian int32 so hashes are identical across hosts and processes
    # (unlike hash() or native-endian arrays).
    n = len(token_ids)
    s = _struct_cache.get(n)
    if s is None:
        s = _struct_cache[n] = struct.Struct(f"<{n}i")
    return s.pack(*token_ids)


def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple = ()
) -> BlockHash:
    """sha256 of (parent, tokens, extra keys); chaining makes it cover the whole prefix."""
    h = hashlib.sha256()
    # Framing (presence byte, token count) keeps distinct inputs from concatenating
    # to the same byte string, e.g. a root block vs. a child whose parent hash
    # happens to look like a token prefix.
    if parent is None:
        h.update(b"\x00")
    else:
        h.update(b"\x01")
        h.update(parent)
    h.update(struct.pack("<I", len(token_ids)))
    h.update(_pack_tokens(token_ids))
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def hash_prompt_blocks(
    token_ids: Sequence[int], block_size: int, extra_keys: tuple = ()
) -> list[BlockHash]:
    """Chained hashes of every full block of token_ids (a partial tail block is never cached)."""
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], extra_keys)
        hashes.append(parent)
    return hashes


# State codes (index = code): small ints so a whole pool's states fit in one bytes object.
BLOCK_STATES = ("free", "cached", "used", "shared")
FREE, CACHED, USED, SHARED = range(4)


def block_state(ref_count: int, cached: bool) -> int:
    """The state code of a block with this ref count, holding a prefix-cache hash or not."""
    return SHARED if ref_count > 1 else USED if ref_count == 1 else CACHED if cached else FREE


class NoFreeBlocks(Exception):
    """Fewer allocatable blocks than requested; the pool was left unchanged."""


@dataclass(slots=True)
class BlockInfo:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    # Kept with the hash so a hit can be verified token by token (hash collisions).
    token_ids: tuple[int, ...] | None = None
    last_used: float = 0.0  # clock time of last free/touch, for eviction age
    hits: int = 0  # prefix hits since this block was last (re)allocated
    # The previous block's hash when this one was cached (None: a prompt's first block).
    # Prefix chains are followed by these links; set and cleared with block_hash.
    parent_hash: BlockHash | None = None
    group: int = 0  # the KV group whose hash it carries (meaningful while block_hash is set)


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_cache: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self._clock = clock
        self._blocks = [BlockInfo(i) for i in range(num_blocks)]
        # Insertion-ordered set of ref-0 block ids: head = LRU, O(1) removal on a hit.
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._index: dict[tuple[int, BlockHash], int] = {}  # (group, hash) -> block id carrying it
        # Maintained incrementally so the properties are O(1).
        self._num_used = 0
        self._num_cached = 0
        self.num_evictions = 0
        self.num_allocated = 0  # blocks handed out, ever (the eviction rate's denominator)
        # Evictions of blocks used within the last `recent_s` seconds (a prefix still in play:
        # the eviction rate's numerator, with preemptions' lost blocks; EvictionAlert.window_s)
        self.recent_s = 60.0
        self.num_recent_evictions = 0
        self.evicted_ages: deque[float] = deque(maxlen=EVICTED_AGES_MAXLEN)
        self.evicted_age_total = 0.0
        # A lower KV tier (runtime/core/kv_tiers.py; None = none): evicted cached blocks of group 0 as
        # (block id, hash, token ids, parent hash), logged before reuse so their KV can be copied down.
        self.offload_log: list[tuple] | None = None
        # Residency events (None = not recorded): ("stored", hash, parent, tokens) | ("removed", hash).
        self.events: list[tuple] | None = None

    def record_events(self) -> None:
        """Start logging residency events into `self.events` (drain with `take_events`)."""
        if self.events is None:
            self.events = []

    def take_events(self) -> list[tuple]:
        events, self.events = self.events or [], ([] if self.events is not None else None)
        return events

    # ---- counts -------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Allocatable blocks: plain free plus cached (everything with ref_count 0)."""
        return len(self._free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self._num_used

    @property
    def num_cached_blocks(self) -> int:
        return self._num_cached

    @property
    def infos(self) -> Sequence[BlockInfo]:
        """The live per-block records, read-only, for cheap views taken under the engine
        lock (snapshot() copies all of them)."""
        return self._blocks

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def usage(self) -> float:
        return self._num_used / self.num_blocks

    # ---- allocation ---------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free_queue):
            raise NoFreeBlocks(f"requested {n} blocks, {len(self._free_queue)} free")
        now: float | None = None
        out: list[int] = []
        for _ in range(n):
            block_id, _ = self._free_queue.popitem(last=False)
            info = self._blocks[block_id]
            if info.block_hash is not None:
                # Reusing a cached block destroys its contents: an eviction.
                if now is None:
                    now = self._clock()
                age = now - info.last_used
                self.num_evictions += 1
                self.num_recent_evictions += age <= self.recent_s
                self.evicted_ages.append(age)
                self.evicted_age_total += age
                del self._index[(info.group, info.block_hash)]
                if self.offload_log is not None and info.group == 0:
                    self.offload_log.append((block_id, info.block_hash, info.token_ids, info.parent_hash))
                if self.events is not None and info.group == 0:
                    self.events.append(("removed", info.block_hash))
                info.block_hash = None
                info.token_ids = None
                info.parent_hash = None
                self._num_cached -= 1
            info.ref_count = 1
            info.hits = 0
            out.append(block_id)
        self._num_used += n
        self.num_allocated += n
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        # Validate first so a bad call changes nothing. A block listed k times must
        # have ref_count >= k (the common case of no repeats costs one check each).
        blocks = self._blocks
        for block_id in block_ids:
            if blocks[block_id].ref_count <= 0:
                raise ValueError(f"double free of block {block_id}")
        if len(block_ids) > 1 and len(set(block_ids)) != len(block_ids):
            counts: dict[int, int] = {}
            for block_id in block_ids:
                counts[block_id] = counts.get(block_id, 0) + 1
            for block_id, k in counts.items():
                if blocks[block_id].ref_count < k:
                    raise ValueError(f"double free of block {block_id}")
        now = self._clock()
        # Reverse order: a sequence's tail blocks are the least likely to be shared
        # by a future prompt, so they should reach the head of the queue first.
        for block_id in reversed(block_ids):
            info = blocks[block_id]
            info.ref_count -= 1
            if info.ref_count == 0:
                info.last_used = now
                self._free_queue[block_id] = None
                self._num_used -= 1
                if info.block_hash is not None:
                    self._num_cached += 1

    # ---- prefix cache -------------------------------------------------------

    def lookup_prefix(
        self, block_hashes: Sequence[BlockHash], token_ids: Sequence[int], group: int = 0
    ) -> list[int]:
        """Block ids of the longest verified cached prefix (of `group`). Read-only."""
        out: list[int] = []
        for i, block_hash in enumerate(block_hashes):
            block_id = self.cached_block(block_hash, token_ids, i, group)
            if block_id is None:
                break
            out.append(block_id)
        return out

    def cached_block(self, block_hash: BlockHash, token_ids: Sequence[int], index: int,
                     group: int = 0) -> int | None:
        """The block caching prompt block `index` (its hash; `token_ids`: the whole prompt)
        for `group`, verified token by token, or None. Read-only."""
        if not self.enable_prefix_cache:
            return None
        block_id = self._index.get((group, block_hash))
        if block_id is None:
            return None
        bs = self.block_size
        # Token verification: a hash collision must never serve another prompt's KV.
        if self._blocks[block_id].token_ids != tuple(token_ids[index * bs:(index + 1) * bs]):
            return None
        return block_id

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a prefix hit on blocks from lookup_prefix: share them (ref += 1)."""
        blocks = self._blocks
        for block_id in block_ids:
            info = blocks[block_id]
            if info.ref_count == 0 and info.block_hash is None:
                raise ValueError(f"touch of uncached free block {block_id}")
        now = self._clock()
        for block_id in block_ids:
            info = blocks[block_id]
            if info.ref_count == 0:
                del self._free_queue[block_id]
                self._num_used += 1
                self._num_cached -= 1
            info.ref_count += 1
            info.hits += 1
            info.last_used = now

    def cache_block(self, block_id: int, block_hash: BlockHash, token_ids: Sequence[int],
                    parent: BlockHash | None = None, group: int = 0, lora_id: int = 0) -> None:
        """Register a newly full used block under (group, hash) (first holder wins). `parent`
        is the previous block's hash (None for a prompt's first block): kept as the block's
        link for prefix chains and reported in residency events (group 0's only: one event
        per prompt block, as a router keys prefixes by hash alone). `lora_id`: the adapter whose KV
        it is (0: the base model's), reported in the event as vLLM's lora_id."""
        if not self.enable_prefix_cache:
            return
        info = self._blocks[block_id]
        if info.ref_count == 0:
            raise ValueError(f"cache_block on unused block {block_id}")
        if len(token_ids) != self.block_size:
            raise ValueError(f"block {block_id}: {len(token_ids)} tokens, need {self.block_size}")
        if info.block_hash is not None:
            if info.block_hash == block_hash and info.group == group:
                return
            raise ValueError(f"block {block_id} already cached under another hash")
        # A duplicate (two requests computed the same prefix concurrently) stays
        # unhashed and simply becomes free when released; the existing entry serves hits.
        if (group, block_hash) in self._index:
            return
        info.block_hash = block_hash
        info.token_ids = tuple(token_ids)
        info.parent_hash = parent
        info.group = group
        self._index[(group, block_hash)] = block_id
        if self.events is not None and group == 0:
            self.events.append(("stored", block_hash, parent, info.token_ids, *((None, lora_id) if lora_id else ())))

    def reset_prefix_cache(self) -> int:
        """Operator flush: forget every cached (ref 0) block. Used blocks keep their hashes."""
        dropped = [key for key, b in self._index.items() if self._blocks[b].ref_count == 0]
        for key in dropped:
            info = self._blocks[self._index.pop(key)]
            info.block_hash = None
            info.token_ids = None
            info.parent_hash = None
        self._num_cached -= len(dropped)
        if self.events is not None:
            self.events.extend(("removed", h) for g, h in dropped if g == 0)
        return len(dropped)

    # ---- introspection ------------------------------------------------------

    def snapshot(self) -> list[BlockInfo]:
        return [dataclasses.replace(info) for info in self._blocks]

    def check_invariants(self) -> None:
        """O(num_blocks) consistency check for tests and debug endpoints."""

        def fail(msg: str) -> None:
            raise RuntimeError(f"BlockPool invariant violated: {msg}")

        # Counted by the one state rule, so counters and console views cannot drift apart.
        by_state = [0, 0, 0, 0]
        for info in self._blocks:
            in_queue = info.block_id in self._free_queue
            if info.ref_count < 0:
                fail(f"block {info.block_id} has ref_count {info.ref_count}")
            state = block_state(info.ref_count, info.block_hash is not None)
            by_state[state] += 1
            if state in (USED, SHARED) and in_queue:
                fail(f"block {info.block_id} is in the free queue with ref_count {info.ref_count}")
            if state in (FREE, CACHED) and not in_queue:
                fail(f"ref-0 block {info.block_id} is missing from the free queue")
            if info.block_hash is not None and self._index.get((info.group, info.block_hash)) != info.block_id:
                fail(f"block {info.block_id} carries a hash the index does not map to it")
            if (info.block_hash is None) != (info.token_ids is None):
                fail(f"block {info.block_id} has a hash without token ids or vice versa")
            if info.parent_hash is not None and (info.block_hash is None or info.parent_hash == info.block_hash):
                fail(f"block {info.block_id} has a parent link without a hash of its own, or to itself")
        free, cached = by_state[FREE], by_state[CACHED]
        used = by_state[USED] + by_state[SHARED]
        for (group, block_hash), block_id in self._index.items():
            if not 0 <= block_id < self.num_blocks:
                fail(f"index points at nonexistent block {block_id}")
            if (self._blocks[block_id].group, self._blocks[block_id].block_hash) != (group, block_hash):
                fail(f"index points at block {block_id}, which does not carry that hash")
        if len(self._free_queue) != cached + free:
            fail(f"free queue holds {len(self._free_queue)} ids, {cached + free} blocks have ref 0")
        if used + cached + free != self.num_blocks:
            fail(f"used {used} + cached {cached} + free {free} != {self.num_blocks}")
        if (used, cached) != (self._num_used, self._num_cached):
            fail(f"counters {self._num_used}/{self._num_cached}, blocks {used}/{cached} used/cached")
