"""The host-RAM KV tier (runtime/core/kv_tiers.py): blocks the device pool evicts go to host
memory and come back as prefix hits instead of being recomputed, with the same tokens; the
tier stays within its bytes; nothing leaks."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.core.kv_tiers import HostBlock, HostTier
from runtime.model.sampling import SamplingParams
from tests.engine_util import make_engine

SP = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)


def prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 260, size=n)]


def engine(ckpt, offload: int):
    from dataclasses import replace

    eng = make_engine(ckpt, num_blocks=14, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=256,
                      watermark=0.0)
    if offload:  # (the config is frozen: a second engine with the field set)
        from runtime.core.engine import LLMEngine

        cfg = replace(eng.config, kv_offload_memory=offload)
        eng = LLMEngine.from_checkpoint(ckpt, lambda m: replace(cfg, model=m), warmup=False, progress=False)
    return eng


def test_an_evicted_prefix_comes_back_from_host_memory_with_the_same_tokens(tiny_ckpt):
    """A (150 tokens: 9 full blocks) runs, B's 150 tokens evict A's last 5 cached blocks from
    the 14-block pool (a request's last blocks go first); A again: with the tier those 5 come
    back from host memory after the 4 still on the device, 144 tokens cached (the same tokens
    and logprobs as its first run); without it only the 4 blocks' 64 tokens are."""
    a, b = prompt(1, 150), prompt(2, 150)
    results = {}
    for offload in (0, 64 << 20):
        eng = engine(tiny_ckpt, offload)
        first = eng.generate([a], SP)[0]
        eng.generate([b], SP)
        again = eng.generate([a], SP)[0]
        results[offload] = (first, again, eng)
    first, again, eng = results[64 << 20]
    assert again.output_ids == first.output_ids
    np.testing.assert_allclose([x for x, _ in again.formatted_logprobs()], [x for x, _ in first.formatted_logprobs()],
                               atol=1e-4)
    assert again.num_cached_tokens == 144 and eng.host_tier.promoted == 5
    assert results[0][1].num_cached_tokens == 64 and results[0][1].output_ids == first.output_ids
    assert eng.host_tier.bytes <= eng.host_tier.capacity_bytes and eng.host_tier.stored >= 5
    eng.pool.check_invariants()
    assert eng.pool.num_used_blocks == 0
    metrics = eng.metrics.render().decode()
    assert f'pagedjax:kv_tier_hit_blocks{{tier="host"}} {float(eng.host_tier.promoted)}' in metrics


def test_the_tier_keeps_to_its_bytes_and_verifies_tokens():
    tier = HostTier(3 * 64)
    blk = lambda t: HostBlock(t, None, [np.zeros(16, np.float32)])  # noqa: E731  (64 bytes each)
    for h in range(5):
        tier.put(h, blk((h,)))
    assert len(tier.blocks) == 3 and tier.bytes == 192 and tier.dropped == 2
    assert tier.get(0, (0,)) is None and tier.get(4, (4,)) is not None
    assert tier.get(4, (5,)) is None  # another prompt's tokens under the hash: never served
    with pytest.raises(ValueError, match="kv_offload_memory: must be positive"):
        HostTier(0)


def test_offload_is_refused_without_the_prefix_cache(tiny_ckpt):
    from dataclasses import replace

    from runtime.core.engine import LLMEngine

    eng = make_engine(tiny_ckpt, num_blocks=14, prefix_cache=False)
    cfg = replace(eng.config, kv_offload_memory=1 << 20)
    with pytest.raises(ValueError, match="kv_offload_memory: the host KV tier holds prefix-cache blocks"):
        LLMEngine.from_checkpoint(tiny_ckpt, lambda m: replace(cfg, model=m), warmup=False, progress=False)


def test_churn_through_a_small_tier_gives_the_untiered_tokens_and_leaks_nothing(tiny_ckpt):
    """24 requests over 3 shared 64-token prefixes with their own tails, two at a time, through
    a 14-block pool and a tier of 6 blocks' bytes: the tokens of an engine without the tier,
    the tier never over its bytes, every block back in the pool."""
    rng = np.random.default_rng(7)
    shared = [prompt(10 + i, 64) for i in range(3)]
    prompts = [shared[int(rng.integers(3))] + prompt(100 + i, int(rng.integers(5, 60))) for i in range(24)]
    plain = engine(tiny_ckpt, 0)
    block = plain.config.cache.bytes_per_block(plain.config.model)
    tiered = engine(tiny_ckpt, 6 * block)
    for i in range(0, 24, 2):
        want = plain.generate(prompts[i:i + 2], SP)
        got = tiered.generate(prompts[i:i + 2], SP)
        assert [r.output_ids for r in got] == [r.output_ids for r in want]
        assert tiered.host_tier.bytes <= 6 * block
    t = tiered.host_tier
    assert t.promoted > 0 and t.dropped > 0 and tiered.scheduler.counters.prefix_hits > plain.scheduler.counters.prefix_hits
    for eng in (plain, tiered):
        eng.pool.check_invariants()
        assert eng.pool.num_used_blocks == 0


def tiered(ckpt, directory, offload: int = 64 << 20, **kw):
    from dataclasses import replace

    from runtime.core.engine import LLMEngine

    eng = make_engine(ckpt, num_blocks=14, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=256,
                      watermark=0.0)
    cfg = replace(eng.config, kv_offload_memory=offload, kv_offload_dir=str(directory), **kw)
    return LLMEngine.from_checkpoint(ckpt, lambda m: replace(cfg, model=m), warmup=False, progress=False)


def test_a_restarted_engine_serves_an_evicted_prefix_from_disk(tiny_ckpt, tmp_path, caplog):
    """A's blocks evicted by B go to host memory and DIR; a new engine (a restart: empty device
    pool, empty host tier) serves A's 9 blocks from DIR with the first run's tokens. A corrupt
    file and one written for other weights are skipped with a log line, never served."""
    import logging

    a, b = prompt(1, 150), prompt(2, 150)
    first_eng = tiered(tiny_ckpt, tmp_path / "kv")
    first = first_eng.generate([a], SP)[0]
    first_eng.generate([b], SP)
    first_eng.generate([prompt(3, 150)], SP)  # (evicts A's first blocks too)
    assert first_eng.disk_tier.stored >= 9
    del first_eng
    restarted = tiered(tiny_ckpt, tmp_path / "kv")
    assert restarted.disk_tier.loaded >= 9
    from runtime.core.block_pool import hash_prompt_blocks
    from runtime.core.kv_events import BlockStored, Residency, decode_batch, encode_batch, to_vllm_events

    told = restarted.disk_tier.announce()  # what a restarted replica tells the router first
    assert {e[1] for e in told} == set(restarted.disk_tier.files) and all(e[-1] == "DISK" for e in told)
    view = Residency()
    view.apply("r", decode_batch(encode_batch(to_vllm_events([("cleared",), *told], 16))))
    assert view.matched("r", hash_prompt_blocks(a, 16)) == 9
    assert all(isinstance(e, BlockStored) for e in to_vllm_events(told, 16))
    again = restarted.generate([a], SP)[0]
    assert again.num_cached_tokens == 144 and again.output_ids == first.output_ids
    assert restarted.disk_tier.promoted == 9

    # corrupt one of A's files, and stamp another with a foreign fingerprint: both skipped
    hashes = hash_prompt_blocks(a, 16)
    f0 = tmp_path / "kv" / f"{hashes[0].hex()}.kvb"
    data = bytearray(f0.read_bytes())
    data[-1] ^= 0xFF
    f0.write_bytes(bytes(data))
    third = tiered(tiny_ckpt, tmp_path / "kv")
    with caplog.at_level(logging.WARNING, logger="runtime.core.kv_tiers"):
        r = third.generate([a], SP)[0]
    assert r.num_cached_tokens == 0 and r.output_ids == first.output_ids  # (block 0 gone: the chain starts there)
    assert "corrupt (its payload does not match its sha256)" in caplog.text
    assert third.disk_tier.skipped == 1 and not f0.exists()
    caplog.clear()
    foreign = tiered(tiny_ckpt, tmp_path / "kv")  # (a file of A's second block, another engine's fingerprint)
    foreign.disk_tier.fingerprint = "another model"
    assert foreign.disk_tier.get(hashes[1], a[16:32]) is None
    assert "written by another model, weights or KV layout" in caplog.text
    assert not (tmp_path / "kv" / f"{hashes[1].hex()}.kvb").exists()


def test_disk_tier_flags_are_checked(tiny_ckpt, tmp_path):
    with pytest.raises(ValueError, match="kv_offload_dir: the disk tier sits under the host tier"):
        tiered(tiny_ckpt, tmp_path / "kv", offload=0)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="kv_offload_dir: .* is not a writable directory"):
        tiered(tiny_ckpt, tmp_path / "file")


