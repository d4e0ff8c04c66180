"""Disaggregated prefill/decode at the engine level (runtime/core/disagg.py, runtime/core/kv_transfer.py):
reserve on the decode engine, prefill + export on the prefill engine, a connector in
between, import + generate on the decode engine -- the same tokens as one engine."""

import time

import numpy as np
import pytest

from runtime.config import kv_scale_groups
from runtime.core.disagg import NoRoom, prefill_then_decode
from runtime.core.kv_transfer import (InProcessConnector, RayHandle, SharedMemoryConnector, TransferError,
                                 TransferTimeout)
from runtime.model.runner import read_blocks
from runtime.model.sampling import SamplingParams
from tests.engine_util import make_engine

BS = 16
# logprobs=0: each token's logprob comes back too, a much finer check on the KV than the tokens
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=10, ignore_eos=True, logprobs=0)


def prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 260, size=n)]


@pytest.fixture(scope="module")
def f32(tiny_ckpt):
    """(prefill, decode): the prefill engine doubles as the colocated reference."""
    return make_engine(tiny_ckpt, num_blocks=64), make_engine(tiny_ckpt, num_blocks=64)


def colocated(engine, ids, params):
    return engine.generate([ids], params)[0]


def same_output(req, want) -> bool:
    """Token for token, and logprobs equal up to float noise (the tail is computed in
    another batch shape than the colocated prompt)."""
    return req.output_ids == want.output_ids and np.allclose(
        [e[0] for e in req.logprobs], [e[0] for e in want.logprobs], atol=1e-4)


def counts(pool) -> tuple[int, int, int]:
    pool.check_invariants()
    return pool.num_free_blocks, pool.num_cached_blocks, pool.num_used_blocks


def sample(engine, name, **labels) -> float:
    return engine.metrics.registry.get_sample_value(name, labels) or 0.0


class Flaky(InProcessConnector):
    """Fails the first `fails` receives."""

    def __init__(self, fails: int):
        super().__init__()
        self.fails, self.sent = fails, []

    def send(self, request_id, blocks):
        self.sent.append(blocks)
        return super().send(request_id, blocks)

    def recv(self, handle, timeout_s):
        if self.fails:
            self.fails -= 1
            raise TransferTimeout("planted: the transfer timed out")
        return super().recv(handle, timeout_s)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("n", [45, 48])  # not / a multiple of the block size
def test_matches_colocated(f32, params, n):
    pre, dec = f32
    ids = prompt(n + 1000 * (params.seed is not None), n)
    want = colocated(pre, ids, params)
    conn = Flaky(0)
    req = prefill_then_decode(pre, dec, conn, ids, params)
    assert same_output(req, want) and len(want.output_ids) == 10
    usable = (n - 1) // BS
    (blocks,) = conn.sent
    assert blocks.first_block == 0 and blocks.num_blocks == usable
    # the decode cache now holds exactly the prefill side's KV for those blocks
    held = dec.pool.lookup_prefix(blocks.block_hashes, ids)
    assert len(held) == usable
    for got, sent in zip(read_blocks(dec.runner, held), blocks.arrays):
        np.testing.assert_array_equal(got, sent)
    assert req.num_cached_tokens == usable * BS  # the decode side computed only the tail
    assert conn.num_buffers == 0 and dec.pool.num_used_blocks == 0
    dec.pool.check_invariants()


def test_partial_local_prefix_and_registration(f32):
    pre, dec = f32
    ids = prompt(7, 70)  # 4 transferable blocks
    dec.generate([ids[:2 * BS] + [5]], GREEDY)  # the decode side already holds 2 of them
    want = colocated(pre, ids, GREEDY)
    before_in = sample(dec, "pagedjax:kv_transfer_bytes_total", direction="in")
    before_out = sample(pre, "pagedjax:kv_transfer_bytes_total", direction="out")
    conn = Flaky(0)
    req = prefill_then_decode(pre, dec, conn, ids, GREEDY)
    assert same_output(req, want)
    (blocks,) = conn.sent
    assert blocks.first_block == 2 and blocks.num_blocks == 2  # only the rest travelled
    # bytes counted = the arrays: K and V, [layers, blocks, block_size, kv_heads, head_dim] float32
    m = dec.config.model
    size = 2 * m.num_layers * 2 * BS * m.num_kv_heads * m.head_dim * 4
    assert blocks.nbytes == size
    assert sample(dec, "pagedjax:kv_transfer_bytes_total", direction="in") - before_in == size
    assert sample(pre, "pagedjax:kv_transfer_bytes_total", direction="out") - before_out == size
    assert sample(dec, "pagedjax:kv_transfer_seconds_count", stage="import") > 0
    # the decode engine registered the transferred blocks: a repeat is served from its cache
    again = dec.generate([ids], GREEDY)[0]
    assert again.num_cached_tokens == 4 * BS and same_output(again, want)
    dec.pool.check_invariants()


