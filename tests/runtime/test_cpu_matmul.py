"""The C++ W8A8 linear kernel (runtime/kernels/cpu/cpu_matmul.cc): the packed layout, the numbers against
XLA's int8 path and a numpy reference, and an engine serving w8a8 through it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runtime.kernels.cpu import matmul as cpu_matmul
from runtime.model.quant import is_quantized, linear, quantization_of, quantize_params, quantize_weight
from runtime.model.sampling import SamplingParams
from tests.engine_util import make_engine

needs_vnni = pytest.mark.skipif(not cpu_matmul.vectorized(), reason="no AVX512-VNNI here: XLA's int8 dot serves w8a8")


def reference(x: np.ndarray, q: np.ndarray, s: np.ndarray, in_scale: np.ndarray | None) -> np.ndarray:
    """Per-row absmax int8 activations (half to even), exact integer products, two scales."""
    y = x * in_scale if in_scale is not None else x
    sx = np.abs(y).max(-1, keepdims=True) / np.float32(127)
    sx = np.where(sx > 0, sx, np.float32(1)).astype(np.float32)
    xq = np.clip(np.rint(y / sx), -127, 127).astype(np.int64)
    return ((xq @ q.astype(np.int64)).astype(np.float32) * sx) * s


def test_pack_layout_matches_the_kernel_contract():
    """Strip s, group kq, panel j, lane l, byte t holds W[4kq + t, 64s + 16j + l]; K pads to 4
    and N to 64 with zeros; the compensation is 128 * column sums over the real rows."""
    rng = np.random.default_rng(0)
    q = rng.integers(-127, 128, size=(2, 10, 70), dtype=np.int8)  # stacked layers, K=10, N=70
    p = cpu_matmul.pack_weight(q, np.ones((2, 70), np.float32))
    assert p["p"].shape == (2, 2, 3, 256) and p["p"].dtype == np.int8
    for L, k, n in ((0, 0, 0), (1, 9, 69), (0, 5, 17), (1, 3, 64)):
        s, c = divmod(n, 64)
        j, lane = divmod(c, 16)
        kq, t = divmod(k, 4)
        assert p["p"][L, s, kq, j * 64 + lane * 4 + t] == q[L, k, n]
    assert p["p"][0, 1, :, :].reshape(3, 4, 16, 4)[:, :, 6:, :].max() == 0  # columns 70.. of strip 1
    assert p["p"][0, :, 2, :].reshape(-1, 4, 16, 4)[..., 2:].max() == 0    # k = 10, 11
    np.testing.assert_array_equal(p["c"], 128 * q.astype(np.int32).sum(1))


@needs_vnni
@pytest.mark.parametrize("M,K,N,smooth", [(1, 64, 48, False), (2, 70, 100, True), (7, 128, 130, False),
                                          (65, 96, 64, True), (130, 64, 200, False)])
def test_kernel_matches_the_reference(M, K, N, smooth):
    rng = np.random.default_rng(M * 1000 + N)
    x = rng.standard_normal((M, K)).astype(np.float32) * 3
    x[0, 0] = 40.0  # an outlier channel in one row only: the other rows keep their precision
    w = quantize_weight(rng.standard_normal((K, N)).astype(np.float32))
    ins = (rng.random(K) + 0.5).astype(np.float32) if smooth else None
    packed = jax.tree.map(jnp.asarray, cpu_matmul.pack_weight(w["q"], w["s"], ins))
    got = np.asarray(jax.jit(cpu_matmul.linear)(jnp.asarray(x), packed))
    want = reference(x, w["q"], w["s"], ins)
    assert got.shape == (M, N)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    if M > 1:  # XLA's int8 path computes the same int8 rows and integer products
        tree = jax.tree.map(jnp.asarray, {**w, **({"in": ins} if smooth else {})})
        np.testing.assert_allclose(got, np.asarray(jax.jit(linear)(jnp.asarray(x), tree)), rtol=1e-6,
                                   atol=1e-6 * np.abs(want).max())


@needs_vnni
def test_kernel_rejects_shapes_that_disagree():
    w = quantize_weight(np.ones((64, 64), np.float32))
    packed = jax.tree.map(jnp.asarray, cpu_matmul.pack_weight(w["q"], w["s"]))
    with pytest.raises(Exception, match="int8 linear"):
        jax.jit(cpu_matmul.linear)(jnp.ones((4, 60), jnp.float32), packed).block_until_ready()


def test_pack_params_fuses_projections_that_share_an_input(tiny_ckpt):
    from runtime.checkpoint.store import load_checkpoint

    cfg, params, _ = load_checkpoint(tiny_ckpt)
    qp = quantize_params(params, "w8a8", grouped=False)  # one scale per output channel (the fallback)
    packed = cpu_matmul.pack_params(qp)
    layers = packed["layers"]
    assert set(layers) >= {"qkv", "gate_up", "wo", "w_down"} and not {"wq", "wk", "wv", "w_gate", "w_up"} & set(layers)
    d, hd = cfg.hidden_size, cfg.head_dim
    assert layers["qkv"]["s"].shape == (cfg.num_layers, (cfg.num_heads + 2 * cfg.num_kv_heads) * hd)
    assert layers["gate_up"]["s"].shape == (cfg.num_layers, 2 * cfg.intermediate_size)
    assert layers["qkv"]["p"].shape[-2:] == (d // 4, 256)
    assert is_quantized(layers["qkv"]) and quantization_of(packed) == "w8a8"
    with pytest.raises(ValueError, match="share their input scale"):
        cpu_matmul._pack([{**qp["layers"]["wq"], "in": np.ones(d, np.float32)}, qp["layers"]["wk"]])
    # the default: a scale per 32 inputs, fused the same way (the grouped kernel's "gs")
    grouped = cpu_matmul.pack_params(quantize_params(params, "w8a8"))["layers"]
    assert grouped["qkv"]["gs"].shape == (cfg.num_layers, d // 32, (cfg.num_heads + 2 * cfg.num_kv_heads) * hd)


@needs_vnni
def test_engine_serves_w8a8_through_the_kernel(tiny_ckpt, monkeypatch, caplog):
    """Packed (and fused) weights give the same greedy tokens as XLA's int8 path, and the
    compiled step calls the kernel; without the kernel the engine says w8a8 runs XLA's dot."""
    prompts = [list(range(3, 40)), [7, 8, 9, 10, 11], list(range(50, 140))]
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    eng = make_engine(tiny_ckpt, quantization="w8a8")
    assert eng.runner.matmul_kernel
    # held per layer (a custom call would otherwise get a copy of each scanned slice)
    layers = eng.runner.params["layers"]
    assert all(isinstance(layers[k], tuple) and len(layers[k]) == eng.runner.cfg.num_layers and "p" in layers[k][0]
               for k in ("qkv", "gate_up", "wo", "w_down"))
    got = [r.output_ids for r in eng.generate(prompts, sp)]
    assert "int8 kernel is not available" not in caplog.text
    monkeypatch.setattr(cpu_matmul, "vectorized", lambda kernels=None: False)
    with caplog.at_level("WARNING", logger="runtime.model.runner"):
        ref = make_engine(tiny_ckpt, quantization="w8a8")
    assert "w8a8: the C++ int8 kernel is not available here" in caplog.text
    assert not ref.runner.matmul_kernel and "wq" in ref.runner.params["layers"]
    assert got == [r.output_ids for r in ref.generate(prompts, sp)]
    from runtime.model.batch import build_step_input
    from runtime.bench.offline import decode_rows

    r = eng.runner
    inp = build_step_input(decode_rows(r, 2, 20), 2, 2, r.max_blocks_per_seq, r.cache_cfg.block_size, r.scratch_row)
    hlo = r._step.lower(r.params, r.kv, r.penalty, inp).as_text()
    assert cpu_matmul.TARGET in hlo
    # the LM head stays float; where the float kernel is on, its packed copy serves 2-64 rows
    packs_head = cpu_matmul.f32_default() and r.cfg.vocab_size % cpu_matmul.F32_STRIP == 0
    assert ("head_f32" in r.params) == (cpu_matmul.F32_TARGET in hlo) == packs_head


