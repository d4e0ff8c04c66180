"""One CPU kernel variant against its references, in a process of its own:

    PAGEDJAX_CPU_KERNEL_VARIANT=avx2 python -m tests.kernels.check_variant OUT.npz

loads the variant the environment names (runtime/kernels/cpu/build.py), checks that the library
reports that variant's instruction-set paths (so the branch that ran is the one meant), runs
the int8 linear (per channel and grouped), the float32 linear (plain, residual, SwiGLU, norm,
the layer tail), the weight-only quantized linear (4- and 8-bit, its layer tail), paged attention (decode, prefill, a shared prefix, an int8 cache) and the
KV write on shapes with row, column and K tails, compares each with its numpy reference (the
float64 attention oracle for attention), and saves the outputs to OUT.npz for the
cross-variant comparison in tests/runtime/test_cpu_kernel_variants.py. Exit status 0 only
when every check passes.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from runtime.kernels.cpu import matmul as cpu_matmul
from runtime.model.xla_attention import QuantizedPages
from runtime.model.batch import choose_shared_prefix
from runtime.kernels.cpu import build
from tests.attention_oracle import oracle, random_batch

OUT: dict[str, np.ndarray] = {}


def close(name: str, got, want, rtol: float, atol: float) -> None:
    got = np.asarray(got)
    OUT[name] = got
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=name)


def int8_reference(x, q, s, in_scale):
    """Per-row absmax int8 activations (half to even), exact integer products, two scales."""
    y = x * in_scale if in_scale is not None else x
    sx = np.abs(y).max(-1, keepdims=True) / np.float32(127)
    sx = np.where(sx > 0, sx, np.float32(1)).astype(np.float32)
    xq = np.clip(np.rint(y / sx), -127, 127).astype(np.int64)
    return ((xq @ q.astype(np.int64)).astype(np.float32) * sx) * s


def grouped_reference(x, q, g):
    """llama.cpp's Q8_0 dot: groups of 32 with their own scales, exact integer sums."""
    M, K = x.shape
    xg = x.reshape(M, K // 32, 32)
    sx = np.abs(xg).max(-1, keepdims=True) / np.float32(127)
    sx = np.where(sx > 0, sx, np.float32(1)).astype(np.float32)
    xq = np.clip(np.rint(xg / sx), -127, 127).astype(np.int64)
    acc = np.einsum("mgk,gkn->mgn", xq, q.reshape(K // 32, 32, -1).astype(np.int64)).astype(np.float64)
    return np.einsum("mgn,mg,gn->mn", acc, sx[..., 0].astype(np.float64), g.astype(np.float64))


def check_int8(rng) -> None:
    from runtime.model.quant import quantize_weight

    # M 1, a 6-row tile plus a row, 33 rows (AMX: two 16-row tiles and a padded one; K 128 is
    # whole 64-byte steps), K not a multiple of 4, N past a 64-column strip
    for M, K, N, smooth in ((1, 64, 48, False), (7, 70, 130, True), (33, 128, 200, False), (16, 256, 64, True)):
        x = rng.standard_normal((M, K)).astype(np.float32) * 3
        x[0, 0] = 40.0
        w = quantize_weight(rng.standard_normal((K, N)).astype(np.float32))
        ins = (rng.random(K) + 0.5).astype(np.float32) if smooth else None
        packed = jax.tree.map(jnp.asarray, cpu_matmul.pack_weight(w["q"], w["s"], ins))
        want = int8_reference(x, w["q"], w["s"], ins)
        close(f"int8_{M}x{K}x{N}", jax.jit(cpu_matmul.linear)(jnp.asarray(x), packed), want, 1e-6,
              1e-6 * np.abs(want).max())
    for M, K, N in ((1, 64, 48), (7, 96, 130), (20, 320, 64)):
        x = rng.standard_normal((M, K)).astype(np.float32) * 3
        q = rng.integers(-127, 128, size=(K, N), dtype=np.int8)
        g = (rng.random((K // 32, N)) * 0.01 + 1e-3).astype(np.float32)
        packed = jax.tree.map(jnp.asarray, cpu_matmul.pack_grouped_weight(q, g))
        want = grouped_reference(x, q, g)
        close(f"int8_g32_{M}x{K}x{N}", jax.jit(cpu_matmul.linear)(jnp.asarray(x), packed), want, 1e-5,
              1e-6 * np.abs(want).max())


def norm(v, w, eps=1e-5):
    """RMS norm in float64 (as the kernel's prologue and runtime.model.linear.rms_norm)."""
    v = v.astype(np.float64)
    return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * w


def check_f32(rng) -> None:
    # every tile remainder of both tile heights (6 and 12 rows), odd strip counts, two row panels
    for M, K, N in ((1, 64, 16), (1, 96, 112), (5, 3, 48), (13, 100, 96), (49, 576, 64), (85, 1536, 32)):
        x = rng.standard_normal((M, K)).astype(np.float32)
        w = rng.standard_normal((K, N)).astype(np.float32)
        res = rng.standard_normal((M, N)).astype(np.float32)
        packed = jax.tree.map(jnp.asarray, cpu_matmul.pack_float(w))
        want = x.astype(np.float64) @ w.astype(np.float64)
        close(f"f32_{M}x{K}x{N}", jax.jit(cpu_matmul.linear_f32)(jnp.asarray(x), packed), want, 1e-5,
              1e-5 * np.sqrt(K))
        close(f"f32_residual_{M}x{K}x{N}", jax.jit(cpu_matmul.linear_f32)(jnp.asarray(x), packed, jnp.asarray(res)),
              res + want, 1e-5, 1e-4 * np.sqrt(K))
    for M, K, inter in ((1, 64, 16), (13, 40, 48), (64, 576, 96)):
        x = rng.standard_normal((M, K)).astype(np.float32)
        gate = (rng.standard_normal((K, inter)) * 0.3).astype(np.float32)
        up = rng.standard_normal((K, inter)).astype(np.float32)
        nw = rng.uniform(0.5, 1.5, K).astype(np.float32)
        packed = jax.tree.map(jnp.asarray, cpu_matmul.pack_swiglu(gate, up))
        g, u = x.astype(np.float64) @ gate, x.astype(np.float64) @ up
        close(f"swiglu_{M}x{K}x{inter}", jax.jit(cpu_matmul.linear_f32)(jnp.asarray(x), packed),
              g / (1 + np.exp(-g)) * u, 2e-5, 2e-5 * np.sqrt(K))
        g, u = norm(x, nw) @ gate, norm(x, nw) @ up
        got = jax.jit(lambda x, w, nw: cpu_matmul.linear_f32(x, w, norm=(nw, 1e-5)))(jnp.asarray(x), packed,
                                                                                    jnp.asarray(nw))
        close(f"swiglu_norm_{M}x{K}x{inter}", got, g / (1 + np.exp(-g)) * u, 2e-5, 2e-5 * np.sqrt(K))
    # the layer tail: wo + residual, the MLP, the next layer's qkv, as one chained call
    for M in (1, 7, 20):
        d, A, inter, nq = 64, 48, 96, 80
        a = rng.standard_normal((M, A)).astype(np.float32)
        h = rng.standard_normal((M, d)).astype(np.float32)
        wo = (rng.standard_normal((A, d)) * 0.2).astype(np.float32)
        gate = (rng.standard_normal((d, inter)) * 0.2).astype(np.float32)
        up = (rng.standard_normal((d, inter)) * 0.2).astype(np.float32)
        down = (rng.standard_normal((inter, d)) * 0.2).astype(np.float32)
        qkv = (rng.standard_normal((d, nq)) * 0.2).astype(np.float32)
        n1, n2 = (rng.uniform(0.5, 1.5, d).astype(np.float32) for _ in range(2))
        h1 = h + a.astype(np.float64) @ wo
        g, u = norm(h1, n1) @ gate, norm(h1, n1) @ up
        out = h1 + (g / (1 + np.exp(-g)) * u) @ down
        j = jnp.asarray
        got, got_qkv = jax.jit(lambda *t: cpu_matmul.layer_tail_f32(
            t[0], t[1], {"f": t[2]}, (t[3], 1e-5), {"fg": t[4]}, {"f": t[5]}, {"f": t[6]}, t[7]))(
            j(a), j(h), j(cpu_matmul.pack_float(wo)["f"]), j(n1), j(cpu_matmul.pack_swiglu(gate, up)["fg"]),
            j(cpu_matmul.pack_float(down)["f"]), j(cpu_matmul.pack_float(qkv)["f"]), j(n2))
        close(f"tail_{M}", got, out, 1e-4, 1e-4)
        close(f"tail_qkv_{M}", got_qkv, norm(out, n2) @ qkv, 1e-4, 1e-4)


def check_attention(rng) -> None:
    """The kernel's targets called directly (runtime/kernels/cpu/attention.py): every query token in
    prefill mode (causal up to its position), each sequence's last token in decode mode,
    against the float64 oracle over the same pages."""
    from runtime.kernels.cpu import attention as cpu_attention

    def run(name, batch, scale, shared=None, pages=None):
        q, kc, vc, kvl, tables, qsl, ns = batch
        want = oracle(q, kc, vc, kvl, tables, qsl, ns, scale)
        n = int(ns[0])
        S, hkv = tables.shape[0], kc.shape[2]
        T, hq, d = q.shape
        qk = jnp.asarray((q * np.float32(scale)).reshape(T, hkv, hq // hkv, d))
        kq, vq = pages if pages else (jnp.asarray(kc), jnp.asarray(vc))
        sh = None if shared is None else jax.tree_util.tree_map(jnp.asarray, shared)
        seq_of, pos = np.zeros(T, np.int32), np.full(T, -1, np.int32)
        for s in range(n):
            a, b = int(qsl[s]), int(qsl[s + 1])
            seq_of[a:b] = s
            pos[a:b] = kvl[s] - (b - a) + np.arange(b - a)
        got = cpu_attention.prefill_attention(qk, kq, vq, jnp.asarray(seq_of), jnp.asarray(pos),
                                              jnp.asarray(tables), sh)
        close(f"attn_prefill_{name}", np.asarray(got).reshape(T, hq, d), want, 3e-5, 3e-5)
        last = np.asarray([int(qsl[s + 1]) - 1 for s in range(n)] + [0] * (S - n))
        lens = np.where(np.arange(S) < n, kvl, 0).astype(np.int32)
        dec = np.asarray(cpu_attention.decode_attention(qk[last], kq, vq, jnp.asarray(lens), jnp.asarray(tables),
                                                        sh)).reshape(S, hq, d)
        close(f"attn_decode_{name}", dec[:n], want[last[:n]], 3e-5, 3e-5)
        assert not dec[n:].any(), f"attn_decode_{name}: rows without a query must be zero"

    # decodes of many lengths (partial blocks, one token, a long one), a prefill chunk, padding;
    # head dims 16 (the tile loops only) and 64 (the split ranges), GQA groups 3, 8 and 1
    for hq, hkv, d in ((9, 3, 64), (8, 1, 16), (4, 4, 32)):
        run(f"mixed_{hq}_{hkv}_{d}", random_batch(rng, [1, 1, 1, 7, 1], [1, 16, 37, 60, 250], hq=hq, hkv=hkv, d=d,
                                                  pad_seqs=2, num_blocks=48), 0.3)
    run("one_long", random_batch(rng, [1], [400], hq=9, hkv=3, d=64, pad_seqs=1, num_blocks=40), 0.125)
    # a shared prefix (cascade) over a float32 and an int8 cache, members decoding and one prefilling
    q, kc, vc, kvl, tables, qsl, ns = random_batch(rng, [1] * 6 + [5], [70, 52, 33, 61, 49, 80, 40], hq=9, hkv=3,
                                                   d=64, pad_seqs=1, mb=6, num_blocks=80)
    for i in range(1, 5):
        tables[i, :2] = tables[0, :2]
    shared = choose_shared_prefix(tables, np.array([5, 4, 3, 4, 4, 5, 3, 0]), kvl, 7, 16)
    assert int(shared.length[0]) == 32

    def paged(c, groups):  # the engine's int8 layout: 8 (K) and 32 (V) channels per scale and zero
        p = QuantizedPages.of(jnp.asarray(c) + 0.5, jnp.int8, groups)
        return p, np.asarray(p.dequantized())

    (kp, kvals), (vp, vvals) = paged(kc, 8), paged(vc, 2)
    run("shared_f32", (q, kc, vc, kvl, tables, qsl, ns), 0.125, shared)
    run("shared_int8", (q, kvals, vvals, kvl, tables, qsl, ns), 0.125, shared, (kp, vp))
    # the KV write: rows at flat slots, padding (-1) and past-the-end slots dropped
    kc, vc = (rng.standard_normal((6, 4, 3, 16)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((5, 3, 16)).astype(np.float32) for _ in range(2))
    slots = np.asarray([3, -1, 23, 24, 0], np.int32)
    got_k, got_v = cpu_attention.write_kv(*map(jnp.asarray, (kc, vc, k, v, slots)))
    for c, rows, got in ((kc, k, got_k), (vc, v, got_v)):
        want = c.reshape(24, 3, 16).copy()
        want[[3, 23, 0]] = rows[[0, 2, 4]]
        close(f"kv_write_{len(OUT)}", np.asarray(got).reshape(24, 3, 16), want, 0, 0)


def check_experts(rng) -> None:
    """The MoE grouped product (cpu_experts.cc) over packed stacked experts: rows sorted by
    expert, an empty expert, N past a whole strip, K past a K block."""
    from runtime.kernels.cpu import experts as cpu_experts

    sizes = np.asarray([13, 0, 7, 1, 40], np.int32)
    M, K, N = int(sizes.sum()), 300, 200
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((2, 5, K, N)).astype(np.float32) / 16
    got = cpu_experts.expert_products(jnp.asarray(x), jnp.asarray(cpu_experts.pack(w)), jnp.int32(1),
                                      jnp.asarray(sizes), N)
    want = np.concatenate([x[a:b] @ w[1, e] for e, (a, b) in enumerate(zip(np.cumsum(sizes) - sizes, np.cumsum(sizes)))])
    close("experts", got, want, 1e-4, 1e-4)


def check_wq(rng) -> None:
    """The weight-only kernel (4-bit values with scales and offsets, the 8-bit head's values
    with scales): row tiles, the dequantized strips from 8 rows, and the layer tail."""
    from runtime.model import quant

    for bits, M, K, N in ((4, 1, 96, 48), (4, 5, 320, 96), (4, 9, 128, 32), (8, 1, 64, 48), (8, 13, 128, 64)):
        w = rng.standard_normal((K, N)).astype(np.float32)
        stored = quant.quantize_weight_int4(w) if bits == 4 else quant.quantize_head_w8({"embed": w.T})
        deq = (quant.dequantize_int4(stored) if bits == 4 else
               (stored["q8"].reshape(K // 32, 32, N).astype(np.float64) * stored["s8"][:, None, :]).reshape(K, N))
        x = rng.standard_normal((M, K)).astype(np.float32)
        got = jax.jit(cpu_matmul.linear_wq)(jnp.asarray(x), jax.tree.map(jnp.asarray, cpu_matmul.pack_wq(stored)))
        close(f"wq{bits}_{M}x{K}x{N}", got, x.astype(np.float64) @ deq, 1e-5, 1e-5 * np.sqrt(K) * np.abs(w).max())
    for M in (1, 9):
        d, A, inter, nq = 64, 96, 64, 96
        ws = {k: (rng.standard_normal(shape) * 0.2).astype(np.float32) for k, shape in
              (("wo", (A, d)), ("gu", (d, 2 * inter)), ("down", (inter, d)), ("qkv", (d, nq)))}
        stored = {k: quant.quantize_weight_int4(v) for k, v in ws.items()}
        deq = {k: quant.dequantize_int4(v) for k, v in stored.items()}
        packed = {k: jax.tree.map(jnp.asarray, cpu_matmul.pack_wq(v)) for k, v in stored.items()}
        a = rng.standard_normal((M, A)).astype(np.float32)
        h = rng.standard_normal((M, d)).astype(np.float32)
        n1, n2 = (rng.uniform(0.5, 1.5, d).astype(np.float32) for _ in range(2))
        h1 = h + a.astype(np.float64) @ deq["wo"]
        gu = norm(h1, n1) @ deq["gu"]
        g, u = gu[:, :inter], gu[:, inter:]
        out = h1 + (g / (1 + np.exp(-g)) * u) @ deq["down"]
        got, got_qkv = jax.jit(lambda a, h, n1, n2: cpu_matmul.layer_tail_wq(
            a, h, packed["wo"], (n1, 1e-5), packed["gu"], packed["down"], packed["qkv"], n2))(
            jnp.asarray(a), jnp.asarray(h), jnp.asarray(n1), jnp.asarray(n2))
        close(f"wq_tail_{M}", got, out, 1e-4, 1e-4)
        close(f"wq_tail_qkv_{M}", got_qkv, norm(out, n2) @ deq["qkv"], 1e-4, 1e-4)


def main(out: str) -> None:
    variant = build.selected_variant()
    lib = build.library()
    assert lib is not None, f"variant {variant} did not load (see the warning above)"
    paths = build.compiled_paths(lib)
    expect = build.VARIANTS[variant].paths
    if expect is not None:
        assert {k: paths[k] for k in expect} == expect, (variant, paths)
    # the switches cpu_matmul reads agree with the paths
    assert paths["int8_vectorized"] == (paths["int8_linear"] != "scalar")
    assert paths["f32_vectorized"] == (paths["f32_linear"] != "scalar")
    assert not paths["amx"] or paths["int8_linear"] == "amx"
    assert cpu_matmul.vectorized() == paths["int8_vectorized"] and cpu_matmul.f32_vectorized() == paths["f32_vectorized"]
    rng = np.random.default_rng(0)
    check_int8(rng)
    check_f32(rng)
    check_wq(rng)
    check_attention(rng)
    check_experts(rng)
    np.savez(out, **OUT)
    print(json.dumps({"variant": variant, "paths": paths, "checks": len(OUT)}))


if __name__ == "__main__":
    main(sys.argv[1])
