from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    rule,
)

from runtime.core.block_pool import (
    BlockPool,
    NoFreeBlocks,
    hash_block,
    hash_prompt_blocks,
)

BS = 4


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def fill_and_cache(pool: BlockPool, tokens: list[int]) -> list[int]:
    """Allocate blocks for tokens and register every full block, like a finished prefill."""
    hashes = hash_prompt_blocks(tokens, pool.block_size)
    ids = pool.allocate(len(hashes))
    for i, (b, h) in enumerate(zip(ids, hashes)):
        pool.cache_block(b, h, tokens[i * BS : (i + 1) * BS])
    return ids


# ---- hashing ----------------------------------------------------------------


def test_hash_is_chained_and_deterministic():
    toks = list(range(12))
    hs = hash_prompt_blocks(toks, BS)
    assert len(hs) == 3
    assert hs[0] == hash_block(None, toks[0:4])
    assert hs[1] == hash_block(hs[0], toks[4:8])
    assert hs == hash_prompt_blocks(toks, BS)
    # Same block tokens under a different parent hash differently.
    assert hash_block(None, toks[4:8]) != hs[1]
    assert all(len(h) == 32 for h in hs)


def test_block_hash_covers_whole_prefix():
    # Identical block-1 tokens after different block-0 tokens must not share a hash,
    # otherwise a lookup that skipped block 0 could serve the wrong KV.
    a = hash_prompt_blocks([1, 1, 1, 1, 5, 5, 5, 5], BS)
    b = hash_prompt_blocks([2, 2, 2, 2, 5, 5, 5, 5], BS)
    assert a[1] != b[1]
    assert hash_block(a[0], [5] * BS) != hash_block(b[0], [5] * BS)


def test_hash_prompt_blocks_ignores_partial_tail():
    assert len(hash_prompt_blocks(list(range(11)), BS)) == 2
    assert hash_prompt_blocks([1, 2, 3], BS) == []


def test_extra_keys_change_hash():
    toks = [1, 2, 3, 4]
    assert hash_block(None, toks) != hash_block(None, toks, ("lora", 1))
    assert hash_block(None, toks, ("a",)) != hash_block(None, toks, ("b",))


# ---- allocate / free ----------------------------------------------------------


def test_initial_state_and_basic_allocate_free():
    pool = BlockPool(8, BS)
    assert (pool.num_free_blocks, pool.num_used_blocks, pool.num_cached_blocks) == (8, 0, 0)
    ids = pool.allocate(3)
    assert ids == [0, 1, 2]  # initially free in id order
    assert pool.num_used_blocks == 3 and pool.num_free_blocks == 5
    assert pool.usage() == pytest.approx(3 / 8)
    assert all(pool.snapshot()[b].ref_count == 1 for b in ids)
    pool.free(ids)
    assert pool.num_used_blocks == 0 and pool.num_free_blocks == 8
    assert pool.allocate(0) == []
    pool.check_invariants()


def test_allocate_is_all_or_nothing():
    pool = BlockPool(4, BS)
    pool.allocate(3)
    before = pool.snapshot()
    with pytest.raises(NoFreeBlocks):
        pool.allocate(2)
    assert pool.snapshot() == before
    assert pool.num_free_blocks == 1
    assert pool.allocate(1) == [3]
    pool.check_invariants()


def test_double_free_raises_and_changes_nothing():
    pool = BlockPool(4, BS)
    a, b = pool.allocate(2)
    pool.free([a])
    with pytest.raises(ValueError, match=f"double free of block {a}"):
        pool.free([a])
    # A call mixing a valid and an invalid id must not half-apply.
    with pytest.raises(ValueError, match="double free"):
        pool.free([b, a])
    assert pool.snapshot()[b].ref_count == 1
    with pytest.raises(ValueError, match=f"double free of block {b}"):
        pool.free([b, b])
    assert pool.snapshot()[b].ref_count == 1
    pool.check_invariants()


