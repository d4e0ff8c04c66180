"""Speculative decoding (n-gram prompt lookup): the proposer, the config, and the engine's
verification -- greedy and seeded outputs equal to plain decoding, exact block accounting,
no compilation after warm-up, the sampled distribution."""

import math
import re

import numpy as np
import pytest

from runtime.config import SpeculativeConfig
from runtime.core import speculative
from runtime.model.runner import compilations
from runtime.model.sampling import SamplingParams
from tests.engine_util import make_engine

SPEC = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=64)


# --- the proposer --------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_last_match():
    toks = [1, 2, 3, 4, 5, 6, 9, 1, 2, 3]
    assert speculative.propose_ngram(toks, 2, 4, 3) == [4, 5, 6]
    assert speculative.propose_ngram(toks, 2, 4, 1) == [4]
    assert speculative.propose_ngram([1, 2, 3, 4], 2, 4, 3) == []          # nothing repeats
    assert speculative.propose_ngram(toks, 4, 4, 3) == []                  # a 4-gram does not repeat
    assert speculative.propose_ngram(toks, 2, 4, 0) == []


def test_ngram_prefers_the_longest_match_then_the_latest_with_room():
    toks = [7, 3, 8, 8, 1, 3, 9, 9, 2, 1, 3]
    # "1 3" matched at 4 (followed by 9 9 2); the bigram beats the unigram "3" matches
    assert speculative.propose_ngram(toks, 1, 3, 3) == [9, 9, 2]
    run = [5] * 6
    assert speculative.propose_ngram(run, 2, 4, 4) == [5, 5]  # the earliest match, the most that follow


def test_config_refuses_what_it_does_not_do():
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}')
    assert c == SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=5)
    for text, msg in (('{"method": "ngram", "suffix_decoding_max_cached_requests": 5}', 'only for method "suffix"'),
                      ('{"method": "eagle"}', r"EAGLE \(.eagle.\) is not implemented"),
                      ('{"method": "ngram", "acceptance_method": "typical"}', r"unsupported key\(s\) acceptance_method"),
                      ('{"num_speculative_tokens": 0}', "num_speculative_tokens: must be 1..16"),
                      ('{"prompt_lookup_min": 3, "prompt_lookup_max": 2}', "prompt_lookup_max: must be >="),
                      ("{nope", "not valid JSON")):
        with pytest.raises(ValueError, match=msg):
            SpeculativeConfig.parse(text)


def test_suffix_cache_proposes_from_recent_outputs_and_stays_bounded():
    c = speculative.SuffixCache(max_requests=2, n_min=2, n_max=3)
    c.add([1, 2, 3, 4, 5, 6])
    assert c.propose([9, 9, 2, 3], 3) == [4, 5, 6]          # "2 3" continues with 4 5 6
    assert c.propose([9, 1, 2, 3], 2) == [4, 5]             # the longest gram, cut to k
    assert c.propose([7, 8], 3) == []
    c.add([7, 8, 10, 11])
    c.add([20, 21, 22, 23])                                  # the first output leaves
    assert c.propose([2, 3], 3) == [] and c.propose([7, 8], 3) == [10, 11]
    for i in range(200):                                     # evicted outputs take their entries along
        c.add([100 + i, 101 + i, 102 + i, 103 + i])
    live_grams = {k for salt, t in c.live.values() for k, _ in c._grams(salt, t)}
    assert len(c.live) == 2 and set(c.index) == live_grams   # exactly the live outputs' grams
    assert c.propose([101 + 199, 102 + 199], 1) == [103 + 199]
    c.add([1, 2, 3, 4, 5, 6], salt="tenant-a")                # kept apart by cache salt
    assert c.propose([2, 3], 3) == [] and c.propose([2, 3], 3, salt="tenant-a") == [4, 5, 6]
    small = speculative.SuffixCache(max_requests=100, n_min=2, n_max=2, max_tokens=10)
    for i in range(5):
        small.add([i, i + 1, i + 2, i + 3, i + 4])            # 5 tokens each: at most 2 outputs fit
    assert small.num_tokens <= 10 and len(small.live) == 2


