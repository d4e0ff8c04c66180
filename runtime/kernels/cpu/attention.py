"""The CPU decode-attention kernel (runtime/kernels/cpu/cpu_attention.cc) as an XLA FFI custom call.

Built and registered by runtime/kernels/cpu/build.py. Where it cannot be built (no compiler,
another platform) or PAGEDJAX_CPU_KERNELS=0, `enabled()` is False and attention stays on the
XLA path: same numbers, slower. runtime/model/xla_attention.py uses it for every query token of a step
(the last token of each sequence in decode mode, the others of prefill chunks in prefill
mode) when the cache is float32 or int8.

Measured inside the whole step (scripts/bench_yardstick.py: the kernels' step against XLA's
with its libraries; attention is the same computation both ways); alone it was ~2x XLA's
path in decode and 1.6-2.3x in 512-token prefill steps (runtime/model/xla_attention.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from runtime.kernels.cpu.build import available, enabled, num_threads  # noqa: F401 (this kernel's switches)

if TYPE_CHECKING:
    from runtime.model.kv_pages import SharedPrefix

TARGET = "pagedjax_decode_attention"
TARGET_INT8 = "pagedjax_decode_attention_int8"
TARGET_KV_WRITE = "pagedjax_kv_write"


HEAD_DIMS = (16, 32, 64, 128, 256)  # the head sizes cpu_attention.cc instantiates


def supports(cache: object) -> bool:
    """Caches the kernel reads: float32 arrays and int8 QuantizedPages of a head size it is
    built for (HEAD_DIMS)."""
    from runtime.model.kv_pages import QuantizedPages

    if isinstance(cache, QuantizedPages):
        return cache.values.dtype == jnp.int8 and cache.zeros is not None and cache.values.shape[-1] in HEAD_DIMS
    return getattr(cache, "dtype", None) == jnp.float32 and getattr(cache, "shape", (0,))[-1] in HEAD_DIMS


def write_kv(k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array,
              slots: jax.Array) -> tuple[jax.Array, jax.Array]:
    """New K/V rows [T, Hkv, D] into float32 caches [NB, BS, Hkv, D] at flat slots (block * BS
    + offset; negative or past the end: dropped), in place (the outputs alias the caches):
    runtime.model.xla_attention.write_kv's semantics as one call instead of XLA's scatter ops."""
    out = (jax.ShapeDtypeStruct(k_cache.shape, jnp.float32), jax.ShapeDtypeStruct(v_cache.shape, jnp.float32))
    call = jax.ffi.ffi_call(TARGET_KV_WRITE, out, vmap_method="sequential", input_output_aliases={0: 0, 1: 1})
    return call(k_cache, v_cache, k.astype(jnp.float32), v.astype(jnp.float32), slots.astype(jnp.int32))


def decode_attention(q: jax.Array, k_cache: object, v_cache: object, kv_lens: jax.Array,
                     block_tables: jax.Array, shared: "SharedPrefix | None" = None,
                     window: jax.Array | int = 0) -> jax.Array:
    """q [S, Hkv, G, D] (scaled) against caches [NB, BS, Hkv, D] (float32, or int8
    QuantizedPages with float16 scales and zeros: dequantized block by block inside the kernel) through block_tables [S, MB]
    up to kv_lens [S] -> normalized [S, Hkv, G, D] float32 (zeros where kv_lens is 0). With
    `shared` (runtime.model.xla_attention.SharedPrefix, tables padded alike), the members' common
    leading blocks are read once for all of them (cascade) before each sequence's own.
    `window` (int32 scalar, may be traced; 0 = full): a query at position p sees keys
    p - window < k <= p; blocks wholly before the window are not read."""
    none = jnp.zeros((0,), jnp.int32)
    return _call(q, k_cache, v_cache, kv_lens, block_tables, shared, none, none, window)


def prefill_attention(q: jax.Array, k_cache: object, v_cache: object, seq_of: jax.Array, pos: jax.Array,
                      block_tables: jax.Array, shared: "SharedPrefix | None" = None,
                      window: jax.Array | int = 0) -> jax.Array:
    """Prefill tokens q [T, Hkv, G, D] (scaled): token t of table row seq_of[t] at position
    pos[t] attends causally to positions <= pos[t] of its sequence (pos -1: output zeros);
    `shared` members' tokens meet the shared prefix once for all (they sit after it) ->
    normalized [T, Hkv, G, D] float32; `window` as in decode_attention."""
    S = block_tables.shape[0]
    return _call(q, k_cache, v_cache, jnp.zeros((S,), jnp.int32), block_tables, shared, seq_of, pos, window)


def _call(q, k_cache, v_cache, kv_lens, block_tables, shared, seq_of, pos, window) -> jax.Array:
    S, mb = block_tables.shape
    if shared is None:
        blocks, length, start = jnp.zeros((mb,), jnp.int32), jnp.zeros((1,), jnp.int32), jnp.zeros((S,), jnp.int32)
    else:
        blocks, length, start = shared.blocks, shared.length, shared.suffix_start
    from runtime.model.kv_pages import QuantizedPages

    i32 = lambda a: a.astype(jnp.int32)
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    tail = (i32(kv_lens), i32(block_tables), i32(blocks), i32(length.reshape(1)), i32(start), i32(seq_of), i32(pos),
            i32(jnp.asarray(window).reshape(1)))
    if isinstance(k_cache, QuantizedPages):
        call = jax.ffi.ffi_call(TARGET_INT8, out, vmap_method="sequential")
        return call(q.astype(jnp.float32), k_cache.values, v_cache.values, k_cache.scales, v_cache.scales,
                    k_cache.zeros, v_cache.zeros, *tail, num_threads=np.int64(num_threads()))
    call = jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")
    return call(q.astype(jnp.float32), k_cache, v_cache, *tail, num_threads=np.int64(num_threads()))
