"""The `AttentionBackend` seam: a family computes q, k, v and hands them to one backend
object, chosen once when the runner is built. A backend writes a layer's new K/V rows into
the paged cache (`write_kv`) and reads them back for the step's queries (`attend`).

    XlaAttention(cpu_kernel=False)   plain XLA (runtime/model/xla_attention.py), any device
    XlaAttention(cpu_kernel=True)    the same contract with the C++ CPU kernels
                                     (runtime/kernels/cpu/cpu_attention.cc) serving the float32/int8 cache
    PallasAttention(interpret=...)   the Mosaic GPU kernel (pallas_kernels/paged_attention.py);
                                     `interpret` runs it in the interpreter (tests without a GPU)

Backends are frozen dataclasses (hashable): they are static arguments of the jitted step.
The cache of all layers is one pair [L * NB, BS, Hkv, D] (or QuantizedPages); layer l's
block b is row l * NB + b, so a backend sees a plain paged cache plus the layer's row base.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import jax
import jax.numpy as jnp

from runtime.model.kv_pages import QuantizedPages, SharedPrefix
from runtime.model.xla_attention import write_kv, xla_ragged_paged_attention

log = logging.getLogger(__name__)
BACKENDS = ("auto", "xla", "pallas")


class AttentionBackend:
    """write_kv then attend, per layer. `inp` is the step's StepInput (runtime/model/batch.py)."""

    name: ClassVar[str]

    def write_kv(self, cache: tuple[Any, Any], k: jax.Array, v: jax.Array, slots: jax.Array) -> tuple[Any, Any]:
        """New rows k, v [T, Hkv, D] into the cache at flat slots (-1: dropped)."""
        raise NotImplementedError

    def attend(self, q: jax.Array, cache: tuple[Any, Any], inp: Any, base: jax.Array, sm_scale: float) -> jax.Array:
        """q [T, Hq, D] against the cache through the step's block tables offset by `base`
        (the layer's first block row) -> [T, Hq, D]; padding rows 0."""
        raise NotImplementedError


@dataclass(frozen=True)
class XlaAttention(AttentionBackend):
    """The ragged paged attention of runtime/model/xla_attention.py, with its shared-prefix (cascade)
    path; `cpu_kernel`: its C++ kernels write the float32 cache in place and serve the
    float32 / int8 cache's reads."""
    cpu_kernel: bool = False
    name: ClassVar[str] = "xla"

    def write_kv(self, cache, k, v, slots):
        return write_kv(*cache, k, v, slots, cpu_kernel=self.cpu_kernel)

    def attend(self, q, cache, inp, base, sm_scale):
        sh = inp.shared
        shared = SharedPrefix(sh.blocks + base, sh.length, sh.suffix_start, sh.suffix_tables + base)
        return xla_ragged_paged_attention(q, *cache, inp.kv_lens, inp.block_tables + base, inp.query_start_loc,
                                          inp.num_seqs, sm_scale=sm_scale, shared=shared, cpu_kernel=self.cpu_kernel)


@dataclass(frozen=True)
class PallasAttention(AttentionBackend):
    """The Mosaic GPU paged attention kernel: per-sequence reads (no cascade); a quantized
    cache's 1-byte values and their scales go in apart. `kernel`: another function with the
    kernel's signature (tests lower the hardware kernel for CUDA on a CPU machine)."""
    interpret: bool = False
    kernel: Callable[..., jax.Array] | None = None
    name: ClassVar[str] = "pallas"

    def write_kv(self, cache, k, v, slots):
        return write_kv(*cache, k, v, slots)

    def attend(self, q, cache, inp, base, sm_scale):
        from pallas_kernels.paged_attention import ragged_paged_attention

        kernel = self.kernel or ragged_paged_attention
        k_cache, v_cache = cache
        kw: dict[str, Any] = {"interpret": True} if self.interpret else {}
        if isinstance(k_cache, QuantizedPages):
            kw.update(k_scale=k_cache.scales, v_scale=v_cache.scales)
            k_cache, v_cache = k_cache.values, v_cache.values
        return kernel(q, k_cache, v_cache, inp.kv_lens, inp.block_tables + base, inp.query_start_loc, inp.num_seqs,
                      sm_scale=sm_scale, **kw)


def resolve(name: str) -> str:
    """auto -> pallas on GPU, xla elsewhere."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend: must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return name


def make_backend(name: str, kv_dtype: str, cpu_kernels: bool) -> AttentionBackend:
    """The backend for `name` (auto | xla | pallas). `cpu_kernels`: the C++ CPU kernels may
    serve the XLA path (the runner says no under tensor parallelism); they do where they are
    built and enabled and the cache is float32 or int8."""
    name = resolve(name)
    if name == "xla":
        from runtime.kernels.cpu import attention as cpu_attention

        return XlaAttention(cpu_kernel=cpu_kernels and kv_dtype in ("float32", "int8") and cpu_attention.available())
    if jax.default_backend() == "gpu":
        return PallasAttention()
    # No GPU: the same kernel runs in the Mosaic GPU interpreter (tests only: slow).
    log.warning("attention_backend=pallas without a GPU: using the Mosaic GPU interpreter")
    from pallas_kernels import _compat

    _compat.interpret_supports_transposed_wgmma()  # probe eagerly: it must not run inside a trace
    return PallasAttention(interpret=True)


def paged_attention(backend: AttentionBackend, num_blocks: int, sm_scale: float, inp: Any, q: jax.Array,
                    k: jax.Array, v: jax.Array, layer: jax.Array, cache: tuple[Any, Any]) -> tuple[jax.Array, Any]:
    """One layer's KV write (slot mapping) and paged attention: the `attention(q, k, v, layer,
    cache)` a family calls, once `inp` is bound. Under tensor parallelism it runs per shard
    (runtime/tp.shard_attention) on the local heads."""
    bs = cache[0].shape[1]
    slots = jnp.where(inp.slot_mapping >= 0, inp.slot_mapping + layer * num_blocks * bs, -1)
    cache = backend.write_kv(cache, k, v, slots)
    return backend.attend(q, cache, inp, layer * num_blocks, sm_scale), cache