@needs_vnni
def test_w8a8_keeps_a_float_head_with_the_float_kernels_copy(tiny_ckpt, monkeypatch):
    """A w8a8 tree without an int8 head gets the float kernel's packed head (vocabulary 32
    here, divisible by its 16-column strips); its logits are the float head's."""
    from runtime.model.families.llama import lm_head

    monkeypatch.setenv("PAGEDJAX_F32_KERNEL", "1")
    r = make_engine(tiny_ckpt, quantization="w8a8").runner
    embed = np.asarray(r.params["embed"])[:32]
    params = cpu_matmul.with_float_head({**r.params, "embed": jnp.asarray(embed)}, tied=True)
    assert params["head_f32"]["f"].shape == (2, embed.shape[1], 16)
    h = jnp.asarray(np.random.default_rng(0).standard_normal((3, embed.shape[1])).astype(np.float32))
    got = np.asarray(jax.jit(lambda p, x: lm_head(r.cfg, p, x))(jax.tree.map(jnp.asarray, params), h))
    np.testing.assert_allclose(got, np.asarray(h) @ embed.T, rtol=1e-5, atol=1e-5)


def grouped_reference(x: np.ndarray, q: np.ndarray, g: np.ndarray) -> np.ndarray:
    """llama.cpp's Q8_0 dot: each row's groups of 32 quantized with their own absmax scale,
    exact integer sums per group, both scales applied per group (float64 here)."""
    M, K = x.shape
    xg = x.reshape(M, K // 32, 32)
    sx = np.abs(xg).max(-1, keepdims=True) / np.float32(127)
    sx = np.where(sx > 0, sx, np.float32(1)).astype(np.float32)
    xq = np.clip(np.rint(xg / sx), -127, 127).astype(np.int64)
    acc = np.einsum("mgk,gkn->mgn", xq, q.reshape(K // 32, 32, -1).astype(np.int64)).astype(np.float64)
    return np.einsum("mgn,mg,gn->mn", acc, sx[..., 0].astype(np.float64), g.astype(np.float64))


@needs_vnni
@pytest.mark.parametrize("M,K,N", [(1, 64, 48), (2, 96, 100), (7, 128, 130), (65, 320, 64), (130, 1536, 200)])
def test_grouped_kernel_matches_the_q8_0_reference(M, K, N):
    """Rows in tiles of 3 and their remainders, K blocks of 256 and a partial one, column tails."""
    from runtime.model.quant import grouped_linear

    rng = np.random.default_rng(M * 1000 + N)
    x = rng.standard_normal((M, K)).astype(np.float32) * 3
    x[0, 0] = 40.0  # an outlier costs only its own group of 32 its precision
    q = rng.integers(-127, 128, size=(K, N), dtype=np.int8)
    g = (rng.random((K // 32, N)) * 0.01 + 1e-3).astype(np.float32)
    packed = jax.tree.map(jnp.asarray, cpu_matmul.pack_grouped_weight(q, g))
    assert packed["gc"].shape == (K // 32, N)
    got = np.asarray(jax.jit(cpu_matmul.linear)(jnp.asarray(x), packed))
    want = grouped_reference(x, q, g)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    if M > 1:  # XLA's grouped path: the same int8 groups and sums
        xla = np.asarray(jax.jit(grouped_linear)(jnp.asarray(x), {"q": jnp.asarray(q), "g": jnp.asarray(g)}))
        np.testing.assert_allclose(xla, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    with pytest.raises(ValueError, match="groups of 32"):
        cpu_matmul.pack_grouped_weight(q, g[:-1])


@needs_vnni
def test_engine_serves_a_q8_0_checkpoint_through_the_grouped_kernel(tmp_path, monkeypatch):
    """A Q8_0 GGUF converted with --quantize w8a8 --quantize-lm-head: the packed, fused
    grouped weights give the XLA grouped path's greedy tokens, and the step calls the
    grouped kernel (head included)."""
    from runtime.checkpoint.store import load_checkpoint
    from runtime.cli import main
    from runtime.model.families.llama import init_params
    from tests.model_files import write_gguf
    from tests.tiny import CHAT_TEMPLATE, tiny_config, tiny_tokenizer_json

    tok_json, vocab = tiny_tokenizer_json()
    cfg = tiny_config(vocab)
    params = init_params(cfg, 1)
    params["embed"] = params["embed"] * 4
    src = write_gguf(tmp_path / "m.gguf", cfg, params, tok_json, qtype="Q8_0", chat_template=CHAT_TEMPLATE)
    ckpt = tmp_path / "q8"
    assert main(["convert", "--from", "gguf", str(src), "--out", str(ckpt), "--quantize", "w8a8",
                 "--quantize-lm-head"]) == 0
    assert "g" in load_checkpoint(ckpt)[1]["layers"]["wq"]
    prompts = [list(range(3, 40)), [7, 8, 9, 10, 11], list(range(50, 140))]
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    eng = make_engine(ckpt, quantization="w8a8", quantize_lm_head=True)
    r = eng.runner
    assert r.matmul_kernel and "gs" in r.params["layers"]["qkv"][0] and "gs" in r.params["head"]
    got = [x.output_ids for x in eng.generate(prompts, sp)]
    from runtime.model.batch import build_step_input
    from runtime.bench.offline import decode_rows

    inp = build_step_input(decode_rows(r, 2, 20), 2, 2, r.max_blocks_per_seq, r.cache_cfg.block_size, r.scratch_row)
    hlo = r._step.lower(r.params, r.kv, r.penalty, inp).as_text()
    assert cpu_matmul.GROUPED_TARGET in hlo and f"{cpu_matmul.TARGET}\"" not in hlo
    monkeypatch.setattr(cpu_matmul, "vectorized", lambda kernels=None: False)
    ref = make_engine(ckpt, quantization="w8a8", quantize_lm_head=True)
    assert not ref.runner.matmul_kernel and "g" in ref.runner.params["layers"]["wq"]
    assert got == [x.output_ids for x in ref.generate(prompts, sp)]


@pytest.mark.skipif(not cpu_matmul.amx(), reason="no AMX-INT8 here (or the OS does not lend the tiles)")
@pytest.mark.parametrize("M,K,N,smooth", [(16, 64, 48, False), (17, 128, 130, True), (64, 576, 960, False),
                                          (130, 1536, 200, True), (33, 70, 64, False), (15, 64, 64, False)])
def test_amx_path_gives_the_vnni_paths_bits(M, K, N, smooth, monkeypatch):
    """16+ rows with K a multiple of 64 run on AMX tiles (padding rows, column tails, the
    SmoothQuant input scale); the int32 sums are exact on both paths, so the outputs are
    identical, and both equal the reference."""
    rng = np.random.default_rng(M * 7 + N)
    x = jnp.asarray(rng.standard_normal((M, K)).astype(np.float32) * 2)
    q = rng.integers(-127, 128, size=(K, N), dtype=np.int8)
    s = (rng.random(N) * 0.01 + 1e-3).astype(np.float32)
    inn = (rng.random(K) + 0.5).astype(np.float32) if smooth else None
    w = jax.tree.map(jnp.asarray, cpu_matmul.pack_weight(q, s, inn))
    f = jax.jit(cpu_matmul.linear)
    monkeypatch.setenv("PAGEDJAX_AMX", "1")
    amx = np.asarray(f(x, w))
    monkeypatch.setenv("PAGEDJAX_AMX", "0")
    assert not cpu_matmul.amx()
    vnni = np.asarray(f(x, w))
    np.testing.assert_array_equal(amx, vnni)
    want = reference(np.asarray(x), q, s, inn)
    np.testing.assert_allclose(amx, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
