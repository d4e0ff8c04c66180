"""The admission quote and its step-time model (runtime/core/step_model.py): the model learns
per token bucket and interpolates; a quote reads the live queue, the prefix cache and the
queue limits and queues nothing; /v1/admission/quote answers it for completions and chat
bodies; a 429's Retry-After follows the model."""

from __future__ import annotations

import re

import numpy as np
import pytest

from runtime.core.step_model import StepTimeModel
from runtime.model.sampling import SamplingParams
from tests.engine_util import make_engine


def prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 260, size=n)]


def test_the_step_time_model():
    m = StepTimeModel()
    assert m.predict(10) is None
    m.observe(8, 0.010)     # bucket 8
    m.observe(64, 0.050)    # bucket 64
    assert m.predict(1) == pytest.approx(0.010) and m.predict(8) == pytest.approx(0.010)
    assert m.predict(36) == pytest.approx(0.030)           # halfway between the buckets
    assert m.predict(128) == pytest.approx(0.100)          # past the largest: in proportion
    m.observe(60, 0.100)    # the same bucket: an average that leans to the past
    assert 0.050 < m.predict(64) < 0.100
    m.observe(0, 1.0)       # (an empty beat teaches nothing)
    assert m.observed == 3


def test_a_quote_reads_the_queue_and_the_prefix_cache_and_queues_nothing(tiny_ckpt):
    eng = make_engine(tiny_ckpt, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256,
                      max_queue_len=3)
    p = prompt(0, 100)
    q = eng.quote(p, 8)
    assert q.admit and q.predicted_ttft_s is None and "no step measured yet" in q.reason
    assert q.queue_ahead == 0 and q.tokens_ahead == 100 and q.prefix_hit_tokens == 0
    eng.generate([p], SamplingParams(temperature=0.0, max_tokens=4))  # steps measured, the prompt cached
    q = eng.quote(p, 8)
    assert q.admit and q.prefix_hit_tokens == 96 and q.tokens_ahead == 4
    assert q.predicted_ttft_s > 0 and q.predicted_itl_s > 0 and q.reason == "admitted at the next step"
    assert not eng.has_unfinished()  # (nothing was queued)
    for i in range(3):
        eng.add_request(prompt(10 + i, 60), SamplingParams(temperature=0.0, max_tokens=4))
    q2 = eng.quote(prompt(20, 60), 8)
    assert not q2.admit and q2.reason == "queue_full" and q2.retry_after_s > 0
    batch = eng.quote(prompt(21, 60), 8, priority="batch")
    assert batch.queue_ahead == 3
    eng.run_until_done()
    q3 = eng.quote(prompt(22, 60), 8)
    assert q3.admit and q3.queue_ahead == 0
    long = eng.quote(prompt(23, 250), 100)
    assert not long.admit and long.reason.startswith("too_long")
    with pytest.raises(ValueError, match="priority"):
        eng.quote(p, 8, priority="urgent")


def test_a_quote_grows_with_the_queue_ahead(tiny_ckpt):
    eng = make_engine(tiny_ckpt, num_blocks=128, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=256)
    eng.generate([prompt(1, 80)], SamplingParams(temperature=0.0, max_tokens=8))
    empty = eng.quote(prompt(2, 80), 8)
    for i in range(4):
        eng.add_request(prompt(30 + i, 120), SamplingParams(temperature=0.0, max_tokens=8))
    busy = eng.quote(prompt(2, 80), 8)
    assert busy.queue_ahead == 4 and busy.tokens_ahead == 4 * 120 + 80
    # (7x the tokens; the measured step times make the ratio vary, 3-6x seen)
    assert busy.predicted_ttft_s > 1.5 * empty.predicted_ttft_s and busy.reason == "queued behind 4 requests"
    eng.run_until_done()


def test_the_endpoint_and_retry_after(tiny_ckpt):
    from tests.console.admin_util import API_KEY, console_client

    eng = make_engine(tiny_ckpt, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256,
                      max_queue_len=1)
    eng.generate([prompt(0, 40)], SamplingParams(temperature=0.0, max_tokens=4))
    h = {"Authorization": f"Bearer {API_KEY}"}
    with console_client(eng) as c:
        r = c.post("/v1/admission/quote", json={"model": "tiny", "prompt": prompt(0, 40), "max_tokens": 8}, headers=h)
        assert r.status_code == 200, r.text
        js = r.json()
        assert js["admit"] is True and js["predicted_ttft_s"] > 0 and js["predicted_itl_s"] > 0
        assert js["prefix_hit_tokens"] == 32 and js["retry_after_s"] is None and "replica" in js
        chat = c.post("/v1/admission/quote", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
                      headers=h)
        assert chat.status_code == 200 and chat.json()["admit"] is True
        assert c.post("/v1/admission/quote", json={"model": "other", "prompt": "x"}, headers=h).status_code == 404
        assert c.post("/v1/admission/quote", json={"model": "tiny", "prompt": "x"}).status_code == 401
        eng.add_request(prompt(5, 40), SamplingParams(temperature=0.0, max_tokens=4))  # the queue is full now
        full = c.post("/v1/completions", json={"model": "tiny", "prompt": prompt(6, 40), "max_tokens": 4}, headers=h)
        assert full.status_code == 429 and int(full.headers["retry-after"]) >= 1
        q = c.post("/v1/admission/quote", json={"model": "tiny", "prompt": prompt(6, 40)}, headers=h).json()
        assert q["admit"] is False and q["reason"] == "queue_full"
    eng.run_until_done()


