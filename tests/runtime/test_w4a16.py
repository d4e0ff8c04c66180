"""w4a16: 4-bit weights as a GGUF stores them (Q4_0 / Q4_1 / Q4_K blocks, exact) or quantized
from float, the weight-only C++ kernel (runtime/kernels/cpu/cpu_linear_wq.cc) against numpy,
and engines serving it against the float32 engine on the same dequantized weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runtime.checkpoint.gguf_source import Q4_BLOCKS
from runtime.kernels.cpu import matmul as cpu_matmul
from runtime.model import quant
from runtime.model.linear import Int4Grouped, Int8GroupedWeightOnly, from_stored
from runtime.model.sampling import SamplingParams
from tests.engine_util import make_engine

needs_kernel = pytest.mark.skipif(not cpu_matmul.f32_vectorized(), reason="the C++ CPU kernels are not built here")


def test_nibbles_hold_a_group_s_two_halves_in_gguf_order():
    """Row 16 g + j of the packed weight: input 32 g + j in the low nibble, 32 g + 16 + j in the
    high one (a Q4_0 / Q4_1 block's own byte order); unpack inverts pack."""
    rng = np.random.default_rng(0)
    q = rng.integers(0, 16, size=(2, 64, 5), dtype=np.uint8)
    p = quant.pack_nibbles(q)
    assert p.shape == (2, 32, 5)
    for L, g, j, n in ((0, 0, 0, 0), (1, 1, 15, 4), (0, 1, 3, 2)):
        assert p[L, 16 * g + j, n] & 15 == q[L, 32 * g + j, n]
        assert p[L, 16 * g + j, n] >> 4 == q[L, 32 * g + 16 + j, n]
    np.testing.assert_array_equal(quant.unpack_nibbles(p), q)


def test_int4_grids_are_no_worse_than_round_to_nearest():
    """Each group's searched grid has at most the squared error of plain round to nearest over
    [min, max] (one of its candidates, before the refit), and a weight already on a 4-bit grid
    (a Q4_1 block's) comes back exactly."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((2, 96, 40)).astype(np.float32)
    q = quant.quantize_weight_int4(w)
    assert q["q4"].dtype == np.uint8 and q["q4"].shape == (2, 48, 40) and q["s4"].shape == (2, 3, 40)
    wg = w.reshape(2, 3, 32, 40)
    lo, hi = wg.min(2, keepdims=True), wg.max(2, keepdims=True)
    rtn = np.clip(np.rint((wg - lo) / ((hi - lo) / 15)), 0, 15) * ((hi - lo) / 15) + lo
    err = ((quant.dequantize_int4(q).reshape(wg.shape) - wg) ** 2).sum(2)
    assert np.all(err <= ((rtn - wg) ** 2).sum(2) * (1 + 1e-5))
    on_grid = quant.dequantize_int4(q)
    np.testing.assert_allclose(quant.dequantize_int4(quant.quantize_weight_int4(on_grid)), on_grid, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="groups of 32"):
        quant.quantize_weight_int4(w[:, :40])


def _q4k_blocks(rng: np.random.Generator, n: int) -> np.ndarray:
    """n random Q4_K super-blocks with finite positive float16 scales."""
    b = rng.integers(0, 256, size=(n, 144), dtype=np.uint8)
    b[:, 0:2] = rng.uniform(1e-3, 1e-1, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    b[:, 2:4] = rng.uniform(1e-3, 1e-1, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    return b


@pytest.mark.parametrize("kind", sorted(Q4_BLOCKS))
def test_gguf_4bit_blocks_decode_to_gguf_s_own_floats_bit_for_bit(kind):
    """values * scale + offset, in float32, equals gguf's dequantizer exactly: no float round trip."""
    import gguf
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(2)
    qt = getattr(gguf.GGMLQuantizationType, kind)
    if kind == "Q4_K":
        raw = _q4k_blocks(rng, 6)
    else:
        raw = quantize(rng.standard_normal((4, 256)).astype(np.float32), qt)
    want = np.asarray(dequantize(raw, qt), np.float32).reshape(-1, 32)
    q, s, m = Q4_BLOCKS[kind](np.asarray(raw, np.uint8).reshape(-1))
    assert q.dtype == np.uint8 and q.max() <= 15
    got = q.astype(np.float32) * s[:, None] + m[:, None]
    np.testing.assert_array_equal(got, want)


def _reference(x: np.ndarray, w: dict[str, np.ndarray]) -> np.ndarray:
    if "q4" in w:
        dense = quant.dequantize_int4(w)
    else:
        K, N = w["q8"].shape
        dense = (w["q8"].reshape(K // 32, 32, N).astype(np.float32) * w["s8"][:, None, :]).reshape(K, N)
    return x.astype(np.float64) @ dense.astype(np.float64)


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("M,K,N", [(1, 64, 16), (1, 576, 960), (2, 96, 48), (3, 1536, 64), (7, 128, 80),
                                   (8, 64, 32), (13, 1536, 48), (70, 96, 160)])
def test_kernel_matches_the_dequantized_product(bits, M, K, N):
    """Every row count (1-row chains, tiles of rows, the dequantize-then-float path from 8 rows)
    gives x @ dequantized(W) to float32 rounding, and XLA's in-graph dequantization agrees."""
    rng = np.random.default_rng(M * 7 + K + N + bits)
    w = rng.standard_normal((K, N)).astype(np.float32)
    stored = quant.quantize_weight_int4(w) if bits == 4 else quant.quantize_head_w8({"embed": w.T})
    x = (rng.standard_normal((M, K)) * 2).astype(np.float32)
    want = _reference(x, stored)
    packed = jax.tree.map(jnp.asarray, cpu_matmul.pack_wq(stored))
    assert packed["qp"].shape == (N // 16, K // 32, 256 if bits == 4 else 512)
    lin = from_stored(packed)
    assert isinstance(lin, cpu_matmul.PackedWq)
    got = np.asarray(jax.jit(lin.apply)(jnp.asarray(x)))
    tol = 2e-6 * np.abs(x).sum(axis=1, keepdims=True) * np.abs(w).max() * 4
    assert got.shape == (M, N)
    assert np.all(np.abs(got - want) <= tol)
    xla = from_stored(jax.tree.map(jnp.asarray, stored))
    assert isinstance(xla, Int4Grouped if bits == 4 else Int8GroupedWeightOnly)
    assert np.all(np.abs(np.asarray(jax.jit(xla.apply)(jnp.asarray(x))) - want) <= tol)


@needs_kernel
@pytest.mark.parametrize("M", [1, 3, 9])
def test_kernel_applies_the_norm_and_adds_the_residual(M):
    """rms_norm(x) @ W + residual in one call equals the separate ops (XLA's Int4Grouped)."""
    from runtime.model.linear import rms_norm

    rng = np.random.default_rng(M)
    K, N = 96, 48
    stored = quant.quantize_weight_int4(rng.standard_normal((K, N)).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((M, K)).astype(np.float32) * 3)
    res = jnp.asarray(rng.standard_normal((M, N)).astype(np.float32))
    nw = jnp.asarray((rng.random(K) + 0.5).astype(np.float32))
    packed = from_stored(jax.tree.map(jnp.asarray, cpu_matmul.pack_wq(stored)))
    got = np.asarray(jax.jit(lambda x, r, w: packed.apply(x, r, (w, 1e-5)))(x, res, nw))
    want = np.asarray(res + rms_norm(x, nw, 1e-5) @ quant.dequantize_int4(stored))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@needs_kernel
def test_kernel_rejects_shapes_that_disagree():
    packed = jax.tree.map(jnp.asarray, cpu_matmul.pack_wq(quant.quantize_weight_int4(np.ones((64, 32), np.float32))))
    with pytest.raises(Exception, match="quantized linear"):
        jax.block_until_ready(cpu_matmul.linear_wq(jnp.ones((2, 96), jnp.float32), packed))
    with pytest.raises(ValueError, match="16-column strips"):
        cpu_matmul.pack_wq(quant.quantize_weight_int4(np.ones((64, 24), np.float32)))


@needs_kernel
@pytest.mark.parametrize("M", [1, 3, 9])
def test_layer_tail_is_the_separate_calls_in_one(M):
    """One WqLayerTail call (wo + residual, norm, gate|up, SwiGLU, w_down + residual, then the
    next layer's norm and qkv) equals the separate linear_wq calls with XLA's SwiGLU between
    them (float32 rounding: its SiLU is the float kernel's formula), with and without the next
    layer; the fused tree is what a Llama-style w4a16 model runs."""
    from runtime.model.linear import rms_norm, typed

    rng = np.random.default_rng(M)
    d, A, ff, Nq = 64, 96, 128, 160

    def packed(K, N):
        return jax.tree.map(jnp.asarray, cpu_matmul.pack_wq(quant.quantize_weight_int4(
            rng.standard_normal((K, N)).astype(np.float32))))

    wo, gu, down, qkv = packed(A, d), packed(d, 2 * ff), packed(ff, d), packed(d, Nq)
    nw, nn = (jnp.asarray((rng.random(d) + 0.5).astype(np.float32)) for _ in range(2))
    a = jnp.asarray(rng.standard_normal((M, A)).astype(np.float32))
    h = jnp.asarray(rng.standard_normal((M, d)).astype(np.float32))

    @jax.jit
    def separate(a, h):
        h1 = cpu_matmul.linear_wq(a, wo, h)
        g, u = jnp.split(cpu_matmul.linear_wq(h1, gu, norm=(nw, 1e-5)), 2, axis=-1)
        out = cpu_matmul.linear_wq(jax.nn.silu(g) * u, down, h1)
        return out, cpu_matmul.linear_wq(rms_norm(out, nn, 1e-5), qkv)

    want_h, want_q = (np.asarray(t) for t in separate(a, h))
    got_h, got_q = (np.asarray(t) for t in jax.jit(
        lambda a, h: cpu_matmul.layer_tail_wq(a, h, wo, (nw, 1e-5), gu, down, qkv, nn))(a, h))
    np.testing.assert_allclose(got_h, want_h, rtol=1e-5, atol=1e-5 * np.abs(want_h).max())
    np.testing.assert_allclose(got_q, want_q, rtol=1e-4, atol=1e-4 * np.abs(want_q).max())
    alone, none = jax.jit(lambda a, h: cpu_matmul.layer_tail_wq(a, h, wo, (nw, 1e-5), gu, down))(a, h)
    assert none is None
    np.testing.assert_array_equal(np.asarray(alone), got_h)
    stacked = {"q4": np.zeros((1, 32, 64), np.uint8), "s4": np.ones((1, 2, 64), np.float32),
               "m4": np.zeros((1, 2, 64), np.float32)}
    layers = {k: stacked for k in quant.LINEAR_WEIGHTS}
    tree = cpu_matmul.pack_wq_params({"embed": np.zeros((8, 64), np.float32), "layers": {
        **layers, "attn_norm": np.ones((1, 64), np.float32)}}, swiglu_tail=True)
    assert isinstance(typed(tree)["layers"]["tail"], cpu_matmul.WqTail)
    plain = cpu_matmul.pack_wq_params({"embed": np.zeros((8, 64), np.float32), "layers": layers})
    assert "tail" not in typed(plain)["layers"]  # (Gemma: its own activation and norms)


@needs_kernel
def test_layer_tail_rejects_shapes_that_disagree():
    rng = np.random.default_rng(0)
    w = lambda K, N: jax.tree.map(jnp.asarray, cpu_matmul.pack_wq(quant.quantize_weight_int4(  # noqa: E731
        rng.standard_normal((K, N)).astype(np.float32))))
    wo, gu, down = w(64, 64), w(64, 128), w(64, 64)
    a, h = jnp.ones((2, 64), jnp.float32), jnp.ones((2, 64), jnp.float32)
    with pytest.raises(Exception, match="shapes disagree"):
        jax.block_until_ready(cpu_matmul.layer_tail_wq(a, h, wo, (jnp.ones((63,), jnp.float32), 1e-5), gu, down))
    with pytest.raises(Exception, match="next layer's qkv"):
        jax.block_until_ready(cpu_matmul.layer_tail_wq(a, h, wo, (jnp.ones((64,), jnp.float32), 1e-5), gu, down,
                                                       w(64, 96), jnp.ones((3,), jnp.float32)))


def _tiny_gguf(tmp_path, qtype: str):
    from runtime.model.families.llama import init_params
    from tests.model_files import write_gguf
    from tests.tiny import CHAT_TEMPLATE, tiny_config, tiny_tokenizer_json

    tok_json, vocab = tiny_tokenizer_json()
    cfg = tiny_config(vocab)
    params = init_params(cfg, 3)
    params["embed"] = params["embed"] * 4
    return write_gguf(tmp_path / f"m-{qtype}.gguf", cfg, params, tok_json, qtype=qtype, chat_template=CHAT_TEMPLATE)


PROMPTS = [list(range(3, 40)), [7, 8, 9, 10, 11], list(range(50, 140))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_a_q4_gguf_serves_its_own_4bit_values_with_the_float_engine_s_tokens(tmp_path, qtype, monkeypatch):
    """convert --quantize w4a16 keeps the GGUF's blocks (q * s4 + m4 equals the float convert's
    weights bit for bit); served as stored (auto), through the kernel and through XLA, the
    engine gives the float32 engine's greedy tokens on those same weights."""
    from runtime.checkpoint.store import load_checkpoint, read_meta
    from runtime.cli import main, inspect_text

    src = _tiny_gguf(tmp_path, qtype)
    w4, f32 = tmp_path / "w4", tmp_path / "f32"
    assert main(["convert", "--from", "gguf", str(src), "--out", str(w4), "--quantize", "w4a16"]) == 0
    assert main(["convert", "--from", "gguf", str(src), "--out", str(f32)]) == 0
    meta = read_meta(w4)
    assert meta["quantization"] == "w4a16" and meta["exact_gguf"] and meta["group_size"] == 32
    assert "(a GGUF's Q4_0/Q4_1/Q4_K blocks, exact)" in inspect_text(w4) and "LM head int8" in inspect_text(w4)
    stored, dense = load_checkpoint(w4)[1], load_checkpoint(f32)[1]
    for k in quant.LINEAR_WEIGHTS:
        np.testing.assert_array_equal(quant.dequantize_int4(jax.tree.map(np.asarray, stored["layers"][k])),
                                      np.asarray(dense["layers"][k]))
    want = [r.output_ids for r in make_engine(f32, quantization="none").generate(PROMPTS, GREEDY)]
    eng = make_engine(w4)
    assert eng.config.quantization == "w4a16"
    if cpu_matmul.f32_vectorized():
        assert eng.runner.wq_kernel and "qp" in eng.runner.params["layers"]["qkv"][0]
        # (the tiny vocabulary, 267, is no multiple of 16: its head stays the XLA path's)
        assert ("qp" in eng.runner.params["head"]) == (eng.runner.cfg.vocab_size % 16 == 0)
    assert [r.output_ids for r in eng.generate(PROMPTS, GREEDY)] == want
    monkeypatch.setattr(cpu_matmul, "f32_vectorized", lambda kernels=None: False)
    xla = make_engine(w4)
    assert not xla.runner.wq_kernel and "q4" in xla.runner.params["layers"]["wq"]
    assert [r.output_ids for r in xla.generate(PROMPTS, GREEDY)] == want


def test_convert_refuses_a_projection_without_an_exact_4bit_path(tmp_path, capsys):
    from runtime.cli import main

    src = _tiny_gguf(tmp_path, "Q8_0")
    assert main(["convert", "--from", "gguf", str(src), "--out", str(tmp_path / "w4"), "--quantize", "w4a16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "blk.0.attn_q.weight is Q8_0" in err[0] and "Q4_0, Q4_1, Q4_K" in err[0]
    assert not (tmp_path / "w4").exists()


def test_a_float_checkpoint_served_as_w4a16(tiny_ckpt):
    """Quantized at start-up (4-bit round to nearest, 8-bit head): the greedy tokens equal a
    float32 engine's on the dequantized weights, and a w4a16 checkpoint is refused as w8a8."""
    from runtime.checkpoint.store import load_checkpoint, quantize_checkpoint, write_checkpoint

    eng = make_engine(tiny_ckpt, quantization="w4a16")
    assert eng.config.quantization == "w4a16"
    got = [r.output_ids for r in eng.generate(PROMPTS, GREEDY)]
    cfg, params, _ = load_checkpoint(tiny_ckpt)
    q = quant.quantize_params(jax.tree.map(np.asarray, params), "w4a16")
    deq = {**params, "layers": {**params["layers"], **{k: quant.dequantize_int4(q["layers"][k])
                                                        for k in quant.LINEAR_WEIGHTS}}}
    deq["embed"] = np.asarray(params["embed"])
    path = tiny_ckpt.parent / "tiny-w4-dequantized"
    write_checkpoint(path, cfg, jax.tree.map(np.asarray, deq), (tiny_ckpt / "tokenizer.json").read_text(),
                     (tiny_ckpt / "chat_template.jinja").read_text(), force=True)
    assert got == [r.output_ids for r in make_engine(path, quantization="none").generate(PROMPTS, GREEDY)]
    w4 = quantize_checkpoint(tiny_ckpt, tiny_ckpt.parent / "tiny-w4", "w4a16", force=True)
    with pytest.raises(ValueError, match="stores w4a16 weights"):
        make_engine(w4, quantization="w8a8")
