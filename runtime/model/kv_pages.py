"""The paged KV cache's data types, shared by the XLA attention path and the C++ CPU kernels:
a quantized cache's pages, its row quantization, and the shared-prefix (cascade) description
a step hands to attention."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

# Largest magnitude of each quantized element type: a row's absmax maps onto it.
QUANT_MAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantizedPages:
    """K or V of a quantized cache: values [NB, BS, Hkv, D] int8 or fp8_e4m3 and one float32
    scale per (slot, KV head) [NB, BS, Hkv], so a token's outlier head cannot coarsen the
    others. Indexing by block ids returns dequantized float32 rows: the attention loops read
    it exactly like a float cache, and only the gathered chunk is ever dequantized."""

    values: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def dtype(self) -> jnp.dtype:
        return self.values.dtype

    def __getitem__(self, ids: jax.Array) -> jax.Array:
        return self.values[ids].astype(jnp.float32) * self.scales[ids][..., None]


def quantize_rows(x: jax.Array, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """x [..., D] float -> (values [..., D] of `dtype`, float32 scales [...]): symmetric,
    absmax over the last axis (one token of one head)."""
    x = x.astype(jnp.float32)
    amax = jnp.abs(x).max(-1)
    scale = jnp.where(amax > 0, amax / QUANT_MAX[jnp.dtype(dtype)], 1.0)
    y = x / scale[..., None]
    if jnp.issubdtype(dtype, jnp.integer):
        y = jnp.clip(jnp.round(y), -127, 127)
    return y.astype(dtype), scale


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SharedPrefix:
    """Leading blocks shared by several sequences of a step (chosen on the host)."""

    blocks: jax.Array         # [MB] int32 the shared block ids, 0-padded
    length: jax.Array         # [1] int32 shared tokens (whole blocks); 0 = none
    suffix_start: jax.Array   # [S] int32 = length for members, 0 for the others
    suffix_tables: jax.Array  # [S, MB] int32 members' tables after the shared blocks; others unchanged
