"""The quantized KV cache (int8 with a float16 scale and zero per 8 channels of K and 32 of V; fp8_e4m3 with
one float32 scale per token and KV head): write quantizes, attention dequantizes on read, sizes follow the real element size, and
start-up rejects what cannot run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runtime.model.xla_attention import QuantizedPages, quantize_rows, write_kv, xla_ragged_paged_attention
from runtime.model.batch import choose_shared_prefix
from runtime.config import CacheConfig
from runtime.model.attention_backend import make_backend, resolve
from runtime.model.runner import KV_DTYPES
from tests.attention_oracle import oracle, random_batch
from tests.engine_util import make_engine

QUANT = ("int8", "fp8_e4m3")


def _quantized(cache: np.ndarray, kv_dtype: str) -> tuple[QuantizedPages, np.ndarray]:
    """A float cache stored quantized, and the float values it now represents."""
    pages = QuantizedPages.of(jnp.asarray(cache), KV_DTYPES[kv_dtype], 4 if kv_dtype == "int8" else 1)
    return pages, np.asarray(pages.dequantized())


@pytest.mark.parametrize("kv_dtype", QUANT)
def test_quantize_rows_error_is_bounded_per_group(kv_dtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((50, 3, 64)).astype(np.float32) + 3.0  # off-centre: the zero earns its keep
    x[7, 1, :16] *= 100.0  # an outlier group must not coarsen the other heads (nor, for int8, groups)
    groups = 4 if kv_dtype == "int8" else 1
    vals, scales, zeros = quantize_rows(jnp.asarray(x), KV_DTYPES[kv_dtype], groups)
    assert vals.dtype == KV_DTYPES[kv_dtype] and scales.shape == (50, 3, groups)
    assert (zeros is None) == (kv_dtype != "int8")
    back = np.asarray(QuantizedPages(vals, scales, zeros).dequantized())
    if kv_dtype == "int8":  # half a step of each group's own range (plus float16's rounding of its pair)
        xg = x.reshape(50, 3, 4, 16)
        step = (xg.max(-1) - xg.min(-1)) / 255
        err = np.abs(back - x).reshape(50, 3, 4, 16).max(-1)
        assert (err <= 0.5 * step * 1.01 + np.abs(xg).max(-1) * 2 ** -10).all()
        assert float(scales[7, 1, 1]) < float(scales[7, 1, 0]) / 20
    else:
        rel = np.abs(back - x).max(-1) / np.abs(x).max(-1)
        assert rel.max() < 0.07
    assert float(scales[7, 0, 0]) < float(scales[7, 1, 0]) / 20  # its neighbours keep their own scale
    p = QuantizedPages.of(jnp.zeros((2, 1, 32)), KV_DTYPES[kv_dtype], groups)  # all zeros: exact, finite
    assert not np.asarray(p.dequantized()).any() and np.isfinite(np.asarray(p.scales, np.float32)).all()
    huge = QuantizedPages.of(jnp.full((1, 1, 32), 7e4).at[0, 0, 0].set(-7e4), KV_DTYPES[kv_dtype], groups)
    assert np.isfinite(np.asarray(huge.dequantized())).all()  # float16 scales and zeros: clipped, finite
    const = QuantizedPages.of(jnp.full((1, 1, 32), 0.3), KV_DTYPES[kv_dtype], groups)  # a constant group
    np.testing.assert_allclose(np.asarray(const.dequantized()), 0.3, rtol=2e-3)


def test_the_engines_int8_cache_holds_a_float16_scale_and_zero_per_8_k_and_32_v_channels():
    from runtime.model.runner import allocate_kv

    k, v = allocate_kv((4, 16, 2, 64), "int8")
    assert k.scales.shape == k.zeros.shape == (4, 16, 2, 8) and k.scales.dtype == jnp.float16
    assert v.scales.shape == v.zeros.shape == (4, 16, 2, 2) and v.zeros.dtype == jnp.float16
    nbytes = [sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(c)) for c in (k, v)]
    assert nbytes == [4 * 16 * 2 * 64 * 1.5, 4 * 16 * 2 * 64 * 1.125]
    k, v = allocate_kv((4, 16, 2, 12), "int8")  # a head size the groups do not divide: one per head
    assert k.scales.shape[-1] == v.scales.shape[-1] == 1
    with pytest.raises(ValueError, match="one scale per row"):
        quantize_rows(jnp.ones((2, 8)), jnp.float8_e4m3fn, 2)


@pytest.mark.parametrize("kv_dtype", QUANT)
def test_write_kv_quantizes_into_pages_and_drops_padding(kv_dtype):
    dt = KV_DTYPES[kv_dtype]
    pages = QuantizedPages.empty((4, 2, 1, 3), dt)
    k = jnp.arange(9, dtype=jnp.float32).reshape(3, 1, 3) + 1
    kc, vc = write_kv(pages, pages, k, -k, jnp.array([5, -1, 0]))
    assert isinstance(kc, QuantizedPages) and kc.values.dtype == dt
    got = np.asarray(kc[jnp.array([2, 0])])  # dequantized blocks 2 and 0
    np.testing.assert_allclose(got[0, 1, 0], [1, 2, 3], rtol=0.07)
    np.testing.assert_allclose(got[1, 0, 0], [7, 8, 9], rtol=0.07)
    written = np.abs(np.asarray(kc.dequantized())).reshape(8, 3).sum(-1) > 0
    assert written.nonzero()[0].tolist() == [0, 5]  # the -1 row went nowhere
    np.testing.assert_allclose(np.asarray(vc[jnp.array([2])])[0, 1, 0], [-1, -2, -3], rtol=0.07)


@pytest.mark.parametrize("kv_dtype", QUANT)
def test_attention_over_a_quantized_cache_equals_attention_over_its_values(kv_dtype):
    """Mixed decode + prefill + cascade: the result is exactly attention over the dequantized
    cache (the only error is the storage rounding), and close to the float result."""
    rng = np.random.default_rng(3)
    q, kc, vc, kvl, tables, qsl, ns = random_batch(rng, [1, 9, 1, 13, 1], [70, 60, 55, 61, 30], hq=6, hkv=2,
                                                   pad_seqs=1, mb=6)
    for i in (1, 2, 3):
        tables[i, :3] = tables[0, :3]
    shared = choose_shared_prefix(tables, np.array([5, 4, 4, 4, 2, 0]), kvl, 5, 16)
    kp, k_vals = _quantized(kc, kv_dtype)
    vp, v_vals = _quantized(vc, kv_dtype)
    got = np.asarray(xla_ragged_paged_attention(jnp.asarray(q), kp, vp, *map(jnp.asarray, (kvl, tables, qsl, ns)),
                                                sm_scale=0.25, kv_chunk_blocks=2, shared_chunk_blocks=2,
                                                prefill_chunk_blocks=2, q_tile=4,
                                                shared=jax.tree_util.tree_map(jnp.asarray, shared)))
    np.testing.assert_allclose(got, oracle(q, k_vals, v_vals, kvl, tables, qsl, ns, 0.25), atol=3e-5, rtol=3e-5)
    float_out = oracle(q, kc, vc, kvl, tables, qsl, ns, 0.25)
    assert np.abs(got - float_out).max() < (0.03 if kv_dtype == "int8" else 0.2)


def test_block_bytes_count_the_scales(tiny_ckpt):
    from runtime.checkpoint.store import load_config

    m = load_config(tiny_ckpt)
    f32, i8 = CacheConfig(16, 64, "float32"), CacheConfig(16, 64, "int8")
    groups = [m.head_dim // n if m.head_dim % n == 0 else 1 for n in (8, 32)]  # K, V
    per_head = 2 * m.head_dim * 1 + 4 * sum(groups)  # K and V: int8 elements + a float16 scale and zero per group
    assert i8.bytes_per_block(m) == m.num_layers * m.num_kv_heads * per_head * 16
    assert f32.bytes_per_block(m) > i8.bytes_per_block(m)
    budget = 8 << 20
    assert CacheConfig.from_memory(m, budget, kv_dtype="int8").num_blocks == budget // i8.bytes_per_block(m)


@pytest.mark.parametrize("kv_dtype", QUANT)
def test_engine_with_quantized_cache_allocates_it_and_generates(tiny_ckpt, kv_dtype):
    from runtime.model.sampling import SamplingParams

    ref = make_engine(tiny_ckpt, num_blocks=64)
    eng = make_engine(tiny_ckpt, num_blocks=64, kv_dtype=kv_dtype)
    k, v = eng.runner.kv
    assert isinstance(k, QuantizedPages) and k.values.dtype == KV_DTYPES[kv_dtype]
    assert eng.runner.kv_cache_bytes() == 64 * eng.config.cache.bytes_per_block(eng.config.model)
    assert eng.runner.kv_cache_bytes() < ref.runner.kv_cache_bytes() / 2.5  # (the scales count: head_dim 16 here)
    prompts = [[5, 9, 2, 7] * 10, [3, 1, 4, 1, 5, 9, 2, 6]]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = [r.output_ids for r in eng.generate(prompts, sp)]
    want = [r.output_ids for r in ref.generate(prompts, sp)]
    assert [len(o) for o in got] == [12, 12]
    assert sum(a == b for x, y in zip(got, want) for a, b in zip(x, y)) >= 12  # mostly the float tokens
    # the prefix cache serves a repeat from quantized blocks: same tokens again
    again = [r.output_ids for r in eng.generate(prompts, sp)]
    assert again == got and eng.scheduler.counters.prefix_hits > 0


def test_attention_backend_for_a_quantized_cache():
    """The Pallas kernel reads fp8 caches (tests/runtime/test_engine_pallas.py runs it), not
    int8's per-16-channel scales and zeros; auto stays XLA without a GPU, and on a GPU serves
    an int8 cache on the XLA path."""
    assert resolve("pallas") == "pallas"
    assert resolve("auto") == "xla"
    assert resolve("xla") == "xla"
    with pytest.raises(ValueError, match="attention_backend"):
        resolve("cuda")
    # the C++ kernels read float32 and int8 caches only; fp8 stays on plain XLA
    assert not make_backend("xla", "fp8_e4m3", cpu_kernels=True).cpu_kernel
    assert not make_backend("xla", "int8", cpu_kernels=False).cpu_kernel
    with pytest.raises(ValueError, match="pallas does not implement the int8 cache"):
        make_backend("pallas", "int8", cpu_kernels=False)


def test_auto_on_a_gpu_serves_an_int8_cache_on_the_xla_path(monkeypatch, caplog):
    from runtime.model.attention_backend import XlaAttention

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with caplog.at_level("INFO", logger="runtime.model.attention_backend"):
        assert make_backend("auto", "int8", cpu_kernels=False) == XlaAttention(cpu_kernel=False)
    assert "does not implement the int8 cache" in caplog.text
    assert make_backend("auto", "fp8_e4m3", cpu_kernels=False).name == "pallas"


@pytest.mark.real_model
def test_int8_kv_accuracy_gate_on_smollm2(smollm2_ckpt):
    """The int8 KV gate (perplexity within +1% of float32) on a short held-out text, with K/V
    rounded exactly as the paged cache stores them."""
    from runtime.bench.accuracy import evaluate, ppl_gate
    from runtime.checkpoint.store import load_checkpoint
    from tests.runtime.test_quant import HELD_OUT

    cfg, params, tok = load_checkpoint(smollm2_ckpt)
    ids = tok.encode(HELD_OUT)
    r = evaluate(cfg, params, ids, "none", 128, tok, kv_dtype="int8")
    assert 0 < abs(r["perplexity_increase"]) <= ppl_gate("none", "int8"), r
    assert 0 < r["mean_abs_logprob_diff"] < 0.05, r


@pytest.mark.real_model
def test_paged_int8_cache_agrees_with_the_accuracy_emulation(smollm2_ckpt):
    """The accuracy command emulates the int8 cache in a dense forward; the engine's paged
    cache must give the same next-token distribution up to rounding noise (so the gate
    measures what is served). Not bit-equal: float32 differences of 1e-6 between the two
    graphs flip a few int8 roundings, and flips compound over 30 layers (1e-3 after 4)."""
    from runtime.bench.accuracy import kv_roundtrip_logits
    from runtime.model.families.llama import dense_logits
    from runtime.model.sampling import SamplingParams
    from tests.runtime.test_quant import HELD_OUT

    eng = make_engine(smollm2_ckpt, num_blocks=64, kv_dtype="int8", max_num_batched_tokens=128)
    ids = eng.tokenizer.encode(HELD_OUT)[:100]
    cfg, params = eng.config.model, eng.runner.params
    emu = np.asarray(jax.nn.log_softmax(kv_roundtrip_logits(cfg, params, jnp.asarray(ids), "int8")[-1]))
    flt = np.asarray(jax.nn.log_softmax(dense_logits(cfg, params, jnp.asarray(ids))[-1]))
    req = eng.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, logprobs=5))[0]
    chosen, top = req.formatted_logprobs()[0]
    assert req.output_ids[0] == int(np.argmax(emu))
    assert abs(chosen - emu[req.output_ids[0]]) < 0.15
    assert len(top) == 5 and all(abs(lp - emu[tid]) < 0.15 for tid, lp in top)
    assert [t for t, _ in top][:2] == list(np.argsort(-emu)[:2])
    assert np.abs(emu - flt).max() > 1e-3  # the emulation does round
