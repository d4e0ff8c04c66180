import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runtime.model.xla_attention import write_kv, xla_ragged_paged_attention
from tests.attention_oracle import oracle, random_batch

CASES = {
    "decode": ([1, 1, 1], [5, 17, 40]),
    "prefill": ([7, 33], [7, 33]),
    "mixed": ([1, 20, 1, 9], [30, 52, 1, 9]),
    "chunk_mid_prompt": ([16], [48]),
    "long_context": ([1, 3], [300, 150]),
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("hq,hkv", [(6, 2), (4, 4), (8, 1)])
def test_xla_path_matches_oracle(name, hq, hkv):
    rng = np.random.default_rng(0)
    q_lens, kv_lens = CASES[name]
    batch = random_batch(rng, q_lens, kv_lens, hq=hq, hkv=hkv, pad_seqs=2, pad_tokens=5)
    want = oracle(*batch, sm_scale=0.25)
    got = np.asarray(xla_ragged_paged_attention(*map(jnp.asarray, batch), sm_scale=0.25,
                                                kv_chunk_blocks=2, shared_chunk_blocks=2, prefill_chunk_blocks=2, q_tile=8))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    assert not got[sum(q_lens):].any(), "padding rows must be zero"


def test_write_kv_scatters_and_drops_padding():
    k_cache = jnp.zeros((4, 2, 1, 3))
    v_cache = jnp.zeros((4, 2, 1, 3))
    k = jnp.arange(9, dtype=jnp.float32).reshape(3, 1, 3) + 1
    kc, vc = write_kv(k_cache, v_cache, k, -k, jnp.array([5, -1, 0]))
    kc = np.asarray(kc)
    np.testing.assert_array_equal(kc[2, 1, 0], [1, 2, 3])  # slot 5 = block 2, offset 1
    np.testing.assert_array_equal(kc[0, 0, 0], [7, 8, 9])
    assert np.count_nonzero(kc) == 6  # the -1 row went nowhere
    np.testing.assert_array_equal(np.asarray(vc)[2, 1, 0], [-1, -2, -3])


def test_xla_path_matches_pallas_reference():
    from pallas_kernels.paged_attention import ref_ragged_paged_attention

    rng = np.random.default_rng(7)
    batch = tuple(map(jnp.asarray, random_batch(rng, [1, 12, 1, 30], [17, 40, 3, 30], hq=6, hkv=2, pad_seqs=1,
                                                pad_tokens=3)))
    want = np.asarray(ref_ragged_paged_attention(*batch, sm_scale=0.3))
    got = np.asarray(xla_ragged_paged_attention(*batch, sm_scale=0.3, kv_chunk_blocks=2, shared_chunk_blocks=2, prefill_chunk_blocks=2, q_tile=4))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_shared_prefix_cascade_matches_oracle():
    from runtime.model.batch import choose_shared_prefix

    rng = np.random.default_rng(11)
    q, kc, vc, kvl, tables, qsl, ns = random_batch(rng, [1, 1, 5, 1, 1], [70, 40, 52, 33, 20], hq=6, hkv=2,
                                                   pad_seqs=1, mb=6)
    tables[1, :2] = tables[0, :2]  # seqs 0, 1, 2 hold the same two leading blocks (a shared prompt)
    tables[2, :2] = tables[0, :2]
    tables[3, 0] = tables[0, 0]    # seq 3 shares only the first block: the run stops at one
    nblocks = np.array([5, 3, 4, 3, 2, 0])
    shared = choose_shared_prefix(tables, nblocks, kvl, 5, 16)
    assert int(shared.length[0]) == 16 and list(shared.suffix_start) == [16, 16, 16, 16, 0, 0]
    want = oracle(q, kc, vc, kvl, tables, qsl, ns, 0.25)
    got = np.asarray(xla_ragged_paged_attention(*map(jnp.asarray, (q, kc, vc, kvl, tables, qsl, ns)),
                                                sm_scale=0.25, kv_chunk_blocks=2, shared_chunk_blocks=2, prefill_chunk_blocks=2, q_tile=4,
                                                shared=jax.tree_util.tree_map(jnp.asarray, shared)))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_mixed_step_with_as_many_tokens_as_slots():
    """T == S does not mean decode-only: a padded slot can leave room for a 2-token chunk."""
    rng = np.random.default_rng(5)
    batch = random_batch(rng, [1, 1, 2], [9, 30, 18], hq=4, hkv=2, pad_seqs=1)
    assert batch[0].shape[0] == batch[4].shape[0] == 4  # T == S == 4
    want = oracle(*batch, sm_scale=0.25)
    got = np.asarray(xla_ragged_paged_attention(*map(jnp.asarray, batch), sm_scale=0.25))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_cascade_with_prefill_chunks_of_members():
    """A burst of chats on one system prompt: several members prefill chunks (longer than one
    query tile) after a 3-block shared prefix, beside decodes and a non-member."""
    import jax

    from runtime.model.batch import choose_shared_prefix

    rng = np.random.default_rng(12)
    q, kc, vc, kvl, tables, qsl, ns = random_batch(rng, [9, 1, 6, 13, 1], [70, 60, 55, 61, 30], hq=6, hkv=2,
                                                   pad_seqs=1, mb=6)
    for i in (1, 2, 3):
        tables[i, :3] = tables[0, :3]
    nblocks = np.array([5, 4, 4, 4, 2, 0])
    shared = choose_shared_prefix(tables, nblocks, kvl, 5, 16)
    assert int(shared.length[0]) == 48
    want = oracle(q, kc, vc, kvl, tables, qsl, ns, 0.25)
    for cb, qt in ((1, 4), (2, 8), (4, 32)):
        got = np.asarray(xla_ragged_paged_attention(*map(jnp.asarray, (q, kc, vc, kvl, tables, qsl, ns)),
                                                    sm_scale=0.25, kv_chunk_blocks=cb, shared_chunk_blocks=cb,
                                                    prefill_chunk_blocks=cb, q_tile=qt,
                                                    shared=jax.tree_util.tree_map(jnp.asarray, shared)))
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_table_narrower_than_the_chunk_sizes():
    """A 7-block table (max_model_len 112) with the default chunk sizes: every loop must read
    whole chunks of a padded table (the last decode chunk once re-read blocks 5-6)."""
    rng = np.random.default_rng(9)
    batch = random_batch(rng, [100, 1], [100, 97], hq=6, hkv=2, mb=7)
    want = oracle(*batch, sm_scale=0.25)
    got = np.asarray(xla_ragged_paged_attention(*map(jnp.asarray, batch), sm_scale=0.25))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
