"""Decode-step inputs for the engine benchmarks (offline.py, breakdown.py, gpu_engine.py):
rows of requests that sit mid-decode, and an attention stand-in that reads no KV."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from runtime.model.xla_attention import write_kv
from runtime.model.attention_backend import AttentionBackend


@dataclass(frozen=True)
class NoAttention(AttentionBackend):
    """Writes the step's KV rows as the XLA path does and reads none: q stands in for
    attention's output (the breakdown's step without attention)."""
    name: ClassVar[str] = "none"

    def write_kv(self, cache, k, v, slots):
        return write_kv(*cache, k, v, slots)

    def attend(self, q, cache, inp, base, sm_scale, window=0, soft_cap=None):
        return q


_noop_attention = NoAttention()


def decode_rows(runner: Any, batch: int, context_len: int, shared_len: int = 0, drafts: int = 0) -> list:
    """`batch` requests that have computed all but their last token, as decode step rows. The
    first `shared_len` tokens (whole blocks) sit in the same blocks for all of them, as
    prefix-cache hits on one system prompt put them; the rest are each request's own.
    `drafts`: each row also carries that many proposals to verify (speculative decoding)."""
    from runtime.core.request import step_row
    from runtime.core.request import Request
    from runtime.model.sampling import SamplingParams

    bs = runner.cache_cfg.block_size
    shared_blocks = min(shared_len, context_len) // bs
    own = math.ceil((context_len + drafts) / bs) - shared_blocks
    # KV groups (runtime/kv_groups.py): each group gets its own pages, every block kept (a
    # sliding group's worst case, before anything slid out of its window)
    groups = runner.kv_groups.num_groups
    per_group = shared_blocks + batch * own
    if groups * per_group > runner.cache_cfg.num_blocks:
        raise ValueError(f"kv_cache_memory: {batch} sequences of {context_len} tokens need "
                         f"{groups * per_group} blocks, the cache has {runner.cache_cfg.num_blocks}")
    if batch > runner.sched.max_num_seqs:
        raise ValueError(f"max_num_seqs: batch {batch} exceeds the envelope ({runner.sched.max_num_seqs})")
    vocab = runner.cfg.vocab_size
    rows = []
    for i in range(batch):
        req = Request(f"decode-{i}", [3 + (13 * i + j) % (vocab - 3) for j in range(context_len)],
                      SamplingParams(temperature=0.0, max_tokens=16))
        start = shared_blocks + i * own
        table = list(range(shared_blocks)) + list(range(start, start + own))
        req.block_tables = [[b + g * per_group for b in table] for g in range(groups)]
        req.state_row, req.num_computed_tokens = i, context_len - 1
        req.spec_token_ids = [3 + (7 * i + j) % (vocab - 3) for j in range(drafts)]
        rows.append(step_row(req, 1 + drafts))
    return rows


def timed_steps(engine: Any, prompts: list[list[int]], params: Any, steps: int, warm_tokens: int = 2) -> list[float]:
    """Seconds of each of `steps` engine steps while every prompt decodes: the requests are
    added, stepped until each has `warm_tokens` output tokens (prefill done, decode under
    way), timed, then aborted and drained (scripts/bench_sampler.py, gpu_engine.py)."""
    import time

    reqs = [engine.add_request(p, params) for p in prompts]
    for _ in range(100_000):
        if all(r.num_output_tokens >= warm_tokens for r in reqs):
            break
        engine.step()
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
    for r in reqs:
        engine.abort(r.request_id)
    engine.run_until_done()
    return walls
