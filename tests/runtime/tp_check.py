"""Tensor-parallel parity check, run in a subprocess by tests/runtime/test_tp.py (XLA_FLAGS
must force the host devices before jax starts):

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/runtime/tp_check.py CKPT TP [TP ...]

Builds an engine at TP 1 and at each TP given, runs the same greedy workloads (a shared
prefix for the prefix cache, a prompt longer than max_num_batched_tokens for chunked
prefill, a small KV pool in optimistic mode for preemption), and prints one JSON line per
TP with its tokens, logprobs and counters beside TP 1's; with --step-memory also the
compiled step's per-device temporaries beside one KV-cache shard (`step_memory`).

    ... tp_check.py CKPT TP [TP ...] --memory

only builds each engine over a large KV pool, generates a few tokens without warm-up (as
`pagedjax generate` does) and prints the step's memory, compilations and engine steps."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def engine(ckpt: Path, tp: int, *, num_blocks: int = 128, max_num_seqs: int = 4, max_num_batched_tokens: int = 32,
           warmup: bool = True, **policy):
    # One prefill shape (every chunk pads to the whole budget) and the decode shapes: the
    # warm-up compiles at each TP size dominate this check's time on a fresh cache.
    from runtime.config import AdmissionPolicy, CacheConfig, EngineConfig, SchedulerConfig
    from runtime.core.engine import LLMEngine

    envelope = SchedulerConfig(max_num_seqs, max_num_batched_tokens, 256, min_token_bucket=max_num_batched_tokens)
    pol = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
               long_prefill_token_threshold=max_num_batched_tokens)
    pol.update(policy)

    def build(model):
        return EngineConfig(model, CacheConfig(16, num_blocks, "float32", True), envelope, AdmissionPolicy(**pol),
                            "xla", "float32", quantization="auto", tensor_parallel_size=tp)

    build.tensor_parallel_size = tp  # restore straight into shards
    return LLMEngine.from_checkpoint(ckpt, build, warmup=warmup, progress=False)


def workload(eng, n_tokens: int, vocab: int, quick: bool) -> dict:
    from runtime.model.runner import compilations
    from runtime.model.sampling import SamplingParams

    rng = np.random.default_rng(0)
    top = min(vocab, 260)
    system = [int(t) for t in rng.integers(3, top, size=40)]
    prompts = [system + [int(t) for t in rng.integers(3, top, size=n)] for n in (3, 9)]
    if not quick:
        prompts.append([int(t) for t in rng.integers(3, top, size=90)])  # > max_num_batched_tokens: chunked
    params = SamplingParams(temperature=0.0, max_tokens=n_tokens, ignore_eos=True, logprobs=5)
    before = compilations()
    t0 = time.perf_counter()
    reqs = eng.generate(prompts[:1], params)  # first alone: its blocks become the others' prefix hits
    reqs += eng.generate(prompts[1:], params)
    out = dict(tokens=[r.output_ids for r in reqs],
               logprobs=[[lp for lp, _ in r.formatted_logprobs()] for r in reqs],
               top=[[[v for _, v in top5] for _, top5 in r.formatted_logprobs()] for r in reqs],
               prefix_hits=eng.scheduler.counters.prefix_hits)
    if not quick:
        # Preemption: the 16-block pool holds ~3 of these 6 requests at once.
        pressure = [[int(t) for t in rng.integers(3, top, size=int(rng.integers(30, 60)))] for _ in range(6)]
        p2 = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        out["pressure"] = [r.output_ids for r in eng.generate(pressure, p2)]
        out["preemptions"] = eng.scheduler.counters.preemptions
    out["seconds"] = round(time.perf_counter() - t0, 2)
    out["compilations_after_warmup"] = compilations() - before
    return out


def step_memory(eng) -> dict:
    """The engine's last launched step program, lowered and compiled again, by XLA's memory
    analysis: per-device temporaries beside the bytes of one KV-cache leaf's shard. The step
    donates the cache and writes each layer's rows in place, so its temporaries are
    activations, logits and sampling state: far below one shard. A cache copied inside the
    step shows up as temporaries of whole shards: with one KV head per device (SmolLM2 at
    TP 3) the KV write's flattening reshape once got a layout with the size-1 head axis
    major, and each shard was copied ~8 times per layer (~80 GB per device per decode step
    over the 2 GiB default pool) with the same tokens, step count and compilations."""
    import jax

    r = eng.runner
    compiled = r._step.lower(r.params, r.kv, r.penalty, r.last_input).compile()
    stats = compiled.memory_analysis()
    leaf = jax.tree.leaves(r.kv)[0]
    shard = math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
    return {"step_temp_bytes": int(stats.temp_size_in_bytes), "kv_shard_bytes": int(shard)}


def memory_check(ckpt: Path, tps: list[int], num_blocks: int, n_tokens: int = 4) -> None:
    """One short greedy generation per TP size without warm-up over a pool of `num_blocks`
    (large, so that one KV shard dwarfs the step's activations); prints the step memory, the
    step programs compiled and the engine steps taken."""
    import jax

    from runtime.model.runner import compilations
    from runtime.model.sampling import SamplingParams

    ref = None
    for tp in [1, *tps]:
        eng = engine(ckpt, tp, num_blocks=num_blocks, max_num_seqs=1, max_num_batched_tokens=16, warmup=False)
        params = SamplingParams(temperature=0.0, max_tokens=n_tokens, ignore_eos=True)
        before, steps = compilations(), 0
        req = eng.add_request([3 + (7 * i) % 250 for i in range(20)], params)  # 20 tokens: two prefill chunks
        while eng.has_unfinished():
            eng.step()
            steps += 1
        res = dict(tp=tp, devices=jax.device_count(), tokens=req.output_ids, steps=steps,
                   compilations=compilations() - before, **step_memory(eng))
        ref = ref or res
        res["same_tokens"] = res["tokens"] == ref["tokens"]
        print(json.dumps(res), flush=True)
        del eng


def main(argv: list[str]) -> None:
    import jax

    from runtime.cli import enable_compilation_cache

    enable_compilation_cache()
    flags = ("--quick", "--memory", "--step-memory")
    quick, memory, with_memory = (f in argv for f in flags)
    argv = [a for a in argv if a not in flags]
    # --pages=N: the pressure pool in pages (default 16: a page of every layer); a model with
    # sliding-window layers has smaller pages (a KV group's layers), so it needs more of them
    pages = [int(a.split("=", 1)[1]) for a in argv if a.startswith("--pages=")]
    argv = [a for a in argv if not a.startswith("--pages=")]
    ckpt, tps = Path(argv[0]), [int(a) for a in argv[1:]]
    if memory:
        memory_check(ckpt, tps, num_blocks=2048)
        return
    n_tokens = 8 if quick else 12
    results = {}
    for tp in [1, *tps]:
        t0 = time.perf_counter()
        # A pool of 16 blocks: the prefix-cache and chunked-prefill prompts fit; six 30-60
        # token prompts of 40 tokens each (~3 blocks' worth each) preempt (optimistic admission).
        # quick (SmolLM2): one sequence at a time in 16-token chunks: 2 step shapes compile; 128
        # blocks (of which it uses 8) make one KV shard (15.7 MB at TP 3) dwarf the step's
        # activations (4.7 MB) for --step-memory.
        eng = engine(ckpt, tp, max_num_batched_tokens=16 if quick else 32, num_blocks=128 if quick else (pages[0] if pages else 16),
                     max_num_seqs=1 if quick else 4, admission_mode="optimistic", watermark=0.0)
        built = time.perf_counter() - t0
        res = workload(eng, n_tokens, eng.config.model.vocab_size, quick)
        if with_memory:  # (after the workload's compilation count: it lowers the step again)
            res.update(step_memory(eng))
        shard = eng.runner.kv[0].sharding
        res.update(tp=tp, build_seconds=round(built, 2), devices=jax.device_count(),
                   kv_shard_shape=list(shard.shard_shape(eng.runner.kv[0].shape)),
                   kv_heads=eng.runner.cfg.num_kv_heads, quantization=eng.config.quantization,
                   lm_head_int8="head" in eng.runner.params)
        experts = eng.runner.params["layers"].get("experts_gate")
        if experts is not None:  # a mixture of experts: the experts each device holds
            res["expert_shard_shape"] = list(experts.w.sharding.shard_shape(experts.w.shape)) if tp > 1 else None
        results[tp] = res
        ref = results[1]
        if tp != 1:
            for key in ("logprobs", "top"):
                diffs = [abs(a - b) for x, y in zip(res[key], ref[key]) for u, v in zip(x, y)
                         for a, b in zip(u if isinstance(u, list) else [u], v if isinstance(v, list) else [v])]
                res[f"max_{key}_diff"] = max(diffs) if diffs else 0.0
            res["same_tokens"] = res["tokens"] == ref["tokens"] and res.get("pressure") == ref.get("pressure")
        print(json.dumps({k: v for k, v in res.items() if k not in ("logprobs", "top")}), flush=True)
        del eng


if __name__ == "__main__":
    main(sys.argv[1:])
