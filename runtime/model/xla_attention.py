"""Paged attention in plain XLA: the CPU path, same signature as the Pallas kernel.
Given no V cache (v_cache None: a latent cache, runtime/model/families/deepseek.py), each
gathered chunk of the K cache serves as keys and values: one read.

One call serves a ragged batch of decode tokens and prefill chunks. It is split in two
so each part gives XLA large, regular products and touches only the KV blocks in use:

* path A -- the LAST query token of every sequence (all of a decode step) attends to its
  whole context; batched over sequences, looping over KV chunks of `kv_chunk_blocks`
  blocks with an online softmax. The loop's trip count is the batch's longest context,
  so no static max-context dimension is compiled in.
* path B -- the remaining tokens of prefill chunks, in query tiles of `q_tile` rows that
  never straddle two sequences; a dynamic loop over tiles (zero iterations in a pure
  decode step), each over its own causal KV range.

On CPU with a float32 or int8 cache both paths are the C++ kernel of runtime/kernels/cpu/cpu_attention.cc
(`cpu_kernel`; its own cascade; int8 blocks dequantized once inside it): ~2x faster in decode,
and in a 512-token prefill step 1.6x (16 chats of 32 tokens after a 352-token shared prompt:
260 -> 159 ms of attention) to 2.3x (one fresh 512-token prompt: 282 -> 122 ms) on a 2-core
EPYC.

A quantized cache (QuantizedPages: int8 values with a scale and zero per group of 8 (K) or
32 (V) channels, or fp8 values with one scale per token and KV head) is read through the
same loops: indexing it dequantizes just the gathered chunk.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from runtime.model.kv_pages import QuantizedPages, SharedPrefix, quantize_rows

NEG = -1e30  # finite "minus infinity": fully masked rows give weights 0, not NaN
FULL = 1 << 30  # the window of a full-attention layer: wider than any context


def _reach(window: jax.Array) -> jax.Array:
    """A layer's window (0: full attention) as the number of keys a query sees: a query at
    position p sees keys p - reach < k <= p (transformers' sliding_window_overlay)."""
    return jnp.where(window > 0, window, FULL)


def _cap(s: jax.Array, soft_cap: float | None) -> jax.Array:
    """Gemma 2's attention logit soft-cap on the scaled scores (before the mask)."""
    return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)


# Chunk sizes, in blocks of 16 tokens, measured on a 2-core AMD EPYC (SmolLM2 heads, 320-token
# shared prompt + 48-112 own tokens, or 368 unshared; /tmp sweeps summarised in BENCHMARKS.md):
# per-sequence products are tiny batched matmuls whose cost grows with the chunk's padding
# and cache footprint, so 2-block chunks win at every batch (S=64 shared: 2.5 ms per layer
# against 3.9 ms at 8 blocks; S=256: 16 vs 26 ms). The cascade product is one real matmul
# with S*G rows: at S >= 128 fewer, longer trips win (8 blocks: 7.3 ms against 16.7 ms).
def decode_chunk_blocks(num_seqs: int) -> int:
    """KV blocks per trip of the per-sequence decode loop."""
    return 2


def cascade_chunk_blocks(num_seqs: int) -> int:
    """KV blocks per trip of the shared-prefix (cascade) loop."""
    return 2 if num_seqs <= 64 else 8