def test_failed_transfer_is_retried_once_then_released(f32):
    pre, dec = f32
    ids = prompt(11, 50)
    want = colocated(pre, ids, GREEDY)
    failures = sample(dec, "pagedjax:kv_transfer_failures_total")
    conn = Flaky(1)  # one failure: the retry succeeds
    assert same_output(prefill_then_decode(pre, dec, conn, ids, GREEDY), want)
    assert len(conn.sent) == 2 and conn.num_buffers == 0
    assert sample(dec, "pagedjax:kv_transfer_failures_total") == failures + 1

    ids = prompt(12, 50)
    before = counts(dec.pool)
    conn = Flaky(2)  # both attempts fail: a clear error, and nothing stays reserved anywhere
    with pytest.raises(TransferError, match="planted"):
        prefill_then_decode(pre, dec, conn, ids, GREEDY)
    assert counts(dec.pool) == before
    assert conn.num_buffers == 0  # the sender's buffers were dropped
    assert not dec.has_unfinished()


def test_no_room_prefills_nothing(f32):
    pre, dec = f32
    before_dec, before_pre = counts(dec.pool), counts(pre.pool)
    queries = pre.scheduler.counters.prefix_queries
    held = [dec.reserve(prompt(100 + i, 480), GREEDY) for i in range(2)]  # 60 of 64 blocks pinned
    pinned = counts(dec.pool)
    with pytest.raises(NoRoom, match="cannot reserve"):
        prefill_then_decode(pre, dec, InProcessConnector(), prompt(102, 100), GREEDY)
    assert counts(dec.pool) == pinned  # the failed reservation changed nothing
    assert pre.scheduler.counters.prefix_queries == queries and counts(pre.pool) == before_pre
    assert not pre.has_unfinished()  # the prefill engine never saw the request
    for r in held:
        dec.release(r)
        dec.release(r)  # idempotent
    assert counts(dec.pool)[0] == before_dec[0] and dec.pool.num_used_blocks == 0


def test_aborted_waiting_request_frees_its_pins(f32):
    pre, dec = f32
    ids = prompt(21, 40)
    free = counts(dec.pool)[0]
    res = dec.reserve(ids, GREEDY)
    assert res.num_transfer == 2 and dec.pool.num_free_blocks == free - 3
    req = dec.add_request(ids, GREEDY, reservation=res)
    with pytest.raises(ValueError, match="reservation"):
        dec.add_request(ids, GREEDY, reservation=res)  # a reservation is taken over once
    dec.abort(req.request_id)
    dec.run_until_done()
    assert req.finish_reason == "abort" and counts(dec.pool)[0] == free and dec.pool.num_used_blocks == 0


def test_int8_cache_over_shared_memory(tiny_ckpt, f32):
    pre = make_engine(tiny_ckpt, num_blocks=32, kv_dtype="int8")
    dec = make_engine(tiny_ckpt, num_blocks=32, kv_dtype="int8")
    ids = prompt(31, 53)
    for params in (GREEDY, SEEDED):
        want = colocated(pre, ids, params)
        dec.reset_prefix_cache()
        assert same_output(prefill_then_decode(pre, dec, SharedMemoryConnector(), ids, params), want)
    blocks = pre.export_kv(ids, 1)
    m = dec.config.model
    # the scales and zeros travel: K's values, scales, zeros, then V's
    assert [a.dtype.name for a in blocks.arrays] == ["int8", "float16", "float16"] * 2
    assert blocks.arrays[1].shape == (m.num_layers, 2, BS, m.num_kv_heads, kv_scale_groups("int8", m.head_dim, "k"))
    # a record for another cache layout is refused with a clear error, before anything is written
    res = f32[1].reserve(ids, GREEDY)
    res.skip_blocks, res.num_transfer = 1, 2
    with pytest.raises(TransferError, match="do not match"):
        f32[1].import_kv(res, blocks)
    f32[1].release(res)
    assert f32[1].pool.num_used_blocks == 0


