"""Residency events: block pool -> vLLM's KV-event wire format -> the router's view, and
the gateway's block hashes equal the engine's (so a match is exact)."""

from __future__ import annotations

import msgpack
from prometheus_client.parser import text_string_to_metric_families

from runtime.core.block_pool import BlockPool, hash_prompt_blocks
from runtime.fleet.gateway import relabel_metrics
from runtime.fleet.replica import replica_stats
from runtime.core.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, Residency, decode_batch, encode_batch,
                               to_vllm_events)
from runtime.model.sampling import SamplingParams
from tests.engine_util import make_engine

BS = 4


def _fill(pool: BlockPool, tokens: list[int]) -> tuple[list[int], list[bytes]]:
    hashes = hash_prompt_blocks(tokens, BS)
    ids = pool.allocate(len(hashes))
    for i, (b, h) in enumerate(zip(ids, hashes)):
        pool.cache_block(b, h, tokens[i * BS:(i + 1) * BS], hashes[i - 1] if i else None)
    return ids, hashes


def test_pool_logs_stores_evictions_and_flushes_in_order():
    pool = BlockPool(4, BS)
    _fill(pool, list(range(8)))          # nothing logged before record_events
    assert pool.events is None and pool.take_events() == []
    pool = BlockPool(4, BS)
    pool.record_events()
    ids, hashes = _fill(pool, list(range(8)))
    assert pool.take_events() == [("stored", hashes[0], None, (0, 1, 2, 3)), ("stored", hashes[1], hashes[0], (4, 5, 6, 7))]
    pool.free(ids)
    pool.allocate(3)                     # two free blocks first, then the LRU cached one is evicted
    ev = pool.take_events()
    assert len(ev) == 1 and ev[0][0] == "removed" and ev[0][1] in hashes
    assert pool.reset_prefix_cache() == 1
    assert [e[0] for e in pool.take_events()] == ["removed"]


def test_vllm_wire_format_round_trips_and_is_tagged_array_like():
    pool = BlockPool(8, BS)
    pool.record_events()
    _, hashes = _fill(pool, list(range(12)))
    events = to_vllm_events([("cleared",), *pool.take_events(), ("removed", hashes[2]), ("removed", hashes[1])], BS)
    # One chain of stores becomes one BlockStored; consecutive removals one BlockRemoved (as vLLM batches).
    assert [type(e) for e in events] == [AllBlocksCleared, BlockStored, BlockRemoved]
    assert events[1].block_hashes == hashes and events[1].parent_block_hash is None
    assert events[1].token_ids == list(range(12)) and events[1].block_size == BS
    data = encode_batch(events, ts=123.5)
    raw = msgpack.unpackb(data)
    # vLLM's layout: [ts, [[tag, fields...], ...]] with the class name as the tag.
    assert raw[0] == 123.5
    assert raw[1][0] == ["AllBlocksCleared"]
    assert raw[1][1][:5] == ["BlockStored", hashes, None, list(range(12)), BS]
    assert raw[1][2][0] == "BlockRemoved" and raw[1][2][1] == [hashes[2], hashes[1]]
    back = decode_batch(data)
    assert back.ts == 123.5 and back.events == events


def test_residency_counts_leading_blocks_and_follows_removals():
    r = Residency()
    h = [bytes([i]) * 32 for i in range(5)]
    r.apply("a", decode_batch(encode_batch([BlockStored(h[:4], None, list(range(16)), BS)])))
    assert r.matched("a", h) == 4 and r.matched("b", h) == 0 and r.num_blocks("a") == 4
    r.apply("a", decode_batch(encode_batch([BlockRemoved([h[1]])])))
    assert r.matched("a", h) == 1  # a hole ends the usable prefix, as in the engine's lookup
    r.apply("a", decode_batch(encode_batch([AllBlocksCleared()])))
    assert r.matched("a", h) == 0


def test_expected_blocks_count_until_the_events_arrive_or_they_expire():
    now = [100.0]
    r = Residency(clock=lambda: now[0])
    h = [bytes([i]) * 32 for i in range(3)]
    r.expect("a", h, ttl_s=0.2)
    assert r.matched("a", h) == 3
    now[0] += 0.19
    assert r.matched("a", h) == 3       # still inside the TTL
    r.apply("a", decode_batch(encode_batch([BlockStored(h[:1], None, list(range(BS)), BS)])))
    now[0] += 0.02                      # past the TTL: only what the events reported stays
    assert r.matched("a", h) == 1
    r.apply("a", decode_batch(encode_batch([BlockRemoved(h[:1])])))
    assert r.matched("a", h) == 0
    r.forget("a")
    assert r.num_blocks("a") == 0