def test_suffix_proposes_a_repeated_answer_from_the_cache(tiny_ckpt):
    """The same question twice: the second answer is proposed from the first (the request's
    own text alone has little to look up), kept whole, and equal to plain decoding's."""
    rng = np.random.default_rng(9)
    prompt = list(rng.integers(3, 260, size=40))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = make_engine(tiny_ckpt).generate([prompt], params)[0].output_ids
    kept = {}
    for method in ("ngram", "suffix"):
        eng = make_engine(tiny_ckpt, speculative=SpeculativeConfig(method=method, disable_by_batch_size=64))
        first = eng.generate([prompt], params)[0]
        second = eng.generate([prompt], params)[0]
        assert first.output_ids == want and second.output_ids == want
        kept[method] = second.spec.accepted
    assert kept["suffix"] > kept["ngram"] and kept["suffix"] >= len(want) // 2


def test_who_may_speculate(tiny_ckpt):
    from runtime.core.request import Request, Status

    def req(**kw):
        r = Request("r", [1, 2, 3, 1, 2], SamplingParams(temperature=0.0, max_tokens=20, **kw))
        r.status, r.num_computed_tokens = Status.RUNNING, 4
        return r
    assert speculative.may_speculate(req(), SPEC, 1)
    assert not speculative.may_speculate(req(), SPEC, 64)                      # batch too large
    assert not speculative.may_speculate(req(speculative=False), SPEC, 1)      # opted out
    assert not speculative.may_speculate(req(presence_penalty=0.5), SPEC, 1)   # penalties
    assert not speculative.may_speculate(req(min_tokens=5, stop_token_ids=(9,)), SPEC, 1)  # a ban in force
    r = req()
    r.num_computed_tokens = 2                                                  # still prefilling
    assert not speculative.may_speculate(r, SPEC, 1)
    r = req()
    speculative.record(r, 4, 0)
    speculative.record(r, 4, 0)                                                # two misses: back off
    assert not speculative.may_speculate(r, SPEC, 1) and r.spec.resume_at == 4
    speculative.record(r, 4, 2)
    assert r.spec.miss_streak == 0 and (r.spec.proposed, r.spec.accepted) == (12, 2)


# --- the engine ----------------------------------------------------------------------------
def _workload(n: int = 12):
    rng = np.random.default_rng(5)
    prompts, params = [], []
    for i in range(n):
        base = list(rng.integers(3, 260, size=int(rng.integers(4, 14))))
        prompts.append(base * int(rng.integers(2, 5)) + list(rng.integers(3, 260, size=i % 3)))
        kind = i % 6
        params.append([
            SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
            SamplingParams(temperature=0.9, seed=i, max_tokens=28, ignore_eos=True, logprobs=3),
            SamplingParams(temperature=1.0, top_p=0.8, top_k=30, seed=100 + i, max_tokens=25, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=33, presence_penalty=0.5, ignore_eos=True),  # not speculated
            SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),         # max_tokens inside a run
            SamplingParams(temperature=0.7, seed=7 * i, max_tokens=31, ignore_eos=True, speculative=False),
        ][kind])
    return prompts, params


def _run(tiny_ckpt, spec, prompts, params, **kw):
    eng = make_engine(tiny_ckpt, num_blocks=96, speculative=spec, **kw)
    reqs = eng.generate(prompts, params)
    assert not eng.has_unfinished() and eng.pool.num_used_blocks == 0
    eng.pool.check_invariants()
    return eng, reqs


