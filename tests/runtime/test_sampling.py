"""Sampling: greedy, temperature, top-k/top-p/min-p, penalties, seeds, batch invariance,
logprobs and the host-side parameter records."""

from __future__ import annotations

import dataclasses
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runtime.model.sampling import (CANDIDATES, MAX_LOGPROBS, SampleOutput, SamplingInputs, SamplingParams,
                              SamplingRow, allowed_tokens, apply_penalties, make_sampling_inputs, sample)

_sample = jax.jit(sample, static_argnames="num_logprobs")
_allowed = jax.jit(allowed_tokens)
_penalise = jax.jit(apply_penalties)


def _run(logits, rows, counts=None, prompt=None, num_logprobs=0, pad_to=None) -> SampleOutput:
    logits = np.asarray(logits, np.float32)
    S, V = len(rows), logits.shape[1]
    pad = pad_to or S
    grow = lambda a, dtype: np.concatenate([np.asarray(a, dtype), np.zeros((pad - S, V), dtype)])
    logits = grow(logits, np.float32)
    counts = grow(np.zeros((S, V)) if counts is None else counts, np.int32)
    prompt = grow(np.zeros((S, V)) if prompt is None else prompt, bool)
    out = _sample(logits, make_sampling_inputs(rows, pad), counts, prompt, num_logprobs=num_logprobs)
    return jax.tree.map(np.asarray, out)