def test_slo_attainment_counts_requests_and_tokens_against_the_targets():
    from types import SimpleNamespace

    from runtime.core.metrics import SLOSample, slo_attainment

    pol = SimpleNamespace(slo_ttft_interactive_s=0.5, slo_itl_interactive_s=0.05, slo_ttft_batch_s=0.0,
                          slo_itl_batch_s=0.0)
    samples = [SLOSample(100.0, "interactive", "ttft", 0.9),   # outside a 60 s window at t=200
               SLOSample(150.0, "interactive", "ttft", 0.4), SLOSample(160.0, "interactive", "ttft", 0.6),
               SLOSample(170.0, "interactive", "itl", 0.01), SLOSample(171.0, "interactive", "itl", 0.07),
               SLOSample(172.0, "interactive", "itl", 0.05), SLOSample(180.0, "batch", "ttft", 9.0)]
    got = slo_attainment(samples, pol, now=200.0, window_s=60.0)
    assert got == {("interactive", "ttft"): (1, 2), ("interactive", "itl"): (2, 3)}  # batch: no target
    assert slo_attainment(samples, pol, now=200.0, window_s=300.0)[("interactive", "ttft")] == (1, 3)


def test_targets_are_policy_fields_and_the_dashboard_and_metrics_show_attainment(tiny_ckpt):
    from tests.console.admin_util import console_client, logged_in

    eng = make_engine(tiny_ckpt, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256)
    eng.update_policy("test", slo_ttft_interactive_s=30.0, slo_itl_interactive_s=1e-6)
    with pytest.raises(ValueError, match="slo_ttft_batch_s: must be between 0.0 and 3600.0"):
        eng.update_policy("test", slo_ttft_batch_s=-1.0)
    eng.generate([prompt(i, 40) for i in range(3)], SamplingParams(temperature=0.0, max_tokens=6))
    got = eng.slo_attainment(60.0)
    assert got[("interactive", "ttft")] == (3, 3)            # 30 s: every first token in time
    assert got[("interactive", "itl")][0] == 0 and got[("interactive", "itl")][1] >= 3 * 4  # 1 us: none
    eng._last_slo = 0.0
    eng._refresh_gauges(0.01, 1, 1)
    text = eng.metrics.render().decode()
    assert 'pagedjax:slo_attainment{metric="ttft",tier="interactive",window="60s"} 1.0' in text
    assert 'pagedjax:slo_attainment{metric="itl",tier="interactive",window="60s"} 0.0' in text
    with console_client(eng) as c:
        logged_in(c)
        dash = c.get("/admin").text
        assert 'id="slo-table"' in dash and "100.0%" in dash and "(3 of 3 requests)" in dash
        assert 'id="quote-check"' in dash
        pol = c.get("/admin/policy").text
        assert "TTFT target, interactive (s)" in pol and 'name="slo_itl_batch_s"' in pol


def test_the_policy_page_previews_a_change_without_applying_it(tiny_ckpt):
    from tests.console.admin_util import console_client, logged_in

    eng = make_engine(tiny_ckpt, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256)
    eng.generate([prompt(0, 40)], SamplingParams(temperature=0.0, max_tokens=4))  # steps measured
    for i in range(3):
        eng.add_request(prompt(1 + i, 48), SamplingParams(temperature=0.0, max_tokens=16))
    with console_client(eng) as c:
        csrf = logged_in(c)
        audit = c.app.state.store.audit_count("policy")
        r = c.post("/admin/policy", data={"watermark": "0.5", "max_num_batched_tokens": "8", "preview": "1",
                                          "_csrf_token": csrf})
        assert r.status_code == 200 and 'id="policy-preview"' in r.text
        rows = re.findall(r'<tr><th scope="row">(current|proposed)</th><td class="num">([\d,]+)</td>', r.text)
        (_, cur), (_, new) = rows
        # 64 blocks: B_max for 3 waiting 48-token prompts (optimistic: their context, 3 blocks each) is capped
        # by max_num_seqs 4 now; with half the pool held back it is 32 // 3 = 10, still capped at 4
        assert int(cur) == int(new) == 4
        assert "medians of the 3 running and waiting requests" in r.text
        assert eng.policy.watermark != 0.5 and c.app.state.store.audit_count("policy") == audit  # nothing applied
        cur_q = eng.quote(prompt(9, 48), 16)
        from runtime.core import step_model

        slow = step_model.quote(eng, prompt(9, 48), 16, policy=eng.policy.replace(eng.envelope, max_num_batched_tokens=8))
        assert slow.predicted_ttft_s > cur_q.predicted_ttft_s  # a smaller token budget: later first tokens
        bad = c.post("/admin/policy", data={"watermark": "2", "preview": "1", "_csrf_token": csrf})
        assert bad.status_code == 422 and 'id="policy-preview"' not in bad.text
    eng.run_until_done()