def test_engine_events_carry_the_gateways_hashes(tiny_ckpt):
    """The gateway hashes a prompt with hash_prompt_blocks; the engine's pool must report
    exactly those hashes once it has computed the prompt, so routing matches are exact."""
    llm = make_engine(tiny_ckpt, num_blocks=64)
    llm.pool.record_events()
    prompt = list(range(3, 3 + 5 * llm.pool.block_size + 3))
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))
    stored = [h for e in to_vllm_events(llm.pool.take_events(), llm.pool.block_size) if isinstance(e, BlockStored)
              for h in e.block_hashes]
    expected = hash_prompt_blocks(prompt, llm.pool.block_size)
    assert stored[:len(expected)] == expected
    s = replica_stats(llm, "r0")
    assert s.num_blocks == 64 and s.block_size == llm.pool.block_size and s.running == s.waiting == 0
    assert s.cached_blocks >= len(expected) and s.free_blocks == 64


def test_fleet_metrics_label_every_sample_by_replica_and_merge_families():
    a = b'# HELP vllm:num_requests_running Running\n# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 3.0\n'
    b = (b'# HELP vllm:num_requests_running Running\n# TYPE vllm:num_requests_running gauge\n'
         b'vllm:num_requests_running 5.0\n# HELP x_total X\n# TYPE x_total counter\nx_total{k="v"} 2.0\n')
    text = relabel_metrics({"r1": a, "r2": b}).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    running = {s.labels["replica"]: s.value for s in fams["vllm:num_requests_running"].samples}
    assert running == {"r1": 3.0, "r2": 5.0}
    assert text.count("# TYPE vllm:num_requests_running") == 1
    assert [s.labels for s in fams["x"].samples] == [{"replica": "r2", "k": "v"}]
    assert "# TYPE x_total counter" in text


def test_tier_events_carry_their_medium_and_count_as_held():
    h = [bytes([i]) * 32 for i in range(4)]
    events = to_vllm_events([("stored", h[0], None, (0, 1, 2, 3)), ("stored", h[1], h[0], (4, 5, 6, 7), "CPU"),
                             ("stored", h[2], h[1], (8, 9, 10, 11), "CPU"), ("removed", h[0]), ("removed", h[3], "CPU")],
                            BS)
    # a chain splits where the medium changes; removals group by medium
    assert [(type(e).__name__, e.medium) for e in events] == [("BlockStored", None), ("BlockStored", "CPU"),
                                                              ("BlockRemoved", None), ("BlockRemoved", "CPU")]
    assert events[1].block_hashes == h[1:3] and events[1].parent_block_hash == h[0]
    assert msgpack.unpackb(encode_batch(events[1:2]))[1][0][-1] == "CPU"  # vLLM's field, last
    r = Residency()
    r.apply("a", decode_batch(encode_batch(events[:2])))
    assert r.matched("a", h) == 3 and r.num_blocks("a") == 1
    r.apply("a", decode_batch(encode_batch([BlockRemoved([h[0]])])))  # off the device, but in no tier: a hole
    assert r.matched("a", h) == 0
    r.apply("a", decode_batch(encode_batch([BlockStored([h[0]], None, [0, 1, 2, 3], BS, medium="CPU")])))
    assert r.matched("a", h) == 3  # the whole chain from host RAM now
    r.apply("a", decode_batch(encode_batch([BlockRemoved([h[1]], medium="DISK")])))
    assert r.matched("a", h) == 3  # another medium's removal leaves the CPU copy
    r.apply("a", decode_batch(encode_batch([AllBlocksCleared()])))
    assert r.matched("a", h) == 0


def test_an_engine_reports_what_its_host_tier_takes_and_drops(tiny_ckpt):
    from dataclasses import replace

    from runtime.core.engine import LLMEngine

    base = make_engine(tiny_ckpt, num_blocks=14, max_num_seqs=2, max_model_len=256, watermark=0.0)
    block = base.runner.kv_block_bytes()
    cfg = replace(base.config, kv_offload_memory=3 * block)  # three blocks of host RAM
    llm = LLMEngine.from_checkpoint(tiny_ckpt, lambda m: replace(cfg, model=m), warmup=False, progress=False)
    llm.pool.record_events()
    sp = SamplingParams(max_tokens=2, temperature=0.0)
    a, b = [3 + i % 250 for i in range(150)], [3 + (7 * i + 1) % 250 for i in range(150)]
    llm.generate([a], sp)
    llm.generate([b], sp)  # evicts five of a's blocks from the 14-block pool: down to host RAM, three kept
    events = to_vllm_events(llm.pool.take_events(), llm.pool.block_size)
    held: set[bytes] = set()  # the CPU medium, replayed in order
    device: set[bytes] = set()
    for e in events:
        where = held if getattr(e, "medium", None) == "CPU" else device
        (where.update if isinstance(e, BlockStored) else where.difference_update)(e.block_hashes)
    bs = llm.pool.block_size
    assert held and held == set(llm.host_tier.blocks) and len(held) <= 3
    assert held <= set(hash_prompt_blocks(a, bs)) | set(hash_prompt_blocks(b, bs))
    assert any(isinstance(e, BlockRemoved) and e.medium == "CPU" for e in events)  # (three did not hold them all)
    r = Residency()
    r.apply("r", decode_batch(encode_batch(events)))
    ha = hash_prompt_blocks(a, bs)
    lead = next((i for i, h in enumerate(ha) if h not in held | device), len(ha))
    assert r.matched("r", ha) == lead and any(h in held for h in ha[:lead])  # the host tier's blocks count
