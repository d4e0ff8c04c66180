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

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import jax
import jax.numpy as jnp

from runtime.kv_groups import KVGroups
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

    def attend(self, q: jax.Array, cache: tuple[Any, Any], inp: Any, base: jax.Array, sm_scale: float,
               window: jax.Array | int = 0, soft_cap: float | None = None) -> jax.Array:
        """q [T, Hq, D] against the cache through the step's block tables offset by `base`
        (the layer's first block row) -> [T, Hq, D]; padding rows 0. `window` (int32, traced;
        0 = full): a query at position p sees keys p - window < k <= p. `soft_cap` (static):
        scaled scores -> soft_cap * tanh(scores / soft_cap) before masking (Gemma 2)."""
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

    def attend(self, q, cache, inp, base, sm_scale, window=0, soft_cap=None):
        sh = inp.shared
        shared = SharedPrefix(sh.blocks + base, sh.length, sh.suffix_start, sh.suffix_tables + base)
        return xla_ragged_paged_attention(q, *cache, inp.kv_lens, inp.block_tables + base, inp.query_start_loc,
                                          inp.num_seqs, sm_scale=sm_scale, shared=shared, cpu_kernel=self.cpu_kernel,
                                          window=window, soft_cap=soft_cap)


@dataclass(frozen=True)
class PallasAttention(AttentionBackend):
    """The Mosaic GPU paged attention kernel: per-sequence reads (no cascade); an fp8 cache's
    1-byte values and their per-token scales go in apart. `kernel`: another function with the
    kernel's signature (tests lower the hardware kernel for CUDA on a CPU machine)."""
    interpret: bool = False
    kernel: Callable[..., jax.Array] | None = None
    name: ClassVar[str] = "pallas"

    def write_kv(self, cache, k, v, slots):
        return write_kv(*cache, k, v, slots)

    def attend(self, q, cache, inp, base, sm_scale, window=0, soft_cap=None):
        # make_backend never pairs this kernel with a windowed or soft-capped model
        from pallas_kernels.paged_attention import ragged_paged_attention

        kernel = self.kernel or ragged_paged_attention
        k_cache, v_cache = cache
        kw: dict[str, Any] = {"interpret": True} if self.interpret else {}
        if isinstance(k_cache, QuantizedPages):  # fp8: one scale per token and head (make_backend)
            kw.update(k_scale=k_cache.scales[..., 0], v_scale=v_cache.scales[..., 0])
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


def make_backend(name: str, kv_dtype: str, cpu_kernels: bool, windowed: bool = False,
                 soft_cap: float | None = None, head_dim: int | None = None, latent: bool = False) -> AttentionBackend:
    """The backend for `name` (auto | xla | pallas). `cpu_kernels`: the C++ CPU kernels may
    serve the XLA path (the runner says no under tensor parallelism); they do where they are
    built and enabled and the cache is float32 or int8. `windowed` / `soft_cap`: the model has
    sliding-window layers / an attention logit soft-cap (the Pallas kernel has neither; the
    C++ CPU kernel has no soft-cap); `head_dim`: the C++ CPU kernel serves only its HEAD_DIMS;
    `latent`: a multi-head latent attention cache (one row per token: keys and values), which
    only the plain XLA path reads. What the Pallas kernel lacks: asked for by name, refused in one line; under `auto` on a
    GPU, the XLA path, said in the log."""
    asked, name = name, resolve(name)
    missing = ("multi-head latent attention (a latent cache)" if latent else
               "sliding-window attention" if windowed else "attention logit soft-capping" if soft_cap is not None
               else "the int8 cache's scales and zeros per group of channels (it reads fp8_e4m3's per-token scales)"
               if kv_dtype == "int8" else None)
    if name == "pallas" and missing:
        if asked == "pallas":
            raise ValueError(f"attention_backend: pallas does not implement {missing} (use --attention-backend xla)")
        log.info("attention: the XLA path, not the Pallas kernel: it does not implement %s", missing)
        name = "xla"
    if name == "xla":
        from runtime.kernels.cpu import attention as cpu_attention

        kernel = cpu_kernels and kv_dtype in ("float32", "int8") and not latent and cpu_attention.available()
        if kernel and soft_cap is not None:
            log.info("attention: the XLA path without the C++ CPU kernel (it has no attention logit soft-cap)")
            kernel = False
        if kernel and head_dim is not None and head_dim not in cpu_attention.HEAD_DIMS:
            log.info("attention: the XLA path without the C++ CPU kernel (head_dim %d; it is built for %s)",
                     head_dim, cpu_attention.HEAD_DIMS)
            kernel = False
        return XlaAttention(cpu_kernel=kernel)
    if jax.default_backend() == "gpu":
        return PallasAttention()
    # No GPU: the same kernel runs in the Mosaic GPU interpreter (tests only: slow).
    log.warning("attention_backend=pallas without a GPU: using the Mosaic GPU interpreter")
    from pallas_kernels import _compat

    _compat.interpret_supports_transposed_wgmma()  # probe eagerly: it must not run inside a trace
    return PallasAttention(interpret=True)


