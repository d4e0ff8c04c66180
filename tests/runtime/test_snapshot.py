"""The engine's read model (runtime/core/snapshot.py): block states from the one rule, the
owner map, parent links and the prefix chains followed by them, links cleared when a
block leaves the prefix cache."""

from __future__ import annotations

import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest

from runtime.core import snapshot as read
from runtime.core.block_pool import BLOCK_STATES, BlockPool, block_state, hash_prompt_blocks
from runtime.model.sampling import SamplingParams
from tests.engine_util import make_engine

BS = 4


def source(pool: BlockPool) -> SimpleNamespace:
    """The parts of an engine the pool-only reads use."""
    return SimpleNamespace(lock=threading.RLock(), pool=pool)


def cache_prompt(pool: BlockPool, tokens: list[int], salt: tuple = ()) -> list[int]:
    """What the scheduler does for a prompt: hit its cached prefix, allocate the rest,
    cache every full block with its parent's hash. Returns the block ids (held)."""
    hashes = hash_prompt_blocks(tokens, BS, salt)
    hit = pool.lookup_prefix(hashes, tokens)
    pool.touch(hit)
    ids = hit + pool.allocate(-(-len(tokens) // BS) - len(hit))
    for i, h in enumerate(hashes):
        pool.cache_block(ids[i], h, tokens[i * BS:(i + 1) * BS], hashes[i - 1] if i else None)
    return ids


def rows(pool: BlockPool, k: int = 10) -> list[tuple[int, int, int, int]]:
    """(first block, hits, blocks, tokens) per chain."""
    return [(c[0].block_id, c[0].hits, len(c), sum(len(b.token_ids) for b in c))
            for c in read.prefix_chains(read.hashed_blocks(source(pool)), k)]


def test_block_states_follow_the_one_rule():
    assert [BLOCK_STATES[block_state(rc, h)] for rc, h in [(0, False), (0, True), (1, False), (1, True), (2, True)]
            ] == ["free", "cached", "used", "used", "shared"]
    pool = BlockPool(6, BS)
    a = cache_prompt(pool, list(range(8)))          # blocks 0, 1: cached after the free
    pool.free(a)
    b = cache_prompt(pool, list(range(8)) + [9])    # hits 0, 1 (used again), allocates 2
    c = cache_prompt(pool, list(range(4)) + [7])    # hits 0 again: shared
    codes = read.block_states(source(pool))
    assert [BLOCK_STATES[x] for x in codes] == ["shared", "used", "used", "used", "free", "free"]
    pool.free(b)
    pool.free(c)
    codes = read.block_states(source(pool))
    assert [BLOCK_STATES[x] for x in codes] == ["cached", "cached", "free", "free", "free", "free"]
    views = read.block_views(SimpleNamespace(lock=threading.RLock(), pool=pool,
                                             scheduler=SimpleNamespace(running=[])), 1, 3)
    assert [(v.block_id, v.state, v.cached_hash, v.hits) for v in views] == [(1, "cached", True, 1),
                                                                            (2, "free", False, 0)]
    pool.check_invariants()


def test_cache_block_records_the_parent_link():
    pool = BlockPool(8, BS)
    tokens = list(range(12))
    ids = cache_prompt(pool, tokens)
    hashes = hash_prompt_blocks(tokens, BS)
    infos = pool.infos
    assert [infos[b].parent_hash for b in ids] == [None, hashes[0], hashes[1]]
    pool.check_invariants()


def test_a_shared_prefix_is_one_chain_with_its_tokens_and_hits():
    pool = BlockPool(4, BS)
    first = list(range(100, 112))                   # 3 full blocks
    pool.free(cache_prompt(pool, first))
    assert rows(pool) == []                         # cached, never reused
    second = cache_prompt(pool, first + [7, 8, 9, 10])  # reuses all 3, adds a 4th block
    assert rows(pool) == [(second[0], 1, 3, 12)]    # the unhit 4th block is not part of it
    (chain,) = read.prefix_chains(read.hashed_blocks(source(pool)))
    assert [b.block_id for b in chain] == second[:3] and all(b.ref_count == 1 for b in chain)
    pool.free(second)
    assert rows(pool) == [(second[0], 1, 3, 12)]    # still cached after the request ends


def test_the_walk_takes_the_most_hit_child():
    pool = BlockPool(16, BS)
    root = [1, 2, 3, 4]
    pool.free(cache_prompt(pool, root + [5, 5, 5, 5]))
    pool.free(cache_prompt(pool, root + [6, 6, 6, 6]))
    for _ in range(2):
        pool.free(cache_prompt(pool, root + [6, 6, 6, 6, 0]))
    pool.free(cache_prompt(pool, root + [5, 5, 5, 5, 0]))
    (chain,) = read.prefix_chains(read.hashed_blocks(source(pool)))
    assert chain[0].hits == 4 and len(chain) == 2 and chain[1].token_ids == (6, 6, 6, 6) and chain[1].hits == 2
    # A second, less reused root comes after it; k limits the rows.
    pool.free(cache_prompt(pool, [9, 9, 9, 9, 1]))
    pool.free(cache_prompt(pool, [9, 9, 9, 9, 2]))
    assert [r[1] for r in rows(pool)] == [4, 1] and len(rows(pool, k=1)) == 1


def test_eviction_clears_links_and_shortens_the_chain():
    pool = BlockPool(4, BS)
    first = list(range(12))
    pool.free(cache_prompt(pool, first))
    second = cache_prompt(pool, first + [50, 51, 52, 53])
    pool.free(second)                               # tail first: 3, 2, 1, 0 is the LRU order
    (evicted,) = pool.allocate(1)                   # evicts the unhit 4th block
    assert evicted == second[3] and pool.infos[evicted].parent_hash is None
    assert rows(pool) == [(second[0], 1, 3, 12)]
    (evicted,) = pool.allocate(1)                   # evicts the chain's last block
    assert evicted == second[2] and pool.infos[evicted].parent_hash is None
    assert rows(pool) == [(second[0], 1, 2, 8)]
    pool.check_invariants()
    pool.allocate(2)                                # the root goes: nothing left to show
    assert all(i.parent_hash is None and i.block_hash is None for i in pool.infos)
    assert rows(pool) == [] and read.hashed_blocks(source(pool)) == []
    pool.check_invariants()


def test_an_orphaned_child_is_not_shown_mid_prompt():
    pool = BlockPool(4, BS)
    tokens = list(range(8))
    pool.free(cache_prompt(pool, tokens))
    root, child = pool.lookup_prefix(hash_prompt_blocks(tokens, BS), tokens)
    pool.touch([root, child])                       # both hit once
    pool.free([root])                               # the root first: it is evicted before its child
    pool.free([child])
    assert rows(pool) == [(root, 1, 2, 8)]
    pool.allocate(2)                                # the two never-used blocks
    assert pool.allocate(1) == [root]
    assert [b.block_id for b in read.hashed_blocks(source(pool))] == [child]
    assert rows(pool) == []                         # the child alone is not a prompt's start
    pool.check_invariants()


def test_reset_prefix_cache_clears_links_of_cached_blocks_only():
    pool = BlockPool(8, BS)
    pool.free(cache_prompt(pool, list(range(8))))
    held = cache_prompt(pool, list(range(20, 28)))
    assert pool.reset_prefix_cache() == 2
    infos = pool.infos
    assert all(infos[b].parent_hash is None and infos[b].block_hash is None for b in range(8) if b not in held)
    assert infos[held[1]].parent_hash == infos[held[0]].block_hash is not None  # used blocks keep theirs
    pool.check_invariants()


def test_check_invariants_catches_a_stale_parent_link():
    pool = BlockPool(4, BS)
    ids = cache_prompt(pool, list(range(8)))
    pool.check_invariants()
    info = pool._blocks[ids[1]]
    info.block_hash, info.token_ids = None, None    # as if eviction forgot the link
    pool._index = {h: b for h, b in pool._index.items() if b != ids[1]}
    with pytest.raises(RuntimeError, match="parent link"):
        pool.check_invariants()


def test_snapshot_does_not_import_the_engine():
    code = "import sys, runtime.core.snapshot; assert 'runtime.core.engine' not in sys.modules and 'jax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    return make_engine(tiny_ckpt, num_blocks=32, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)


def test_engine_read_model_owners_chains_and_counters(engine):
    system = list(range(3, 3 + 48))                 # 3 full blocks of 16
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.generate([system + [100]], params)
    req = engine.add_request(system + [101, 102], params)
    engine.step()
    snap = read.take_snapshot(engine)
    assert snap.prefix_hits == 48 and snap.used_blocks == len(req.block_ids)
    assert [b.block_id for b in snap.blocks if req.request_id in b.owners] == sorted(req.block_ids)
    assert all(b.owners == () for b in snap.blocks if b.block_id not in req.block_ids)
    codes = read.block_states(engine)
    assert [BLOCK_STATES[c] for c in codes] == [b.state for b in snap.blocks]
    (chain,) = read.prefix_chains(read.hashed_blocks(engine))
    assert [b.block_id for b in chain] == req.block_ids[:3] and chain[0].hits == 1
    assert sum(len(b.token_ids) for b in chain) == 48 and all(b.ref_count == 1 for b in chain)
    (view,) = [r for r in snap.requests if r.request_id == req.request_id]
    assert view.cached_tokens == 48 and view.blocks == len(req.block_ids)
    engine.run_until_done()
    snap = read.take_snapshot(engine, with_blocks=False)
    assert snap.blocks == [] and snap.used_blocks == 0 and snap.evictions == 0 and snap.evicted_age_mean is None
    w = read.metrics_window(engine)
    assert len(w.ttft) == 2 and w.steps and isinstance(w.steps, tuple)
    engine.pool.check_invariants()
