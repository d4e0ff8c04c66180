"""The sampler's share of a decode step on a large vocabulary (Gemma 3 270M: 262,144 tokens).

Two measurements, both in one process on this machine:

1. the engine's decode step (batch S, every row decoding) with greedy rows, with sampled rows
   (Gemma 3's own generation config: temperature 1, top_k 64, top_p 0.95) and with sampled
   rows plus repetition/frequency penalties; the difference to greedy is what sampling adds;
2. `sample()` alone, jitted, on [S, V] logits with the same parameters (greedy includes the
   argmax over the vocabulary, which every step pays).

Rounds alternate between the settings so drift in the machine's speed hits each alike; the
CPU model, its vector flags and the load average are printed beside the numbers.

    .venv/bin/python scripts/bench_sampler.py [--checkpoint checkpoints/gemma-3-270m] [--batch 1 8 32]
        [--out bench-results/sampler-gemma3.json]     (BENCHMARKS.md renders it)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=1.0, top_k=64, top_p=0.95),
    "sampled+penalties": dict(temperature=1.0, top_k=64, top_p=0.95, repetition_penalty=1.1,
                              frequency_penalty=0.2),
}


def decode_step_ms(engine, batch: int, params, steps: int) -> float:
    """Median wall time of one engine step while `batch` requests all decode."""
    from runtime.bench.step_rows import timed_steps

    prompts = [[2] + [1000 + 17 * i + j for j in range(31)] for i in range(batch)]
    return statistics.median(timed_steps(engine, prompts, params, steps)) * 1e3


def sampler_ms(vocab: int, batch: int, params, reps: int) -> float:
    import jax
    import numpy as np

    from runtime.model.runner import NUM_LOGPROBS
    from runtime.model.sampling import SamplingRow, make_sampling_inputs, penalties_on, sample

    inputs = make_sampling_inputs([SamplingRow(params.with_seed(np.random.default_rng(0)))] * batch, batch)
    logits = jax.random.normal(jax.random.key(0), (batch, vocab)) * 4
    counts = jax.numpy.zeros((batch, vocab), jax.numpy.int32)
    mask = jax.numpy.zeros((batch, vocab), bool)
    # As the runner calls it: the [S, V] penalty state only when some row uses penalties.
    fn = jax.jit(lambda lg, inp, c, m: jax.lax.cond(
        penalties_on(inp), lambda: sample(lg, inp, c, m, num_logprobs=NUM_LOGPROBS, only_if_asked=True),
        lambda: sample(lg, inp, None, None, num_logprobs=NUM_LOGPROBS, only_if_asked=True)).token_ids)
    fn(logits, inputs, counts, mask).block_until_ready()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(logits, inputs, counts, mask).block_until_ready()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, default=ROOT / "checkpoints" / "gemma-3-270m")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=24, help="timed decode steps per setting and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, help="write the table as JSON (BENCHMARKS.md's sampler section)")
    args = ap.parse_args()
    if not (args.checkpoint / "config.json").is_file():
        sys.exit(f"bench_sampler: no checkpoint at {args.checkpoint} (run pagedjax pull gemma3-270m)")

    from runtime.bench.machine import loadavg_1m, machine_info
    from runtime.config import AdmissionPolicy, CacheConfig, EngineConfig, KernelConfig, SchedulerConfig
    from runtime.core.engine import LLMEngine
    from runtime.model.sampling import SamplingParams

    info = machine_info()
    info["loadavg_1m_start"] = loadavg_1m()
    print(f"machine: {info['cpu_model']}, {info['cores']} cores, jax {info.get('jax')}; "
          f"load avg 1m at start {loadavg_1m()}")
    top = max(args.batch)

    def build(model):
        return EngineConfig(model, CacheConfig(16, 200 * top + 256, "float32", True), SchedulerConfig(top, 256, 512),
                            AdmissionPolicy(max_num_seqs=top, max_num_batched_tokens=256,
                                            long_prefill_token_threshold=256),
                            "xla", "float32", kernels=KernelConfig())

    engine = LLMEngine.from_checkpoint(args.checkpoint, build, warmup=True, progress=False)
    vocab = engine.config.model.vocab_size
    print(f"model: {args.checkpoint.name}, vocabulary {vocab:,}")
    params = {name: SamplingParams(max_tokens=400, ignore_eos=True, **kw) for name, kw in SETTINGS.items()}
    for name, p in params.items():  # compile every setting's path before timing any
        decode_step_ms(engine, top, p, 2)

    step: dict[tuple[str, int], list[float]] = {}
    alone: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for b in args.batch:
            for name, p in params.items():
                step.setdefault((name, b), []).append(decode_step_ms(engine, b, p, args.steps))
                alone.setdefault((name, b), []).append(sampler_ms(vocab, b, p, args.steps))

    print(f"load avg 1m at end {loadavg_1m()}; medians over {args.rounds} alternating rounds")
    rows = [{"batch": b, "setting": name, "step_ms": statistics.median(step[(name, b)]),
             "sample_ms": statistics.median(alone[(name, b)]),
             "greedy_step_ms": statistics.median(step[("greedy", b)])} for b in args.batch for name in params]
    for line in table(rows):
        print(line)
    if args.out:
        info.update(loadavg_1m_end=loadavg_1m(), measured_at=time.strftime("%Y-%m-%d %H:%M", time.gmtime()))
        args.out.write_text(json.dumps({"kind": "sampler", "machine": info, "checkpoint": args.checkpoint.name,
                                        "vocab_size": vocab, "rounds": args.rounds, "steps": args.steps,
                                        "settings": SETTINGS, "rows": rows}, indent=2))
        print(f"wrote {args.out}")
    return 0


def table(rows: list[dict]) -> list[str]:
    """The markdown table of `rows` (what main prints and BENCHMARKS.md shows)."""
    out = ["| batch | setting | decode step ms | sample() alone ms | sample() / step | step vs greedy |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['batch']} | {r['setting']} | {r['step_ms']:.1f} | {r['sample_ms']:.2f} | "
                   f"{r['sample_ms'] / r['step_ms']:.1%} | {r['step_ms'] / r['greedy_step_ms']:.2f}x |")
    return out


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    raise SystemExit(main())
