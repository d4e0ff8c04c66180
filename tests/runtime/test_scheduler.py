"""Scheduler on the host alone: the device step is simulated by committing tokens."""

from runtime.core.block_pool import BlockPool
from runtime.config import AdmissionPolicy, CacheConfig, SchedulerConfig
from runtime.core.request import Request, Status
from runtime.model.sampling import SamplingParams
from runtime.core.scheduler import Scheduler


def make(num_blocks=16, mode="optimistic", watermark=0.0, budget=64, seqs=8, **kw):
    cache = CacheConfig(16, num_blocks, "float32", True)
    env = SchedulerConfig(seqs, budget, 1024)
    pol = AdmissionPolicy(watermark=watermark, admission_mode=mode, max_num_seqs=seqs,
                          max_num_batched_tokens=budget, long_prefill_token_threshold=kw.pop("chunk", budget), **kw)
    return Scheduler(cache, env, pol, BlockPool(num_blocks, 16))


def req(rid, n, max_tokens=32, priority="interactive", start=3):
    return Request(rid, list(range(start, start + n)), SamplingParams(temperature=0.0, max_tokens=max_tokens),
                   priority)


def step(s):
    out = s.schedule()
    for r, n in out.scheduled:
        if s.commit(r, n):
            s.append_token(r, 7)
            if len(r.output_ids) >= r.params.max_tokens:
                s.finish(r, "length")
    return out


def test_chunked_prefill_mixes_with_decodes_under_budget():
    s = make(budget=32, chunk=20)
    a = req("a", 5)
    s.add(a)
    step(s)  # a prefilled
    b = req("b", 50)
    s.add(b)
    out = step(s)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 20)]  # chunk cap 20
    out = step(s)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 20)]
    out = step(s)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 10)]
    assert b.output_ids == [7] and out.num_batched_tokens == 11


def test_preemption_picks_batch_tier_then_least_work():
    s = make(num_blocks=6)
    inter = req("i", 30, priority="interactive")
    batch_big = req("bb", 20, priority="batch", start=40)
    batch_small = req("bs", 8, priority="batch", start=80)
    for r in (inter, batch_big, batch_small):
        s.add(r)
    step(s)
    assert s.pool.num_free_blocks == 1  # 2 + 2 + 1 blocks held
    for _ in range(40):
        out = step(s)
        if out.preempted:
            break
    # the victim is a batch request, and of those the one with the least computed work
    assert out.preempted[0] is batch_small
    assert inter.status is Status.RUNNING


def test_preempted_resume_before_new_arrivals():
    """Optimistic admission over a 5-block pool: two 30-token prompts grow until one is
    preempted; a request arriving after that is scheduled only after the victim resumes."""
    s = make(num_blocks=5, seqs=4)
    a, b = req("a", 30, max_tokens=40), req("b", 30, max_tokens=40, start=50)
    s.add(a)
    s.add(b)
    step(s)
    for _ in range(10):
        out = step(s)
        if out.preempted:
            break
    assert out.preempted, "the pool never ran out: no preemption to resume from"
    victim = out.preempted[0]
    assert victim.status is Status.PREEMPTED and victim.num_computed_tokens == 0
    late = req("late", 4, start=100)  # one block: it would fit before the victim does
    s.add(late)
    order: list[str] = []  # request ids in the order the scheduler first gives them tokens
    for _ in range(200):
        for r, _n in step(s).scheduled:
            if r in (victim, late) and r.request_id not in order:
                order.append(r.request_id)
        if len(order) == 2:
            break
    assert order == [victim.request_id, "late"]
    assert victim.num_preemptions == 1


def test_reserve_mode_admits_only_what_fits_and_never_preempts():
    s = make(num_blocks=8, mode="reserve")
    rs = [req(f"r{i}", 20, max_tokens=30, start=3 + 50 * i) for i in range(4)]  # 50 tokens -> 4 blocks each
    for r in rs:
        s.add(r)
    step(s)
    assert [r.status for r in rs].count(Status.RUNNING) == 2
    while any(not r.is_finished for r in rs):
        out = step(s)
        assert not out.preempted
    assert s.counters.preemptions == 0 and s.pool.num_used_blocks == 0


def test_max_admissions_per_step_spreads_admission():
    s = make(num_blocks=64, max_admissions_per_step=2)
    rs = [req(f"r{i}", 5, start=3 + 10 * i) for i in range(6)]
    for r in rs:
        s.add(r)
    assert len(step(s).scheduled) == 2
    assert len(step(s).scheduled) == 4


def test_prefix_hit_skips_cached_blocks_but_computes_last_token():
    s = make(num_blocks=32)
    a = req("a", 48, max_tokens=1)
    s.add(a)
    step(s)
    assert a.is_finished
    b = req("b", 48, max_tokens=1)  # identical prompt: 3 full blocks, last token must be recomputed
    s.add(b)
    out = step(s)
    assert b.num_cached_tokens == 32 and out.scheduled[0][1] == 16
    assert s.counters.prefix_hits == 32 and s.counters.prefix_queries == 96


def test_too_long_rejected_at_once():
    s = make(num_blocks=4)
    try:
        s.add(req("x", 60, max_tokens=10))
        raise AssertionError("should raise")
    except ValueError as exc:
        assert "can never fit" in str(exc)
    assert s.counters.rejections == {"too_long": 1}


def test_burst_with_one_prompt_prefills_it_once():
    s = make(num_blocks=64, budget=128, max_admissions_per_step=8)
    a, b, c = (req(x, 40, max_tokens=4) for x in "abc")  # same 40-token prompt: 2 full blocks
    for r in (a, b, c):
        s.add(r)
    out = step(s)
    assert [r.request_id for r, _ in out.scheduled] == ["a"]  # b and c wait for a's blocks
    out = step(s)
    assert {r.request_id: n for r, n in out.scheduled} == {"a": 1, "b": 8, "c": 8}
    assert b.num_cached_tokens == c.num_cached_tokens == 32
