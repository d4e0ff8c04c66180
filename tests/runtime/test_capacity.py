"""One capacity rule and one request owner (runtime/core/capacity.py, runtime/core/request.py).

The scheduler's admission, a disaggregated reservation and the fleet router's fit check
must answer alike on the same state: a reservation that succeeds is admitted, and a
replica the router sends a request to takes it. And `step_row` only reads a request: the
scheduler's `commit` does the step's bookkeeping. Host only (no model, no device step).
"""

from __future__ import annotations

import copy
import threading
from types import SimpleNamespace

import pytest

from runtime.core import capacity
from runtime.core.request import step_row
from runtime.core.disagg import NoRoom, release, reserve
from runtime.fleet.policy import RouteRequest, route
from runtime.fleet.replica import replica_stats
from runtime.core.metrics import EngineMetrics
from runtime.core.request import Request, uses_prefix_cache
from runtime.model.sampling import SamplingParams
from tests.runtime.test_scheduler import make, req, step

CACHED_START, CACHED_LEN = 500, 40  # a finished prompt whose 2 full blocks stay cached


def state(mode: str, watermark: float, running: int, cached: bool):
    """A scheduler holding `running` decoding requests (1 block each, no growth in the next
    step) and, if `cached`, the cached blocks of an earlier prompt; nothing waiting."""
    s = make(num_blocks=12, mode=mode, watermark=watermark)
    if cached:
        s.add(req("cached", CACHED_LEN, max_tokens=1, start=CACHED_START))
        step(s)
    for i in range(running):
        s.add(req(f"run{i}", 3, max_tokens=20, start=100 + 30 * i))
    step(s)
    assert len(s.running) == running and s.num_waiting == 0
    return s


def engine_of(s) -> SimpleNamespace:
    """What disagg.reserve and replica_stats read of an engine."""
    return SimpleNamespace(pool=s.pool, scheduler=s, policy=s.policy, envelope=s.envelope,
                           lock=threading.RLock(), metrics=EngineMetrics())


def candidate(n: int, max_tokens: int, penalty: bool) -> tuple[list[int], SamplingParams]:
    start = CACHED_START if n == CACHED_LEN else 900
    return list(range(start, start + n)), SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                        repetition_penalty=1.2 if penalty else 1.0)


def admitted(s, prompt: list[int], params: SamplingParams) -> bool:
    r = Request("cand", prompt, params)
    s.add(r)
    return any(x is r for x, _ in s.schedule().scheduled)


@pytest.mark.parametrize("mode", ["optimistic", "reserve"])
@pytest.mark.parametrize("watermark", [0.0, 0.25])
@pytest.mark.parametrize("running", [0, 1, 3])
@pytest.mark.parametrize("cached", [False, True])
def test_reservation_router_and_admission_agree(mode, watermark, running, cached):
    seen = set()
    for n in (5, 20, CACHED_LEN, 70, 100):
        for max_tokens in (1, 30, 60):
            for penalty in (False, True):
                prompt, params = candidate(n, max_tokens, penalty)
                a = state(mode, watermark, running, cached)
                try:
                    release(engine_of(a), reserve(engine_of(a), prompt, params))
                    reserved = True
                except NoRoom:
                    reserved = False
                admits = admitted(state(mode, watermark, running, cached), prompt, params)
                assert reserved == admits, (n, max_tokens, penalty)
                seen.add(admits)
                if cached and n == CACHED_LEN and not penalty:
                    continue  # the router does not count the cached hits it would revive
                stats = replica_stats(engine_of(state(mode, watermark, running, cached)), "r0")
                routed = route(RouteRequest((), n, max_tokens), [stats], matched=lambda r: 0).replica
                assert (routed is not None) == admits, (n, max_tokens, penalty)
    if mode == "reserve" and running == 3:
        assert seen == {True, False}  # the grid reaches both sides of the line


def test_headroom_is_the_rule_admission_applies():
    pol = make(watermark=0.25).policy
    pool = make(num_blocks=12).pool
    # idle: the watermark is not kept; 12 free blocks take a 12-block claim
    assert capacity.headroom(pool, pol, num_tokens=190, max_total_tokens=190, hits=[], promised=0,
                             engine_busy=False).fits
    busy = capacity.headroom(pool, pol, num_tokens=150, max_total_tokens=190, hits=[], promised=0, engine_busy=True)
    assert (busy.need, busy.available, busy.kept_free, busy.fits) == (10, 12, 3, False)
    # a reserved request passed the watermark when it was reserved
    pinned = pool.allocate(10)
    room = capacity.headroom(pool, pol, num_tokens=150, max_total_tokens=190, hits=[], promised=0,
                             engine_busy=True, pinned=pinned)
    assert (room.available, room.kept_free, room.fits) == (12, 0, True)


def test_one_predicate_for_the_prefix_cache():
    plain = SamplingParams(temperature=0.0)
    for params in (SamplingParams(temperature=0.0, presence_penalty=0.5),
                   SamplingParams(temperature=0.0, frequency_penalty=0.5),
                   SamplingParams(temperature=0.0, repetition_penalty=1.1),
                   SamplingParams(temperature=0.0, prompt_logprobs=1)):
        assert not uses_prefix_cache(params) and not Request("x", [1], params).uses_prefix_cache
        s = state("optimistic", 0.0, 0, cached=True)
        prompt = list(range(CACHED_START, CACHED_START + CACHED_LEN))
        res = reserve(engine_of(s), prompt, params)
        assert res.block_hashes == [] and res.num_transfer == 0  # transfers nothing ...
        release(engine_of(s), res)
        r = Request("y", prompt, params)
        s.add(r)
        s.schedule()
        assert r.num_cached_tokens == 0  # ... and computes its whole prompt
    assert uses_prefix_cache(plain)


def fields(r: Request) -> dict:
    return copy.deepcopy(vars(r))


def test_step_row_reads_the_request_and_commit_counts_the_penalty_rows():
    s = make(budget=32, chunk=20)
    r = Request("a", list(range(3, 53)), SamplingParams(temperature=0.0, max_tokens=4, repetition_penalty=1.2))
    s.add(r)
    rows, in_flight = [], False
    for _ in range(5):  # as the engine's pipeline: plan and launch step N+1, then read step N back
        (got, n), = s.schedule().scheduled
        assert got is r
        before = fields(r)
        row = step_row(r, n)
        assert fields(r) == before and step_row(r, n) == row  # reads only: the same row twice
        sampled = s.commit(r, n)
        rows.append((row.start_pos, len(row.token_ids), row.count_from, row.pending_last, r.row_counted_upto))
        if in_flight:
            s.append_token(r, 7)
        in_flight = sampled
    # prefill chunks add every token; a decode row's input is the token the device sampled and
    # already counted in the row's penalty state, so it is not counted again (count_from 1)
    assert rows == [(0, 20, 0, False, 20), (20, 20, 0, False, 40), (40, 10, 0, False, 51),
                    (50, 1, 1, True, 52), (51, 1, 1, True, 53)]