def paged_attention(backend: AttentionBackend, num_blocks: int, sm_scale: float, windows: tuple[int, ...],
                    soft_cap: float | None, inp: Any, q: jax.Array, k: jax.Array, v: jax.Array | None, layer: jax.Array,
                    cache: tuple[Any, Any], *, groups: KVGroups | None = None) -> tuple[jax.Array, Any]:
    """One layer's KV write (slot mapping) and paged attention: the `attention(q, k, v, layer,
    cache)` a family calls, once `inp` is bound. `windows`: every layer's window
    (ModelConfig.layer_windows(), 0 = full), picked here by the scanned layer index;
    `soft_cap`: the model's attention logit soft-cap or None. `groups`: the KV groups
    (runtime/kv_groups.py; None = one group of all layers): layer l reads group G(l)'s
    block tables at row base i(l) * num_blocks. Under tensor parallelism it runs per shard
    (runtime/tp.shard_attention) on the local heads."""
    bs = cache[0].shape[1]
    if groups is None or groups.num_groups == 1:
        group, row = 0, layer if groups is None else jnp.asarray(groups.layer_index, jnp.int32)[layer]
    else:
        group = jnp.asarray(groups.layer_group, jnp.int32)[layer]
        row = jnp.asarray(groups.layer_index, jnp.int32)[layer]
    inp = _group_view(inp, group)
    slots = jnp.where(inp.slot_mapping >= 0, inp.slot_mapping + row * num_blocks * bs, -1)
    window = jnp.asarray(windows, jnp.int32)[layer] if any(windows) else 0
    if v is None:  # a latent cache (MLA): each token's one row is its key and its value; V is [..., 0]
        cache = backend.write_kv(cache, k, k[..., :0], slots)
        return backend.attend(q, (cache[0], None), inp, row * num_blocks, sm_scale, window, soft_cap), cache
    cache = backend.write_kv(cache, k, v, slots)
    return backend.attend(q, cache, inp, row * num_blocks, sm_scale, window, soft_cap), cache


def _group_view(inp: Any, group: Any) -> Any:
    """The step input as one group's layers see it: that group's slot mapping and block
    tables; the shared prefix (cascade) only in group 0, whose tables it was chosen from
    (other groups read their own tables whole)."""
    tables = inp.block_tables[group]
    if isinstance(group, int):
        return dataclasses.replace(inp, slot_mapping=inp.slot_mapping[group], block_tables=tables)
    sh, first = inp.shared, group == 0
    shared = SharedPrefix(sh.blocks, jnp.where(first, sh.length, 0), jnp.where(first, sh.suffix_start, 0),
                          jnp.where(first, sh.suffix_tables, tables))
    return dataclasses.replace(inp, slot_mapping=inp.slot_mapping[group], block_tables=tables, shared=shared)
