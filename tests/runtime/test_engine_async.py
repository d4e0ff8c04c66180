"""Async scheduling: step N+1 is launched before step N is read back; outputs must not change."""

import numpy as np

from runtime.model.sampling import SamplingParams
from tests.engine_util import make_engine


def _mixed_params(i: int) -> SamplingParams:
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, presence_penalty=0.7, repetition_penalty=1.3,
                       ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=20, seed=i, max_tokens=8, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, stop=("e",)),
    ]
    return kinds[i % len(kinds)]


def test_async_and_sync_scheduling_give_the_same_outputs(tiny_ckpt):
    rng = np.random.default_rng(11)
    prompts = [list(rng.integers(3, 260, size=int(rng.integers(3, 120)))) for _ in range(20)]
    params = [_mixed_params(i) for i in range(20)]
    runs = {}
    for mode in (True, False):
        eng = make_engine(tiny_ckpt, num_blocks=128)
        eng.set_async_scheduling(mode)
        reqs = eng.generate(prompts, params)
        runs[mode] = [(r.output_ids, r.finish_reason, [lp[0] for lp in r.logprobs]) for r in reqs]
        assert eng.pool.num_used_blocks == 0 and not eng.has_unfinished()
        eng.pool.check_invariants()
    for a, b in zip(runs[True], runs[False]):
        assert a[0] == b[0] and a[1] == b[1]
        np.testing.assert_allclose(a[2], b[2], rtol=1e-5)


def test_a_step_is_in_flight_between_beats_and_its_token_is_pending(tiny_ckpt):
    eng = make_engine(tiny_ckpt)
    req = eng.add_request([5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    eng.step()  # launches the prefill; nothing read back yet
    assert eng._inflight is not None and req.num_pending == 1 and req.output_ids == []
    eng.step()  # launches the first decode (its input read on the device), reads the prefill back
    assert len(req.output_ids) == 1 and req.num_pending == 1
    eng.run_until_done()
    assert len(req.output_ids) == 3 and req.num_pending == 0 and req.finish_reason == "length"
    assert eng._inflight is None


def test_stop_seen_late_drops_the_extra_token_and_frees_blocks(tiny_ckpt):
    eng = make_engine(tiny_ckpt, num_blocks=64)
    rng = np.random.default_rng(3)
    prompt = list(rng.integers(3, 260, size=20))
    ref = make_engine(tiny_ckpt, num_blocks=64)
    ref.set_async_scheduling(False)
    want = ref.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))[0].output_ids
    stop_tok = want[5]
    chunks = []
    req = eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=(stop_tok,)),
                          on_output=chunks.append)
    eng.run_until_done()
    cut = want.index(stop_tok) + 1
    assert req.output_ids == want[:cut] and req.finish_reason == "stop"
    assert [t for c in chunks for t in c.token_ids] == want[:cut]  # the in-flight token never reached the client
    assert eng.pool.num_used_blocks == 0
    eng.pool.check_invariants()