def test_shared_memory_connector():
    from multiprocessing import shared_memory

    from runtime.core.kv_transfer import KVBlocks

    arrays = [np.arange(2 * 3 * 4, dtype=np.int8).reshape(2, 3, 4), np.linspace(0, 1, 6, dtype=np.float32)]
    blocks = KVBlocks(16, "int8", 2, 1, [b"h1"], list(range(32)), arrays)
    conn = SharedMemoryConnector()
    handle = conn.send("r1", blocks)
    got = conn.recv(handle, timeout_s=1.0)
    assert got.header() == blocks.header() and all(np.array_equal(a, b) for a, b in zip(got.arrays, arrays))
    assert handle.nbytes == blocks.nbytes == 24 + 24
    conn.drop(handle)
    conn.drop(handle)  # idempotent
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=handle.segment)
    with pytest.raises(TransferTimeout, match="did not appear"):
        conn.recv(handle, timeout_s=0.05)


def test_reserved_requests_go_ahead_of_unreserved(f32):
    """Two reservations pin 60 of 64 blocks; a request without one that needs 32 waits in
    front. Were the reserved ones queued behind it, nothing could ever be admitted."""
    _, dec = f32
    big = dec.add_request(prompt(41, 500), SamplingParams(temperature=0.0, max_tokens=2))
    reqs = []
    for i in range(2):
        ids = prompt(42 + i, 480)
        res = dec.reserve(ids, SamplingParams(temperature=0.0, max_tokens=2))
        # (never imported: the decode engine computes the prompt itself -- slower, same tokens)
        reqs.append(dec.add_request(ids, SamplingParams(temperature=0.0, max_tokens=2), reservation=res))
    for _ in range(100):
        if not dec.has_unfinished():
            break
        dec.step()
    assert all(r.finish_reason == "length" for r in [*reqs, big])
    assert reqs[0].first_scheduled_time <= reqs[1].first_scheduled_time < big.first_scheduled_time
    assert dec.pool.num_used_blocks == 0
    dec.pool.check_invariants()


def test_ray_connector(f32):
    """The fleet's connector over a local Ray object store: one packed object per record,
    the arrays back bit for bit, Ray's timeout as TransferTimeout, drop frees the ref;
    and a whole prefill -> decode through it gives the colocated tokens."""
    ray = pytest.importorskip("ray")
    from runtime.core.kv_transfer import KVBlocks, RayConnector

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        arrays = [np.arange(2 * 3 * 4, dtype=np.int8).reshape(2, 3, 4), np.linspace(0, 1, 6, dtype=np.float32)]
        blocks = KVBlocks(16, "int8", 2, 1, [b"h1"], list(range(32)), arrays)
        conn = RayConnector()
        handle = conn.send("r1", blocks)
        got = conn.recv(handle, timeout_s=5.0)
        assert got.header() == blocks.header() and all(
            a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(got.arrays, arrays))
        assert handle.nbytes == blocks.nbytes and conn.num_buffers == 1
        conn.drop(handle)
        conn.drop(handle)  # idempotent
        assert conn.num_buffers == 0

        @ray.remote(num_cpus=0)
        def never() -> None:
            time.sleep(30)

        slow = RayHandle(never.remote(), blocks.header(), (), 0)
        with pytest.raises(TransferTimeout, match="not received within"):
            conn.recv(slow, timeout_s=0.2)
        ray.cancel(slow.ref, force=True)

        pre, dec = f32
        ids = prompt(61, 50)
        want = colocated(pre, ids, GREEDY)
        assert same_output(prefill_then_decode(pre, dec, conn, ids, GREEDY), want)
        assert conn.num_buffers == 0 and dec.pool.num_used_blocks == 0
    finally:
        if started:
            ray.shutdown()


@pytest.mark.real_model
def test_smollm2_through_prefill_and_decode_engines_matches_colocated(smollm2_ckpt):
    """The real model: 30 layers, GQA 9/3, head dim 64 -- 2 full blocks travel as one
    layer-stacked record; greedy and seeded outputs (logprobs included) equal one engine's."""
    pre, dec = (make_engine(smollm2_ckpt, num_blocks=128, max_num_seqs=4, max_num_batched_tokens=64)
                for _ in range(2))
    rng = np.random.default_rng(7)
    for params in (GREEDY, SEEDED):
        ids = [int(t) for t in rng.integers(3, 20000, size=45)]
        want = colocated(pre, ids, params)
        conn = InProcessConnector()
        req = prefill_then_decode(pre, dec, conn, ids, params)
        assert same_output(req, want), (req.output_ids, want.output_ids)
        assert req.num_cached_tokens == 2 * BS and conn.num_buffers == 0
    assert dec.pool.num_used_blocks == 0
    dec.pool.check_invariants()