def test_lru_least_recently_freed_reused_first():
    pool = BlockPool(4, BS)
    ids = pool.allocate(4)
    pool.free([ids[2]])
    pool.free([ids[0]])
    pool.free([ids[3]])
    pool.free([ids[1]])
    assert pool.allocate(4) == [ids[2], ids[0], ids[3], ids[1]]


def test_free_releases_in_reverse_order():
    pool = BlockPool(6, BS)
    req = pool.allocate(4)  # [0, 1, 2, 3]
    other = pool.allocate(2)
    pool.free(req)
    # The request's last block is evicted first, its first block last.
    assert pool.allocate(4) == list(reversed(req))
    pool.free(other)


def test_eviction_counting_and_age():
    clock = FakeClock()
    pool = BlockPool(2, BS, clock=clock)
    a = fill_and_cache(pool, [1, 2, 3, 4])  # one cached-to-be block
    plain = pool.allocate(1)  # never hashed
    clock.t = 10.0
    pool.free(a)
    clock.t = 11.0
    pool.free(plain)
    assert pool.num_cached_blocks == 1 and pool.num_free_blocks == 2
    clock.t = 25.0
    got = pool.allocate(1)  # head of queue is the cached block -> eviction
    assert got == a
    assert pool.num_evictions == 1
    assert list(pool.evicted_ages) == [15.0]
    assert pool.evicted_age_total == 15.0
    assert pool.num_cached_blocks == 0
    assert pool.lookup_prefix(hash_prompt_blocks([1, 2, 3, 4], BS), [1, 2, 3, 4]) == []
    info = pool.snapshot()[a[0]]
    assert info.block_hash is None and info.token_ids is None
    # Taking a plain free block is not an eviction.
    pool.allocate(1)
    assert pool.num_evictions == 1
    pool.check_invariants()


def test_evicted_ages_is_bounded():
    clock = FakeClock()
    pool = BlockPool(1, BS, clock=clock)
    for i in range(1100):
        b = pool.allocate(1)
        pool.cache_block(b[0], hash_block(None, [i] * BS), [i] * BS)
        pool.free(b)
        clock.t += 1.0
    pool.allocate(1)
    assert pool.num_evictions == 1100
    assert len(pool.evicted_ages) == 1024
    assert pool.evicted_age_total == pytest.approx(1100.0)


# ---- prefix cache -------------------------------------------------------------


def test_prefix_lookup_full_hit_and_partial():
    pool = BlockPool(8, BS)
    toks = list(range(12))
    ids = fill_and_cache(pool, toks)
    hs = hash_prompt_blocks(toks, BS)
    assert pool.lookup_prefix(hs, toks) == ids  # hit while still used
    pool.free(ids)
    assert pool.num_cached_blocks == 3
    assert pool.lookup_prefix(hs, toks) == ids  # hit from the cached state
    longer = toks + [99, 98, 97, 96]
    assert pool.lookup_prefix(hash_prompt_blocks(longer, BS), longer) == ids
    assert pool.lookup_prefix(hs[:1], toks) == ids[:1]
    pool.check_invariants()


def test_prefix_divergence_stops_chain_even_if_later_tokens_equal():
    pool = BlockPool(8, BS)
    toks = list(range(12))
    ids = fill_and_cache(pool, toks)
    pool.free(ids)
    diverged = toks[:4] + [100, 5, 6, 7] + toks[8:]  # block 1 differs, block 2 identical
    got = pool.lookup_prefix(hash_prompt_blocks(diverged, BS), diverged)
    assert got == ids[:1]


def test_lookup_is_read_only():
    pool = BlockPool(4, BS)
    toks = list(range(8))
    ids = fill_and_cache(pool, toks)
    pool.free(ids)
    before = pool.snapshot()
    pool.lookup_prefix(hash_prompt_blocks(toks, BS), toks)
    assert pool.snapshot() == before
    assert pool.num_free_blocks == 4


