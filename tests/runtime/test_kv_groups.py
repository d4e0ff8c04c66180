"""KV groups (runtime/kv_groups.py) and the scheduler's use of them on the host: layer
grouping, what a sliding group frees, what a prefix hit reuses, what admission counts."""

import pytest

from runtime.config import AdmissionPolicy, CacheConfig, ModelConfig, SchedulerConfig
from runtime.core import capacity
from runtime.core.block_pool import BlockPool
from runtime.kv_groups import NULL_BLOCK, KVGroups
from runtime.core.request import Request
from runtime.core.scheduler import Scheduler
from runtime.model.sampling import SamplingParams

BS = 16


def model(num_layers=6, window=32, every=3, **kw) -> ModelConfig:
    """Llama-shaped; every `every`-th layer global (every=0: all sliding, window=None: none)."""
    types = () if not every or window is None else tuple(
        "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(num_layers))
    base = dict(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=num_layers,
                num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=4096, sliding_window=window,
                layer_types=types, name="t")
    base.update(kw)
    return ModelConfig(**base)


def gemma3_270m() -> ModelConfig:
    """Gemma 3 270M's attention shape: 18 layers, every 6th global, window 512, 1 KV head x 256."""
    return model(18, 512, 6, num_heads=4, num_kv_heads=1, head_dim=256, hidden_size=640)


# --- grouping ------------------------------------------------------------------------------

def test_gemma3_layers_split_into_equal_groups_full_first():
    kvg = KVGroups.of(gemma3_270m())
    assert kvg.group_size == 3 and kvg.windows == (0, 512, 512, 512, 512, 512)
    assert [layer for layer in range(18) if kvg.layer_group[layer] == 0] == [5, 11, 17]
    # every (group, index) row is one layer's: the cache [g * NB, ...] has no overlap or gap
    rows = {(kvg.layer_group[layer], kvg.layer_index[layer]) for layer in range(18)}
    assert rows == {(g, i) for g in range(6) for i in range(3)}
    assert all(kvg.windows[kvg.layer_group[layer]] == w for layer, w in enumerate(gemma3_270m().layer_windows()))


def test_uniform_models_are_one_group_of_all_layers():
    full = KVGroups.of(model(window=None))
    assert full == KVGroups.single(6) and full.layer_index == tuple(range(6)) and not full.frees_blocks
    mistral = KVGroups.of(model(window=32, every=0))
    assert mistral.num_groups == 1 and mistral.group_size == 6 and mistral.windows == (32,)
    assert KVGroups.of(gemma3_270m(), split=False) == KVGroups.single(18)  # CacheConfig.kv_groups off


def test_window_rules_match_brute_force():
    kvg = KVGroups.of(model(window=40))
    assert kvg.windows == (0, 40, 40)
    for start in range(200):
        lo = start - 40 + 1  # the first key a query at `start` sees
        wholly_before = sum(1 for b in range(50) if (b + 1) * BS <= lo)
        assert kvg.skipped_blocks(1, start, BS) == wholly_before and kvg.skipped_blocks(0, start, BS) == 0
        n = start // BS  # a hit of n blocks: the next query is at n * BS
        need = {b for b in range(n) if (b + 1) * BS > n * BS - 40 + 1}
        assert set(kvg.hit_window(1, n, BS)) == need and list(kvg.hit_window(0, n, BS)) == list(range(n))
    for chunk in (1, 7, 16, 33):
        for total in (1, 40, 41, 130):
            most = max(kvg.live_blocks(1, s, min(s + n, total), BS)
                       for s in range(total) for n in range(1, chunk + 1))
            assert most <= kvg.max_live_blocks(1, total, chunk, BS) <= most + 1
            assert kvg.max_live_blocks(0, total, chunk, BS) == -(-total // BS)


def test_gemma3_8k_sequence_holds_under_a_quarter_of_keep_everything():
    kvg, keep = KVGroups.of(gemma3_270m()), KVGroups.single(18)
    tokens = 8192
    # pages x layers per page: the layer-blocks each layout keeps for one decoding sequence
    grouped, everything = kvg.steady_pages(tokens, BS) * kvg.group_size, keep.steady_pages(tokens, BS) * 18
    assert everything == 18 * 512
    assert grouped / everything <= 0.25
    assert grouped == 3 * 512 + 15 * (512 - (tokens - 512 + 1) // BS)


# --- the scheduler ---------------------------------------------------------------------------

def make(groups: KVGroups, num_blocks=64, mode="optimistic", budget=64, chunk=None, watermark=0.0) -> Scheduler:
    cache = CacheConfig(BS, num_blocks, "float32", True)
    env = SchedulerConfig(8, budget, 1024)
    pol = AdmissionPolicy(watermark=watermark, admission_mode=mode, max_num_seqs=8, max_num_batched_tokens=budget,
                          long_prefill_token_threshold=chunk or budget)
    return Scheduler(cache, env, pol, BlockPool(num_blocks, BS), groups)


def req(rid, n, max_tokens=32, start=3) -> Request:
    return Request(rid, [start + i % 50 for i in range(n)], SamplingParams(temperature=0.0, max_tokens=max_tokens))


def step(s: Scheduler) -> None:
    out = s.schedule()
    for r, n in out.scheduled:
        if s.commit(r, n):
            s.append_token(r, 7)
            if len(r.output_ids) >= r.params.max_tokens:
                s.finish(r, "length")
    s.pool.check_invariants()


def held(s: Scheduler) -> int:
    return sum(len(r.held_blocks()) for r in s.running)


def test_sliding_groups_release_what_the_window_left_behind():
    kvg = KVGroups.of(model(window=32))  # 1 full + 2 sliding groups of 2 layers
    s = make(kvg, budget=64)
    r = req("a", 100, max_tokens=60)
    s.add(r)
    most = 0
    while not r.is_finished:
        step(s)
        if r.is_finished:
            break
        assert s.pool.num_used_blocks == held(s)  # the pool counts exactly what the tables hold
        full, *sliding = r.block_tables
        assert NULL_BLOCK not in full and len(full) == -(-r.num_computed_tokens // BS)
        for t in sliding:
            live = [b for b in t if b != NULL_BLOCK]
            assert t[:len(t) - len(live)] == [NULL_BLOCK] * (len(t) - len(live))  # released: a leading run
            # what the next step's queries can still see is all there
            assert len(t) - len(live) <= kvg.skipped_blocks(1, r.num_computed_tokens, BS)
            most = max(most, len(live))
    assert most <= kvg.max_live_blocks(1, 160, 64, BS)
    assert s.pool.num_used_blocks == 0  # all back, sliding pages cached or free
    # decode near the end: 159 computed tokens, the window needs keys from 128 on -> 2 live blocks
    assert kvg.live_blocks(1, 159, 160, BS) == 2


def test_keep_everything_layout_never_releases():
    s = make(KVGroups.single(6))
    r = req("a", 100, max_tokens=30)
    s.add(r)
    for _ in range(5):
        step(s)
    assert r.block_tables[0] == r.block_ids and NULL_BLOCK not in r.block_ids
    assert len(r.block_ids) == -(-r.num_computed_tokens // BS)


def run_to_end(s: Scheduler, r: Request) -> None:
    s.add(r)
    while not r.is_finished:
        step(s)


def evict(s: Scheduler, block_id: int) -> None:
    """Test helper: make `block_id` the next to be reused, then reuse it (an eviction)."""
    s.pool._free_queue.move_to_end(block_id, last=False)
    got = s.pool.allocate(1)
    assert got == [block_id]
    s.pool.free(got)  # (back as a plain free block: its hash is gone)


def test_prefix_hit_needs_only_the_window_of_sliding_groups():
    kvg = KVGroups.of(model(window=32))  # a hit needs cdiv(31, 16) = 2 window blocks per sliding group
    s = make(kvg, num_blocks=64)
    prompt = req("a", 130, max_tokens=1)
    run_to_end(s, prompt)
    hashes, toks = prompt.block_hashes, prompt.token_ids

    def hit_of(rid):
        r = Request(rid, list(toks[:130]) + [9, 9], SamplingParams(temperature=0.0, max_tokens=1))
        return s._prefix_hit(r)

    n, tables = hit_of("b")
    assert n == 8  # all 8 full blocks of the prompt (cacheable: those before the last token)
    assert tables[0] == [s.pool.cached_block(hashes[i], toks, i, 0) for i in range(8)]
    for g in (1, 2):
        assert tables[g][:6] == [NULL_BLOCK] * 6 and NULL_BLOCK not in tables[g][6:] and len(tables[g]) == 8

    # A sliding group's page outside the window may go: the hit stays whole.
    evict(s, s.pool.cached_block(hashes[2], toks, 2, 1))
    assert hit_of("c")[0] == 8
    # One inside the last window: the hit shortens to where a whole window is still cached.
    evict(s, s.pool.cached_block(hashes[6], toks, 6, 2))
    n, tables = hit_of("d")
    assert n == 6 and tables[2] == [NULL_BLOCK] * 4 + [s.pool.cached_block(hashes[i], toks, i, 2) for i in (4, 5)]
    # A full group's page: no hit past it.
    evict(s, s.pool.cached_block(hashes[4], toks, 4, 0))
    assert hit_of("e")[0] == 2  # [0, 4) full, and group 1 lost block 2: window of 2 is blocks 0-1
    s.pool.check_invariants()


def test_prefix_hit_admission_reuses_the_window_and_computes_the_rest():
    kvg = KVGroups.of(model(window=32))
    s = make(kvg, num_blocks=64)
    first = req("a", 130, max_tokens=1)
    run_to_end(s, first)
    second = Request("b", list(first.token_ids[:130]) + [9, 9], SamplingParams(temperature=0.0, max_tokens=3))
    s.add(second)
    step(s)
    assert second.num_cached_tokens == 128 and s.counters.prefix_hits >= 128
    assert [len(t) for t in second.block_tables] == [9, 9, 9]
    assert second.block_tables[1][:6] == [NULL_BLOCK] * 6
    while not second.is_finished:
        step(s)
    assert s.pool.num_used_blocks == 0


def test_admission_counts_pages_per_group():
    kvg = KVGroups.of(model(window=32))
    pool_pages = 60
    s = make(kvg, num_blocks=pool_pages, budget=32)
    # 600 tokens: keep-everything pages hold all 6 layers, so the same bytes are 60 // 3 = 20 of
    # them and 38 are needed (never fits); grouped: 38 full-group pages + 2 x a window's worth
    assert capacity.never_fits(600, 1024, BlockPool(pool_pages // kvg.num_groups, BS)) == "cache"
    assert capacity.never_fits(600, 1024, s.pool, kvg, 32) is None
    r = req("long", 560, max_tokens=40)
    s.add(r)
    for _ in range(40):
        step(s)
        assert s.pool.num_used_blocks == held(s) <= pool_pages
    assert r.num_computed_tokens > 560 and r.num_preemptions == 0


def test_reserve_mode_claims_the_window_not_the_sequence():
    kvg = KVGroups.of(model(window=32))
    s = make(kvg, num_blocks=60, mode="reserve", budget=32)
    r = req("a", 400, max_tokens=100)
    claim = capacity.claim_blocks(kvg, BS, start=0, num_tokens=400, max_total_tokens=500, admission_mode="reserve",
                                  chunk=32)
    assert claim == 32 + 2 * kvg.max_live_blocks(1, 500, 32, BS) < 3 * 32
    s.add(r)
    while not r.is_finished:
        step(s)
        grow = capacity.promised_growth(s.running, "reserve", BS, kvg, 32)
        assert grow >= 0 and held(s) + grow <= claim  # what it holds never passes what it reserved
    assert r.num_preemptions == 0


@pytest.mark.parametrize("every", [3, 0])
def test_preemption_returns_every_groups_pages(every):
    kvg = KVGroups.of(model(window=32, every=every))
    s = make(kvg, num_blocks=24, budget=64)
    rs = [req(f"r{i}", 60, max_tokens=40, start=3 + 7 * i) for i in range(3)]
    for r in rs:
        s.add(r)
    for _ in range(120):
        step(s)
        assert s.pool.num_used_blocks == held(s)
        if all(r.is_finished for r in rs):
            break
    assert all(r.is_finished for r in rs) and s.pool.num_used_blocks == 0