def _rows(params: SamplingParams, n: int, step0: int = 0) -> list[SamplingRow]:
    return [SamplingRow(params, step0 + i) for i in range(n)]


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _reference_mask(s: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Sort-based float64 reference of the filters on one row of scaled logits."""
    s = s.astype(np.float64)
    order = np.argsort(-s, kind="stable")
    p = _softmax(s)[order]
    keep = np.ones(len(s), bool)
    k = len(s) if top_k <= 0 else min(top_k, len(s))
    keep[k:] = False
    mass_k = p[:k].sum()
    cum = np.cumsum(p)
    n_p = int(np.searchsorted(cum, top_p * mass_k)) + 1 if top_p < 1 else len(s)
    keep[n_p:] = False
    keep &= p >= min_p * p[0]
    thr = s[order][keep].min()
    return s >= thr


def _chi2(samples: np.ndarray, probs: np.ndarray) -> float:
    n = len(samples)
    obs = np.bincount(samples, minlength=len(probs))
    support = probs > 0
    assert obs[~support].sum() == 0, "sampled a token with zero probability"
    exp = probs[support] * n
    return float(((obs[support] - exp) ** 2 / exp).sum())


LOGITS6 = np.array([2.0, -1.0, 0.5, 3.0, -2.0, 1.0], np.float32)


# ---------------------------------------------------------------------------- greedy / distribution
def test_greedy_is_argmax_and_ignores_the_key():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((8, 3000)).astype(np.float32)
    rows = [SamplingRow(SamplingParams(temperature=t, seed=s), step)
            for t, s, step in zip([0.0, 0.0, 1e-6, 0.0, 0.0, 0.0, 0.0, 0.0], range(8), range(0, 80, 10))]
    out = _run(logits, rows)
    np.testing.assert_array_equal(out.token_ids, logits.argmax(-1))
    other = _run(logits, [SamplingRow(dataclasses.replace(r.params, seed=99), r.step + 5) for r in rows])
    np.testing.assert_array_equal(other.token_ids, out.token_ids)


@pytest.mark.parametrize("V", [49152, 1000, 37])
def test_two_level_argmax_takes_the_first_maximum(V):
    """Greedy's argmax (chunk maxima, then inside the winning chunk) is np.argmax: ties go to
    the lowest index, also across chunks and inside one; a row of -inf gives 0; vocabularies
    no chunk size divides take the one-level path."""
    from runtime.model.sampling import _argmax

    rng = np.random.default_rng(V)
    x = rng.standard_normal((8, V)).astype(np.float32)
    x[1, [V - 1, V // 2, 3]] = 9.0                # a tie across chunks: the lowest wins
    x[2, [5, 6]] = 9.0                            # a tie inside one chunk
    x[3] = -np.inf
    x[4, V - 1] = 9.0                             # the last token
    x[5] = np.round(x[5])                         # many ties among integers
    got = np.asarray(jax.jit(_argmax)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, x.argmax(-1))
    assert got.dtype == np.int32


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_temperature_matches_softmax_distribution(temperature):
    n = 6000
    logits = np.tile(LOGITS6, (n, 1))
    out = _run(logits, _rows(SamplingParams(temperature=temperature, seed=1234), n))
    # chi-square, 5 degrees of freedom: 20.5 is the 0.1% critical value
    assert _chi2(out.token_ids, _softmax(LOGITS6.astype(np.float64) / temperature)) < 20.5


def test_top_k_one_and_tiny_top_p_are_greedy():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((16, 5000)).astype(np.float32) * 2
    for params in (SamplingParams(temperature=1.5, top_k=1, seed=7),
                   SamplingParams(temperature=1.5, top_p=1e-6, seed=7),
                   SamplingParams(temperature=1.5, min_p=1.0, seed=7)):
        out = _run(logits, _rows(params, 16))
        np.testing.assert_array_equal(out.token_ids, logits.argmax(-1), err_msg=str(params))


@pytest.mark.parametrize("kw", [dict(top_k=3), dict(top_p=0.8), dict(min_p=0.2),
                                dict(top_k=4, top_p=0.7, min_p=0.05)])
def test_filters_renormalise_the_kept_tokens(kw):
    n, temp = 6000, 0.9
    logits = np.tile(LOGITS6, (n, 1))
    out = _run(logits, _rows(SamplingParams(temperature=temp, seed=5, **kw), n))
    s = LOGITS6.astype(np.float64) / temp
    keep = _reference_mask(s, kw.get("top_k", 0), kw.get("top_p", 1.0), kw.get("min_p", 0.0))
    probs = np.where(keep, _softmax(s), 0.0)
    probs /= probs.sum()
    assert keep.sum() < len(keep)
    assert _chi2(out.token_ids, probs) < 20.5


def test_min_p_removes_unlikely_tokens():
    logits = np.tile(np.array([4.0, 3.9, 2.0, 0.0, -1.0, 3.0], np.float32), (2000, 1))
    out = _run(logits, _rows(SamplingParams(temperature=1.0, min_p=0.3, seed=3), 2000))
    # p_i / p_max = exp(l_i - 4): tokens 0, 1 and 5 (0.37) stay; 2 (0.14), 3, 4 go
    assert set(np.unique(out.token_ids)) == {0, 1, 5}


@pytest.mark.parametrize("V", [300, 5000])
def test_filter_masks_match_a_sorting_reference_including_fallbacks(V):
    # V=5000 > CANDIDATES: large top-k and wide nuclei take the bisection fallbacks
    rng = np.random.default_rng(V)
    cases = [dict(top_k=5), dict(top_k=CANDIDATES + 37), dict(top_k=V - 1), dict(top_p=0.9),
             dict(top_p=0.5), dict(top_p=0.999), dict(min_p=0.1), dict(top_k=2 * CANDIDATES, top_p=0.7),
             dict(top_k=50, top_p=0.9, min_p=0.02), dict(top_p=0.95, min_p=0.3), dict()]
    logits = (rng.standard_normal((len(cases), V)) * rng.uniform(0.3, 3, (len(cases), 1))).astype(np.float32)
    rows = [SamplingRow(SamplingParams(temperature=0.8, seed=i, **kw)) for i, kw in enumerate(cases)]
    inputs = make_sampling_inputs(rows, len(rows))
    zeros = np.zeros((len(rows), V), np.int32)
    mask = np.asarray(_allowed(logits, inputs, zeros, zeros > 0))
    for i, kw in enumerate(cases):
        ref = _reference_mask(logits[i] / np.float32(0.8), kw.get("top_k", 0), kw.get("top_p", 1.0),
                              kw.get("min_p", 0.0))
        np.testing.assert_array_equal(mask[i], ref, err_msg=str(kw))
    # and every sampled token is an allowed one
    for step in range(20):
        out = _run(logits, [SamplingRow(r.params, step) for r in rows])
        assert mask[np.arange(len(rows)), out.token_ids].all()


# ---------------------------------------------------------------------------- penalties
def test_penalties_exact_values():
    counts = np.array([[0, 2, 1, 0, 0, 3]], np.int32)
    prompt = np.array([[1, 0, 0, 0, 1, 0]], bool)
    rows = [SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5,
                                       presence_penalty=0.25))]
    x = np.asarray(_penalise(LOGITS6[None], make_sampling_inputs(rows, 1), counts, prompt))
    # repetition over prompt+output (2 -> 1, -1 -> -2, 0.5 -> 0.25, -2 -> -4, 1 -> 0.5; 3 unseen),
    # then frequency 0.5 * count, then presence 0.25 on output tokens
    np.testing.assert_allclose(x[0], [1.0, -3.25, -0.5, 3.0, -4.0, -1.25], rtol=0, atol=1e-6)
    plain = np.asarray(_penalise(LOGITS6[None], make_sampling_inputs([None], 1), counts, prompt))
    np.testing.assert_array_equal(plain[0], LOGITS6)


def test_penalties_steer_greedy_and_sampling():
    logits = np.array([[3.0, 2.9, 0.0, 0.0]], np.float32)
    counts = np.array([[2, 0, 0, 0]], np.int32)
    greedy = SamplingParams(temperature=0.0, frequency_penalty=0.1)
    assert _run(logits, [SamplingRow(greedy)], counts=counts).token_ids[0] == 1
    neg = SamplingParams(temperature=0.0, presence_penalty=-1.0)
    assert _run(logits, [SamplingRow(neg)], counts=np.array([[0, 1, 0, 0]])).token_ids[0] == 1  # 3.9 > 3
    # sampling draws from softmax(penalised / T)
    n, temp = 6000, 0.7
    params = SamplingParams(temperature=temp, repetition_penalty=1.5, presence_penalty=0.5, seed=11)
    big_counts = np.tile(np.array([[0, 1, 0, 2, 0, 0]], np.int32), (n, 1))
    prompt = np.tile(np.array([[1, 0, 0, 0, 0, 0]], bool), (n, 1))
    out = _run(np.tile(LOGITS6, (n, 1)), _rows(params, n), counts=big_counts, prompt=prompt)
    x = np.asarray(_penalise(LOGITS6[None], make_sampling_inputs([SamplingRow(params)], 1),
                             big_counts[:1], prompt[:1]))[0]
    assert _chi2(out.token_ids, _softmax(x.astype(np.float64) / temp)) < 20.5


# ---------------------------------------------------------------------------- seeds and batch invariance
def _mixed_rows(n: int, seed: int) -> list[SamplingRow]:
    r = random.Random(seed)
    rows = []
    for i in range(n):
        kw = r.choice([dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.7, top_k=20),
                       dict(temperature=1.2, top_p=0.9), dict(temperature=1.0, top_k=500, top_p=0.95),
                       dict(temperature=0.9, min_p=0.05, top_p=0.8),
                       dict(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5,
                            frequency_penalty=0.2, top_k=40)])
        rows.append(SamplingRow(SamplingParams(seed=r.randrange(2**32), **kw), r.randrange(100)))
    return rows


def test_seed_determinism_and_step_dependence():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((32, 2000)).astype(np.float32)
    rows = _rows(SamplingParams(temperature=1.0, seed=42), 32)
    a, b = _run(logits, rows), _run(logits, rows)
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
    c = _run(logits, [SamplingRow(dataclasses.replace(r.params, seed=43), r.step) for r in rows])
    d = _run(logits, [SamplingRow(r.params, r.step + 1) for r in rows])
    assert (c.token_ids != a.token_ids).sum() > 16 and (d.token_ids != a.token_ids).sum() > 16


def test_batch_invariance_alone_vs_in_batch_at_other_positions():
    rng = np.random.default_rng(3)
    S, V = 32, 5000
    logits = (rng.standard_normal((S, V)) * 2).astype(np.float32)
    counts = (rng.random((S, V)) < 0.01).astype(np.int32) * rng.integers(1, 4, (S, V)).astype(np.int32)
    prompt = rng.random((S, V)) < 0.01
    rows = _mixed_rows(S, 0)
    full = _run(logits, rows, counts, prompt, num_logprobs=3)
    perm = rng.permutation(S)
    shuffled = _run(logits[perm], [rows[i] for i in perm], counts[perm], prompt[perm], num_logprobs=3,
                    pad_to=64)
    np.testing.assert_array_equal(shuffled.token_ids[:S], full.token_ids[perm])
    for i in range(S):
        alone = _run(logits[i:i + 1], [rows[i]], counts[i:i + 1], prompt[i:i + 1], num_logprobs=3)
        assert alone.token_ids[0] == full.token_ids[i], (i, rows[i])
        np.testing.assert_allclose(alone.logprobs[0], full.logprobs[i], rtol=1e-6)
        np.testing.assert_array_equal(alone.top_ids[0], full.top_ids[i])


# ---------------------------------------------------------------------------- logprobs
def test_logprobs_are_raw_log_softmax_and_top_ids_sorted():
    rng = np.random.default_rng(4)
    logits = (rng.standard_normal((6, 700)) * 3).astype(np.float32)
    counts = np.ones((6, 700), np.int32)
    rows = [SamplingRow(SamplingParams(temperature=t, top_k=k, presence_penalty=1.0, repetition_penalty=1.5,
                                       seed=i)) for i, (t, k) in enumerate([(0.0, 0), (0.5, 10), (1.3, 0)] * 2)]
    out = _run(logits, rows, counts=counts, num_logprobs=MAX_LOGPROBS)
    ref = jax.nn.log_softmax(jnp.asarray(logits, jnp.float64 if jax.config.x64_enabled else jnp.float32))
    ref = np.asarray(ref)
    np.testing.assert_allclose(out.logprobs, ref[np.arange(6), out.token_ids], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out.top_ids, np.argsort(-logits, -1, kind="stable")[:, :MAX_LOGPROBS])
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(ref, out.top_ids, 1), rtol=1e-5, atol=1e-5)
    assert (np.diff(out.top_logprobs, axis=1) <= 0).all()
    assert out.top_ids.dtype == np.int32 and out.token_ids.dtype == np.int32
    none = _run(logits, rows, num_logprobs=0)
    assert none.top_ids.shape == (6, 0) and none.top_logprobs.shape == (6, 0)


# ---------------------------------------------------------------------------- host-side records
@pytest.mark.parametrize("field,value,message", [
    ("temperature", 5, "temperature: must be between 0 and 2, got 5"),
    ("temperature", -0.1, "temperature: must be between 0 and 2, got -0.1"),
    ("temperature", float("nan"), "temperature: must be between 0 and 2, got nan"),
    ("temperature", "hot", "temperature: must be a number, got 'hot'"),
    ("top_p", 0.0, "top_p: must be in (0, 1], got 0.0"),
    ("top_p", 1.5, "top_p: must be in (0, 1], got 1.5"),
    ("top_k", -2, "top_k: must be -1 or 0 (off) or a positive integer below 2**31, got -2"),
    ("top_k", 2.5, "top_k: must be an integer, got 2.5"),
    ("min_p", 1.1, "min_p: must be between 0 and 1, got 1.1"),
    ("presence_penalty", 2.5, "presence_penalty: must be between -2 and 2, got 2.5"),
    ("frequency_penalty", -3, "frequency_penalty: must be between -2 and 2, got -3"),
    ("repetition_penalty", 0.0, "repetition_penalty: must be in (0, 2], got 0.0"),
    ("repetition_penalty", 2.5, "repetition_penalty: must be in (0, 2], got 2.5"),
    ("seed", -1, "seed: must be between 0 and 2**32-1, got -1"),
    ("seed", 2**32, "seed: must be between 0 and 2**32-1, got 4294967296"),
    ("max_tokens", 0, "max_tokens: must be at least 1, got 0"),
    ("stop", ("ok", ""), "stop: must be a list of non-empty strings"),
    ("stop_token_ids", (1, -4), "stop_token_ids: must be non-negative token ids"),
    ("ignore_eos", "yes", "ignore_eos: must be true or false, got 'yes'"),
    ("logprobs", 21, "logprobs: must be between 0 and 20, got 21"),
    ("n", 0, "n: must be at least 1, got 0"),
])
def test_sampling_params_validation(field, value, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    assert str(err.value).startswith(message)


def test_sampling_params_defaults_normalisation_and_seeds():
    p = SamplingParams(top_k=-1, stop=["a", "b"], stop_token_ids=[7], logprobs=0)
    assert p.stop == ("a", "b") and p.stop_token_ids == (7,) and not p.greedy
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(seed=5).with_seed(np.random.default_rng(0)).seed == 5
    a = SamplingParams().with_seed(np.random.default_rng(1))
    assert a.seed == SamplingParams().with_seed(np.random.default_rng(1)).seed
    assert 0 <= SamplingParams().with_seed(random.Random(2)).seed < 2**32
    hash(p)


def test_make_sampling_inputs_layout_and_padding():
    rows = [SamplingRow(SamplingParams(temperature=0.5, top_k=-1, top_p=0.9, seed=2**32 - 1), 7), None]
    inp = make_sampling_inputs(rows, 4)
    assert isinstance(inp, SamplingInputs)
    assert inp.temperature.tolist() == [0.5, 0.0, 0.0, 0.0] and inp.temperature.dtype == np.float32
    assert inp.top_k.tolist() == [0, 0, 0, 0] and inp.top_k.dtype == np.int32
    assert inp.seeds.tolist() == [2**32 - 1, 0, 0, 0] and inp.seeds.dtype == np.uint32
    assert inp.steps.tolist() == [7, 0, 0, 0] and inp.steps.dtype == np.int32
    assert inp.repetition_penalty.tolist() == [1.0] * 4
    with pytest.raises(ValueError, match="^pad_to: "):
        make_sampling_inputs(rows, 1)
    with pytest.raises(ValueError, match="^seed: "):
        make_sampling_inputs([SamplingRow(SamplingParams())], 1)
    assert make_sampling_inputs([SamplingRow(SamplingParams(temperature=0.0))], 1).seeds.tolist() == [0]


def test_pytrees_go_through_jit():
    leaves = jax.tree.leaves(make_sampling_inputs([None], 2))
    assert len(leaves) == len(dataclasses.fields(SamplingInputs))
    out = _run(np.zeros((2, 10), np.float32), [None, None], num_logprobs=2)
    assert len(jax.tree.leaves(out)) == 4 and out.token_ids.tolist() == [0, 0]


@pytest.mark.parametrize("scale", [4.0, 0.0])
def test_top_values_in_two_stages_equal_lax_top_k(scale):
    """A large vocabulary takes top_values' two stages; the values are lax.top_k's, also
    with many ties (rounded logits) and a row of all-equal values (scale 0)."""
    from runtime.model.sampling import top_values

    S, V = 3, 8 * CANDIDATES * 64 * 2
    x = jnp.round(jax.random.normal(jax.random.key(7), (S, V)) * scale * 8) / 8
    x = x.at[1, 12345].set(1e4).at[2, :].set(x[2] * 0.01)        # one far outlier; a flat row
    want = jax.lax.top_k(x, CANDIDATES)[0]
    np.testing.assert_array_equal(np.asarray(jax.jit(top_values, static_argnums=1)(x, CANDIDATES)), np.asarray(want))
    small = x[:, :4096]  # below the two-stage size: lax.top_k itself
    np.testing.assert_array_equal(np.asarray(top_values(small, CANDIDATES)), np.asarray(jax.lax.top_k(small, CANDIDATES)[0]))
