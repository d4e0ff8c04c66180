"""A mixture of experts' grouped product (runtime/kernels/cpu/cpu_experts.cc) as an XLA FFI
custom call: the rows routed to each expert times that expert's matrix, read in place from
the stacked weights of every layer (runtime/model/linear.py StackedExperts says when)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from runtime.kernels.cpu.build import available, enabled, num_threads  # noqa: F401 (this kernel's switches)
from runtime.model.linear import StackedExperts, pytree, static

TARGET = "pagedjax_expert_products"
STRIP = 64  # columns per packed strip (cpu_experts.cc kStrip)


def pack(w: np.ndarray) -> np.ndarray:
    """[L, E, K, N] -> [L, E, ceil(N/64), K, 64] float32, the strips contiguous (the last one
    padded with zero columns): the layout the kernel reads."""
    w = np.asarray(w, np.float32)
    *lead, K, N = w.shape
    S = -(-N // STRIP)
    padded = np.zeros((*lead, K, S * STRIP), np.float32)
    padded[..., :N] = w
    return np.ascontiguousarray(np.moveaxis(padded.reshape(*lead, K, S, STRIP), -2, -3))


def expert_products(x: jax.Array, w: jax.Array, layer: jax.Array, sizes: jax.Array, n: int) -> jax.Array:
    """x [M, K] float32, rows sorted by expert (sizes [E] each); w packed [L, E, S, K, 64]
    float32 (pack); layer int32 scalar; n the matrices' true width -> [M, n] float32
    (runtime/model/linear.py expert_products' numbers)."""
    if not available():  # (also registers the targets in this process)
        raise RuntimeError("expert products: the C++ CPU kernels are not built here (runtime/kernels/cpu/build.py)")
    M, N = x.shape[0], n
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((M, N), jnp.float32), vmap_method="sequential")
    return call(x, w, jnp.asarray(layer, jnp.int32).reshape(1), sizes.astype(jnp.int32),
                num_threads=np.int64(num_threads()))


@pytree
class PackedExperts(StackedExperts):
    """StackedExperts for the kernel: w float32 packed in strips (pack), `n` the matrices' width."""
    n: int = static(0)

    def product(self, x: jax.Array, sizes: jax.Array) -> jax.Array:
        return expert_products(x.astype(jnp.float32), self.w, self.index, sizes, self.n).astype(x.dtype)


def pack_held(params: dict) -> dict:
    """Every StackedExperts of the layers as PackedExperts (host side, once at start)."""
    layers = {k: PackedExperts(jnp.asarray(pack(np.asarray(v.w, np.float32))), rows=v.rows, n=int(v.w.shape[-1]))
              if isinstance(v, StackedExperts) and not isinstance(v, PackedExperts) and v.s is None else v
              for k, v in params["layers"].items()}
    return {**params, "layers": layers}