def test_the_fingerprint_follows_the_weights_and_the_kv_layout(tiny_ckpt):
    from dataclasses import replace

    from runtime.checkpoint.store import load_checkpoint
    from runtime.core.kv_tiers import fingerprint

    eng = make_engine(tiny_ckpt, num_blocks=14)
    _, params, _ = load_checkpoint(tiny_ckpt)
    base = fingerprint(eng.config, params)
    assert fingerprint(eng.config, params) == base
    tuned = {**params, "embed": np.asarray(params["embed"]) + 1e-3}
    assert fingerprint(eng.config, tuned) != base
    bf16 = replace(eng.config, cache=replace(eng.config.cache, kv_dtype="bfloat16"))
    assert fingerprint(bf16, params) != base


def test_a_graceful_stop_writes_the_device_prefixes_to_disk(tiny_ckpt, tmp_path):
    """A prefix never evicted is on disk after the serving loop stops (AsyncEngine.stop
    flushes the device prefix cache), so a restart serves all of it."""
    from runtime.core.async_engine import AsyncEngine

    a = prompt(1, 150)
    eng = tiered(tiny_ckpt, tmp_path / "kv")
    first = eng.generate([a], SP)[0]
    assert eng.disk_tier.stored == 0  # nothing evicted yet
    AsyncEngine(eng).stop()
    assert eng.disk_tier.stored == 9
    again = tiered(tiny_ckpt, tmp_path / "kv").generate([a], SP)[0]
    assert again.num_cached_tokens == 144 and again.output_ids == first.output_ids