def test_outputs_equal_plain_decoding_greedy_and_seeded(tiny_ckpt):
    prompts, params = _workload()
    _, plain = _run(tiny_ckpt, None, prompts, params)
    eng, spec = _run(tiny_ckpt, SPEC, prompts, params)
    for a, b in zip(plain, spec):
        assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason
        if a.params.logprobs is not None:
            np.testing.assert_allclose([x[0] for x in a.logprobs], [x[0] for x in b.logprobs], atol=2e-4)
            assert [list(x[1]) for x in a.logprobs] == [list(x[1]) for x in b.logprobs]
    kept = {i: (r.spec.proposed, r.spec.accepted) for i, r in enumerate(spec)}
    assert all(kept[i] == (0, 0) for i in range(3, len(spec), 6))   # penalties: never proposed
    assert all(kept[i] == (0, 0) for i in range(5, len(spec), 6))   # opted out
    assert sum(p for p, _ in kept.values()) > 50 and sum(a for _, a in kept.values()) > 20
    c = eng.scheduler.counters
    assert (c.spec_proposed, c.spec_accepted) == (sum(p for p, _ in kept.values()), sum(a for _, a in kept.values()))
    text = eng.metrics.render().decode()
    assert f'vllm:spec_decode_num_accepted_tokens_total{{method="ngram"}} {float(c.spec_accepted)}' in text
    assert f'pagedjax:spec_decode_num_draft_tokens_total{{method="ngram"}} {float(c.spec_proposed)}' in text
    per_pos = [float(x.split()[-1]) for x in text.splitlines()
               if x.startswith('vllm:spec_decode_num_accepted_tokens_per_pos_total{method="ngram",position=')]
    assert sum(per_pos) == c.spec_accepted and per_pos[0] == max(per_pos)


