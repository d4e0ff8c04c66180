"""The paged KV cache's data types, shared by the XLA attention path and the C++ CPU kernels:
a quantized cache's pages, its row quantization, and the shared-prefix (cascade) description
a step hands to attention."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


# Largest magnitude of a symmetric element type: a row's absmax maps onto it.
QUANT_MAX = {jnp.dtype(jnp.float8_e4m3fn): 448.0}
# int8 caches: an asymmetric float16 scale and zero per group of channels of a token's head,
# 8 for K and 32 for V (runtime/config.py INT8_KV_GROUP). Why: docs/quantization.md "KV cache".
# float16 holds the pair: K/V values are clipped to +-F16_SAFE first (past it the zero would
# overflow to inf; no model's keys or values come near).
F16_SAFE = 60000.0




@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantizedPages:
    """K or V of a quantized cache: values [NB, BS, Hkv, D] int8 or fp8_e4m3, and per token and
    KV head G groups of D/G channels, each with a scale [NB, BS, Hkv, G] and, for int8, a zero
    [NB, BS, Hkv, G] (value = q * scale + zero, both float16: asymmetric, so a group's range
    maps onto all 256 steps); fp8: G = 1, symmetric, float32 scales, zeros None. Indexing by
    block ids returns dequantized float32 rows: the attention loops read it exactly like a
    float cache, and only the gathered chunk is ever dequantized."""

    values: jax.Array
    scales: jax.Array
    zeros: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def dtype(self) -> jnp.dtype:
        return self.values.dtype

    def __getitem__(self, ids: jax.Array) -> jax.Array:
        return dequantize(self.values[ids], self.scales[ids], None if self.zeros is None else self.zeros[ids])

    @classmethod
    def of(cls, x: jax.Array, dtype: jnp.dtype, groups: int = 1) -> "QuantizedPages":
        """Rows x [..., D] quantized as the cache stores them (quantize_rows)."""
        return cls(*quantize_rows(x, dtype, groups))

    def dequantized(self) -> jax.Array:
        """All of it as float32 [..., D]."""
        return dequantize(self.values, self.scales, self.zeros)

    @classmethod
    def empty(cls, shape: tuple[int, ...], dtype: jnp.dtype, groups: int = 1) -> "QuantizedPages":
        """An all-zero cache [NB, BS, Hkv, D] of `dtype` (int8 or float8_e4m3fn) with `groups`
        scales per token and head (int8; fp8 has one)."""
        g = groups
        if jnp.dtype(dtype) == jnp.dtype(jnp.int8):
            return cls(jnp.zeros(shape, dtype), jnp.zeros((*shape[:-1], g), jnp.float16),
                       jnp.zeros((*shape[:-1], g), jnp.float16))
        return cls(jnp.zeros(shape, dtype), jnp.ones((*shape[:-1], g), jnp.float32))


def dequantize(values: jax.Array, scales: jax.Array, zeros: jax.Array | None) -> jax.Array:
    """values [..., D], scales / zeros [..., G] -> float32 [..., D]."""
    g = scales.shape[-1]
    x = values.astype(jnp.float32).reshape(*values.shape[:-1], g, -1) * scales.astype(jnp.float32)[..., None]
    if zeros is not None:
        x = x + zeros.astype(jnp.float32)[..., None]
    return x.reshape(values.shape)


def quantize_rows(x: jax.Array, dtype: jnp.dtype, groups: int = 1) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """x [..., D] float -> (values [..., D] of `dtype`, scales [..., G], zeros [..., G] or None):
    the layout QuantizedPages stores (one token of one head per row). int8: per group of
    D/G channels (G = `groups`), scale = (max - min) / 255 and zero = min + 128 * scale,
    rounded to float16 first so the values are chosen against the stored pair; fp8: absmax
    per row, no zero (`groups` must be 1)."""
    x = x.astype(jnp.float32)
    g = groups
    if jnp.dtype(dtype) == jnp.dtype(jnp.int8):
        xg = jnp.clip(x, -F16_SAFE, F16_SAFE).reshape(*x.shape[:-1], g, -1)
        lo, hi = xg.min(-1), xg.max(-1)
        scale = ((hi - lo) / 255.0).astype(jnp.float16)
        zero = (lo + 128.0 * scale.astype(jnp.float32)).astype(jnp.float16)
        s32 = scale.astype(jnp.float32)
        inv = jnp.where(s32 > 0, 1.0 / jnp.where(s32 > 0, s32, 1.0), 0.0)
        q = jnp.clip(jnp.round((xg - zero.astype(jnp.float32)[..., None]) * inv[..., None]), -128, 127)
        return q.astype(jnp.int8).reshape(x.shape), scale, zero
    if g != 1:
        raise ValueError(f"quantize_rows: {jnp.dtype(dtype)} takes one scale per row, not {g} groups")
    amax = jnp.abs(x).max(-1)
    scale = jnp.where(amax > 0, amax / QUANT_MAX[jnp.dtype(dtype)], 1.0)
    return (x / scale[..., None]).astype(dtype), scale[..., None], None


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SharedPrefix:
    """Leading blocks shared by several sequences of a step (chosen on the host)."""

    blocks: jax.Array         # [MB] int32 the shared block ids, 0-padded
    length: jax.Array         # [1] int32 shared tokens (whole blocks); 0 = none
    suffix_start: jax.Array   # [S] int32 = length for members, 0 for the others
    suffix_tables: jax.Array  # [S, MB] int32 members' tables after the shared blocks; others unchanged
