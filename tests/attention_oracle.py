"""NumPy float64 oracle for ragged paged attention and a random ragged-batch builder,
shared by the XLA-path and Pallas-kernel tests."""

from __future__ import annotations

import numpy as np


def oracle(q, k_cache, v_cache, kv_lens, block_tables, qsl, num_seqs, sm_scale):
    q = np.asarray(q, np.float64)
    kc, vc = np.asarray(k_cache, np.float64), np.asarray(v_cache, np.float64)
    T, Hq, D = q.shape
    bs, hkv = kc.shape[1], kc.shape[2]
    out = np.zeros((T, Hq, D))
    for s in range(int(np.asarray(num_seqs).reshape(-1)[0])):
        a, b = int(qsl[s]), int(qsl[s + 1])
        kv = int(kv_lens[s])
        pos = np.arange(kv)
        blocks = np.asarray(block_tables[s])[pos // bs]
        k = kc[blocks, pos % bs]  # [kv, Hkv, D]
        v = vc[blocks, pos % bs]
        for i, t in enumerate(range(a, b)):
            p = kv - (b - a) + i
            for h in range(Hq):
                kh = h // (Hq // hkv)
                sc = (k[: p + 1, kh] @ q[t, h]) * sm_scale
                w = np.exp(sc - sc.max())
                out[t, h] = (w / w.sum()) @ v[: p + 1, kh]
    return out


def random_batch(rng, q_lens, kv_lens, *, hq=6, hkv=2, d=16, bs=16, num_blocks=64, pad_seqs=0,
                 pad_tokens=0, mb=None, dtype=np.float32):
    """Random caches and a ragged batch; block ids are a random permutation (non-contiguous)."""
    S = len(q_lens) + pad_seqs
    need = [(kv + bs - 1) // bs for kv in kv_lens]
    mb = mb or max(max(need), 1)
    perm = rng.permutation(num_blocks)
    tables = np.zeros((S, mb), np.int32)
    used = 0
    for s, n in enumerate(need):
        tables[s, :n] = perm[used:used + n]
        used += n
    assert used <= num_blocks
    T = sum(q_lens) + pad_tokens
    qsl = np.zeros(S + 1, np.int32)
    qsl[1: len(q_lens) + 1] = np.cumsum(q_lens)
    qsl[len(q_lens) + 1:] = qsl[len(q_lens)]
    kvl = np.zeros(S, np.int32)
    kvl[: len(kv_lens)] = kv_lens
    q = rng.standard_normal((T, hq, d)).astype(dtype)
    kc = rng.standard_normal((num_blocks, bs, hkv, d)).astype(dtype)
    vc = rng.standard_normal((num_blocks, bs, hkv, d)).astype(dtype)
    return q, kc, vc, kvl, tables, qsl, np.array([len(q_lens)], np.int32)