def test_token_verification_rejects_hash_collision():
    pool = BlockPool(4, BS)
    toks = list(range(8))
    ids = fill_and_cache(pool, toks)
    pool.free(ids)
    hs = hash_prompt_blocks(toks, BS)
    # Simulate a collision: the index entry for block 1's hash holds other tokens.
    pool._blocks[ids[1]].token_ids = (9, 9, 9, 9)
    assert pool.lookup_prefix(hs, toks) == ids[:1]
    # And a request whose tokens differ from the stored ones never matches block 0.
    assert pool.lookup_prefix(hs, [7, 7, 7, 7] + toks[4:]) == []


def test_touch_removes_cached_block_from_free_queue():
    clock = FakeClock()
    pool = BlockPool(3, BS, clock=clock)
    toks = list(range(8))
    ids = fill_and_cache(pool, toks)
    pool.free(ids)
    assert pool.num_free_blocks == 3 and pool.num_cached_blocks == 2
    clock.t = 5.0
    hit = pool.lookup_prefix(hash_prompt_blocks(toks, BS), toks)
    pool.touch(hit)
    snap = pool.snapshot()
    assert [snap[b].ref_count for b in hit] == [1, 1]
    assert [snap[b].hits for b in hit] == [1, 1]
    assert [snap[b].last_used for b in hit] == [5.0, 5.0]
    assert pool.num_free_blocks == 1 and pool.num_cached_blocks == 0
    assert pool.num_used_blocks == 2
    # The touched blocks can no longer be allocated: only the third block is left.
    rest = pool.allocate(1)
    assert rest[0] not in hit
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)
    # Sharing a used block bumps its ref count; it needs two frees to release.
    pool.touch(hit)
    assert pool.snapshot()[hit[0]].ref_count == 2
    pool.free(hit)
    assert pool.num_used_blocks == 3
    pool.free(hit)
    assert pool.num_cached_blocks == 2
    pool.check_invariants()


def test_touch_of_plain_free_block_rejected():
    pool = BlockPool(2, BS)
    with pytest.raises(ValueError):
        pool.touch([0])
    pool.check_invariants()


def test_cache_block_duplicate_hash_keeps_existing_entry():
    pool = BlockPool(4, BS)
    toks = [1, 2, 3, 4]
    h = hash_block(None, toks)
    a, b = pool.allocate(2)
    pool.cache_block(a, h, toks)
    pool.cache_block(b, h, toks)
    snap = pool.snapshot()
    assert snap[a].block_hash == h and snap[b].block_hash is None
    pool.free([a, b])
    assert pool.num_cached_blocks == 1
    assert pool.lookup_prefix([h], toks) == [a]
    pool.check_invariants()


def test_cache_block_on_free_block_rejected():
    pool = BlockPool(2, BS)
    with pytest.raises(ValueError):
        pool.cache_block(0, hash_block(None, [1, 2, 3, 4]), [1, 2, 3, 4])


def test_reset_prefix_cache_drops_only_cached_blocks():
    pool = BlockPool(6, BS)
    t1, t2 = list(range(8)), list(range(100, 108))
    ids1 = fill_and_cache(pool, t1)
    ids2 = fill_and_cache(pool, t2)
    pool.free(ids1)
    assert pool.reset_prefix_cache() == 2
    assert pool.num_cached_blocks == 0 and pool.num_free_blocks == 4
    assert pool.lookup_prefix(hash_prompt_blocks(t1, BS), t1) == []
    # Used blocks keep their hashes and are cached once released.
    assert pool.lookup_prefix(hash_prompt_blocks(t2, BS), t2) == ids2
    pool.free(ids2)
    assert pool.num_cached_blocks == 2
    # Dropped blocks are plain free now: allocating them is no eviction.
    pool.allocate(4)
    assert pool.num_evictions == 0
    # ids2's blocks sat behind them in the queue and are still cached.
    assert pool.reset_prefix_cache() == 2
    assert pool.reset_prefix_cache() == 0
    pool.check_invariants()


