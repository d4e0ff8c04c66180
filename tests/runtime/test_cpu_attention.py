"""The C++ decode-attention kernel (runtime/kernels/cpu/cpu_attention.cc): built and registered on this
machine, equal to the float64 oracle and to the XLA path, and chosen by default for float32
caches (never for quantized ones)."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runtime.kernels.cpu import attention as cpu_attention
from runtime.model.xla_attention import QuantizedPages, xla_ragged_paged_attention
from tests.attention_oracle import oracle, random_batch


def test_kernel_builds_where_a_compiler_exists():
    if shutil.which("g++") or shutil.which("c++"):
        assert cpu_attention.available(), "g++ is here but the kernel did not build: see the log warning"
    else:
        assert not cpu_attention.available()


needs_kernel = pytest.mark.skipif(not cpu_attention.available(), reason="no C++ compiler: XLA path only")


@needs_kernel
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 1, 16), (4, 4, 32), (16, 2, 128), (4, 1, 256)])
def test_cpu_kernel_matches_oracle(hq, hkv, d):
    rng = np.random.default_rng(hq * 100 + d)
    # decodes of many lengths (partial blocks, one token, a long one), a prefill chunk whose
    # last token goes through the kernel, and padding sequences
    batch = random_batch(rng, [1, 1, 1, 7, 1], [1, 16, 37, 60, 250], hq=hq, hkv=hkv, d=d, pad_seqs=2,
                         pad_tokens=3, num_blocks=48)
    want = oracle(*batch, sm_scale=0.3)
    for kernel in (True, False):
        got = np.asarray(xla_ragged_paged_attention(*map(jnp.asarray, batch), sm_scale=0.3, cpu_kernel=kernel))
        np.testing.assert_allclose(got, want, atol=3e-5, rtol=3e-5)
        assert not got[sum([1, 1, 1, 7, 1]):].any(), "padding rows must be zero"


@needs_kernel
@pytest.mark.parametrize("kv_lens,shared_blocks", [([400], 0), ([400, 3], 0), ([420, 260], 10), ([33, 700], 2)])
def test_small_batches_split_each_sequence_and_merge(kv_lens, shared_blocks):
    """At a batch too small for the cores (sequences x KV heads < 4 per core) the kernel splits
    each sequence's own blocks into ranges and merges their softmax partials (and the cascade's,
    for members of a shared prefix); a padding row stays zero."""
    from runtime.model.batch import choose_shared_prefix

    rng = np.random.default_rng(sum(kv_lens) + shared_blocks)
    pad = 1 if len(kv_lens) == 1 else 0  # (2 sequences + 3 KV heads: 6 items, split on 2 cores)
    q, kc, vc, kvl, tables, qsl, ns = random_batch(rng, [1] * len(kv_lens), kv_lens, hq=9, hkv=3, d=64,
                                                   pad_seqs=pad, num_blocks=120)
    shared = None
    if shared_blocks:
        tables[1, :shared_blocks] = tables[0, :shared_blocks]
        nblocks = np.array([(k + 15) // 16 for k in kv_lens] + [0] * pad)
        sh = choose_shared_prefix(tables, nblocks, kvl, len(kv_lens), 16)
        assert int(sh.length[0]) == 16 * shared_blocks
        shared = jax.tree_util.tree_map(jnp.asarray, sh)
    want = oracle(q, kc, vc, kvl, tables, qsl, ns, 0.125)
    got = np.asarray(xla_ragged_paged_attention(*map(jnp.asarray, (q, kc, vc, kvl, tables, qsl, ns)), sm_scale=0.125,
                                                shared=shared, cpu_kernel=True))
    np.testing.assert_allclose(got, want, atol=3e-5, rtol=3e-5)
    assert not got[len(kv_lens):].any()


@needs_kernel
def test_kv_write_kernel_matches_the_xla_scatter():
    """The in-place C++ KV write puts each row at its flat slot and drops padding (-1) and
    out-of-range slots, as runtime.model.xla_attention.write_kv's scatter does; donated caches stay
    the same buffers (no copy)."""
    from runtime.model.xla_attention import write_kv

    rng = np.random.default_rng(5)
    kc, vc = (jnp.asarray(rng.standard_normal((6, 4, 3, 16)).astype(np.float32)) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((5, 3, 16)).astype(np.float32)) for _ in range(2))
    slots = jnp.asarray([3, -1, 23, 24, 0], jnp.int32)  # (24 = past the end)
    want = write_kv(kc, vc, k, v, slots)
    got = jax.jit(lambda *a: write_kv(*a, cpu_kernel=True))(kc, vc, k, v, slots)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert not np.array_equal(np.asarray(want[0]), np.asarray(kc))  # (the rows landed)
    f = jax.jit(lambda *a: write_kv(*a, cpu_kernel=True), donate_argnums=(0, 1))
    kc2, vc2 = jnp.array(kc), jnp.array(vc)
    ptr = kc2.unsafe_buffer_pointer()
    out = f(kc2, vc2, k, v, slots)
    assert out[0].unsafe_buffer_pointer() == ptr
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(want[0]))


@needs_kernel
@pytest.mark.parametrize("bs", [8, 32, 64])
def test_cpu_kernel_matches_oracle_at_other_block_sizes(bs):
    """Decode reads a sequence's own blocks 16 tokens at a time: blocks of 8 (one partial
    tile), 32 and 64 (several tiles, the last partial) must give the oracle's output."""
    rng = np.random.default_rng(bs)
    lens = [1, 5, 16, 17, 40, 63, 64, 65, 130]
    batch = random_batch(rng, [1] * len(lens), lens, hq=9, hkv=3, d=64, bs=bs, pad_seqs=1,
                         num_blocks=sum((n + bs - 1) // bs for n in lens) + 2)
    want = oracle(*batch, sm_scale=0.125)
    got = np.asarray(xla_ragged_paged_attention(*map(jnp.asarray, batch), sm_scale=0.125, cpu_kernel=True))
    np.testing.assert_allclose(got, want, atol=3e-5, rtol=3e-5)
    assert not got[len(lens):].any(), "padding rows must be zero"


@needs_kernel
def test_kernel_is_the_default_for_float32_and_int8_caches_only():
    rng = np.random.default_rng(1)
    q, kc, vc, kvl, tables, qsl, ns = random_batch(rng, [1, 1], [20, 33], hq=6, hkv=2)
    args = (jnp.asarray(q), jnp.asarray(kc), jnp.asarray(vc), *map(jnp.asarray, (kvl, tables, qsl, ns)))
    text = jax.jit(lambda *a: xla_ragged_paged_attention(*a, sm_scale=0.25)).lower(*args).as_text()
    assert cpu_attention.TARGET in text
    lower = lambda pages: jax.jit(lambda *a: xla_ragged_paged_attention(*a, sm_scale=0.25)).lower(
        args[0], pages, pages, *args[3:]).as_text()
    i8 = lower(QuantizedPages.empty(kc.shape, jnp.int8, 4))
    assert cpu_attention.TARGET_INT8 in i8
    f8 = lower(QuantizedPages.empty(kc.shape, jnp.float8_e4m3fn))
    assert cpu_attention.TARGET not in f8 and cpu_attention.TARGET_INT8 not in f8  # fp8: the XLA loops


@needs_kernel
def test_kernel_inside_the_engine_gives_the_xla_tokens(tiny_ckpt, monkeypatch):
    from runtime.model.sampling import SamplingParams
    from tests.engine_util import make_engine

    prompts = [list(range(3, 60)), [5, 6, 7], list(range(100, 140))]
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    eng = make_engine(tiny_ckpt)
    assert eng.runner.attention_kernel
    with_kernel = [r.output_ids for r in eng.generate(prompts, sp)]
    monkeypatch.setenv("PAGEDJAX_CPU_KERNELS", "0")  # as on a machine without a compiler
    plain = make_engine(tiny_ckpt)
    assert not plain.runner.attention_kernel
    assert [r.output_ids for r in plain.generate(prompts, sp)] == with_kernel
    monkeypatch.setenv("PAGEDJAX_CPU_KERNELS", "1")
    assert make_engine(tiny_ckpt, kv_dtype="int8").runner.attention_kernel
    assert not make_engine(tiny_ckpt, kv_dtype="fp8_e4m3").runner.attention_kernel


@needs_kernel
@pytest.mark.parametrize("members", [3, 20])
def test_cpu_kernel_cascade_matches_oracle(members):
    """Members of a shared prefix (more than one 16-row chunk of them at 20 x 3 groups), a
    member prefilling a chunk, a non-member, padding: the kernel's cascade equals the oracle."""
    from runtime.model.batch import choose_shared_prefix

    rng = np.random.default_rng(members)
    q_lens = [1] * members + [6, 1]
    kv_lens = [int(x) for x in rng.integers(50, 90, size=members)] + [70, 40]
    q, kc, vc, kvl, tables, qsl, ns = random_batch(rng, q_lens, kv_lens, hq=9, hkv=3, d=64, pad_seqs=1, mb=6,
                                                   num_blocks=160)
    for i in range(1, members + 1):
        tables[i, :3] = tables[0, :3]  # sequences 0..members share three leading blocks
    nblocks = np.array([(k + 15) // 16 for k in kv_lens] + [0])
    shared = choose_shared_prefix(tables, nblocks, kvl, len(q_lens), 16)
    assert int(shared.length[0]) == 48 and int((shared.suffix_start > 0).sum()) == members + 1
    want = oracle(q, kc, vc, kvl, tables, qsl, ns, 0.125)
    got = np.asarray(xla_ragged_paged_attention(*map(jnp.asarray, (q, kc, vc, kvl, tables, qsl, ns)), sm_scale=0.125,
                                                shared=jax.tree_util.tree_map(jnp.asarray, shared),
                                                cpu_kernel=True))
    np.testing.assert_allclose(got, want, atol=3e-5, rtol=3e-5)


@needs_kernel
def test_cpu_kernel_over_an_int8_cache_equals_attention_over_its_values():
    """int8 pages (with a cascade): the kernel dequantizes block by block exactly as the XLA
    loops do, so both equal the oracle over the dequantized cache."""
    from runtime.config import kv_scale_groups
    from runtime.model.batch import choose_shared_prefix

    rng = np.random.default_rng(8)
    q, kc, vc, kvl, tables, qsl, ns = random_batch(rng, [1] * 6 + [5], [70, 52, 33, 61, 49, 80, 40], hq=9, hkv=3,
                                                   d=64, pad_seqs=1, mb=6, num_blocks=80)
    for i in range(1, 5):
        tables[i, :2] = tables[0, :2]
    shared = choose_shared_prefix(tables, np.array([5, 4, 3, 4, 4, 5, 3, 0]), kvl, 7, 16)
    assert int(shared.length[0]) == 32

    def pages(c, part):  # the engine's layout: a scale and zero per 8 (K) / 32 (V) channels
        p = QuantizedPages.of(jnp.asarray(c) + 0.5, jnp.int8, kv_scale_groups("int8", 64, part))  # off-centre
        return p, np.asarray(p.dequantized())

    (kp, kvals), (vp, vvals) = pages(kc, "k"), pages(vc, "v")
    assert kp.scales.shape[-1] == 8 and vp.scales.shape[-1] == 2
    want = oracle(q, kvals, vvals, kvl, tables, qsl, ns, 0.125)
    sh = jax.tree_util.tree_map(jnp.asarray, shared)
    rest = tuple(map(jnp.asarray, (kvl, tables, qsl, ns)))
    for kernel in (True, False):
        got = np.asarray(xla_ragged_paged_attention(jnp.asarray(q), kp, vp, *rest, sm_scale=0.125, shared=sh,
                                                    cpu_kernel=kernel))
        np.testing.assert_allclose(got, want, atol=3e-5, rtol=3e-5)


@needs_kernel
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 1, 16), (4, 4, 32)])
def test_prefill_tokens_in_the_kernel_match_oracle(hq, hkv, d):
    """Prefill chunks of every shape (a whole long prompt, chunks continuing a context, a
    two-token chunk, members of a shared prefix prefilling their own tokens) beside decodes:
    the kernel's prefill mode (tiles of 16 / G tokens, causal per row) equals the oracle."""
    from runtime.model.batch import choose_shared_prefix

    rng = np.random.default_rng(hq + hkv + d)
    q_lens = [100, 1, 37, 2, 20, 19, 1]
    kv_lens = [100, 45, 90, 50, 68, 83, 60]
    q, kc, vc, kvl, tables, qsl, ns = random_batch(rng, q_lens, kv_lens, hq=hq, hkv=hkv, d=d, pad_seqs=1,
                                                   pad_tokens=5, mb=8, num_blocks=96)
    for i in (5, 6):
        tables[i, :3] = tables[4, :3]  # 4, 5, 6 share three blocks; 4 and 5 prefill after them
    shared = choose_shared_prefix(tables, np.array([(k + 15) // 16 for k in kv_lens] + [0]), kvl, 7, 16)
    assert int(shared.length[0]) == 48
    want = oracle(q, kc, vc, kvl, tables, qsl, ns, 0.2)
    args = tuple(map(jnp.asarray, (q, kc, vc, kvl, tables, qsl, ns)))
    for sh in (None, jax.tree_util.tree_map(jnp.asarray, shared)):
        got = np.asarray(xla_ragged_paged_attention(*args, sm_scale=0.2, shared=sh, cpu_kernel=True))
        np.testing.assert_allclose(got, want, atol=3e-5, rtol=3e-5)
        assert not got[sum(q_lens):].any(), "padding rows must be zero"
