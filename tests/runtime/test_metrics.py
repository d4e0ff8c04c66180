"""/metrics' engine state (runtime/core/metrics.py EngineStateCollector): read when scraped, under
the same names and meanings as before, so nothing has to keep it in step with the engine."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from runtime.model.sampling import SamplingParams
from tests.engine_util import make_engine

STATE_SERIES = {
    "pagedjax:num_requests_running": "gauge", "pagedjax:num_requests_waiting": "gauge",
    "pagedjax:num_requests_preempted": "gauge", "pagedjax:kv_cache_usage_perc": "gauge",
    "pagedjax:kv_blocks": "gauge", "pagedjax:compilations_total": "gauge",
    "pagedjax:prefix_cache_queries": "counter", "pagedjax:prefix_cache_hits": "counter",
    "pagedjax:prefix_cache_evictions": "counter", "pagedjax:num_preemptions": "counter",
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge",
}


def scrape(eng) -> dict[tuple[str, tuple], float]:
    fams = list(text_string_to_metric_families(eng.metrics.render().decode()))
    types = {f.name: f.type for f in fams}
    assert {k: types.get(k) for k in STATE_SERIES} == STATE_SERIES
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams for s in f.samples}


def test_state_is_read_at_scrape_time_not_at_the_last_step(tiny_ckpt):
    eng = make_engine(tiny_ckpt, num_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    system = list(range(3, 3 + 32))
    eng.generate([system + [100]], params)
    eng.add_request(system + [101], params)
    eng.add_request(system + [102], params, priority="batch")
    m = scrape(eng)  # no step since the two were queued: a mirror set per step would say 0
    assert m[("pagedjax:num_requests_waiting", ())] == m[("vllm:num_requests_waiting", ())] == 2
    assert m[("pagedjax:num_requests_running", ())] == 0
    eng.step()
    m = scrape(eng)
    pool, c = eng.pool, eng.scheduler.counters
    assert m[("pagedjax:num_requests_running", ())] == m[("vllm:num_requests_running", ())] == 2
    assert m[("pagedjax:kv_blocks", (("state", "used"),))] == pool.num_used_blocks > 0
    assert m[("pagedjax:kv_blocks", (("state", "cached"),))] == pool.num_cached_blocks
    assert sum(m[("pagedjax:kv_blocks", (("state", s),))] for s in ("used", "cached", "free")) == 64
    assert m[("pagedjax:kv_cache_usage_perc", ())] == pool.usage()
    assert m[("pagedjax:prefix_cache_queries_total", ())] == c.prefix_queries > 0
    assert m[("pagedjax:prefix_cache_hits_total", ())] == c.prefix_hits == 64  # 32 cached tokens, twice
    assert ("pagedjax:prefix_cache_hits_created", ()) in m  # as prometheus_client's own Counter has it
    eng.run_until_done()
    assert scrape(eng)[("pagedjax:num_requests_running", ())] == 0