def _scatter(cache: jax.Array, rows: jax.Array, idx: jax.Array) -> jax.Array:
    """rows [T, ...] into cache [NB, BS, ...] at flat slots idx (NB * BS: dropped), indexed by
    (block, offset). Not through a [NB * BS, ...] reshape: with one KV head per device (TP =
    Hkv, e.g. SmolLM2 at TP 3) XLA gave the reshaped-back cache a layout with the size-1 head
    axis major and copied every device's whole cache ~8 times per layer and step."""
    bs = cache.shape[1]
    return cache.at[idx // bs, idx % bs].set(rows.astype(cache.dtype), mode="drop")


def write_kv(k_cache: Any, v_cache: Any, k: jax.Array, v: jax.Array, slot_mapping: jax.Array,
             cpu_kernel: bool = False) -> tuple[Any, Any]:
    """Scatter new K/V rows [T, Hkv, D] into caches [NB, BS, Hkv, D] (arrays or
    QuantizedPages, which quantize each row on the way in) at flat slots
    (block * BS + offset); slot -1 (padding) is dropped. cpu_kernel: a float32 cache is
    written by the C++ kernels' in-place call (runtime/kernels/cpu/attention.py write_kv)."""
    if cpu_kernel and not isinstance(k_cache, QuantizedPages) and k_cache.dtype == jnp.float32:
        from runtime.kernels.cpu import attention as cpu_attention

        return cpu_attention.write_kv(k_cache, v_cache, k, v, slot_mapping)
    nb, bs = k_cache.shape[:2]
    idx = jnp.where(slot_mapping < 0, nb * bs, slot_mapping)  # out of range -> dropped

    def put(cache, x):
        if isinstance(cache, QuantizedPages):
            q, scale, zero = quantize_rows(x, cache.values.dtype, cache.scales.shape[-1])
            return QuantizedPages(_scatter(cache.values, q, idx), _scatter(cache.scales, scale, idx),
                                  None if zero is None else _scatter(cache.zeros, zero, idx))
        return _scatter(cache, x, idx)

    return put(k_cache, k), put(v_cache, v)


def _online_update(m, l, acc, s, pv):
    """One online-softmax step: s [..., R, C] scores; pv(p) -> [..., R, D] the weighted values."""
    m_new = jnp.maximum(m, s.max(-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[..., None])
    return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + pv(p)


def _gather_chunk(cache: jax.Array, block_ids: jax.Array) -> jax.Array:
    """cache [NB, BS, Hkv, D], block_ids [..., CB] -> [..., Hkv, CB*BS, D]."""
    g = cache[block_ids]  # [..., CB, BS, Hkv, D]
    g = g.reshape(*block_ids.shape[:-1], -1, *cache.shape[2:])  # [..., C, Hkv, D]
    return jnp.moveaxis(g, -2, -3).astype(jnp.float32)


def _online_init(S, hkv, g, D):
    return (jnp.full((S, hkv, g), NEG), jnp.zeros((S, hkv, g)), jnp.zeros((S, hkv, g, D)))


def _last_token_attention(qg, k_cache, v_cache, kv_lens, block_tables, start, cb, init, reach, soft_cap):
    """Path A. qg [S, Hkv, G, D] (scaled) attends to positions [start[s], kv_lens[s]) read
    through block_tables[s] (whose block 0 holds position start[s]), continuing the online
    softmax partials `init`; positions at or before kv_lens - 1 - reach are outside the window
    (the loop starts at the first chunk any sequence still sees). Gathered chunks stay in cache
    layout [S, C, Hkv, D] (a transpose would copy every chunk); small chunks keep them in cache
    for both products."""
    S, hkv, g, D = qg.shape
    bs = k_cache.shape[1]
    chunk = cb * bs
    n_chunks = (jnp.max(kv_lens - start) + chunk - 1) // chunk
    lo = kv_lens - reach  # the first position each sequence's last token sees
    c_lo = jnp.min(jnp.where(kv_lens > 0, jnp.maximum(lo - start, 0) // chunk, n_chunks))

    def body(c, carry):
        m, l, acc = carry
        ids = jax.lax.dynamic_slice_in_dim(block_tables, c * cb, cb, axis=1)  # [S, CB]
        k = k_cache[ids].reshape(S, chunk, hkv, D).astype(jnp.float32)
        v = k if v_cache is k_cache else v_cache[ids].reshape(S, chunk, hkv, D).astype(jnp.float32)
        s = _cap(jnp.einsum("skgd,sckd->skgc", qg, k), soft_cap)
        pos = start[:, None] + c * chunk + jnp.arange(chunk)[None, :]
        s = jnp.where(((pos < kv_lens[:, None]) & (pos >= lo[:, None]))[:, None, None, :], s, NEG)
        return _online_update(m, l, acc, s, lambda p: jnp.einsum("skgc,sckd->skgd", p, v))

    return jax.lax.fori_loop(c_lo, n_chunks, body, init)


def _shared_prefix_attention(qg, k_cache, v_cache, shared_blocks, shared_len, member, cb, lo, soft_cap):
    """Cascade step for a prefix many sequences hold in the same blocks (a shared system
    prompt): its KV is gathered ONCE and every member's query meets it in one product with
    S*G rows per KV head, instead of each sequence re-reading the same blocks. lo [S]: the
    first position each query's window sees (chunks no member sees are skipped)."""
    S, hkv, g, D = qg.shape
    bs = k_cache.shape[1]
    chunk = cb * bs
    n_chunks = (shared_len + chunk - 1) // chunk
    c_lo = jnp.min(jnp.where(member, jnp.maximum(lo, 0) // chunk, n_chunks))

    def body(c, carry):
        m, l, acc = carry
        ids = jax.lax.dynamic_slice_in_dim(shared_blocks, c * cb, cb)  # [CB]
        k = k_cache[ids].reshape(chunk, hkv, D).astype(jnp.float32)
        v = k if v_cache is k_cache else v_cache[ids].reshape(chunk, hkv, D).astype(jnp.float32)
        s = _cap(jnp.einsum("skgd,ckd->skgc", qg, k), soft_cap)
        pos = c * chunk + jnp.arange(chunk)
        visible = (pos[None, :] < shared_len) & member[:, None] & (pos[None, :] >= lo[:, None])  # [S, C]
        s = jnp.where(visible[:, None, None, :], s, NEG)
        return _online_update(m, l, acc, s, lambda p: jnp.einsum("skgc,ckd->skgd", p, v))

    return jax.lax.fori_loop(c_lo, n_chunks, body, _online_init(S, hkv, g, D))


def _head_major_chunk(carry, qh, k_cache, v_cache, block_ids, visible, soft_cap):
    """One online-softmax step of head-major query rows qh [Hkv, R, D] over the KV chunk in
    `block_ids` [CB]; visible [R, C] masks (row, position) pairs."""
    k = _gather_chunk(k_cache, block_ids)  # [Hkv, C, D]
    v = k if v_cache is k_cache else _gather_chunk(v_cache, block_ids)
    sc = jnp.where(visible[None], _cap(jnp.einsum("krd,kcd->krc", qh, k), soft_cap), NEG)
    return _online_update(*carry, sc, lambda p: jnp.einsum("krc,kcd->krd", p, v))


def _shared_prefix_rows(qh, k_cache, v_cache, shared_blocks, shared_len, row_ok, row_pos, cb, reach, soft_cap):
    """The cascade step for prefill tokens: qh [Hkv, R, D] (rows = (token, group), head-major
    so the products need no transposes) against the shared prefix, causal by `row_pos` [R]
    within the window `reach`; rows with row_ok False see nothing. Returns online-softmax
    partials [Hkv, R(, D)]."""
    hkv, R, D = qh.shape
    chunk = cb * k_cache.shape[1]
    n_chunks = (shared_len + chunk - 1) // chunk
    row_lo = row_pos - reach + 1
    c_lo = jnp.min(jnp.where(row_ok, jnp.maximum(row_lo, 0) // chunk, n_chunks))

    def body(c, carry):
        pos = c * chunk + jnp.arange(chunk)
        visible = ((pos[None, :] < shared_len) & row_ok[:, None] & (pos[None, :] <= row_pos[:, None])
                   & (pos[None, :] >= row_lo[:, None]))  # [R, C]
        return _head_major_chunk(carry, qh, k_cache, v_cache,
                                 jax.lax.dynamic_slice_in_dim(shared_blocks, c * cb, cb), visible, soft_cap)

    init = (jnp.full((hkv, R), NEG), jnp.zeros((hkv, R)), jnp.zeros((hkv, R, D)))
    return jax.lax.fori_loop(c_lo, n_chunks, body, init)


def _prefill_tiles(q, k_cache, v_cache, kv_lens, block_tables, qsl, num_seqs, sm_scale, cb, qt,
                   shared=None, cb_shared=1, reach=FULL, soft_cap=None):
    """Path B: every non-last query token, tile by tile. Returns [T, Hq, D] (zeros elsewhere).
    With `shared` (cascade), all prefill tokens of member sequences meet the shared prefix in
    one product first (a burst of chats on one system prompt would otherwise re-read it per
    tile); each tile then continues over its own suffix only."""
    T, Hq, D = q.shape
    S = kv_lens.shape[0]
    hkv, bs = k_cache.shape[2], k_cache.shape[1]
    g = Hq // hkv
    chunk = cb * bs
    q_len = qsl[1:] - qsl[:-1]
    live = jnp.arange(S) < num_seqs
    body_len = jnp.where(live, jnp.maximum(q_len - 1, 0), 0)  # tokens before the last one
    tiles = (body_len + qt - 1) // qt
    tile_end = jnp.cumsum(tiles)
    n_tiles = tile_end[-1]
    max_tiles = T // qt + S  # static bound for the tile arrays
    t_idx = jnp.arange(max_tiles)
    t_seq = jnp.minimum(jnp.searchsorted(tile_end, t_idx, side="right"), S - 1)
    t_first = qsl[t_seq] + (t_idx - (tile_end[t_seq] - tiles[t_seq])) * qt
    t_rows = jnp.minimum(qt, qsl[t_seq] + body_len[t_seq] - t_first)

    q_pad = jnp.concatenate([q, jnp.zeros((qt, Hq, D), q.dtype)]).astype(jnp.float32) * sm_scale
    out = jnp.zeros((T + qt, Hq, D), jnp.float32)
    start = jnp.zeros((S,), jnp.int32)  # where each sequence's table (and tile loop) begins
    tables = block_tables
    if shared is not None:
        tok = jnp.arange(T + qt)
        seq_of = jnp.clip(jnp.searchsorted(qsl[1:], tok, side="right"), 0, S - 1)
        tok_pos = kv_lens[seq_of] - q_len[seq_of] + (tok - qsl[seq_of])
        member = (shared.suffix_start > 0) & live
        qh = jnp.moveaxis(q_pad.reshape(T + qt, hkv, g, D), 0, 1).reshape(hkv, (T + qt) * g, D)
        parts = _shared_prefix_rows(qh, k_cache, v_cache, shared.blocks, shared.length.reshape(()),
                                    jnp.repeat(member[seq_of] & (tok < T), g), jnp.repeat(tok_pos, g), cb_shared,
                                    reach, soft_cap)
        start, tables = jnp.where(member, shared.suffix_start, 0), shared.suffix_tables

    def tile_body(i, out):
        s, first, rows = t_seq[i], t_first[i], t_rows[i]
        start_pos = kv_lens[s] - q_len[s] + (first - qsl[s])  # absolute position of row 0
        qg = jax.lax.dynamic_slice_in_dim(q_pad, first, qt).reshape(qt, hkv, g, D)
        qg = jnp.moveaxis(qg, 0, 1).reshape(hkv, qt * g, D)  # rows = (token, group)
        row_pos = start_pos + jnp.repeat(jnp.arange(qt), g)
        base = start[s]
        n_chunks = (start_pos + rows - base + chunk - 1) // chunk
        c_lo = jnp.maximum(start_pos - reach + 1 - base, 0) // chunk  # chunks before the window: skipped
        table = tables[s]

        def kv_body(c, carry):
            pos = base + c * chunk + jnp.arange(chunk)
            visible = (pos[None, :] <= row_pos[:, None]) & (pos[None, :] > row_pos[:, None] - reach)
            return _head_major_chunk(carry, qg, k_cache, v_cache, jax.lax.dynamic_slice_in_dim(table, c * cb, cb),
                                     visible, soft_cap)

        if shared is None:
            init = (jnp.full((hkv, qt * g), NEG), jnp.zeros((hkv, qt * g)), jnp.zeros((hkv, qt * g, D)))
        else:  # this tile's rows of the shared-prefix partials (same (token, group) row order)
            init = tuple(jax.lax.dynamic_slice_in_dim(a, first * g, qt * g, axis=1) for a in parts)
        m, l, acc = jax.lax.fori_loop(c_lo, n_chunks, kv_body, init)
        res = (acc / jnp.maximum(l, 1e-30)[..., None]).reshape(hkv, qt, g, D)
        res = jnp.moveaxis(res, 1, 0).reshape(qt, Hq, D)
        old = jax.lax.dynamic_slice_in_dim(out, first, qt)
        keep = (jnp.arange(qt) < rows)[:, None, None]
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(keep, res, old), first, axis=0)

    out = jax.lax.fori_loop(0, n_tiles, tile_body, out)
    return out[:T]


def _prefill_kernel(q, k_cache, v_cache, kv_lens, block_tables, qsl, live, sm_scale, shared, window):
    """Path B as the C++ kernel: each non-last token of a prefill chunk with its sequence and
    position (-1 for the last tokens and padding, which path A and nobody serve)."""
    from runtime.kernels.cpu import attention as cpu_attention

    T, Hq, D = q.shape
    S = kv_lens.shape[0]
    hkv = k_cache.shape[2]
    tok = jnp.arange(T)
    seq_of = jnp.clip(jnp.searchsorted(qsl[1:], tok, side="right"), 0, S - 1)
    q_len = qsl[1:] - qsl[:-1]
    body = live[seq_of] & (tok >= qsl[seq_of]) & (tok < qsl[seq_of] + q_len[seq_of] - 1)
    pos = jnp.where(body, kv_lens[seq_of] - q_len[seq_of] + (tok - qsl[seq_of]), -1)
    qg = q.reshape(T, hkv, Hq // hkv, D).astype(jnp.float32) * sm_scale
    out = cpu_attention.prefill_attention(qg, k_cache, v_cache, seq_of, pos, block_tables, shared, window)
    return out.reshape(T, Hq, D)


@partial(jax.jit, static_argnames=("sm_scale", "kv_chunk_blocks", "shared_chunk_blocks", "prefill_chunk_blocks",
                                   "q_tile", "cpu_kernel", "soft_cap"))
def xla_ragged_paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array | None, kv_lens: jax.Array,
                               block_tables: jax.Array, query_start_loc: jax.Array, num_seqs: jax.Array,
                               *, sm_scale: float, kv_chunk_blocks: int | None = None,
                               shared_chunk_blocks: int | None = None, prefill_chunk_blocks: int = 8,
                               q_tile: int = 32, shared: "SharedPrefix | None" = None,
                               cpu_kernel: bool | None = None, window: jax.Array | int = 0,
                               soft_cap: float | None = None) -> jax.Array:
    """q [T,Hq,D]; caches [NB,BS,Hkv,D]; kv_lens [S]; block_tables [S,MB]; query_start_loc [S+1];
    num_seqs [1]. Returns [T,Hq,D] in q.dtype; padding rows are 0. v_cache None: the keys are
    the values (a latent cache), each chunk gathered once. See pallas_kernels.paged_attention
    for the full contract. `shared` (optional) names blocks several sequences share at the start
    of their tables; the last-token path then reads them once for all (cascade attention).
    Chunk sizes (in blocks; None = the tuned defaults at the top of this file) for the per-sequence
    decode loop, the shared-prefix loop and the prefill tiles. `cpu_kernel` (None = when it is
    available and the cache is float32 or int8) runs path A as the C++ kernel of runtime/cpu_attention.
    `window` (an int32 scalar, traced: one program serves every layer): a query at position p
    sees keys p - window < k <= p; 0 = full attention. `soft_cap` (static): scores (already
    scaled) become soft_cap * tanh(scores / soft_cap) before masking (Gemma 2); XLA path only."""
    if v_cache is None:  # (one tracer for both inside this jit: the loops below gather the chunk once)
        v_cache = k_cache
    T, Hq, D = q.shape
    S, mb = block_tables.shape
    hkv = k_cache.shape[2]
    cb = min(kv_chunk_blocks or decode_chunk_blocks(S), mb)
    cb_shared = min(shared_chunk_blocks or cascade_chunk_blocks(S), mb)
    cb_prefill = min(prefill_chunk_blocks, mb)
    pad = -mb % math.lcm(cb, cb_shared, cb_prefill)  # every loop slices whole chunks of the padded table

    def padded(t):  # the chunk loops slice whole chunks of a table
        return jnp.pad(t, [(0, 0)] * (t.ndim - 1) + [(0, pad)]) if pad else t

    block_tables = padded(block_tables)
    n = num_seqs.reshape(())
    live = jnp.arange(S) < n
    kv_lens = jnp.where(live, kv_lens, 0)
    q_len = query_start_loc[1:] - query_start_loc[:-1]
    has_query = live & (q_len > 0)

    last = jnp.clip(query_start_loc[1:] - 1, 0, T - 1)
    qg = q[last].reshape(S, hkv, Hq // hkv, D).astype(jnp.float32) * sm_scale
    a_lens = jnp.where(has_query, kv_lens, 0)
    shared_p = None if shared is None else SharedPrefix(padded(shared.blocks), shared.length, shared.suffix_start,
                                                        padded(shared.suffix_tables))
    from runtime.kernels.cpu import attention as cpu_attention

    window = jnp.asarray(window, jnp.int32).reshape(())
    reach = _reach(window)
    if cpu_kernel is None:
        cpu_kernel = cpu_attention.enabled() and cpu_attention.supports(k_cache) and soft_cap is None
    elif cpu_kernel and soft_cap is not None:
        raise ValueError("cpu_kernel: the C++ CPU kernel has no attention logit soft-cap (use the XLA path)")
    elif cpu_kernel and not cpu_attention.available():  # also registers it in this process
        raise ValueError("cpu_kernel: the C++ CPU kernel is not available here (see the log)")
    if cpu_kernel:  # the C++ kernel: its own cascade over the shared blocks, then each sequence's
        out_last = cpu_attention.decode_attention(qg, k_cache, v_cache, a_lens, block_tables, shared_p,
                                                  window).reshape(S, Hq, D)
    elif shared is None:
        partials = _last_token_attention(qg, k_cache, v_cache, a_lens, block_tables, jnp.zeros_like(a_lens), cb,
                                         _online_init(S, hkv, Hq // hkv, D), reach, soft_cap)
    else:
        member = (shared.suffix_start > 0) & has_query
        init = _shared_prefix_attention(qg, k_cache, v_cache, shared_p.blocks, shared.length.reshape(()),
                                        member, cb_shared, a_lens - reach, soft_cap)
        start = jnp.where(member, shared.suffix_start, 0)
        partials = _last_token_attention(qg, k_cache, v_cache, a_lens, shared_p.suffix_tables, start, cb, init,
                                         reach, soft_cap)
    if not cpu_kernel:
        m, l, acc = partials
        out_last = (acc / jnp.maximum(l, 1e-30)[..., None]).reshape(S, Hq, D)
    # A pure decode step (every sequence one token) leaves path B without work: skip even
    # its setup (real control flow on CPU).
    if cpu_kernel:
        prefill = lambda: _prefill_kernel(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, live, sm_scale,
                                          shared_p, window)
    else:
        prefill = lambda: _prefill_tiles(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, n, sm_scale,
                                         cb_prefill, min(q_tile, T), shared_p, cb_prefill, reach, soft_cap)
    out = jax.lax.cond(jnp.any(live & (q_len > 1)), prefill, lambda: jnp.zeros((T, Hq, D), jnp.float32))
    out = out.at[jnp.where(has_query, last, T)].set(out_last, mode="drop")
    return out.astype(q.dtype)
