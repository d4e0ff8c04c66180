"""Structured outputs in the runtime (runtime/model/structured.py, the sampler's bitmask and
logit_bias, the engine's matchers), min_tokens and prompt logprobs, on a tiny model."""

from __future__ import annotations

import json
import re
import threading

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from runtime.checkpoint.store import load_checkpoint
from runtime.model.families.llama import dense_logits
from runtime.model.sampling import SamplingParams, SamplingRow, make_sampling_inputs, sample
from runtime.model.structured import Guide, GuideCompiler, TokenMasks, allowed_ids
from tests.engine_util import make_engine

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["kind", "n", "inner", "tags"],
          "properties": {"kind": {"enum": ["cat", "dog"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "inner": {"type": "object", "additionalProperties": False, "required": ["ok"],
                                   "properties": {"ok": {"type": "boolean"}}},
                         "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b"]}}}}


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    return make_engine(tiny_ckpt, max_num_seqs=8, max_num_batched_tokens=64)


def test_token_masks_ban_tokens_and_leave_the_rest():
    masks = TokenMasks(100)
    assert masks.build(2, [], []) is masks.all_allowed(2)   # nothing constrained: the shared all-ones mask
    m = masks.build(3, [], [(1, [0, 5, 31, 32, 63, 99])])
    assert m.shape == (3, 4) and m.dtype == np.int32
    assert list(allowed_ids(m[0], 100)) == list(range(100))
    assert set(allowed_ids(m[1], 100)) == set(range(100)) - {0, 5, 31, 32, 63, 99}


def test_bad_guides_are_value_errors_naming_the_field(engine):
    comp = GuideCompiler(engine.tokenizer, engine.config.model.vocab_size)
    with pytest.raises(ValueError, match=r"^structured_outputs\.regex: .*regex"):
        comp.compile(Guide("regex", "a(b", "structured_outputs.regex"))
    with pytest.raises(ValueError, match=r"^structured_outputs\.grammar: "):
        comp.compile(Guide("grammar", "start: undefined_rule", "structured_outputs.grammar"))
    with pytest.raises(ValueError, match="kind must be one of"):
        Guide("yaml", "x")
    with pytest.raises(ValueError, match="non-empty list"):
        Guide.choice([], "structured_outputs.choice")


def test_a_grammar_that_compiles_too_slowly_is_refused(engine, monkeypatch):
    slow = GuideCompiler(engine.tokenizer, engine.config.model.vocab_size, timeout_s=0.2)
    build = slow._build
    release, built = threading.Event(), threading.Event()

    def held_build(tok, g):
        # Held until the test lets go (bounded, so a compile() that waited for it fails, not hangs).
        release.wait(60)
        try:
            return build(tok, g)
        finally:
            built.set()

    monkeypatch.setattr(slow, "_build", held_build)
    try:
        with pytest.raises(ValueError, match=r"^response_format: the grammar did not compile within 0.2 s"):
            slow.compile(Guide.json_schema(SCHEMA, "response_format"))
        assert not built.is_set()  # refused at the limit while the compile was still going
    finally:
        release.set()
    assert built.wait(60)  # the background compile still ends (its result is dropped)


def test_sampler_applies_the_bitmask_and_logit_bias():
    V = 300
    logits = jax.random.normal(jax.random.key(1), (4, V), jnp.float32)
    masks = TokenMasks(V)
    mask = masks.build(4, [], [(0, [t for t in range(V) if t not in (7, 250)]),
                               (2, [t for t in range(V) if t % 3])])
    greedy = SamplingParams(temperature=0.0)
    rows = [SamplingRow(greedy), SamplingRow(SamplingParams(temperature=0.0, logit_bias={123: 100.0})),
            SamplingRow(SamplingParams(temperature=1.0, seed=3)), SamplingRow(greedy)]
    fn = jax.jit(lambda lg, si: sample(lg, si, None, None, num_logprobs=2).token_ids)
    out = np.asarray(fn(logits, make_sampling_inputs(rows, 4, mask)))
    free = np.asarray(fn(logits, make_sampling_inputs(rows, 4, masks.all_allowed(4))))
    assert out[0] == (7 if logits[0, 7] >= logits[0, 250] else 250)
    assert out[1] == free[1] == 123
    assert out[3] == free[3] == int(np.argmax(logits[3]))
    for step in range(40):  # sampled draws stay inside the mask
        r = [rows[0], rows[1], SamplingRow(rows[2].params, step), rows[3]]
        assert int(fn(logits, make_sampling_inputs(r, 4, mask))[2]) % 3 == 0


