import numpy as np
import pytest

from runtime.model.dense import dense_greedy
from runtime.model.sampling import SamplingParams
from runtime.core.scheduler import Overloaded
from tests.engine_util import make_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def prompts(n, rng, lo=3, hi=150, vocab=260):
    return [list(rng.integers(3, vocab, size=int(rng.integers(lo, hi)))) for _ in range(n)]


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    return make_engine(tiny_ckpt)


def test_paged_matches_dense_greedy(engine):
    rng = np.random.default_rng(1)
    cfg, params = engine.config.model, engine.runner.params
    for p in prompts(4, rng, 5, 60):
        want = list(dense_greedy(cfg, params, p, 12))
        (req,) = engine.generate([p], GREEDY)
        assert req.output_ids == want


def test_batch_invariance_greedy_and_seeded(engine):
    rng = np.random.default_rng(2)
    ps = prompts(32, rng, 3, 150)  # some prompts exceed the 64-token step budget -> chunked
    assert max(map(len, ps)) > 64
    for params in (GREEDY, SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=12, seed=7,
                                          ignore_eos=True)):
        together = [r.output_ids for r in engine.generate(ps, params)]
        alone = [engine.generate([p], params)[0].output_ids for p in ps]
        assert together == alone
        assert all(len(o) == 12 for o in together)


def test_prefix_cache_hits_and_same_outputs(tiny_ckpt, engine):
    rng = np.random.default_rng(3)
    system = list(rng.integers(3, 260, size=320))
    a = engine.generate([system + [5, 6, 7]], GREEDY)[0]
    b = engine.generate([system + [8, 9, 10, 11]], GREEDY)[0]
    assert b.num_cached_tokens >= 304 and b.num_cached_tokens % 16 == 0
    nocache = make_engine(tiny_ckpt, prefix_cache=False)
    b2 = nocache.generate([system + [8, 9, 10, 11]], GREEDY)[0]
    assert b2.num_cached_tokens == 0
    assert b.output_ids == b2.output_ids
    assert a.output_ids == nocache.generate([system + [5, 6, 7]], GREEDY)[0].output_ids


@pytest.mark.parametrize("mode", ["optimistic", "reserve"])
def test_kv_pressure(tiny_ckpt, mode):
    rng = np.random.default_rng(4)
    ps = prompts(24, rng, 30, 60)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    # about three requests' worth of blocks: (60 + 40) / 16 -> 7 blocks each
    eng = make_engine(tiny_ckpt, num_blocks=21, admission_mode=mode, watermark=0.0, prefix_cache=False)
    reqs = eng.generate(ps, params)
    # The same prompts with room to spare (batch invariance makes batching them fair).
    want = [r.output_ids for r in make_engine(tiny_ckpt, num_blocks=512).generate(ps, params)]
    assert [r.output_ids for r in reqs] == want
    assert all(r.finish_reason == "length" for r in reqs)
    pre = eng.scheduler.counters.preemptions
    assert (pre > 0) if mode == "optimistic" else (pre == 0)
    assert eng.pool.num_used_blocks == 0
    assert eng.pool.num_free_blocks == eng.pool.num_blocks
    eng.pool.check_invariants()


def test_live_watermark_lowers_concurrency(tiny_ckpt):
    eng = make_engine(tiny_ckpt, num_blocks=64, watermark=0.0, max_admissions_per_step=64,
                      max_num_seqs=16, max_num_batched_tokens=1024)
    rng = np.random.default_rng(5)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for p in prompts(16, rng, 40, 48):  # 3 prompt blocks each
        eng.add_request(p, params)
    eng.step()
    assert len(eng.scheduler.running) == 16
    eng.run_until_done()
    new = eng.update_policy("tester", watermark=0.5)
    assert new.watermark == 0.5
    for p in prompts(16, rng, 40, 48):
        eng.add_request(p, params)
    eng.step()
    # 32 of 64 blocks are held back: admissions stop once fewer than 32 + 3 are free
    assert len(eng.scheduler.running) == 10
    eng.run_until_done()


