"""LoRA's batched low-rank products (runtime/kernels/cpu/cpu_lora.cc) as an XLA FFI custom call:
each row times its adapter slot's a and b, read in place from the whole slot table
(runtime/model/lora.py LoraLinear uses it on CPU where the kernels are built)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from runtime.kernels.cpu.build import available, num_threads

TARGET = "pagedjax_lora_products"


def lora_products(x: jax.Array, slots: jax.Array, a: jax.Array, b: jax.Array, parts: tuple[int, ...],
                  layer: jax.Array) -> jax.Array:
    """x [M, K], slots [M] int32 (-1: none), a [L, S, K, P*R], b [L, S, R, N] float32, parts the P
    parts' column offsets (0, ..., N), layer int32 (a and b float32 or both bfloat16) -> [M, N] float32: columns of part p are
    (x[t] @ a[layer, slots[t]])[pR:(p+1)R] @ b[layer, slots[t]], zero where slots[t] < 0."""
    if not available():  # (also registers the targets in this process)
        raise RuntimeError("lora products: the C++ CPU kernels are not built here (runtime/kernels/cpu/build.py)")
    target = TARGET + ("_bf16" if a.dtype == jnp.bfloat16 else "")
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], b.shape[-1]), jnp.float32),
                            vmap_method="sequential")
    return call(x.astype(jnp.float32), slots.astype(jnp.int32), a, b, jnp.asarray(np.asarray(parts, np.int32)),
                jnp.asarray(layer, jnp.int32).reshape(1), num_threads=np.int64(num_threads()))
