"""Warm-up covers every shape: a long varied workload compiles nothing new."""

import asyncio
import re
import time
from collections import Counter

import numpy as np

from runtime.core.async_engine import AsyncEngine
from runtime.model.runner import compilations
from runtime.model.sampling import SamplingParams
from tests.engine_util import make_engine


def test_no_compilations_after_warmup(tiny_ckpt):
    eng = make_engine(tiny_ckpt, num_blocks=96, max_num_seqs=8, max_num_batched_tokens=64, warmup=True)
    before = compilations()
    assert before >= eng.compilations_at_ready > 0
    rng = np.random.default_rng(0)
    reqs = []
    for i in range(200):
        n = int(rng.integers(1, 200))
        params = SamplingParams(temperature=float(rng.choice([0.0, 0.8])), top_p=0.9, max_tokens=int(rng.integers(1, 24)),
                                seed=i, logprobs=int(rng.integers(0, 3)) if i % 5 == 0 else None,
                                presence_penalty=0.5 if i % 7 == 0 else 0.0)
        reqs.append(eng.add_request(list(rng.integers(3, 260, size=n)), params,
                                    priority="batch" if i % 3 == 0 else "interactive"))
        if i % 9 == 0:
            eng.step()
    eng.run_until_done()
    assert compilations() == before
    assert eng.pool.num_used_blocks == 0
    text = eng.metrics.render().decode()
    by_reason: Counter[str] = Counter()
    for line in text.splitlines():
        if line.startswith("pagedjax:request_success_total{"):
            by_reason[re.search(r'finished_reason="([^"]+)"', line).group(1)] += float(line.split()[-1])
    assert sum(by_reason.values()) == 200
    assert by_reason == Counter(r.finish_reason for r in reqs)  # each request counted under its own reason


def test_metrics_and_snapshot(tiny_ckpt):
    eng = make_engine(tiny_ckpt, num_blocks=64)
    system = list(range(3, 3 + 64))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    eng.generate([system + [100]], params)
    r = eng.add_request(system + [101, 102], params, priority="batch")
    eng.step()
    snap = eng.snapshot()
    assert snap.used_blocks > 0 and snap.prefix_hits == 64
    assert any(b.state == "used" and r.request_id in b.owners for b in snap.blocks)
    assert len(snap.blocks) == 64 and snap.used_blocks + snap.cached_blocks + snap.free_blocks == 64
    (view,) = [v for v in snap.requests if v.request_id == r.request_id]
    assert view.priority == "batch" and view.cached_tokens == 64 and view.blocks == len(r.block_ids)
    eng.run_until_done()
    text = eng.metrics.render().decode()
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
                 "prompt_tokens_total", "generation_tokens_total", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
                 "request_queue_time_seconds_bucket", "kv_blocks", "compilations_total", "step_time_seconds_bucket"):
        assert f"pagedjax:{name}" in text, name
    hits = float(next(ln for ln in text.splitlines() if ln.startswith("pagedjax:prefix_cache_hits_total")).split()[-1])
    assert hits == 64
    gen = float(next(ln for ln in text.splitlines() if ln.startswith("pagedjax:generation_tokens_total")).split()[-1])
    assert gen == 8


def test_async_engine_streams_and_aborts(tiny_ckpt):
    eng = make_engine(tiny_ckpt)
    aeng = AsyncEngine(eng)
    aeng.start()

    async def main():
        outs = [o async for o in aeng.stream([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=6,
                                                                        ignore_eos=True))]
        assert outs[-1].finished and outs[-1].completion_tokens == 6
        assert sum(len(o.token_ids) for o in outs) == 6
        agen = aeng.stream([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=10_000 // 40, ignore_eos=True))
        await agen.__anext__()
        await agen.aclose()  # consumer went away -> abort

    asyncio.run(main())
    # The abort takes effect at the engine thread's next step boundary: wait for that (bounded
    # generously: a loaded machine's step can take a while), not a fixed number of naps.
    deadline = time.monotonic() + 60
    while eng.has_unfinished():
        assert time.monotonic() < deadline, "the aborted request never finished"
        time.sleep(0.01)
    assert eng.pool.num_used_blocks == 0
    aeng.stop()
    assert not aeng.running


def test_penalty_state_rows_are_cleared_only_where_reset():
    """The step clears the penalty-state rows that new requests take (reset), in a loop over
    just those rows: the others, reset flags on padding included, keep their counts."""
    from types import SimpleNamespace

    import jax.numpy as jnp

    from runtime.model.runner import _reset_state_rows

    rng = np.random.default_rng(0)
    counts = rng.integers(1, 5, size=(6, 40)).astype(np.int32)
    mask = rng.random((6, 40)) < 0.5
    inp = SimpleNamespace(reset_rows=jnp.array([True, False, True, False]), state_rows=jnp.array([4, 1, 0, 2]))
    c, m = (np.asarray(a) for a in _reset_state_rows(jnp.asarray(counts), jnp.asarray(mask), inp))
    assert (c[[0, 4]] == 0).all() and not m[[0, 4]].any()
    np.testing.assert_array_equal(c[[1, 2, 3, 5]], counts[[1, 2, 3, 5]])
    np.testing.assert_array_equal(m[[1, 2, 3, 5]], mask[[1, 2, 3, 5]])
    none = SimpleNamespace(reset_rows=jnp.zeros(4, bool), state_rows=jnp.array([4, 1, 0, 2]))
    c, m = (np.asarray(a) for a in _reset_state_rows(jnp.asarray(counts), jnp.asarray(mask), none))
    np.testing.assert_array_equal(c, counts)
    np.testing.assert_array_equal(m, mask)
