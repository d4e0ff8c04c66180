"""Owns the parameters and KV cache on the device and runs the one jitted step:
forward + KV write (slot mapping) + sampling, with the cache donated.

The KV cache of all layers is one array pair [L * num_blocks, block_size, Hkv, D]:
layer l's block b lives at row l * num_blocks + b, so the attention kernel sees a plain
paged cache and the layer scan carries the whole cache without slicing (no copies).
A quantized cache (--kv-cache-dtype int8|fp8_e4m3) is the same pair of QuantizedPages:
values of that shape plus their scales (and zeros) per slot, head and group of channels
(runtime/model/kv_pages.py).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from runtime.model.kv_pages import QuantizedPages
from runtime.model.batch import TOKEN_OUTPUT, TOKEN_PROMPT, StepInput, build_step_input
from runtime.config import (QUANTIZED_KV_DTYPES, CacheConfig, KernelConfig, LoraConfig, ModelConfig, SchedulerConfig,
                            kv_scale_groups)
from runtime.model.attention_backend import AttentionBackend, make_backend, paged_attention
from runtime.model.families import family
from runtime.model.families.llama import Params, attention_scale
from runtime.model.quant import cast_params
from runtime.model.sampling import SampleOutput, penalties_on, sample

log = logging.getLogger(__name__)
NUM_LOGPROBS = 20  # always computed, so one program serves requests with and without logprobs
STEP_FN_NAME = "pagedjax_step"
KV_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "int8": jnp.int8, "fp8_e4m3": jnp.float8_e4m3fn}


def allocate_kv(shape: tuple[int, ...], kv_dtype: str, latent: bool = False) -> tuple[Any, Any]:
    """Empty K and V caches [L*NB, BS, Hkv, D]: plain arrays, or QuantizedPages (values plus
    their scales, and zeros for int8: runtime/model/kv_pages.py) for int8 / fp8_e4m3.
    `latent` (multi-head latent attention): the K cache's rows are the keys and the values,
    so V is [..., 0]: no bytes, the same tree for every caller."""
    dtype = KV_DTYPES[kv_dtype]
    if latent:  # (quantized: the latent row with its own scale groups, INT8_KV_GROUP["latent"])
        k = (QuantizedPages.empty(shape, dtype, kv_scale_groups(kv_dtype, shape[-1], "latent"))
             if kv_dtype in QUANTIZED_KV_DTYPES else jnp.zeros(shape, dtype))
        return k, jnp.zeros((*shape[:-1], 0), jnp.float32)
    if kv_dtype in QUANTIZED_KV_DTYPES:
        return tuple(QuantizedPages.empty(shape, dtype, kv_scale_groups(kv_dtype, shape[-1], part)) for part in "kv")
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)

_compile_lock = threading.Lock()
_compilations: dict[str, int] = {}


def _on_event(event: str, duration: float, **kw: Any) -> None:
    if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
        name = kw.get("fun_name", "")
        with _compile_lock:
            _compilations[name] = _compilations.get(name, 0) + 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


def compilations(fun_name: str = STEP_FN_NAME) -> int:
    """Programs built for the engine step so far in this process (a persistent-cache hit
    still counts: it is a shape the steady state should never see)."""
    with _compile_lock:
        return sum(v for k, v in _compilations.items() if fun_name in k)


def pack_float_for(cfg: ModelConfig, params: Params, fuse_mlp: bool = True) -> Params:
    """The float32 tree packed for the C++ float kernel as far as the family's layer allows:
    a Llama-style layer (SWIGLU_TAIL) gets the SwiGLU gate|up pair and with it the fused layer
    tail (runtime/kernels/cpu/matmul.py); any other (Gemma: post-norms, GeGLU) gets each
    projection packed on its own (q|k|v still one product), so typed() builds no tail and
    the family applies its own activation and norms; a mixture of experts gets its attention
    projections packed (its experts stay the family's grouped products). `fuse_mlp` False (LoRA: an
    adapter's delta goes between the products the tail fuses) packs a Llama-style layer the same way."""
    from runtime.kernels.cpu import matmul as cpu_matmul

    if fuse_mlp and getattr(family(cfg), "SWIGLU_TAIL", True):
        return cpu_matmul.pack_float_params(params, cfg.tie_word_embeddings)
    layers = dict(params["layers"])
    names = tuple(n for n in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down") if n in layers)
    if not all(n in layers for n in ("wq", "wk", "wv")):  # (latent attention: no q|k|v to fuse)
        return params
    if any(np.shape(layers[n])[-1] % cpu_matmul.F32_STRIP for n in names):
        return params
    layers["qkv"] = cpu_matmul.pack_float(np.concatenate([np.asarray(layers.pop(n), np.float32)
                                                          for n in ("wq", "wk", "wv")], axis=-1))
    if not fuse_mlp and "w_gate" in layers and "w_up" in layers:  # (LoRA: gate|up one plain product)
        layers["gate_up"] = cpu_matmul.pack_float(np.concatenate([np.asarray(layers.pop(n), np.float32)
                                                                  for n in ("w_gate", "w_up")], axis=-1))
    for n in names[3:]:
        if n in layers:
            layers[n] = cpu_matmul.pack_float(layers[n])
    return cpu_matmul.with_float_head({**params, "layers": layers}, cfg.tie_word_embeddings)


def tune_cpu_allocator() -> None:
    """XLA:CPU allocates each call's temporaries afresh; past glibc's default 32 MiB
    mmap threshold every step pays page faults to touch them again (measured 10-60 ms
    per step here). Raising the thresholds keeps that memory in the heap for reuse."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 2 << 30)  # M_TRIM_THRESHOLD
    except OSError:
        pass


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PromptLogprobs:
    logprobs: jax.Array       # [T] f32 log_softmax at each token of its prompt_targets token (0: none)
    top_ids: jax.Array        # [T, NUM_LOGPROBS] i32, most probable first
    top_logprobs: jax.Array   # [T, NUM_LOGPROBS] f32


PROMPT_LP_CHUNK = 128  # prompt rows per lm_head pass: a [128, V] slab, not [T, V]


def prompt_logprobs(cfg: ModelConfig, params: Params, hidden: jax.Array, targets: jax.Array) -> PromptLogprobs:
    """Raw-logit log_softmax of every token's next prompt token, in PROMPT_LP_CHUNK slabs."""
    T = hidden.shape[0]
    c = min(PROMPT_LP_CHUNK, T)
    pad = -T % c
    h = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(-1, c, hidden.shape[1])
    tg = jnp.pad(targets, (0, pad), constant_values=-1).reshape(-1, c)

    def slab(args):
        hs, ts = args
        logits = family(cfg).lm_head(cfg, params, hs)
        lse = jax.nn.logsumexp(logits, -1)
        chosen = jnp.take_along_axis(logits, jnp.maximum(ts, 0)[:, None], 1)[:, 0] - lse
        vals, ids = jax.lax.top_k(logits, NUM_LOGPROBS)
        return jnp.where(ts >= 0, chosen, 0.0), ids.astype(jnp.int32), vals - lse[:, None]
    lp, ids, top = jax.lax.map(slab, (h, tg))
    return PromptLogprobs(lp.reshape(-1)[:T], ids.reshape(-1, NUM_LOGPROBS)[:T], top.reshape(-1, NUM_LOGPROBS)[:T])


def _no_prompt_logprobs(T: int) -> PromptLogprobs:
    return PromptLogprobs(jnp.zeros((T,), jnp.float32), jnp.zeros((T, NUM_LOGPROBS), jnp.int32),
                          jnp.zeros((T, NUM_LOGPROBS), jnp.float32))


def _reset_state_rows(counts: jax.Array, prompt_mask: jax.Array, inp: StepInput) -> tuple[jax.Array, jax.Array]:
    """Penalty state: clear the rows new requests take, one row at a time in a loop that runs
    as many times as rows reset (none in steady decode). Why not one scatter of the reset
    rows: XLA materializes its [S, vocab] zero update every step, reset or not (2.5 ms of a
    105 ms 64-row SmolLM2 step); a where over the whole state reads and writes all of it."""
    order = jnp.sort(jnp.where(inp.reset_rows, inp.state_rows, counts.shape[0]))  # reset rows first

    def clear(i, state):
        c, pm = state
        return (jax.lax.dynamic_update_slice(c, jnp.zeros((1, c.shape[1]), c.dtype), (order[i], 0)),
                jax.lax.dynamic_update_slice(pm, jnp.zeros((1, pm.shape[1]), pm.dtype), (order[i], 0)))
    return jax.lax.fori_loop(0, jnp.sum(inp.reset_rows.astype(jnp.int32)), clear, (counts, prompt_mask))


def _step(cfg: ModelConfig, backend: AttentionBackend, num_blocks: int, mesh: Any, params: Params, kv: tuple,
          rows: tuple, inp: StepInput, *, groups: Any = None) -> tuple[tuple, tuple, SampleOutput, PromptLogprobs, Any]:
    """rows = (counts [R, V] i32, prompt_mask [R, V] bool, last_token [R] i32): per-request
    device state, row R-1 being scratch for padding. groups: the KV groups (runtime/kv_groups.py;
    None: one group of all layers). mesh: None, or the tensor-parallel mesh
    (attention then runs per shard on its heads; runtime/model/tp.py)."""
    counts, prompt_mask, last_token = rows
    scratch = counts.shape[0] - 1
    # A decode row whose input is the token the previous (still unread) step sampled reads
    # it here: the host launches step N+1 without waiting for step N's tokens.
    token_ids = jnp.where(inp.token_from_state, last_token[inp.token_row], inp.token_ids)
    counts, prompt_mask = _reset_state_rows(counts, prompt_mask, inp)
    prompt_rows = jnp.where(inp.token_kind == TOKEN_PROMPT, inp.token_row, scratch)
    prompt_mask = prompt_mask.at[prompt_rows, token_ids].set(True)
    out_rows = jnp.where(inp.token_kind == TOKEN_OUTPUT, inp.token_row, scratch)
    counts = counts.at[out_rows, token_ids].add(1)

    local = partial(paged_attention, backend, num_blocks, attention_scale(cfg), cfg.layer_windows(),
                    cfg.attn_logit_softcapping, groups=groups)
    if mesh is None:
        attention = partial(local, inp)
    else:
        from runtime.model.tp import shard_attention

        attention = partial(shard_attention(local, mesh), inp)

    if "lora" in params:  # the step's rows by adapter slot (runtime/model/lora.py)
        from runtime.model.lora import LoraBatch

        params = {**params, "lora_batch": LoraBatch.of(inp.lora_slots, params["lora"])}
    fam = family(cfg)
    hidden, kv, *stats = fam.forward_hidden(cfg, params, token_ids, inp.positions, attention, kv)
    load = expert_load(cfg, stats[0]["expert_ids"], inp) if stats and "expert_ids" in stats[0] else None
    T = token_ids.shape[0]
    plp = jax.lax.cond(jnp.any(inp.prompt_targets >= 0),
                       lambda: prompt_logprobs(cfg, params, hidden, inp.prompt_targets),
                       lambda: _no_prompt_logprobs(T))

    def sample_at(token_index: jax.Array, sampling: Any, state_rows: jax.Array) -> SampleOutput:
        logits = fam.lm_head(cfg, params, hidden[token_index])
        if mesh is not None:  # vocab-sharded products, then one all-gather of the [S, V] logits (not of the
            # head's weights); sampling then runs whole on every device
            from runtime.model.tp import gather_logits

            logits = gather_logits(cfg, mesh, logits)
        # The [S, V] penalty state is gathered only when some row uses penalties.
        return jax.lax.cond(
            penalties_on(sampling),
            lambda: sample(logits, sampling, counts[state_rows], prompt_mask[state_rows],
                           num_logprobs=NUM_LOGPROBS, only_if_asked=True),
            lambda: sample(logits, sampling, None, None, num_logprobs=NUM_LOGPROBS, only_if_asked=True))

    K = inp.spec.draft_ids.shape[1]
    if K == 0:
        out, spec = sample_at(inp.logits_indices, inp.sampling, inp.state_rows), None
    else:
        out, spec = jax.lax.cond(jnp.any(inp.spec.draft_ids >= 0), lambda: _verify(sample_at, inp),
                                 lambda: _unverified(sample_at(inp.logits_indices, inp.sampling, inp.state_rows), K))
    kept_rows = jnp.where(inp.sample_mask, inp.state_rows, scratch)
    counts = counts.at[kept_rows, out.token_ids].add(1)
    last_token = last_token.at[kept_rows].set(out.token_ids)
    return kv, (counts, prompt_mask, last_token), out, plp, spec, load


def expert_load(cfg: ModelConfig, expert_ids: jax.Array, inp: StepInput) -> jax.Array:
    """[L, E] int32: the step's real tokens routed to each expert of each layer (padding rows
    not counted; a dense layer's row stays 0), from the family's expert_ids [L, T, k]."""
    L, T, k = expert_ids.shape
    real = jnp.arange(T) < inp.query_start_loc[inp.num_seqs[0]]
    layer = jnp.broadcast_to(jnp.arange(L)[:, None, None], expert_ids.shape)
    add = jnp.broadcast_to(real[None, :, None], expert_ids.shape).astype(jnp.int32)
    return jnp.zeros((L, cfg.num_experts), jnp.int32).at[layer, expert_ids].add(add, mode="drop")


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SpecOutput:
    """A speculative step's verification, per row: the sample after each of its positions
    (its last token, then each proposal) and how many proposals it keeps."""
    token_ids: jax.Array      # [S, K+1] i32
    accepted: jax.Array       # [S] i32 leading proposals equal to the sample before them
    logprobs: jax.Array       # [S, K+1] f32
    top_ids: jax.Array        # [S, K+1, NUM_LOGPROBS] i32
    top_logprobs: jax.Array   # [S, K+1, NUM_LOGPROBS] f32


def _verify(sample_at: Any, inp: StepInput) -> tuple[SampleOutput, SpecOutput]:
    """Sample after every verify slot with the key its row would use at that output index
    (the row's step + the slot's offset), so each sample is the token the row would make one
    step at a time given the proposals before it. A proposal is kept while it equals the
    sample before it (runtime/core/speculative.py says why this is exact); the row's token is
    the sample after its last kept proposal."""
    sp = inp.spec
    sampling = jax.tree.map(lambda a: a[sp.slot_row], inp.sampling)
    token_mask = jnp.where((sp.slot_mask >= 0)[:, None], sp.masks[jnp.maximum(sp.slot_mask, 0)], sampling.token_mask)
    sampling = dataclasses.replace(sampling, steps=sampling.steps + sp.slot_offset, token_mask=token_mask)
    flat = sample_at(sp.slot_token, sampling, inp.state_rows[sp.slot_row])
    per_row = jax.tree.map(lambda a: a[sp.row_slots], flat)              # [S, K+1, ...]
    keep = jnp.cumprod((per_row.token_ids[:, :-1] == sp.draft_ids).astype(jnp.int32), axis=1)
    accepted = jnp.sum(keep, axis=1)
    last = jnp.take_along_axis(sp.row_slots, accepted[:, None], 1)[:, 0]
    out = jax.tree.map(lambda a: a[last], flat)
    return out, SpecOutput(per_row.token_ids, accepted, per_row.logprobs, per_row.top_ids, per_row.top_logprobs)


def _unverified(out: SampleOutput, K: int) -> tuple[SampleOutput, SpecOutput]:
    """A step of a speculating engine with no proposals in it: the plain samples, in the
    verified step's shapes (each row keeps none)."""
    wide = lambda a: jnp.repeat(a[:, None], K + 1, axis=1)
    return out, SpecOutput(wide(out.token_ids), jnp.zeros_like(out.token_ids), wide(out.logprobs),
                           wide(out.top_ids), wide(out.top_logprobs))


class StepHandle:
    """A launched step's outputs, still on (or coming back from) the device."""

    def __init__(self, out: SampleOutput, num_rows: int, plp: PromptLogprobs | None = None,
                 spec: "SpecOutput | None" = None, load: jax.Array | None = None):
        self._out, self.num_rows, self._plp, self._spec, self._load = out, num_rows, plp, spec, load
        self._host: dict[str, np.ndarray] | None = None

    def result(self) -> dict[str, np.ndarray]:
        """Blocks until the device has finished the step; host arrays of the real rows. A
        step that verified proposals gives its rows' samples at every position instead:
        token_ids, logprobs, top_ids and top_logprobs [n, K+1, ...], and "accepted" [n]."""
        if self._host is None:
            host = jax.device_get(self._spec if self._spec is not None else self._out)
            n = self.num_rows
            self._host = {"token_ids": np.asarray(host.token_ids)[:n], "logprobs": np.asarray(host.logprobs)[:n],
                          "top_ids": np.asarray(host.top_ids)[:n], "top_logprobs": np.asarray(host.top_logprobs)[:n]}
            if self._spec is not None:
                self._host["accepted"] = np.asarray(host.accepted)[:n]
            self._spec = None
            if self._load is not None:  # a mixture of experts: the step's tokens per expert [L, E]
                self._host["expert_load"] = np.asarray(jax.device_get(self._load))
                self._load = None
            if self._plp is not None:  # only steps that computed prompt logprobs bring them back
                plp = jax.device_get(self._plp)
                self._host.update(prompt_logprobs=np.asarray(plp.logprobs), prompt_top_ids=np.asarray(plp.top_ids),
                                  prompt_top_logprobs=np.asarray(plp.top_logprobs))
            self._out = self._plp = None
        return self._host


class ModelRunner:
    def __init__(self, cfg: ModelConfig, params: Params, cache: CacheConfig, sched: SchedulerConfig,
                 attention_backend: str = "auto", dtype: Any = jnp.float32, quantization: str = "none",
                 tensor_parallel_size: int = 1, kernels: KernelConfig | None = None, spec_k: int = 0,
                 lora: LoraConfig | None = None):
        """With a quantization, `params` come quantized (runtime.model.quant.prepare calibrates and
        quantizes them once, in the engine). tensor_parallel_size > 1: params and KV cache
        sharded over a mesh of that many devices (runtime/model/tp.py); 1 is the single-device path.
        `kernels`: the CPU kernels' switches (EngineConfig.kernels), environment overrides applied.
        `spec_k`: proposals a row may carry for verification (speculative decoding; 0: off).
        `lora`: hold a table of adapter slots (runtime/model/lora.py); the kernels' fused layer
        tails are not built then (an adapter's delta goes between their products)."""
        self.spec_k = spec_k
        if lora is not None and tensor_parallel_size > 1:
            raise ValueError("lora: LoRA adapters with --tensor-parallel-size > 1 are not supported yet")
        self.kernels = kernels = (kernels or KernelConfig()).with_env()
        self.tp = tensor_parallel_size
        self.mesh = None
        if self.tp > 1:
            from runtime.model import tp

            tp.validate(cfg, self.tp, attention_backend=attention_backend, quantization=quantization)
            self.mesh = tp.make_mesh(self.tp)
            params = tp.shard_params(cfg, params, self.mesh)  # no-op for leaves loaded into their shards
            cfg = tp.runner_config(cfg, self.tp)  # KV heads as replicated for N > Hkv
        self.cfg, self.cache_cfg, self.sched = cfg, cache, sched
        if jax.default_backend() == "cpu":
            tune_cpu_allocator()
        self.quantization = quantization
        # w8a8 on a CPU with AVX512-VNNI: the C++ int8 kernel, weights packed for it once here.
        from runtime.kernels.cpu import build as cpu_kernels
        from runtime.kernels.cpu import matmul as cpu_matmul

        if jax.default_backend() == "cpu" and cpu_kernels.enabled(kernels):
            cpu_kernels.configure(kernels)  # the library's process-wide knobs (AMX, the pool's linger)
        self.matmul_kernel = quantization == "w8a8" and cpu_matmul.vectorized(kernels) and self.tp == 1
        if quantization == "w8a8" and not self.matmul_kernel and self.tp == 1 and jax.default_backend() == "cpu":
            # the trade must be visible: without the kernel w8a8 buys accuracy loss, not speed
            log.warning("w8a8: the C++ int8 kernel is not available here (it needs AVX512-VNNI and the CPU "
                        "kernels enabled), so the products run as XLA's int8 dot, which measured slower than "
                        "float32 on an AVX2-only EPYC; compare both with `pagedjax bench offline --part decode`")
        if self.matmul_kernel:
            params = cpu_matmul.pack_params(params)
            if "head" not in params and cpu_matmul.f32_default(kernels):  # the head stays float: the float kernel's copy
                params = cpu_matmul.with_float_head(params, cfg.tie_word_embeddings)
        # w4a16: the weight-only kernel reads the 4-bit values (and the 8-bit head) as stored
        self.wq_kernel = (quantization == "w4a16" and self.tp == 1 and jax.default_backend() == "cpu"
                          and cpu_matmul.f32_vectorized(kernels))
        if self.wq_kernel:
            params = cpu_matmul.pack_wq_params(params, swiglu_tail=lora is None and getattr(family(cfg), "SWIGLU_TAIL", True))
        # w4a16 on a Hopper GPU: the Mosaic GPU kernel reads the nibbles (runtime/model/mosaic_linear.py)
        from runtime.model import mosaic_linear

        self.w4_gpu_kernel = mosaic_linear.applies(quantization, dtype, self.tp)
        if self.w4_gpu_kernel:
            params = mosaic_linear.pack_params(params)
        # float32 weights: the C++ float kernel (faster than XLA's dot at 1-512 rows on the
        # CPUs measured; cpu_matmul.f32_default says where it is the default)
        self.f32_kernel = (quantization == "none" and jnp.dtype(dtype) == jnp.float32 and self.tp == 1
                           and jax.default_backend() == "cpu" and cpu_matmul.f32_default(kernels))
        if self.f32_kernel:
            params = pack_float_for(cfg, params, fuse_mlp=lora is None)
            self.f32_kernel = "qkv" in params["layers"]
        self.params = cast_params(params, dtype)
        # XLA:CPU: float layer weights as separate per-layer arrays (models/llama.py
        # unstack_weights says why); KernelConfig.per_layer_weights off keeps them stacked.
        self.per_layer_weights = jax.default_backend() == "cpu" and self.tp == 1 and kernels.per_layer_weights
        if self.per_layer_weights:
            from runtime.model.families.llama import unstack_weights
            from runtime.model.quant import LINEAR_WEIGHTS

            self.params = unstack_weights(self.params, LINEAR_WEIGHTS)
        hold = getattr(family(cfg), "hold_weights", None)  # a family's weights the layer scan must not slice
        if hold is not None:
            self.params = hold(cfg, self.params)
            if (jax.default_backend() == "cpu" and self.tp == 1 and jnp.dtype(dtype) == jnp.float32
                    and cpu_kernels.enabled(kernels)):  # a mixture of experts' products: the C++ kernel
                from runtime.kernels.cpu import experts as cpu_experts

                self.params = cpu_experts.pack_held(self.params)
            if self.mesh is not None:  # expert parallelism: each device runs its share of the experts
                from runtime.model.tp import hold_expert_shards

                self.params = hold_expert_shards(self.params, self.mesh)
        if self.mesh is None:
            from runtime.kernels.cpu import hugepages

            self.params = hugepages.place_weights(self.params, kernels)
        self.lora = lora
        if lora is not None:  # a fixed table of adapter slots: loading one never recompiles
            from runtime.model.lora import LoraTable, lora_names

            kernel = jax.default_backend() == "cpu" and cpu_kernels.enabled(kernels)
            self.params = {**self.params, "lora": LoraTable.empty(cfg, lora_names(self.params["layers"]),
                                                                  lora.max_loras, lora.max_lora_rank, kernel,
                                                                  KV_DTYPES[lora.dtype])}
        self.max_blocks_per_seq = -(-sched.max_model_len // cache.block_size)
        if cache.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache_dtype: {cache.kv_dtype!r} is not supported by the runner "
                             f"(supported: {', '.join(KV_DTYPES)})")
        # KV groups (runtime/kv_groups.py): a page holds a group's layers; one group of all
        # layers (every model without sliding layers) is the [L * NB, ...] layout.
        from runtime.kv_groups import KVGroups

        self.kv_groups = KVGroups.of(cfg, cache.kv_groups)
        shape = (self.kv_groups.group_size * cache.num_blocks, cache.block_size, cfg.num_kv_heads, cfg.head_dim)
        if self.mesh is None:
            self.kv = allocate_kv(shape, cache.kv_dtype, latent=cfg.mla)
            from runtime.kernels.cpu import hugepages

            hugepages.collapse(self.kv, kernels)
        rows = sched.max_num_seqs + 1  # last row is scratch for padding
        self.penalty = (jnp.zeros((rows, cfg.vocab_size), jnp.int32), jnp.zeros((rows, cfg.vocab_size), bool),
                        jnp.zeros((rows,), jnp.int32))
        if self.mesh is not None:  # each device allocates its KV heads' slice only (no whole cache anywhere)
            alloc = partial(allocate_kv, shape, cache.kv_dtype)
            self.kv_shardings = tp.kv_sharding(self.mesh, jax.eval_shape(alloc))
            self.kv = jax.jit(alloc, out_shardings=self.kv_shardings)()
            self.penalty = jax.device_put(self.penalty, tp.replicated(self.mesh))
        self.scratch_row = rows - 1
        # Under TP the plain XLA path: the C++ CPU kernels' custom calls are not shard-safe yet.
        self.attention = make_backend(attention_backend, cache.kv_dtype,
                                      cpu_kernels=self.tp == 1 and kernels.cpu_kernels,
                                      windowed=any(cfg.layer_windows()), soft_cap=cfg.attn_logit_softcapping,
                                      head_dim=cfg.head_dim, latent=cfg.mla)
        self.attention_backend = self.attention.name
        self.attention_kernel = bool(getattr(self.attention, "cpu_kernel", False))  # decode rows on the C++ kernel
        fn = partial(_step, cfg, self.attention, cache.num_blocks, self.mesh, groups=self.kv_groups)
        fn.__name__ = STEP_FN_NAME  # type: ignore[attr-defined]
        if self.mesh is None:
            self._step = jax.jit(fn, donate_argnums=(1, 2))
        else:  # explicit shardings: nothing reshards per step; the cache is donated per shard
            rep = tp.replicated(self.mesh)
            pshard = tp.param_shardings(cfg, self.params, self.mesh)
            self.params = jax.device_put(self.params, pshard)  # (a cast to the compute dtype keeps them)
            self._step = jax.jit(fn, donate_argnums=(1, 2), in_shardings=(pshard, self.kv_shardings, rep, rep),
                                 out_shardings=(self.kv_shardings, rep, rep, rep, rep, rep))
            log.info("tensor parallel: %d devices (%s), %d query / %d KV heads per device, embeddings/LM head %s; "
                     "attention on the XLA path (C++ CPU kernels off under TP)", self.tp,
                     ", ".join(str(d) for d in self.mesh.devices.flat), cfg.num_heads // self.tp,
                     cfg.num_kv_heads // self.tp,
                     "by vocabulary" if tp.vocab_sharded(cfg, self.tp) else
                     f"replicated (vocabulary {cfg.vocab_size} does not divide by {self.tp})")
        self.fail_next_step: Exception | None = None  # test hook: the next step raises this
        self.last_input: StepInput | None = None  # the padded input of the last launch (benchmarks replay it)
        from runtime.model.structured import TokenMasks

        self.masks = TokenMasks(cfg.vocab_size)  # the all-allowed mask every unconstrained step passes

    def recover(self) -> bool:
        """After a failed step the donated cache may be gone: rebuild it empty. Returns
        True when KV contents were lost (the caller drops cached prefixes and recomputes)."""
        arrays = jax.tree.leaves((self.kv, self.penalty))
        if not any(a.is_deleted() for a in arrays):
            return False
        if self.mesh is not None:  # rebuilt in its shards
            from runtime.model import tp

            self.kv = jax.tree.map(lambda a, sh: jnp.zeros(a.shape, a.dtype, device=sh), self.kv, self.kv_shardings)
            self.penalty = tuple(jnp.zeros(a.shape, a.dtype, device=tp.replicated(self.mesh)) for a in self.penalty)
            return True
        self.kv = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), self.kv)
        self.penalty = tuple(jnp.zeros(a.shape, a.dtype) for a in self.penalty)
        from runtime.kernels.cpu import hugepages

        hugepages.collapse(self.kv, self.kernels)  # (a new buffer: back on huge pages, as at start)
        return True

    def write_lora_slot(self, slot: int, weights: dict | None) -> None:
        """Put an adapter's weights (runtime/core/lora.py Adapter.weights; None: zeros) in a slot
        of the device table, between steps: the next launch reads it."""
        from runtime.model.lora import write_slot

        table = self.params["lora"]
        a, b = table.slot_arrays(self.cfg, weights or {})
        self.params = {**self.params, "lora": write_slot(table, slot, a, b)}

    def kv_cache_bytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(self.kv))

    def kv_block_bytes(self) -> int:
        """Bytes one block holds over every layer and leaf (read_blocks' host copy of it): each
        leaf is [L*NB, BS, ...], one row per layer and block."""
        L = self.cfg.num_layers
        return sum(a.nbytes // (a.shape[0] // L) for a in jax.tree.leaves(self.kv))

    def launch(self, seqs: list, num_seqs_bucket: int, num_tokens_bucket: int,
               token_mask: np.ndarray | None = None) -> "StepHandle":
        """Build the padded input and dispatch the step; returns at once (JAX dispatch is
        asynchronous), the device state already advanced for the next launch. token_mask:
        the [num_seqs_bucket, ceil(V/32)] allowed-token bitmask (None: every token)."""
        if token_mask is None:
            token_mask = self.masks.all_allowed(num_seqs_bucket)
        inp = build_step_input(seqs, num_seqs_bucket, num_tokens_bucket, self.max_blocks_per_seq,
                               self.cache_cfg.block_size, self.scratch_row, token_mask,
                               num_groups=self.kv_groups.num_groups, cascade=not self.kv_groups.windows[0],
                               spec_k=self.spec_k)
        if self.fail_next_step is not None:
            exc, self.fail_next_step = self.fail_next_step, None
            raise exc
        self.kv, self.penalty, out, plp, spec, load = self._step(self.params, self.kv, self.penalty, inp)
        self.last_input = inp
        wants_prompt = any(sq.prompt_next for sq in seqs)
        if not any(sq.drafts for sq in seqs):
            spec = None
        res = spec if spec is not None else out
        for a in (res.token_ids, res.logprobs, res.top_ids, res.top_logprobs,
                  *((spec.accepted,) if spec is not None else ()),
                  *((plp.logprobs, plp.top_ids, plp.top_logprobs) if wants_prompt else ()),
                  *((load,) if load is not None else ())):
            a.copy_to_host_async()
        return StepHandle(out, len(seqs), plp if wants_prompt else None, spec, load)

    def replay(self, inp: StepInput) -> float:
        """Benchmarks: run the step program once more on a launched step's input (`last_input`)
        and wait; seconds. It advances the device state as a step would (the KV slots and the
        rows' last tokens), so the requests of that step are garbage afterwards: abort them."""
        t0 = time.perf_counter()
        self.kv, self.penalty, out, *_ = self._step(self.params, self.kv, self.penalty, inp)
        jax.block_until_ready(out)
        return time.perf_counter() - t0

    def run(self, seqs: list, num_seqs_bucket: int, num_tokens_bucket: int) -> dict[str, np.ndarray]:
        """Launch and wait (warm-up, tests)."""
        return self.launch(seqs, num_seqs_bucket, num_tokens_bucket).result()

    def warmup(self, progress: bool = True) -> float:
        """Compile every (seqs, tokens) bucket once: dummy requests in the scratch row whose
        KV goes to block 0 (no request owns it yet)."""
        from runtime.model.batch import ScheduledSeq
        from runtime.model.sampling import SamplingParams, SamplingRow

        t0 = time.perf_counter()
        if self.lora is not None:  # the slot-writing program, once (slot 0 is empty at start)
            self.write_lora_slot(0, None)
        greedy = SamplingRow(SamplingParams(temperature=0.0), 0)
        for s, t in tqdm(self.sched.bucket_pairs(), desc="compiling buckets", unit="shape", disable=not progress):
            per = [t // s] * s
            per[-1] += t - sum(per)
            seqs = [ScheduledSeq(token_ids=[0] * n, start_pos=0,
                                 block_tables=[[0] * -(-n // self.cache_cfg.block_size)] * self.kv_groups.num_groups,
                                 prompt_len=n, state_row=self.scratch_row, reset_row=False, sample=True,
                                 sampling_row=greedy) for n in per]
            self.run(seqs, s, t)
        return time.perf_counter() - t0


# --- KV block transfer (disaggregated prefill/decode; runtime/core/disagg.py) ---------------------
# Separate programs from the step, used only by disaggregation: ordinary serving compiles
# nothing new. Block counts are bucketed to powers of two so a replica builds a handful.

def transfer_bucket(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@partial(jax.jit, static_argnums=(1,))
def _gather_blocks(kv: tuple, num_layers: int, block_ids: jax.Array) -> tuple:
    """Every leaf [L*NB, BS, ...] -> [L, n, BS, ...]: the blocks' rows of each layer."""
    def take(a):
        nb = a.shape[0] // num_layers
        rows = jnp.arange(num_layers)[:, None] * nb + block_ids[None, :]
        return a[rows]
    return jax.tree.map(take, kv)


@partial(jax.jit, static_argnums=(1,), donate_argnums=(0,))
def _scatter_blocks(kv: tuple, num_layers: int, block_ids: jax.Array, data: tuple) -> tuple:
    """The inverse of _gather_blocks, in place (donated). A padding id of -1 maps past the
    end and mode="drop" discards its write, so padding never touches a real block."""
    def put(a, d):
        nb = a.shape[0] // num_layers
        rows = jnp.where(block_ids >= 0, jnp.arange(num_layers)[:, None] * nb + block_ids[None, :], a.shape[0])
        return a.at[rows].set(d.astype(a.dtype), mode="drop")
    return jax.tree.map(put, kv, data)


def read_blocks(runner: ModelRunner, block_ids: list[int]) -> list[np.ndarray]:
    """Host copies of the blocks' KV: the leaves of runner.kv (K, V; values, scales and zeros for
    a quantized cache), each [L, n, BS, Hkv, D or groups]. Padding reads block 0 and is cut off."""
    n = len(block_ids)
    ids = np.zeros(transfer_bucket(n), np.int32)
    ids[:n] = block_ids
    out = _gather_blocks(runner.kv, runner.cfg.num_layers, jnp.asarray(ids))
    return [np.asarray(a)[:, :n] for a in jax.device_get(jax.tree.leaves(out))]


def write_blocks(runner: ModelRunner, block_ids: list[int], leaves: list[np.ndarray]) -> None:
    """Write host arrays laid out as read_blocks returns them into the blocks (in order)."""
    n = len(block_ids)
    b = transfer_bucket(n)
    ids = np.full(b, -1, np.int32)
    ids[:n] = block_ids
    padded = [np.concatenate([x, np.zeros((x.shape[0], b - n, *x.shape[2:]), x.dtype)], 1) if b > n else x
              for x in leaves]
    data = jax.tree.unflatten(jax.tree.structure(runner.kv), padded)
    runner.kv = _scatter_blocks(runner.kv, runner.cfg.num_layers, jnp.asarray(ids), data)
    if runner.mesh is not None:  # keep the step's cache sharding (a no-op when XLA kept it)
        runner.kv = jax.device_put(runner.kv, runner.kv_shardings)