def test_chunked_prefill_prefix_cache_and_stop_tokens_with_speculation(tiny_ckpt):
    """Small steps (proposals cut short by the token budget), a shared prefix served from the
    cache, a stop token inside a kept run: the same tokens, and the stop ends the output."""
    prompts, params = _workload(8)
    prompts = [prompts[0][:20] + p for p in prompts]  # one shared prefix
    want = [r.output_ids for r in _run(tiny_ckpt, None, prompts, params, max_num_batched_tokens=16)[1]]
    stops = [SamplingParams(**{**p.__dict__, "stop_token_ids": (w[len(w) // 2],)}) if p.greedy else p
             for p, w in zip(params, want)]
    _, got = _run(tiny_ckpt, SPEC, prompts, stops, max_num_batched_tokens=16)
    for w, r, p in zip(want, got, stops):
        if p.stop_token_ids:
            cut = w.index(p.stop_token_ids[0]) + 1
            assert r.output_ids == w[:cut] and r.finish_reason == "stop"
        else:
            assert r.output_ids == w
    assert sum(r.num_cached_tokens for r in got) > 0


def test_rejected_proposals_roll_back_their_blocks(tiny_ckpt):
    """A proposal that crosses into a new block, then is rejected: the block goes back to the
    pool at once, and no block with a rejected token is ever cached."""
    eng = make_engine(tiny_ckpt, num_blocks=64, speculative=SPEC)
    prompt = [11, 12, 13, 14, 15] * 3  # 15 tokens: the next proposals reach into block 2
    r = eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    seen = []
    while not r.is_finished:
        eng.step()
        if r.spec_token_ids:
            assert eng._inflight is not None and eng._inflight.verifies
        if not r.is_finished and eng._inflight is None:
            # between steps: the tables hold exactly what the computed tokens and the next one need
            assert len(r.block_ids) == eng.scheduler.blocks_for(r.num_computed_tokens + 1)
            seen.append(r.num_computed_tokens)
    assert r.spec.proposed > r.spec.accepted  # some proposals were rejected
    cached = eng.pool.cached_block
    toks = r.token_ids
    for i, h in enumerate(r.block_hashes):  # every cached block holds the request's real tokens
        assert cached(h, toks, i, 0) is not None
    assert eng.pool.num_used_blocks == 0
    eng.pool.check_invariants()


def test_no_compilation_after_warmup_with_speculation(tiny_ckpt):
    eng = make_engine(tiny_ckpt, num_blocks=96, speculative=SPEC, warmup=True)
    before = compilations()
    prompts, params = _workload(10)
    eng.generate(prompts, params)
    assert sum(r.spec.accepted for r in eng.scheduler.running) == 0
    assert eng.scheduler.counters.spec_accepted > 0
    assert compilations() == before


def test_speculation_turns_off_at_the_batch_size(tiny_ckpt):
    """Six requests with disable_by_batch_size 4: nothing is proposed until the four short
    ones finish, then the two long ones speculate. At 1 nothing ever is."""
    prompts, _ = _workload(6)
    params = [SamplingParams(temperature=0.0, max_tokens=40 if i < 2 else 6, ignore_eos=True) for i in range(6)]
    eng = make_engine(tiny_ckpt, num_blocks=96, speculative=SpeculativeConfig(disable_by_batch_size=4))
    reqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    while any(not r.is_finished for r in reqs[2:]):
        eng.step()
        assert eng.scheduler.counters.spec_proposed == 0
    eng.run_until_done()
    assert eng.scheduler.counters.spec_proposed > 0 and reqs[0].spec.proposed + reqs[1].spec.proposed > 0
    _, reqs = _run(tiny_ckpt, SpeculativeConfig(disable_by_batch_size=1), prompts[:1], params[:1])
    assert reqs[0].spec.proposed == 0


def _chi2_ok(samples: list[int], logprobs_row) -> tuple[float, int]:
    """Chi-square of `samples` against a raw logprobs row (ids, logprobs): bins of expected
    count >= 5, the rest pooled. Returns (statistic, degrees of freedom)."""
    n = len(samples)
    top = dict(zip(logprobs_row[1].tolist(), np.exp(logprobs_row[2]).tolist()))
    counts: dict[int, int] = {}
    for t in samples:
        counts[t] = counts.get(t, 0) + 1
    bins = [t for t, p in top.items() if p * n >= 5]
    obs = [counts.get(t, 0) for t in bins] + [n - sum(counts.get(t, 0) for t in bins)]
    exp = [top[t] * n for t in bins] + [(1.0 - sum(top[t] for t in bins)) * n]
    return sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 1e-9), len(obs) - 1


def test_sampled_tokens_follow_the_target_distribution(tiny_ckpt):
    """Statistical: 320 seeds at temperature 1 of a prompt ending in a run the proposer
    extends. Given the most common first token t1 (from the prefill), the second token is the
    first verify slot's sample and the third the second slot's, reached only when the first
    proposal was kept: each matches the target model's law (plain decoding's raw logprobs
    of the prompt + t1 [+ t2]) by a chi-square test. Every seed's tokens are also plain
    decoding's."""
    base = [21, 22, 23, 24, 25, 26] * 3
    n = 320
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=4, ignore_eos=True) for s in range(n)]
    plain = make_engine(tiny_ckpt, num_blocks=200, max_num_seqs=8)
    t1 = plain.generate([base], [SamplingParams(temperature=0.0, max_tokens=1)])[0].output_ids[0]
    prompt = base + [t1] * 4  # the proposer sees "t1 t1" and proposes more of it
    cfg = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2, disable_by_batch_size=64)
    eng = make_engine(tiny_ckpt, num_blocks=200, speculative=cfg, max_num_seqs=8)
    got, want = [], []
    for i in range(0, n, 8):
        got += [tuple(r.output_ids) for r in eng.generate([prompt] * 8, params[i:i + 8])]
        want += [tuple(r.output_ids) for r in plain.generate([prompt] * 8, params[i:i + 8])]
    assert got == want
    c = eng.scheduler.counters
    assert c.spec_proposed > n // 2 and c.spec_accepted > n // 4
    first = max(set(g[0] for g in got), key=lambda t: sum(g[0] == t for g in got))
    ref = lambda ids: plain.generate([prompt + ids], [SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)]
                                     )[0].logprobs[0]
    second = [g[1] for g in got if g[0] == first]
    assert len(second) >= 80
    chi2, dof = _chi2_ok(second, ref([first]))
    assert chi2 < dof + 4 * math.sqrt(2 * dof) + 10, (chi2, dof)
    t2 = max(set(second), key=second.count)
    third = [g[2] for g in got if g[:2] == (first, t2)]
    assert len(third) >= 60
    chi2, dof = _chi2_ok(third, ref([first, t2]))
    assert chi2 < dof + 4 * math.sqrt(2 * dof) + 10, (chi2, dof)


