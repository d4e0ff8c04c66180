"""The C++ float32 linear kernel (runtime/kernels/cpu/cpu_linear_f32.cc): the packed layout, the numbers
against a float64 reference, shape checks, and an engine serving float32 through it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runtime.kernels.cpu import matmul as cpu_matmul
from runtime.model.sampling import SamplingParams
from tests.engine_util import make_engine

needs_f32 = pytest.mark.skipif(not cpu_matmul.f32_vectorized(),
                               reason="no AVX2 + FMA kernel here: XLA's dot serves float32")


def test_float_pack_layout():
    w = np.arange(5 * 48, dtype=np.float32).reshape(5, 48)
    f = cpu_matmul.pack_float(w)["f"]
    assert f.shape == (3, 5, 16)
    for s in range(3):
        np.testing.assert_array_equal(f[s], w[:, 16 * s:16 * s + 16])
    stacked = cpu_matmul.pack_float(np.stack([w, -w]))["f"]  # a leading layer axis stays in front
    assert stacked.shape == (2, 3, 5, 16) and (stacked[1] == -f).all()
    with pytest.raises(ValueError, match="do not divide"):
        cpu_matmul.pack_float(np.ones((4, 40), np.float32))


@needs_f32
@pytest.mark.parametrize("M,K,N", [(1, 64, 16), (5, 3, 48), (7, 100, 96), (48, 64, 32), (49, 576, 64),
                                   (130, 17, 160), (85, 1536, 32), (200, 1536, 48)])
def test_float_kernel_matches_a_float64_reference(M, K, N):
    """Row panels (at K 1536 at most 84 rows: 85 rows make two, 200 three, the last short),
    odd K, odd and even strip counts (the AVX-512 tile pairs strips); the next strips'
    prefetch runs in each of them."""
    rng = np.random.default_rng(M * 100 + K)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((K, N)).astype(np.float32)
    packed = jax.tree.map(jnp.asarray, cpu_matmul.pack_float(w))
    got = np.asarray(jax.jit(cpu_matmul.linear_f32)(jnp.asarray(x), packed))
    want = x.astype(np.float64) @ w.astype(np.float64)
    assert got.shape == (M, N)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(K))



@needs_f32
@pytest.mark.parametrize("M", range(1, 14))
def test_float_kernel_every_row_remainder(M):
    """Every row count of a register tile (6 rows on AVX2, 12 on AVX-512) and one past it, over
    three strips (one pair and one single on AVX-512)."""
    rng = np.random.default_rng(M)
    x = rng.standard_normal((M, 9)).astype(np.float32)
    w = rng.standard_normal((9, 48)).astype(np.float32)
    got = np.asarray(jax.jit(cpu_matmul.linear_f32)(jnp.asarray(x), jax.tree.map(jnp.asarray, cpu_matmul.pack_float(w))))
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.astype(np.float64), rtol=1e-5, atol=1e-4)

@needs_f32
def test_float_kernel_rejects_shapes_that_disagree():
    packed = jax.tree.map(jnp.asarray, cpu_matmul.pack_float(np.ones((64, 32), np.float32)))
    with pytest.raises(Exception, match="float32 linear"):
        jax.jit(cpu_matmul.linear_f32)(jnp.ones((4, 60), jnp.float32), packed).block_until_ready()


@needs_f32
@pytest.mark.parametrize("M,K,inter", [(1, 64, 16), (13, 40, 48), (64, 576, 96), (85, 1536, 32)])
def test_swiglu_epilogue_gives_silu_gate_times_up(M, K, inter):
    """Gate and up packed as strip pairs: the kernel returns silu(gate) * up [M, inter] (odd
    pair counts, row tails and several row panels included), against float64."""
    rng = np.random.default_rng(M + K)
    x = rng.standard_normal((M, K)).astype(np.float32)
    gate = (rng.standard_normal((K, inter)) * 0.3).astype(np.float32)
    up = rng.standard_normal((K, inter)).astype(np.float32)
    packed = jax.tree.map(jnp.asarray, cpu_matmul.pack_swiglu(gate, up))
    got = np.asarray(jax.jit(cpu_matmul.linear_f32)(jnp.asarray(x), packed))
    g, u = x.astype(np.float64) @ gate, x.astype(np.float64) @ up
    assert got.shape == (M, inter)
    np.testing.assert_allclose(got, g / (1 + np.exp(-g)) * u, rtol=2e-5, atol=2e-5 * np.sqrt(K))


@needs_f32
@pytest.mark.parametrize("M,K,N", [(1, 64, 16), (7, 100, 48), (64, 576, 576), (85, 1536, 32)])
def test_residual_epilogue_adds_the_residual(M, K, N):
    rng = np.random.default_rng(M * 3 + N)
    x, w = rng.standard_normal((M, K)).astype(np.float32), rng.standard_normal((K, N)).astype(np.float32)
    res = rng.standard_normal((M, N)).astype(np.float32) * 10
    packed = jax.tree.map(jnp.asarray, cpu_matmul.pack_float(w))
    got = np.asarray(jax.jit(cpu_matmul.linear_f32)(jnp.asarray(x), packed, jnp.asarray(res)))
    np.testing.assert_allclose(got, res + x.astype(np.float64) @ w, rtol=1e-5, atol=1e-4 * np.sqrt(K))


@needs_f32
@pytest.mark.parametrize("M,K", [(1, 64), (13, 100), (64, 576), (85, 1536)])
def test_norm_prologue_normalizes_the_rows_first(M, K):
    """norm=(w, eps): the kernel RMS-normalizes x's rows (as models/llama.py rms_norm) before
    the product, for a plain and a SwiGLU weight, with a residual too."""
    from runtime.model.families.llama import rms_norm

    rng = np.random.default_rng(M + K)
    x = (rng.standard_normal((M, K)) * 3).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, K).astype(np.float32)
    w = rng.standard_normal((K, 48)).astype(np.float32)
    res = rng.standard_normal((M, 48)).astype(np.float32)
    y = np.asarray(rms_norm(jnp.asarray(x), jnp.asarray(nw), 1e-5)).astype(np.float64)
    packed = jax.tree.map(jnp.asarray, cpu_matmul.pack_float(w))
    f = jax.jit(lambda x, w, r, nw: cpu_matmul.linear_f32(x, w, r, (nw, 1e-5)))
    got = np.asarray(f(jnp.asarray(x), packed, jnp.asarray(res), jnp.asarray(nw)))
    np.testing.assert_allclose(got, res + y @ w, rtol=1e-5, atol=1e-4 * np.sqrt(K))
    gate, up = w[:, :16] * 0.3, w[:, 16:32]
    sw = jax.tree.map(jnp.asarray, cpu_matmul.pack_swiglu(gate, up))
    got = np.asarray(jax.jit(lambda x, w, nw: cpu_matmul.linear_f32(x, w, norm=(nw, 1e-5)))(
        jnp.asarray(x), sw, jnp.asarray(nw)))
    g, u = y @ gate, y @ up
    np.testing.assert_allclose(got, g / (1 + np.exp(-g)) * u, rtol=2e-5, atol=2e-5 * np.sqrt(K))


@needs_f32
def test_epilogues_refuse_what_they_cannot_do():
    x = jnp.ones((4, 32), jnp.float32)
    sw = jax.tree.map(jnp.asarray, cpu_matmul.pack_swiglu(np.ones((32, 16), np.float32), np.ones((32, 16), np.float32)))
    with pytest.raises(ValueError, match="no residual"):
        cpu_matmul.linear_f32(x, sw, jnp.ones((4, 16), jnp.float32))
    with pytest.raises(ValueError, match="must match"):
        cpu_matmul.pack_swiglu(np.ones((32, 16), np.float32), np.ones((32, 32), np.float32))
    w = jax.tree.map(jnp.asarray, cpu_matmul.pack_float(np.ones((32, 16), np.float32)))
    with pytest.raises(Exception, match="residual must be"):
        jax.block_until_ready(jax.jit(cpu_matmul.linear_f32)(x, w, jnp.ones((3, 16), jnp.float32)))
    with pytest.raises(Exception, match="norm weight must have K"):
        jax.block_until_ready(jax.jit(lambda x, w, nw: cpu_matmul.linear_f32(x, w, norm=(nw, 1e-5)))(
            x, w, jnp.ones((31,), jnp.float32)))


@needs_f32
def test_engine_serves_float32_through_the_kernel(tiny_ckpt, monkeypatch):
    """Packed, fused, per-layer float weights: the same greedy tokens and logprobs (to float
    rounding) as XLA's dot, and the compiled step calls the kernel; PAGEDJAX_F32_KERNEL=0
    turns it off. Unforced, it is on exactly where the library says it is preferred."""
    prompts = [list(range(3, 40)), [7, 8, 9, 10, 11], list(range(50, 140))]
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)
    monkeypatch.setenv("PAGEDJAX_F32_KERNEL", "1")  # (the default on AVX2-only CPUs)
    eng = make_engine(tiny_ckpt)
    assert eng.runner.f32_kernel
    layers = eng.runner.params["layers"]
    assert all(isinstance(layers[k], tuple) and "f" in layers[k][0] for k in ("qkv", "wo", "w_down"))
    assert isinstance(layers["gate_up"], tuple) and "fg" in layers["gate_up"][0]  # SwiGLU pairs
    got = eng.generate(prompts, sp)
    monkeypatch.setenv("PAGEDJAX_F32_KERNEL", "0")
    ref = make_engine(tiny_ckpt)
    assert not ref.runner.f32_kernel and "wq" in ref.runner.params["layers"]
    want = ref.generate(prompts, sp)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    for a, b in zip(got, want):
        np.testing.assert_allclose([e[0] for e in a.logprobs], [e[0] for e in b.logprobs], atol=1e-4)
    from runtime.model.batch import build_step_input
    from runtime.bench.offline import decode_rows

    r = eng.runner
    inp = build_step_input(decode_rows(r, 2, 20), 2, 2, r.max_blocks_per_seq, r.cache_cfg.block_size, r.scratch_row)
    hlo = r._step.lower(r.params, r.kv, r.penalty, inp).as_text()
    # layer 0's qkv alone; then each layer's wo, MLP and the next layer's qkv in one call
    assert cpu_matmul.F32_TARGET in hlo and cpu_matmul.TAIL_TARGET in hlo
    monkeypatch.delenv("PAGEDJAX_F32_KERNEL")
    from runtime.kernels.cpu import build as cpu_kernels

    assert make_engine(tiny_ckpt).runner.f32_kernel == bool(cpu_kernels.library().PagedjaxF32LinearPreferred())


@needs_f32
def test_packed_lm_head_gives_xla_s_logits_at_the_rows_it_serves():
    """The runner's packed head copy ("head_f32") serves 1-64 rows; more than 64 keep XLA's
    product; the logits agree either way."""
    from runtime.model.families.llama import init_params, lm_head
    from tests.tiny import tiny_config

    cfg = tiny_config(272)  # (a vocabulary the kernel's 16-column strips divide)
    params = jax.tree.map(jnp.asarray, init_params(cfg, seed=3))
    packed = {**params, "head_f32": jax.tree.map(jnp.asarray, cpu_matmul.pack_float(np.asarray(params["embed"]).T))}
    rng = np.random.default_rng(0)
    for rows in (1, 2, 64, 65):
        h = jnp.asarray(rng.standard_normal((rows, cfg.hidden_size)).astype(np.float32))
        want = np.asarray(jax.jit(lm_head, static_argnums=0)(cfg, params, h))
        fn = jax.jit(lm_head, static_argnums=0)
        np.testing.assert_allclose(np.asarray(fn(cfg, packed, h)), want, rtol=1e-5, atol=1e-5)
        assert (cpu_matmul.F32_TARGET in fn.lower(cfg, packed, h).as_text()) == (rows <= 64)


def _tail_weights(rng, d=96, A=64, inter=160, Q=128):
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    T = lambda t: jax.tree.map(jnp.asarray, t)  # noqa: E731
    return dict(wo=T(cpu_matmul.pack_float(f(A, d))), gu=T(cpu_matmul.pack_swiglu(f(d, inter), f(d, inter))),
                down=T(cpu_matmul.pack_float(f(inter, d))), qkv=T(cpu_matmul.pack_float(f(d, Q))),
                nw=jnp.asarray(1 + 0.1 * f(d)), nn=jnp.asarray(1 + 0.1 * f(d)))


@needs_f32
@pytest.mark.parametrize("M", [1, 3, 13, 64, 130])
def test_layer_tail_is_the_separate_calls_bit_for_bit(M):
    """One call (wo + residual, norm, SwiGLU, w_down + residual, then the next layer's norm and
    qkv) gives the bits of the four linear_f32 calls it replaces, with and without the next
    layer: 1 row (the 4-strip row tiles), one tile, two tiles, one panel, two panels."""
    rng = np.random.default_rng(M)
    w = _tail_weights(rng)
    a = jnp.asarray(rng.standard_normal((M, 64)).astype(np.float32))
    h = jnp.asarray(rng.standard_normal((M, 96)).astype(np.float32))

    @jax.jit
    def separate(a, h, w):
        h1 = cpu_matmul.linear_f32(a, w["wo"], h)
        out = cpu_matmul.linear_f32(cpu_matmul.linear_f32(h1, w["gu"], norm=(w["nw"], 1e-5)), w["down"], h1)
        return out, cpu_matmul.linear_f32(out, w["qkv"], norm=(w["nn"], 1e-5))

    chained = jax.jit(lambda a, h, w: cpu_matmul.layer_tail_f32(a, h, w["wo"], (w["nw"], 1e-5), w["gu"], w["down"],
                                                                w["qkv"], w["nn"]))
    alone = jax.jit(lambda a, h, w: cpu_matmul.layer_tail_f32(a, h, w["wo"], (w["nw"], 1e-5), w["gu"], w["down"])[0])
    want_h, want_qkv = (np.asarray(t) for t in separate(a, h, w))
    got_h, got_qkv = (np.asarray(t) for t in chained(a, h, w))
    np.testing.assert_array_equal(got_h, want_h)
    np.testing.assert_array_equal(got_qkv, want_qkv)
    np.testing.assert_array_equal(np.asarray(alone(a, h, w)), want_h)


@needs_f32
def test_layer_tail_rejects_shapes_that_disagree():
    rng = np.random.default_rng(0)
    w = _tail_weights(rng)
    a, h = jnp.ones((2, 64), jnp.float32), jnp.ones((2, 96), jnp.float32)
    with pytest.raises(Exception, match="shapes disagree"):
        jax.block_until_ready(cpu_matmul.layer_tail_f32(a, h, w["wo"], (jnp.ones((95,), jnp.float32), 1e-5),
                                                        w["gu"], w["down"]))
    with pytest.raises(Exception, match="next layer's qkv"):
        jax.block_until_ready(cpu_matmul.layer_tail_f32(a, h, w["wo"], (w["nw"], 1e-5), w["gu"], w["down"],
                                                        w["qkv"], jnp.ones((3,), jnp.float32)))


@needs_f32
@pytest.mark.parametrize("swiglu", [False, True])
def test_a_row_gets_the_same_bits_at_any_row_count(swiglu):
    """Batch invariance at the kernel: one row alone (4-strip row tiles, 4-strip items) and the
    same row among 6 others (register tiles of 2 strips) give identical outputs."""
    rng = np.random.default_rng(7)
    K, n = 576, 160
    w = (cpu_matmul.pack_swiglu(rng.standard_normal((K, n)).astype(np.float32), rng.standard_normal((K, n)).astype(np.float32))
         if swiglu else cpu_matmul.pack_float(rng.standard_normal((K, n)).astype(np.float32)))
    w = jax.tree.map(jnp.asarray, w)
    x = rng.standard_normal((7, K)).astype(np.float32)
    f = jax.jit(cpu_matmul.linear_f32)
    all_rows = np.asarray(f(jnp.asarray(x), w))
    for r in (0, 3, 6):
        np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x[r:r + 1]), w))[0], all_rows[r])


@needs_f32
def test_kernel_calls_from_several_threads_at_once():
    """The pool handoff (a helper lingers for the next call's work) under calls from four
    threads at once, with tails and plain products interleaved: every result stays exact."""
    import threading

    rng = np.random.default_rng(3)
    w = _tail_weights(rng)
    tail = jax.jit(lambda a, h, w: cpu_matmul.layer_tail_f32(a, h, w["wo"], (w["nw"], 1e-5), w["gu"], w["down"],
                                                             w["qkv"], w["nn"]))
    plain = jax.jit(lambda x, w: cpu_matmul.linear_f32(x, w["down"]))
    cases = []
    for m in (1, 2, 5, 12):
        a = jnp.asarray(rng.standard_normal((m, 64)).astype(np.float32))
        h = jnp.asarray(rng.standard_normal((m, 96)).astype(np.float32))
        x = jnp.asarray(rng.standard_normal((m, 160)).astype(np.float32))
        cases.append((a, h, x, [np.asarray(t) for t in tail(a, h, w)], np.asarray(plain(x, w))))
    errors = []

    def worker(seed):
        for i in range(60):
            a, h, x, want_tail, want_plain = cases[(seed + i) % len(cases)]
            got = [np.asarray(t) for t in tail(a, h, w)]
            if not all(np.array_equal(g, e) for g, e in zip(got, want_tail)) or \
                    not np.array_equal(np.asarray(plain(x, w)), want_plain):
                errors.append((seed, i))

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
