"""Tensor-parallel parity check, run in a subprocess by tests/runtime/test_tp.py (XLA_FLAGS
must force the host devices before jax starts):

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/runtime/tp_check.py CKPT TP [TP ...]

Builds an engine at TP 1 and at each TP given, runs the same greedy workloads (a shared
prefix for the prefix cache, a prompt longer than max_num_batched_tokens for chunked
prefill, a small KV pool in optimistic mode for preemption), and prints one JSON line per
TP with its tokens, logprobs and counters beside TP 1's."""

from __future__ import annotations

import json
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
    from runtime.engine import LLMEngine

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
    from runtime.model_runner import compilations
    from runtime.sampling import SamplingParams

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


def main(argv: list[str]) -> None:
    import jax

    from runtime.cli import enable_compilation_cache

    enable_compilation_cache()
    quick = "--quick" in argv
    argv = [a for a in argv if a != "--quick"]
    ckpt, tps = Path(argv[0]), [int(a) for a in argv[1:]]
    n_tokens = 8 if quick else 12
    results = {}
    for tp in [1, *tps]:
        t0 = time.perf_counter()
        # A pool of 16 blocks: the prefix-cache and chunked-prefill prompts fit; six 30-60
        # token prompts of 40 tokens each (~3 blocks' worth each) preempt (optimistic admission).
        # quick (SmolLM2): one sequence at a time in 16-token chunks: 2 step shapes compile.
        eng = engine(ckpt, tp, max_num_batched_tokens=16 if quick else 32, num_blocks=64 if quick else 16,
                     max_num_seqs=1 if quick else 4, admission_mode="optimistic", watermark=0.0)
        built = time.perf_counter() - t0
        res = workload(eng, n_tokens, eng.config.model.vocab_size, quick)
        shard = eng.runner.kv[0].sharding
        res.update(tp=tp, build_seconds=round(built, 2), devices=jax.device_count(),
                   kv_shard_shape=list(shard.shard_shape(eng.runner.kv[0].shape)),
                   kv_heads=eng.runner.cfg.num_kv_heads, quantization=eng.config.quantization,
                   lm_head_int8="head" in eng.runner.params)
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