def test_a_stop_string_inside_a_kept_run_ends_the_output_at_its_token(tiny_ckpt):
    """A verified step hands several tokens over at once; a stop string completed by one in
    the middle of them ends the client's output there: the same tokens, text and count as
    plain decoding. The stops are the output's first 3..9 tokens' text (this model repeats
    its first token, so the proposals keep whole runs of it)."""
    prompt = [11, 12, 13, 14, 15] * 4
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    ref = make_engine(tiny_ckpt, num_blocks=64).generate([prompt], greedy)[0]
    engines = {"plain": make_engine(tiny_ckpt, num_blocks=64), "spec": make_engine(tiny_ckpt, num_blocks=64,
                                                                                  speculative=SPEC)}
    for cut in range(3, 10):
        stop = engines["plain"].tokenizer.decode(ref.output_ids[:cut])
        runs = {}
        for name, e in engines.items():
            chunks = []
            e.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=(stop,)),
                          on_output=chunks.append)
            e.run_until_done()
            runs[name] = ([t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks),
                          chunks[-1].completion_tokens, chunks[-1].finish_reason, [len(c.token_ids) for c in chunks])
        assert runs["spec"][:4] == runs["plain"][:4] and runs["plain"][3] == "stop", (cut, runs)
        assert runs["plain"][0] == ref.output_ids[:cut]
    assert engines["spec"].scheduler.counters.spec_accepted > 0


def test_proposals_never_preempt_anyone():
    """The scheduler alone: a decoding request whose proposals reach into a block the pool
    does not have drops them and is scheduled alone, nobody is preempted."""
    from tests.runtime.test_scheduler import make, req, step

    s = make(num_blocks=3)
    a, b = req("a", 30, max_tokens=2), req("b", 14, max_tokens=20, start=60)
    s.add(a)
    s.add(b)
    step(s)                                   # a: 2 blocks, b: 1 block, none free
    assert s.pool.num_free_blocks == 0 and b.num_computed_tokens == 14
    b.spec_token_ids = [1, 2, 3]              # positions 15..17: into a second block
    out = s.schedule()
    assert not out.preempted and dict((r.request_id, n) for r, n in out.scheduled)["b"] == 1
    assert b.spec_token_ids == [] and len(b.block_ids) == 1