def _params(**kw):
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 48, **kw})


def test_constrained_outputs_match_and_batch_with_free_rows(engine):
    tok = engine.tokenizer
    prompt = tok.encode("Answer in JSON please: ")
    guided = [_params(guide=Guide.json_schema(SCHEMA, "response_format"), max_tokens=80),
              _params(guide=Guide("regex", r"[0-9]{2}-[a-z]{3}", "structured_outputs.regex")),
              _params(guide=Guide.choice(["left", "right", "up"], "structured_outputs.choice")),
              _params(guide=Guide("grammar", 'root ::= "yes" | "no"', "structured_outputs.grammar"))]
    free = [_params(ignore_eos=True, max_tokens=12), _params(temperature=0.9, seed=5, ignore_eos=True, max_tokens=12)]
    alone_free = [r.output_ids for r in engine.generate([prompt] * 2, free)]
    alone_guided = [tok.decode(r.output_ids) for r in engine.generate([prompt] * 4, guided)]
    mixed = engine.generate([prompt] * 6, [guided[0], free[0], guided[1], free[1], guided[2], guided[3]])
    assert [mixed[1].output_ids, mixed[3].output_ids] == alone_free        # batch invariance
    texts = [tok.decode(mixed[i].output_ids) for i in (0, 2, 4, 5)]
    assert texts == alone_guided
    jsonschema.validate(json.loads(texts[0]), SCHEMA)
    assert re.fullmatch(r"[0-9]{2}-[a-z]{3}", texts[1])
    assert texts[2] in ("left", "right", "up") and texts[3] in ("yes", "no")
    assert all(mixed[i].finish_reason == "stop" for i in (0, 2, 4, 5))
    # Sampled constrained outputs validate too, for any seed.
    reqs = engine.generate([prompt] * 8, [_params(temperature=1.0, seed=s, max_tokens=80,
                                                  guide=Guide.json_schema(SCHEMA, "r")) for s in range(8)])
    for r in reqs:
        jsonschema.validate(json.loads(tok.decode(r.output_ids)), SCHEMA)


def test_min_tokens_holds_back_eos_that_logit_bias_forces(engine):
    eos = engine.tokenizer.eos_token_ids[0]
    prompt = engine.tokenizer.encode("hello")
    forced, held = engine.generate([prompt] * 2, [_params(logit_bias={eos: 100.0}),
                                                  _params(logit_bias={eos: 100.0}, min_tokens=5)])
    assert forced.output_ids == [eos] and forced.finish_reason == "stop"
    assert len(held.output_ids) == 6 and held.output_ids[-1] == eos and eos not in held.output_ids[:5]
    with pytest.raises(ValueError, match="^logit_bias: token id"):
        engine.add_request(prompt, _params(logit_bias={10**6: 1.0}))
    with pytest.raises(ValueError, match="^min_tokens: "):
        _params(min_tokens=100, max_tokens=10)


def test_prompt_logprobs_equal_dense_logits_through_cache_hits_and_chunks(engine, tiny_ckpt):
    cfg, params, _ = load_checkpoint(tiny_ckpt)
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, cfg.vocab_size, 150)]
    engine.generate([prompt], _params(max_tokens=1))      # the prompt's blocks are now cached
    outs = []
    req = engine.add_request(prompt, _params(max_tokens=2, prompt_logprobs=3), on_output=outs.append)
    engine.run_until_done()
    got = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    assert len(got) == 1 and len(got[0]) == len(prompt) and got[0][0] is None
    assert req.num_cached_tokens == 0  # computed, not served from the cache (150 tokens: 3 chunks of 64)
    ref = np.asarray(jax.nn.log_softmax(dense_logits(cfg, params, jnp.asarray(prompt)), -1))
    want = [ref[i, prompt[i + 1]] for i in range(len(prompt) - 1)]
    assert [e[0] for e in got[0][1:]] == pytest.approx(want, abs=1e-4)
    top = got[0][1][1]
    assert len(top) == 3 and top[0][0] == int(np.argmax(ref[0])) and top[0][1] == pytest.approx(ref[0].max(), abs=1e-4)
