"""Where a long prefill's time goes: one prompt's chunks, each timed with the engine's own step
and with an attention stand-in that reads no KV (runtime/bench/step_rows.py NoAttention, as the
decode breakdown does), so attention = step - stand-in and the rest is projections, norms, the
LM head and the step's fixed cost. SmolLM2, one process, rounds alternating.

For a prompt of N tokens computed in chunks of C (the engine's token budget), chunk i starts at
i*C and attends to everything before it: the table gives each chunk's times and their sums, and
the sums are the prompt's prefill time and its attention share. The CPU, its flags and the load
are printed beside the numbers.

    PYTHONPATH=. .venv/bin/python scripts/bench_prefill_profile.py [--tokens 4096 8192] [--chunk 512]
        [--json bench-results/prefill_profile.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=str(ROOT / "checkpoints" / "smollm2-135m-instruct"))
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    import jax

    from runtime.bench.machine import announce, engine_from_flags, loadavg_1m
    from runtime.bench.step_rows import _noop_attention
    from runtime.core.request import Request, step_row
    from runtime.model.batch import build_step_input
    from runtime.model.runner import _step
    from runtime.model.sampling import SamplingParams

    info = announce()
    top = max(args.tokens)
    eng = engine_from_flags(args.checkpoint, ["--max-model-len", str(top), "--max-num-batched-tokens", str(args.chunk),
                                              "--max-num-seqs", "4", "--kv-cache-memory", "1GiB"])
    runner, cfg = eng.runner, eng.runner.cfg
    bs, vocab = runner.cache_cfg.block_size, cfg.vocab_size
    noop = jax.jit(partial(_step, cfg, _noop_attention, runner.cache_cfg.num_blocks, None), donate_argnums=(1, 2))
    state = {"kv": runner.kv, "rows": runner.penalty}

    def chunk_input(start: int):
        req = Request("profile", [3 + (7 * j) % (vocab - 3) for j in range(top)], SamplingParams(temperature=0.0))
        req.block_tables = [list(range(-(-(start + args.chunk) // bs)))]
        req.state_row, req.num_computed_tokens = 0, start
        seq = step_row(req, args.chunk)
        return jax.device_put(build_step_input([seq], 1, args.chunk, runner.max_blocks_per_seq, bs,
                                               runner.scratch_row, runner.masks.all_allowed(1)))

    def timed(fn, inp) -> float:
        def go():
            state["kv"], state["rows"], out, *_ = fn(runner.params, state["kv"], state["rows"], inp)
            jax.block_until_ready(out.token_ids)
        go()
        ts = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            go()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    starts = list(range(0, top, args.chunk))
    full: dict[int, list[float]] = {s: [] for s in starts}
    stand_in: dict[int, list[float]] = {s: [] for s in starts}
    try:
        for _ in range(2):
            for s in starts:
                inp = chunk_input(s)
                full[s].append(timed(runner._step, inp))
                stand_in[s].append(timed(noop, inp))
    finally:
        runner.kv, runner.penalty = state["kv"], state["rows"]
    load = loadavg_1m() or 0.0
    chunks = [{"start": s, "step_ms": min(full[s]) * 1e3, "no_attention_ms": min(stand_in[s]) * 1e3} for s in starts]
    prompts = []
    for n in args.tokens:
        cs = [c for c in chunks if c["start"] < n]
        total = sum(c["step_ms"] for c in cs)
        attn = sum(max(0.0, c["step_ms"] - c["no_attention_ms"]) for c in cs)
        prompts.append({"tokens": n, "chunks": len(cs), "prefill_ms": total, "attention_ms": attn,
                        "attention_share": attn / total})
    print(f"chunks of {args.chunk} tokens, best of 2 rounds of median-of-{args.iters}; load {load:.2f} at the end")
    print("| chunk start | step ms | without attention ms | attention ms |")
    print("|---|---|---|---|")
    for c in chunks:
        print(f"| {c['start']} | {c['step_ms']:.1f} | {c['no_attention_ms']:.1f} | "
              f"{max(0.0, c['step_ms'] - c['no_attention_ms']):.1f} |")
    for r in prompts:
        print(f"{r['tokens']}-token prompt: {r['chunks']} chunks, prefill {r['prefill_ms'] / 1e3:.2f} s, attention "
              f"{r['attention_ms'] / 1e3:.2f} s ({r['attention_share']:.0%})")
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "chunk": args.chunk, "chunks": chunks, "prompts": prompts,
                                         "load": load, "measured_at": time.strftime("%Y-%m-%d %H:%M", time.gmtime())},
                                        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