@pytest.mark.parametrize("changes,field", [({"watermark": 1.5}, "watermark"), ({"watermark": -0.1}, "watermark"),
                                           ({"max_num_batched_tokens": 10**6}, "max_num_batched_tokens"),
                                           ({"bogus": 1}, "bogus"), ({"admission_mode": "yolo"}, "admission_mode")])
def test_invalid_policy_rejected_and_old_kept(engine, changes, field):
    before = engine.policy
    with pytest.raises(ValueError, match=field):
        engine.update_policy("tester", **changes)
    assert engine.policy == before


def test_failed_step_fails_only_its_requests(engine):
    rng = np.random.default_rng(6)
    a = engine.add_request(prompts(1, rng)[0], GREEDY)
    engine.runner.fail_next_step = RuntimeError("planted")
    engine.step()
    assert a.finish_reason == "error"
    (b,) = engine.generate(prompts(1, rng), GREEDY)
    assert b.finish_reason == "length" and len(b.output_ids) == 12
    assert engine.pool.num_used_blocks == 0
    engine.pool.check_invariants()


def test_queue_limits_and_too_long(tiny_ckpt):
    eng = make_engine(tiny_ckpt, max_queue_len=2)
    eng.add_request([5, 6], GREEDY)
    eng.add_request([5, 6], GREEDY)
    with pytest.raises(Overloaded):
        eng.add_request([5, 6], GREEDY)
    with pytest.raises(ValueError, match="context length"):
        eng.add_request([5] * 500, SamplingParams(max_tokens=100))
    eng.run_until_done()


def test_stop_conditions_and_logprobs(engine):
    p = [10, 20, 30, 40]
    full = engine.generate([p], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0]
    stop_tok = full.output_ids[3]
    r = engine.generate([p], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=(stop_tok,),
                                            ignore_eos=True))[0]
    assert r.finish_reason == "stop" and r.output_ids[-1] == stop_tok
    assert len(r.output_ids) == full.output_ids.index(stop_tok) + 1
    r = engine.generate([p], SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True))[0]
    assert len(r.logprobs) == 5
    chosen, top = r.formatted_logprobs()[0]
    assert len(top) == 3 and top[0][0] == r.output_ids[0] and abs(top[0][1] - chosen) < 1e-5


def test_request_logprobs_stay_raw_and_format_as_the_client_sees_them(engine):
    """One representation: a Request holds the step's raw rows before and after generate();
    formatted_logprobs() is exactly what its streamed outputs carried."""
    outs = []
    sp = SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, prompt_logprobs=2, ignore_eos=True)
    r = engine.generate([[10, 20, 30, 40]], sp, on_output=outs.append)[0]
    assert len(r.logprobs) == 4 and all(isinstance(e[1], np.ndarray) for e in r.logprobs)
    assert r.formatted_logprobs() == [e for o in outs for e in o.logprobs]
    streamed_prompt = next(o.prompt_logprobs for o in outs if o.prompt_logprobs is not None)
    assert [None, *r.formatted_prompt_logprobs()] == streamed_prompt and len(streamed_prompt) == 4


def test_stop_string_truncates_text(engine):
    p = [10, 20, 30, 40]
    outs = []
    engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                       on_output=outs.append)
    engine.run_until_done()
    text = "".join(o.text for o in outs)
    assert len(text) >= 4
    stop = text[2:4]
    outs2 = []
    engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, stop=(stop,)),
                       on_output=outs2.append)
    engine.run_until_done()
    assert outs2[-1].finish_reason == "stop" and outs2[-1].stop_reason == stop
    assert "".join(o.text for o in outs2) == text[:text.index(stop)]


def test_abort_frees_blocks(engine):
    r = engine.add_request(list(range(3, 100)), GREEDY)
    engine.step()
    assert engine.pool.num_used_blocks > 0
    engine.abort(r.request_id)
    engine.step()
    assert r.finish_reason == "abort" and engine.pool.num_used_blocks == 0
