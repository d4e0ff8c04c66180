"""Swap preemption against recompute on a preemption-heavy batch workload, SmolLM2, one run.

`--requests` batch-tier requests, each a `--prompt-tokens` prompt of its own (runtime/corpus.py's
words, no shared prefix) and `--max-tokens` greedy tokens, all queued at once on an engine whose
device pool holds about a third of what they grow to: optimistic admission takes them in on
their prompts and decode growth then preempts. Three engines alike but for the preemption
policy: recompute without a host tier (today's default), recompute with a host tier
(`--kv-offload-memory 1GiB --preemption-mode recompute`: evicted prefix blocks come back from
host memory as prefix hits), and swap (`--preemption-mode auto`). Each run is timed whole; the
runs alternate over `--rounds`. Reported per engine: preemptions, swaps, the prefill tokens
computed a second time (scheduler counter `recomputed_tokens`), wall time, and whether every
request's tokens equal the first engine's. The CPU, its vector flags and the load are printed.

    PYTHONPATH=. .venv/bin/python scripts/bench_swap.py [--requests 24] [--json bench-results/swap.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ENGINES = {"recompute": [], "recompute + host tier": ["--kv-offload-memory", "1GiB", "--preemption-mode", "recompute"],
           "swap": ["--kv-offload-memory", "1GiB", "--preemption-mode", "auto"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=str(ROOT / "checkpoints" / "smollm2-135m-instruct"))
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--pool-share", type=float, default=0.3, help="device pool / what all requests grow to")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    from runtime.bench.machine import announce, engine_from_flags, loadavg_1m
    from runtime.corpus import WORDS
    from runtime.model.sampling import SamplingParams

    info = announce()
    per_request = args.prompt_tokens + args.max_tokens
    pool_blocks = int(args.requests * -(-per_request // 16) * args.pool_share)

    def build_engine(extra: list[str]):
        return engine_from_flags(args.checkpoint, ["--max-model-len", str(per_request + 16), "--max-num-seqs",
                                                   str(args.requests), "--max-num-batched-tokens", "512", *extra],
                                 num_blocks=pool_blocks)

    engines = {name: build_engine(extra) for name, extra in ENGINES.items()}
    tok = next(iter(engines.values())).tokenizer

    def text(seed: int) -> list[int]:
        rng = random.Random(seed)
        return tok.encode(" ".join(rng.choice(WORDS) for _ in range(2 * args.prompt_tokens)))[:args.prompt_tokens]

    prompts = [text(i) for i in range(args.requests)]
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for eng in engines.values():  # warm-up: compile every step shape the workload meets
        eng.generate(prompts[:2], sp)
    walls: dict[str, list[float]] = {n: [] for n in engines}
    counts: dict[str, dict] = {}
    outs: dict[str, list[list[int]]] = {}
    for _ in range(args.rounds):
        for name, eng in engines.items():
            c = eng.scheduler.counters
            before = (c.preemptions, c.swapped_out, c.recomputed_tokens)
            t0 = time.perf_counter()
            reqs = eng.generate(prompts, sp, priority="batch")
            walls[name].append(time.perf_counter() - t0)
            now = (c.preemptions, c.swapped_out, c.recomputed_tokens)
            counts[name] = dict(zip(("preemptions", "swaps", "recomputed_tokens"),
                                    (a - b for a, b in zip(now, before))))
            outs[name] = [r.output_ids for r in reqs]
            eng.pool.check_invariants()
            assert eng.pool.num_used_blocks == 0
    base = outs["recompute"]
    rows = [{"engine": n, **counts[n], "wall_s": statistics.median(walls[n]),
             "same": sum(a == b for a, b in zip(outs[n], base)),
             "swap_declined": dict(eng.swap_space.declined) if eng.swap_space is not None else {}}
            for n, eng in engines.items()]
    load = loadavg_1m() or 0.0
    print(f"{args.requests} batch requests x ({args.prompt_tokens} prompt + {args.max_tokens} output tokens), "
          f"device pool {pool_blocks} blocks of 16; medians over {args.rounds} alternating rounds; load {load:.2f}")
    print("| engine | preemptions | swaps | prefill tokens recomputed | wall s | same tokens |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['engine']} | {r['preemptions']} | {r['swaps']} | {r['recomputed_tokens']:,} | {r['wall_s']:.2f} | "
              f"{r['same']}/{args.requests} |")
    waste = {r["engine"]: r["recomputed_tokens"] for r in rows}
    cut = 1 - waste["swap"] / waste["recompute"] if waste["recompute"] else 0.0
    print(f"swap recomputes {cut:.1%} fewer prefill tokens than recompute (goal: at least 80% fewer)")
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "requests": args.requests, "prompt_tokens": args.prompt_tokens,
                                         "max_tokens": args.max_tokens, "pool_blocks": pool_blocks,
                                         "rounds": args.rounds, "rows": rows, "cut": cut, "load": load,
                                         "measured_at": time.strftime("%Y-%m-%d %H:%M", time.gmtime())},
                                        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
