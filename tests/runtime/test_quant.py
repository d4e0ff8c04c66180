"""W8A8 linear layers: the quantization math, the decoder with quantized weights, the engine."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runtime.model.families.llama import dense_logits
from runtime.model.quant import is_quantized, linear, quantize_params, quantize_weight
from runtime.model.sampling import SamplingParams
from tests.engine_util import make_engine


def test_quantize_weight_per_output_channel_round_trip():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((2, 64, 48)).astype(np.float32) * np.linspace(0.01, 3, 48)  # channel scales differ
    qw = quantize_weight(w)
    assert qw["q"].dtype == np.int8 and qw["s"].shape == (2, 48)
    assert np.abs(qw["q"]).max() == 127
    back = qw["q"].astype(np.float32) * qw["s"][:, None, :]
    # per-channel: each column's error is bounded by half its own step
    assert (np.abs(back - w) <= qw["s"][:, None, :] / 2 + 1e-6).all()


def test_linear_w8a8_close_to_float_and_per_token_scaled():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    x[3] *= 1000.0  # an outlier token must not cost the others their precision
    ref = x @ w
    got = np.asarray(jax.jit(linear)(jnp.asarray(x), jax.tree.map(jnp.asarray, quantize_weight(w))))
    rel = np.abs(got - ref) / np.abs(ref).max(axis=1, keepdims=True)
    assert rel.max() < 0.03
    assert np.abs(got[0] - ref[0]).max() < 0.03 * np.abs(ref[0]).max()
    assert np.array_equal(np.asarray(linear(jnp.asarray(x), jnp.asarray(w))), np.asarray(jnp.asarray(x) @ w))


def test_quantize_params_keeps_head_and_norms_float(tiny_ckpt):
    from runtime.checkpoint.store import load_checkpoint

    cfg, params, _ = load_checkpoint(tiny_ckpt)
    qp = quantize_params(params, "w8a8")
    assert all(is_quantized(qp["layers"][k]) for k in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"))
    assert not is_quantized(qp["layers"]["attn_norm"]) and not is_quantized(qp["embed"])
    assert quantize_params(params, "none") is params
    with pytest.raises(ValueError, match="quantization"):
        quantize_params(params, "int3")
    ref = np.asarray(dense_logits(cfg, params, jnp.arange(3, 40)))
    got = np.asarray(dense_logits(cfg, jax.tree.map(jnp.asarray, qp), jnp.arange(3, 40)))
    assert (ref.argmax(-1) == got.argmax(-1)).mean() >= 0.9
    assert np.abs(got - ref).max() < 0.1 * np.abs(ref).max()


def test_w8a8_smoothing_folds_into_norms_w_up_and_wv(tiny_ckpt, monkeypatch):
    """Calibrated w8a8 on a GQA model: one scale per 32 inputs, no input scale left (every
    1/s folded into what makes the input, wo's tied over the query heads of a KV head), and
    the model's logits kept."""
    from runtime.checkpoint.store import load_checkpoint
    from runtime.model import quant
    from runtime.model.quant import W8A8_GROUP, activation_absmax, calibration_ids, is_grouped

    cfg, params, tok = load_checkpoint(tiny_ckpt)
    assert cfg.num_heads > cfg.num_kv_heads  # the wv fold needs its tie
    am = activation_absmax(cfg, params, calibration_ids(tok, cfg.max_position_embeddings))
    qp = quantize_params(params, "w8a8", am, head_dim=cfg.head_dim)
    assert is_grouped(qp) and not any("in" in qp["layers"][k] for k in ("wo", "w_down"))
    assert qp["layers"]["wo"]["g"].shape[-2] == cfg.num_heads * cfg.head_dim // W8A8_GROUP
    ids = jnp.arange(3, 40)
    ref = np.asarray(dense_logits(cfg, params, ids))
    got = np.asarray(dense_logits(cfg, jax.tree.map(jnp.asarray, qp), ids))
    assert (ref.argmax(-1) == got.argmax(-1)).mean() >= 0.9
    assert np.abs(got - ref).max() < 0.1 * np.abs(ref).max()
    # The folds alone are exact: with the rounding taken out (weights left float after
    # smoothing), the smoothed model gives the float model's logits.
    monkeypatch.setattr(quant, "quantize_weight_grouped", lambda w: w)
    folded = quantize_params(params, "w8a8", am, head_dim=cfg.head_dim)
    assert not np.allclose(folded["layers"]["wv"], params["layers"]["wv"])  # it did move scale
    np.testing.assert_allclose(np.asarray(dense_logits(cfg, jax.tree.map(jnp.asarray, folded), ids)), ref,
                               rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_engine_serves_w8a8(tiny_ckpt):
    eng = make_engine(tiny_ckpt, quantization="w8a8")
    layers = eng.runner.params["layers"]
    if eng.runner.matmul_kernel:  # packed for the C++ kernel, q|k|v as one product
        qkv = layers["qkv"][0] if isinstance(layers["qkv"], tuple) else layers["qkv"]  # (held per layer)
        assert "wq" not in layers and qkv["p"].dtype == jnp.int8
    else:
        assert layers["wq"]["q"].dtype == jnp.int8
    ref = make_engine(tiny_ckpt)
    rng = np.random.default_rng(2)
    prompts = [list(rng.integers(3, 260, size=n)) for n in (5, 40, 90)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got = [r.output_ids for r in eng.generate(prompts, params)]
    want = [r.output_ids for r in ref.generate(prompts, params)]
    assert all(len(g) == 8 for g in got)
    agree = np.mean([a == b for g, w in zip(got, want) for a, b in zip(g, w)])
    assert agree >= 0.5  # random tiny weights: quantization may flip near-ties, not the whole output


HELD_OUT = (
    "The river town woke slowly that spring. Fishermen pulled their boats onto the gravel bank, "
    "children ran between the market stalls, and the baker opened his shutters to let the smell of "
    "fresh bread drift across the square. Nobody in the town remembered a winter as long as the one "
    "that had just ended. Snow had closed the mountain road for eleven weeks, and the ferry had stopped "
    "running when ice formed along the western shore. Now the water was high and brown, carrying "
    "branches and pieces of old fences down toward the sea. The mayor called a meeting in the school "
    "hall to decide how the town would repair the damaged bridge before the summer traders arrived. "
    "Some people wanted to borrow money from the regional bank; others argued that every family should "
    "give a few days of work instead. The debate lasted until late in the evening, and in the end they "
    "agreed to do both: the bank would pay for steel and cement, and volunteers would do the digging, "
    "carrying and painting. By the first week of June the new bridge was finished, and the whole town "
    "walked across it together, singing the old songs their grandparents had taught them."
)


@pytest.mark.real_model
def test_w8a8_accuracy_gate_on_smollm2(smollm2_ckpt):
    """The quantization gate (perplexity within +3% of float32), on a short held-out text,
    with the engine's own calibrated SmoothQuant weights."""
    from runtime.bench.accuracy import PPL_GATES, evaluate
    from runtime.checkpoint.store import load_checkpoint

    cfg, params, tok = load_checkpoint(smollm2_ckpt)
    ids = tok.encode(HELD_OUT)
    assert len(ids) > 200
    r = evaluate(cfg, params, ids, "w8a8", 128, tok)
    # 224 tokens are too few for the perplexity gate itself (that one is `pagedjax bench
    # accuracy` on 4,095 tokens): the logprob difference is the steady signal. On this text:
    # a scale per 32 inputs, smoothed, 0.040 nats (perplexity -0.5..-1%); unsmoothed 0.061;
    # the earlier scale per token and output channel 0.106 (+3.2%), which changed answers.
    assert r["perplexity_increase"] <= PPL_GATES["w8a8"], r
    assert r["mean_abs_logprob_diff"] < 0.055, r


def test_linear_w8a16_dequantizes_weights_only():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    qw = quantize_weight(w)
    tree = {"w8": jnp.asarray(qw["q"]), "s": jnp.asarray(qw["s"])}
    got = np.asarray(jax.jit(linear)(jnp.asarray(x), tree))
    # exactly the float product with the dequantized weights: activations are not rounded
    want = x @ (qw["q"].astype(np.float32) * qw["s"][None, :])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_engine_serves_w8a16(tiny_ckpt):
    from runtime.model.quant import quantization_of

    eng = make_engine(tiny_ckpt, quantization="w8a16")
    assert quantization_of(eng.runner.params) == "w8a16" and eng.runner.params["layers"]["wq"]["w8"].dtype == jnp.int8
    ref = make_engine(tiny_ckpt)
    prompts = [list(range(3, 40)), [7, 8, 9]]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got = [r.output_ids for r in eng.generate(prompts, sp)]
    want = [r.output_ids for r in ref.generate(prompts, sp)]
    assert np.mean([a == b for g, w in zip(got, want) for a, b in zip(g, w)]) >= 0.5


@pytest.mark.parametrize("method", ["w8a8", "w8a16"])
def test_quantized_checkpoint_loads_without_requantizing(tiny_ckpt, tmp_path, method, monkeypatch):
    """`convert --from pagedjax --quantize` stores int8 weights and scales; the engine serves
    them as stored (auto), with the same tokens as quantizing the float checkpoint at start."""
    from runtime.model import quant
    from runtime.checkpoint.store import load_checkpoint, read_meta, stored_weight_bytes
    from runtime.cli import inspect_text, main

    out = tmp_path / "q"
    assert main(["convert", "--from", "pagedjax", str(tiny_ckpt), "--out", str(out), "--quantize", method]) == 0
    _, params, _ = load_checkpoint(out)
    key, scale = ("q", "g") if method == "w8a8" else ("w8", "s")  # w8a8: a scale per 32 inputs
    assert params["layers"]["wq"][key].dtype == jnp.int8 and params["layers"]["wq"][scale].dtype == jnp.float32
    assert read_meta(out)["group_size"] == (32 if method == "w8a8" else None)
    assert stored_weight_bytes(out) < stored_weight_bytes(tiny_ckpt) / 2
    assert f"quantization                  {method}" in inspect_text(out)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [list(range(3, 40)), [7, 8, 9]]
    want = [r.output_ids for r in make_engine(tiny_ckpt, quantization=method).generate(prompts, sp)]
    calls = []
    monkeypatch.setattr(quant, "quantize_params", lambda *a, **k: calls.append(a))
    eng = make_engine(out)  # auto: as stored
    assert eng.config.quantization == method and not calls
    assert [r.output_ids for r in eng.generate(prompts, sp)] == want
    assert make_engine(out, quantization=method).config.quantization == method and not calls


def test_quantized_checkpoint_bad_requests(tiny_ckpt, tmp_path, capsys):
    from runtime.cli import main

    out = tmp_path / "q"
    assert main(["convert", "--from", "pagedjax", str(tiny_ckpt), "--out", str(out), "--quantize", "w8a8"]) == 0
    assert main(["convert", "--from", "pagedjax", str(out), "--out", str(tmp_path / "qq"), "--quantize", "w8a8"]) == 2
    assert "already quantized (w8a8)" in capsys.readouterr().err
    assert main(["convert", "--from", "pagedjax", str(tiny_ckpt), "--out", str(tmp_path / "f")]) == 2
    assert "give --quantize" in capsys.readouterr().err
    with pytest.raises(ValueError, match="stores w8a8 weights and cannot be served as none"):
        make_engine(out, quantization="none")
    with pytest.raises(ValueError, match="cannot be served as w8a16"):
        make_engine(out, quantization="w8a16")


def test_w8a8_int8_lm_head_for_two_rows_and_up(tiny_ckpt):
    """--quantize-lm-head: calibrated w8a8 adds an int8 copy of the head (a scale per 32
    inputs, like the layers); steps of 2+ rows use it, a 1-row step keeps the float head
    (XLA's 1-row int8 dot is slow)."""
    from runtime.checkpoint.store import load_checkpoint
    from runtime.model.families.llama import lm_head
    from runtime.model.quant import prepare

    cfg, params, tok = load_checkpoint(tiny_ckpt)
    assert "head" not in prepare(params, "w8a8", cfg, tok)  # opt-in
    qp = jax.tree.map(jnp.asarray, prepare(params, "w8a8", cfg, tok, lm_head=True))
    head = qp["head"]
    assert head["q"].dtype == jnp.int8 and head["q"].shape == (cfg.hidden_size, cfg.vocab_size)
    assert head["g"].shape == (cfg.hidden_size // 32, cfg.vocab_size) and "in" not in head
    h = jnp.asarray(np.random.default_rng(5).standard_normal((6, cfg.hidden_size)).astype(np.float32))
    ref = np.asarray(lm_head(cfg, params, h))
    got = np.asarray(lm_head(cfg, qp, h))
    assert not np.array_equal(got, ref) and np.abs(got - ref).max() < 0.05 * np.abs(ref).max()
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.8
    np.testing.assert_array_equal(np.asarray(lm_head(cfg, qp, h[:1])), np.asarray(lm_head(cfg, params, h[:1])))


def test_checkpoint_with_int8_lm_head(tiny_ckpt, tmp_path):
    from runtime.checkpoint.store import read_meta
    from runtime.cli import main

    out = tmp_path / "qh"
    assert main(["convert", "--from", "pagedjax", str(tiny_ckpt), "--out", str(out), "--quantize", "w8a8",
                 "--quantize-lm-head"]) == 0
    assert read_meta(out)["lm_head_int8"]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [list(range(3, 30)), [9, 8, 7, 6]]
    eng = make_engine(out)
    assert eng.config.quantization == "w8a8" and eng.config.quantize_lm_head
    head = eng.runner.params["head"]
    assert head["p" if eng.runner.matmul_kernel else "q"].dtype == jnp.int8
    want = make_engine(tiny_ckpt, quantization="w8a8", quantize_lm_head=True).generate(prompts, sp)
    assert [r.output_ids for r in eng.generate(prompts, sp)] == [r.output_ids for r in want]
    plain = tmp_path / "q"
    assert main(["convert", "--from", "pagedjax", str(tiny_ckpt), "--out", str(plain), "--quantize", "w8a8"]) == 0
    with pytest.raises(ValueError, match="stored without the int8 LM head"):
        make_engine(plain, quantize_lm_head=True)
    with pytest.raises(ValueError, match="needs --quantization w8a8"):
        make_engine(tiny_ckpt, quantization="w8a16", quantize_lm_head=True)


def test_per_layer_weights_give_the_stacked_model_s_logits(tiny_ckpt, monkeypatch):
    """unstack_weights (the CPU runner's layout: one array per layer, picked by lax.switch)
    is a layout change only: the same logits as the stacked tree, and the runner uses it on
    CPU unless PAGEDJAX_PER_LAYER_WEIGHTS=0."""
    from runtime.checkpoint.store import load_checkpoint
    from runtime.model.families.llama import unstack_weights
    from runtime.model.quant import LINEAR_WEIGHTS

    cfg, params, _ = load_checkpoint(tiny_ckpt)
    params = jax.tree.map(jnp.asarray, params)
    split = unstack_weights(params, LINEAR_WEIGHTS)
    assert all(isinstance(split["layers"][k], tuple) and len(split["layers"][k]) == cfg.num_layers
               for k in LINEAR_WEIGHTS)
    assert not isinstance(split["layers"]["attn_norm"], tuple)  # norms stay stacked (scanned)
    ids = jnp.asarray([1, 5, 9, 33, 7, 2], jnp.int32)
    want = jax.jit(dense_logits, static_argnums=0)(cfg, params, ids)
    got = jax.jit(dense_logits, static_argnums=0)(cfg, split, ids)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert make_engine(tiny_ckpt, num_blocks=16).runner.per_layer_weights
    monkeypatch.setenv("PAGEDJAX_PER_LAYER_WEIGHTS", "0")
    eng = make_engine(tiny_ckpt, num_blocks=16)
    layers = eng.runner.params["layers"]
    assert not eng.runner.per_layer_weights and not isinstance(layers.get("wq", layers.get("qkv")), tuple)
