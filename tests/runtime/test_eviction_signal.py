"""The KV eviction rate as a capacity signal (runtime/core/metrics.py eviction_signal; the
seeds: warn at 5%, alert at 10%): what counts as lost (a preempted request's uncached blocks,
cached blocks evicted within the window of their last use), the rate over its window, the
thresholds, /metrics and the console's dashboard."""

from __future__ import annotations

import pytest

from runtime.config import EvictionAlert
from runtime.core.block_pool import BlockPool
from runtime.core.metrics import EvictionSeries, eviction_signal
from tests.runtime.test_block_pool import BS, FakeClock, fill_and_cache
from tests.runtime.test_scheduler import make, req, step


def test_rate_is_lost_over_allocated_within_the_window_and_states_follow_the_thresholds():
    alert = EvictionAlert(window_s=60.0, warn=0.05, alert=0.10)
    # before the window: 1000 allocated, 500 lost (ignored); in it: 200 allocated
    samples = [(0.0, 1000, 500), (50.0, 1100, 500)]
    sig = eviction_signal(samples, 100.0, 1200, 504, alert)
    assert (sig.allocated, sig.lost, sig.rate, sig.state) == (200, 4, 0.02, "ok") and sig.advice == ""
    sig = eviction_signal(samples, 100.0, 1200, 512, alert)
    assert sig.rate == pytest.approx(0.06) and sig.state == "warn" and "KV budget" in sig.advice
    sig = eviction_signal(samples, 100.0, 1200, 530, alert)
    assert sig.state == "alert" and "add a replica" in sig.advice
    assert eviction_signal([], 0.0, 0, 0, alert).rate is None
    assert eviction_signal([(0.0, 10, 0)], 1.0, 10, 0, alert).rate is None  # nothing allocated
    with pytest.raises(ValueError, match="eviction_warn: need 0 < warn <= alert <= 1"):
        EvictionAlert(warn=0.2, alert=0.1)


def test_the_series_covers_the_window_whatever_the_step_rate():
    """Samples at most once a second, trimmed to one before the window: 10,000 steps in 100 s
    keep ~61 samples, and the rate still reads back to the window's start."""
    series = EvictionSeries()
    for i in range(10_000):
        t = i / 100.0
        series.add(t, i, i // 20, 60.0)
    assert 55 <= len(series.samples) <= 62 and series.samples[0][0] < 100.0 - 60.0 <= series.samples[1][0]
    sig = eviction_signal(list(series.samples), 100.0, 10_000, 500, EvictionAlert())
    assert sig.rate == pytest.approx(0.05, abs=0.002)


def test_only_recently_used_cached_blocks_count_when_evicted():
    clock = FakeClock()
    pool = BlockPool(2, BS, clock=clock)
    pool.recent_s = 60.0
    a = fill_and_cache(pool, [1, 2, 3, 4])
    b = fill_and_cache(pool, [5, 6, 7, 8])
    pool.free(a)
    clock.t = 30.0
    pool.free(b)
    clock.t = 80.0  # a unused for 80 s, b for 50 s
    pool.allocate(2)
    assert pool.num_evictions == 2 and pool.num_recent_evictions == 1
    assert pool.num_allocated == 4


def test_a_preemption_counts_the_blocks_it_drops():
    """A preempted request's blocks not in the prefix cache (its partial tail) are lost at
    once; its registered full blocks stay cached, and count when they are evicted while still
    recent (the pool's count)."""
    s = make(num_blocks=8, seqs=4)
    a = req("a", 20)  # one full 16-token block (registered) and a partial one
    s.add(a)
    step(s)
    assert len(a.held_blocks()) == 2
    s.preempt_all()
    assert s.counters.preempted_blocks_lost == 1 and s.pool.num_cached_blocks == 1
    s.pool.allocate(8)  # the cached block is reused for new data: a live prefix evicted
    assert s.pool.num_recent_evictions == 1


def test_engine_reports_the_rate_on_metrics_and_the_dashboard(tiny_ckpt):
    """Four long requests in a 12-block pool preempt each other: the engine's gauge and the
    dashboard show the rate and its state with what to do."""
    from runtime.model.sampling import SamplingParams
    from tests.console.admin_util import console_client, logged_in
    from tests.console.test_admin_pages import text_of
    from tests.engine_util import make_engine

    eng = make_engine(tiny_ckpt, num_blocks=12, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
                      watermark=0.0)
    eng.generate([[3 + (i * 7 + j) % 250 for j in range(40)] for i in range(4)],
                 SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert eng.scheduler.counters.preemptions > 0
    sig = eng.eviction()
    assert sig.lost > 0 and sig.rate > 0
    metrics = eng.metrics.render().decode()
    rate = next(float(x.split()[-1]) for x in metrics.splitlines() if x.startswith("pagedjax:kv_eviction_rate "))
    state = next(float(x.split()[-1]) for x in metrics.splitlines() if x.startswith("pagedjax:kv_eviction_state "))
    assert rate == pytest.approx(sig.rate) and state == ("ok", "warn", "alert").index(sig.state)
    with console_client(eng) as c:
        logged_in(c)
        page = c.get("/admin").text
    assert text_of(page, "eviction-rate").endswith("%")
    assert f"<strong>{sig.state.upper()}</strong>" in page