def test_prefix_cache_disabled():
    pool = BlockPool(4, BS, enable_prefix_cache=False)
    toks = list(range(8))
    ids = fill_and_cache(pool, toks)
    pool.free(ids)
    assert pool.num_cached_blocks == 0
    assert pool.lookup_prefix(hash_prompt_blocks(toks, BS), toks) == []
    pool.allocate(4)
    assert pool.num_evictions == 0
    pool.check_invariants()


def test_check_invariants_detects_corruption():
    pool = BlockPool(4, BS)
    ids = fill_and_cache(pool, list(range(8)))
    pool.check_invariants()
    pool._free_queue[ids[0]] = None  # used block also in the free queue
    with pytest.raises(RuntimeError, match="free queue"):
        pool.check_invariants()
    del pool._free_queue[ids[0]]
    pool._blocks[ids[1]].block_hash = b"x" * 32  # index no longer matches
    with pytest.raises(RuntimeError):
        pool.check_invariants()


# ---- stateful model -------------------------------------------------------------

NUM_BLOCKS = 12
# Few prompts with shared prefixes, so hits, sharing and evictions actually happen.
# The last two have an identical block 1 under different parents (chaining).
PROMPTS = [
    [0] * 4 + [1] * 4 + [2] * 4,
    [0] * 4 + [1] * 4 + [3] * 4 + [4] * 2,
    [0] * 4 + [5] * 4,
    [6] * 4 + [7] * 4 + [8] * 3,
    [9] * 4 + [7] * 4,
]
prompts = st.sampled_from(range(len(PROMPTS)))


