"""Owns the parameters and KV cache on the device and runs the one jitted step:
forward + KV write (slot mapping) + sampling, with the cache donated.

The KV cache of all layers is one array pair [L * num_blocks, block_size, Hkv, D]:
layer l's block b lives at row l * num_blocks + b, so the attention kernel sees a plain
paged cache and the layer scan carries the whole cache without slicing (no copies).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from runtime.attention import SharedPrefix, write_kv, xla_ragged_paged_attention
from runtime.batch import TOKEN_OUTPUT, TOKEN_PROMPT, StepInput, build_step_input
from runtime.config import CacheConfig, ModelConfig, SchedulerConfig
from runtime.models.llama import Params, forward_hidden, lm_head
from runtime.sampling import SampleOutput, sample

log = logging.getLogger(__name__)
NUM_LOGPROBS = 20  # always computed, so one program serves requests with and without logprobs
STEP_FN_NAME = "pagedjax_step"

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


def select_attention(backend: str) -> Callable[..., jax.Array]:
    if backend == "auto":
        backend = "pallas" if jax.default_backend() == "gpu" else "xla"
    if backend == "xla":
        return xla_ragged_paged_attention
    if backend == "pallas":
        from pallas_kernels.paged_attention import ragged_paged_attention

        if jax.default_backend() == "gpu":
            return ragged_paged_attention
        # No GPU: the same kernel runs in the Mosaic GPU interpreter (tests only: slow).
        log.warning("attention_backend=pallas without a GPU: using the Mosaic GPU interpreter")
        from pallas_kernels import _compat

        _compat.interpret_supports_transposed_wgmma()  # probe eagerly: it must not run inside a trace
        return partial(ragged_paged_attention, interpret=True)
    raise ValueError(f"attention_backend: must be auto, xla or pallas, got {backend!r}")


def _step(cfg: ModelConfig, attention: Callable, num_blocks: int, params: Params, kv: tuple,
          penalty: tuple, inp: StepInput) -> tuple[tuple, tuple, SampleOutput]:
    counts, prompt_mask = penalty
    scratch = counts.shape[0] - 1
    # Penalty state: clear rows taken by new requests, then record this step's input tokens.
    # Scatter only the reset rows (a where over the whole [rows, vocab] state would read and
    # write all of it every step: ~3 ms of a 30 ms batch-1 step for SmolLM2).
    reset_at = jnp.where(inp.reset_rows, inp.state_rows, counts.shape[0])
    counts = counts.at[reset_at].set(0, mode="drop")
    prompt_mask = prompt_mask.at[reset_at].set(False, mode="drop")
    prompt_rows = jnp.where(inp.token_kind == TOKEN_PROMPT, inp.token_row, scratch)
    prompt_mask = prompt_mask.at[prompt_rows, inp.token_ids].set(True)
    out_rows = jnp.where(inp.token_kind == TOKEN_OUTPUT, inp.token_row, scratch)
    counts = counts.at[out_rows, inp.token_ids].add(1)

    bs = kv[0].shape[1]
    sm_scale = 1.0 / math.sqrt(cfg.head_dim)

    def paged_attention(q, k, v, layer, cache):
        k_cache, v_cache = cache
        slots = jnp.where(inp.slot_mapping >= 0, inp.slot_mapping + layer * num_blocks * bs, -1)
        k_cache, v_cache = write_kv(k_cache, v_cache, k, v, slots)
        base = layer * num_blocks
        kw = {}
        if attention is xla_ragged_paged_attention:  # the Pallas kernel reads shared blocks per sequence
            sh = inp.shared
            kw["shared"] = SharedPrefix(sh.blocks + base, sh.length, sh.suffix_start, sh.suffix_tables + base)
        out = attention(q, k_cache, v_cache, inp.kv_lens, inp.block_tables + base,
                        inp.query_start_loc, inp.num_seqs, sm_scale=sm_scale, **kw)
        return out, (k_cache, v_cache)

    hidden, kv = forward_hidden(cfg, params, inp.token_ids, inp.positions, paged_attention, kv)
    logits = lm_head(cfg, params, hidden[inp.logits_indices])
    out = sample(logits, inp.sampling, counts[inp.state_rows], prompt_mask[inp.state_rows],
                 num_logprobs=NUM_LOGPROBS)
    kept_rows = jnp.where(inp.sample_mask, inp.state_rows, scratch)
    counts = counts.at[kept_rows, out.token_ids].add(1)
    return kv, (counts, prompt_mask), out


class ModelRunner:
    def __init__(self, cfg: ModelConfig, params: Params, cache: CacheConfig, sched: SchedulerConfig,
                 attention_backend: str = "auto", dtype: Any = jnp.float32):
        self.cfg, self.cache_cfg, self.sched = cfg, cache, sched
        if jax.default_backend() == "cpu":
            tune_cpu_allocator()
        self.params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, dtype), params)
        self.max_blocks_per_seq = -(-sched.max_model_len // cache.block_size)
        kv_dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}.get(cache.kv_dtype, jnp.float32)
        shape = (cfg.num_layers * cache.num_blocks, cache.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv = (jnp.zeros(shape, kv_dtype), jnp.zeros(shape, kv_dtype))
        rows = sched.max_num_seqs + 1  # last row is scratch for padding
        self.penalty = (jnp.zeros((rows, cfg.vocab_size), jnp.int32), jnp.zeros((rows, cfg.vocab_size), bool))
        self.scratch_row = rows - 1
        self.attention_backend = attention_backend
        fn = partial(_step, cfg, select_attention(attention_backend), cache.num_blocks)
        fn.__name__ = STEP_FN_NAME  # type: ignore[attr-defined]
        self._step = jax.jit(fn, donate_argnums=(1, 2))
        self.fail_next_step: Exception | None = None  # test hook: the next step raises this

    def recover(self) -> bool:
        """After a failed step the donated cache may be gone: rebuild it empty. Returns
        True when KV contents were lost (the caller drops cached prefixes and recomputes)."""
        arrays = (*self.kv, *self.penalty)
        if not any(a.is_deleted() for a in arrays):
            return False
        self.kv = tuple(jnp.zeros(a.shape, a.dtype) for a in self.kv)
        self.penalty = tuple(jnp.zeros(a.shape, a.dtype) for a in self.penalty)
        return True

    def kv_cache_bytes(self) -> int:
        return 2 * self.kv[0].size * self.kv[0].dtype.itemsize

    def run(self, seqs: list, num_seqs_bucket: int, num_tokens_bucket: int) -> dict[str, np.ndarray]:
        inp = build_step_input(seqs, num_seqs_bucket, num_tokens_bucket, self.max_blocks_per_seq,
                               self.cache_cfg.block_size, self.scratch_row)
        if self.fail_next_step is not None:
            exc, self.fail_next_step = self.fail_next_step, None
            raise exc
        self.kv, self.penalty, out = self._step(self.params, self.kv, self.penalty, inp)
        host = jax.device_get(out)
        n = len(seqs)
        return {"token_ids": np.asarray(host.token_ids)[:n], "logprobs": np.asarray(host.logprobs)[:n],
                "top_ids": np.asarray(host.top_ids)[:n], "top_logprobs": np.asarray(host.top_logprobs)[:n]}

    def warmup(self, progress: bool = True) -> float:
        """Compile every (seqs, tokens) bucket once with dummy inputs written to block 0."""
        from runtime.batch import ScheduledSeq
        from runtime.sampling import SamplingParams, SamplingRow

        t0 = time.perf_counter()
        pairs = self.sched.bucket_pairs()
        row = SamplingRow(SamplingParams(temperature=0.0), 0)
        for s, t in tqdm(pairs, desc="compiling buckets", unit="shape", disable=not progress):
            per = [t // s] * s
            per[-1] += t - sum(per)
            seqs = [ScheduledSeq([0] * n, 0, [0] * -(-n // self.cache_cfg.block_size), 0, self.scratch_row,
                                 False, False, row) for n in per]
            self.run(seqs, s, t)
        return time.perf_counter() - t0