def test_churn_with_speculation_leaks_nothing(tiny_ckpt):
    """KV pressure with preemptions (optimistic admission), aborts at random beats, a shared
    prefix: every request that was not aborted gets plain decoding's tokens, and the pool
    ends with every block free and its invariants whole."""
    rng = np.random.default_rng(12)
    system = list(rng.integers(3, 260, size=20))
    prompts = [system + list(rng.integers(3, 260, size=int(rng.integers(3, 8)))) * 3 for _ in range(16)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = [r.output_ids for r in make_engine(tiny_ckpt, num_blocks=512).generate(prompts, params)]
    eng = make_engine(tiny_ckpt, num_blocks=24, watermark=0.0, speculative=SPEC)
    reqs = [eng.add_request(p, params) for p in prompts]
    aborted = set()
    beat = 0
    while eng.has_unfinished():
        eng.step()
        beat += 1
        if beat % 7 == 0:
            live = [r for r in reqs if not r.is_finished and r.request_id not in aborted]
            if live and len(aborted) < 4:
                victim = live[int(rng.integers(len(live)))]
                eng.abort(victim.request_id)
                aborted.add(victim.request_id)
        eng.pool.check_invariants()
    for r, w in zip(reqs, want):
        if r.request_id not in aborted:
            assert r.output_ids == w and r.finish_reason == "length"
    c = eng.scheduler.counters
    assert c.preemptions > 0 and c.spec_accepted > 0 and len(aborted) == 4
    assert eng.pool.num_used_blocks == 0 and eng.pool.num_free_blocks == eng.pool.num_blocks


def test_a_grammar_checks_the_proposals_and_masks_each_position(tiny_ckpt):
    """guided_proposals cuts the proposals before the first token the grammar forbids and
    gives each later position the mask after the proposals before it; the matcher is left
    as it was."""
    from runtime.model.structured import Guide, allowed_ids

    eng = make_engine(tiny_ckpt)
    tok = eng.tokenizer
    m = eng.compile_guide(Guide("regex", r"[0-9]{2}-[a-z]{3}", "structured_outputs.regex"))
    ids = lambda s: tok.encode(s)[1:] if tok.encode("")[:1] else tok.encode(s)  # (no BOS)
    drafts = ids("12-a") + ids("9") + ids("bc")       # "9" is not a letter: cut there
    got, masks = speculative.guided_proposals(m, drafts, eng.runner.masks.width)
    assert got == ids("12-a") and masks.shape == (len(got), eng.runner.masks.width)
    allowed = allowed_ids(masks[-1], eng.config.model.vocab_size).tolist()  # after "12-a": letters only
    assert allowed and all(re.fullmatch("[a-z]{1,2}", tok.decode([t])) for t in allowed)
    assert m.validate_tokens(ids("34-xyz")) == len(ids("34-xyz"))  # untouched: still at the start
    done, _ = speculative.guided_proposals(m, ids("12-abc") + ids("d"), eng.runner.masks.width)
    assert done == ids("12-abc")                       # complete: nothing after it


def test_structured_outputs_speculate_with_the_same_tokens(tiny_ckpt):
    """JSON-schema outputs whose prompt shows the shape: proposals come from it, the grammar
    checks them, and the outputs (greedy and seeded) are plain decoding's and valid."""
    import json

    import jsonschema

    from runtime.model.structured import Guide
    from tests.runtime.test_structured import SCHEMA

    eng = make_engine(tiny_ckpt, speculative=SPEC)
    tok = eng.tokenizer
    example = '{"kind": "cat", "n": 5, "inner": {"ok": true}, "tags": ["a", "b"]}'
    prompt = tok.encode(f"Answer in JSON like {example} or {example}: ")
    params = [SamplingParams(temperature=t, seed=s, max_tokens=80, guide=Guide.json_schema(SCHEMA, "r"))
              for t, s in ((0.0, 0), (1.0, 1), (1.0, 2), (0.7, 3))]
    want = [r.output_ids for r in make_engine(tiny_ckpt).generate([prompt] * 4, params)]
    got = eng.generate([prompt] * 4, params)
    assert [r.output_ids for r in got] == want
    for r in got:
        jsonschema.validate(json.loads(tok.decode(r.output_ids)), SCHEMA)
    assert sum(r.spec.proposed for r in got) > 0 and sum(r.spec.accepted for r in got) > 0
    assert eng.pool.num_used_blocks == 0


@pytest.fixture(scope="module")
def other_tiny(tmp_path_factory):
    """Another random tiny model: same tokenizer, different weights and shape (a poor draft)."""
    from tests.tiny import make_tiny_checkpoint

    # untied: a tied tiny model mostly repeats its last token, as the target does
    return make_tiny_checkpoint(tmp_path_factory.mktemp("draft") / "tiny-draft", seed=7, num_layers=1,
                                tie_word_embeddings=False)


def _draft_run(tiny_ckpt, draft):
    """The workload with `draft` drafting for the tiny target: plain decoding's tokens."""
    prompts, params = _workload(6)
    want = [r.output_ids for r in make_engine(tiny_ckpt, num_blocks=96).generate(prompts, params)]
    cfg = SpeculativeConfig(method="draft_model", model=str(draft), num_speculative_tokens=4,
                            disable_by_batch_size=64)
    eng, got = _run(tiny_ckpt, cfg, prompts, params)
    assert [r.output_ids for r in got] == want
    return eng, got


def test_draft_model_drafting_for_itself_keeps_every_proposal(tiny_ckpt):
    """The target as its own draft: greedy proposals are exactly the target's tokens, so every
    one is kept (the upper bound); seeded sampled rows keep the plain tokens too."""
    _, got = _draft_run(tiny_ckpt, tiny_ckpt)
    greedy = [r for r in got if r.params.greedy and r.params.speculative and not r.params.presence_penalty]
    assert all(r.spec.proposed > 0 and r.spec.accepted == r.spec.proposed for r in greedy)


def test_a_poor_draft_model_keeps_little_and_changes_nothing(tiny_ckpt, other_tiny):
    eng, _ = _draft_run(tiny_ckpt, other_tiny)
    c = eng.scheduler.counters
    assert c.spec_proposed > 0 and c.spec_accepted < c.spec_proposed // 2


def test_draft_model_refusals(tiny_ckpt, tmp_path):
    with pytest.raises(ValueError, match="only with it"):
        SpeculativeConfig.parse('{"method": "draft_model"}')
    with pytest.raises(ValueError, match="not a pagedjax checkpoint"):
        make_engine(tiny_ckpt, speculative=SpeculativeConfig(method="draft_model", model=str(tmp_path)))
    eng = make_engine(tiny_ckpt, speculative=SpeculativeConfig(method="draft_model", model=str(tiny_ckpt)))
    with pytest.raises(ValueError, match="no draft KV beside it"):  # a decode replica: imports have no draft KV
        eng.reserve([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4))
    with pytest.raises(ValueError, match="max_model_len"):
        make_engine(tiny_ckpt, max_model_len=2048,
                    speculative=SpeculativeConfig(method="draft_model", model=str(tiny_ckpt)))


def test_console_shows_what_speculation_kept(tiny_ckpt):
    """The dashboard's kept fraction and each running request's kept / proposed tokens."""
    from tests.console.admin_util import console_client, logged_in

    eng = make_engine(tiny_ckpt, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256,
                      speculative=SPEC)
    r = eng.add_request([11, 12, 13, 14, 15] * 4, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    while r.spec.accepted < 4:
        eng.step()
    with console_client(eng) as c:
        logged_in(c)
        dash = c.get("/admin", headers={"HX-Request": "true"}).text
        c_ = eng.scheduler.counters
        assert 'id="spec-acceptance"' in dash and f"{c_.spec_accepted} of {c_.spec_proposed} proposed tokens" in dash
        page = c.get("/admin/requests", headers={"HX-Request": "true"}).text
        assert f"{r.spec.accepted} of {r.spec.proposed} proposed kept" in page
    eng.abort(r.request_id)
    eng.run_until_done()


def test_draft_model_with_structured_outputs_and_no_compilation_after_warmup(tiny_ckpt):
    """A draft's proposals for a JSON-schema output are cut by the grammar after the draft
    made them; the outputs are plain decoding's and valid; warm-up compiles the draft's
    programs too, and nothing compiles after it."""
    import json

    import jsonschema

    from runtime.model.structured import Guide
    from tests.runtime.test_structured import SCHEMA

    cfg = SpeculativeConfig(method="draft_model", model=str(tiny_ckpt), num_speculative_tokens=4,
                            disable_by_batch_size=64)
    plain = make_engine(tiny_ckpt)
    tok = plain.tokenizer
    prompt = tok.encode("Answer in JSON: ")
    params = [SamplingParams(temperature=t, seed=s, max_tokens=60, guide=Guide.json_schema(SCHEMA, "r"))
              for t, s in ((0.0, 0), (1.0, 1))] + [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)]
    want = [r.output_ids for r in plain.generate([prompt] * 3, params)]
    eng = make_engine(tiny_ckpt, speculative=cfg, warmup=True)
    before = compilations()
    got = eng.generate([prompt] * 3, params)
    assert [r.output_ids for r in got] == want
    for r in got[:2]:
        jsonschema.validate(json.loads(tok.decode(r.output_ids)), SCHEMA)
    assert got[0].spec.proposed > 0 and got[2].spec.accepted == got[2].spec.proposed > 0
    assert compilations() == before and eng.pool.num_used_blocks == 0
    eng.pool.check_invariants()