class BlockPoolMachine(RuleBasedStateMachine):
    """Requests hold lists of block ids; the model tracks who holds what."""

    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.pool = BlockPool(NUM_BLOCKS, BS, clock=self.clock)
        self.held: dict[int, list[int]] = {}  # request id -> block ids
        self.shared: set[int] = set()  # blocks obtained via touch since last allocation
        self.next_id = 0
        self.hits = self.evictions_seen = 0  # for the coverage sanity test below

    def _new_request(self, blocks: list[int]) -> int:
        rid = self.next_id
        self.next_id += 1
        self.held[rid] = blocks
        return rid

    def _allocate(self, n: int) -> list[int] | None:
        if n > self.pool.num_free_blocks:
            before = self.pool.snapshot()
            with pytest.raises(NoFreeBlocks):
                self.pool.allocate(n)
            assert self.pool.snapshot() == before
            return None
        evictions = self.pool.num_evictions
        blocks = self.pool.allocate(n)
        self.evictions_seen += self.pool.num_evictions - evictions
        assert len(set(blocks)) == n
        held_anywhere = {b for bs in self.held.values() for b in bs}
        assert not set(blocks) & held_anywhere, "allocated a block someone holds"
        self.shared -= set(blocks)  # a fresh allocation is exclusive again
        return blocks

    def _cache(self, blocks: list[int], tokens: list[int], start: int = 0) -> None:
        hashes = hash_prompt_blocks(tokens, BS)
        for i in range(start, min(len(blocks), len(hashes))):
            if self.pool.snapshot()[blocks[i]].block_hash is None:
                self.pool.cache_block(blocks[i], hashes[i], tokens[i * BS : (i + 1) * BS],
                                      hashes[i - 1] if i else None)

    @rule(target=requests, n=st.integers(0, 5))
    def allocate(self, n: int) -> int:
        self.clock.t += 1.0
        return self._new_request(self._allocate(n) or [])

    @rule(target=requests, p=prompts)
    def admit_prompt(self, p: int) -> int:
        """The scheduler's flow: reuse the cached prefix, allocate and cache the rest."""
        self.clock.t += 1.0
        tokens = PROMPTS[p]
        hashes = hash_prompt_blocks(tokens, BS)
        hit = self.pool.lookup_prefix(hashes, tokens)
        snap = self.pool.snapshot()
        for i, b in enumerate(hit):  # every hit is verified and chained
            assert snap[b].block_hash == hashes[i]
            assert snap[b].token_ids == tuple(tokens[i * BS : (i + 1) * BS])
        self.pool.touch(hit)
        self.shared.update(hit)
        self.hits += len(hit)
        needed = -(-len(tokens) // BS) - len(hit)
        new = self._allocate(needed)
        if new is None:  # not admitted: give the shared blocks back
            self.pool.free(hit)
            return self._new_request([])
        blocks = hit + new
        self._cache(blocks, tokens, start=len(hit))
        return self._new_request(blocks)

    @rule(rid=requests, p=prompts)
    def cache(self, rid: int, p: int) -> None:
        # Registers arbitrary held blocks, often under a hash another block holds.
        self._cache(self.held.get(rid, []), PROMPTS[p])

    @rule(rid=consumes(requests))
    def free(self, rid: int) -> None:
        self.clock.t += 1.0
        self.pool.free(self.held.pop(rid))

    @rule()
    def reset(self) -> None:
        cached = self.pool.num_cached_blocks
        assert self.pool.reset_prefix_cache() == cached
        assert self.pool.num_cached_blocks == 0

    @rule()
    def double_free_rejected(self) -> None:
        free_ids = [i.block_id for i in self.pool.snapshot() if i.ref_count == 0]
        if free_ids:
            before = self.pool.snapshot()
            with pytest.raises(ValueError, match="double free"):
                self.pool.free(free_ids[:1])
            assert self.pool.snapshot() == before

    @invariant()
    def pool_consistent(self) -> None:
        self.pool.check_invariants()

    @invariant()
    def parent_links_are_the_hash_chain(self) -> None:
        # A block's link is the hash it was chained from (prefix chains follow these).
        for i in self.pool.snapshot():
            if i.block_hash is None:
                assert i.parent_hash is None
            else:
                assert hash_block(i.parent_hash, i.token_ids) == i.block_hash

    @invariant()
    def ref_counts_match_holders(self) -> None:
        holders = [0] * NUM_BLOCKS
        for blocks in self.held.values():
            for b in blocks:
                holders[b] += 1
        assert [i.ref_count for i in self.pool.snapshot()] == holders
        for b, k in enumerate(holders):
            if k > 1:
                assert b in self.shared, f"block {b} held by {k} requests without a touch"

    @invariant()
    def counts_add_up(self) -> None:
        p = self.pool
        snap = p.snapshot()
        used = sum(1 for i in snap if i.ref_count > 0)
        cached = sum(1 for i in snap if i.ref_count == 0 and i.block_hash is not None)
        free = sum(1 for i in snap if i.ref_count == 0 and i.block_hash is None)
        assert used + cached + free == NUM_BLOCKS
        assert (p.num_used_blocks, p.num_cached_blocks, p.num_free_blocks) == (used, cached, cached + free)
        assert used <= NUM_BLOCKS


BlockPoolMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None
)
TestBlockPoolMachine = BlockPoolMachine.TestCase


def test_machine_exercises_hits_and_evictions():
    """Guard against the model silently degenerating into allocate/free only."""
    m = BlockPoolMachine()
    for _ in range(2):
        for p in range(len(PROMPTS)):
            m.free(m.admit_prompt(p))
    m.reset()
    for p in range(len(PROMPTS)):
        m.free(m.admit_prompt(p))
    assert m.pool.num_cached_blocks > NUM_BLOCKS // 2
    m.allocate(5)
    m.allocate(5)  # more than the plain free blocks: must evict cached ones
    m.pool_consistent()
    m.parent_links_are_the_hash_chain()
    m.ref_counts_match_holders()
    m.counts_add_up()
    assert m.hits > 0 and m.evictions_seen > 0
