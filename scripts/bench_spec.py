"""Speculative decoding (n-gram prompt lookup) against plain decoding on SmolLM2, one run.

Two workloads of greedy chats: `copy` (rewrite or extract: the answer repeats the prompt)
and `chat` (open questions: little to look up). Each at batch 1, 8 and 64 (the batch is
that many requests at once, the prompts cycled), through two engines built the same way
but for `--speculative-config` (one engine per config given); tokens/s counts generated
tokens over the wall time from the first request added to the last finished (a batch
smaller than the prompt set runs the prompts in groups, one after another), ITL is each request's (last - first token
time) / (tokens - 1), averaged. The engines alternate per row so drift in the machine's
speed hits all; each row is the median of `--rounds` runs; the CPU, its vector flags and the load average are printed beside.

    PYTHONPATH=. .venv/bin/python scripts/bench_spec.py [--batches 1 8 64] [--max-tokens 128] \
        [--speculative-config JSON [JSON ...]] [--rounds 2]
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

PARAGRAPH = ("Teh quick brwon fox jumpd over the lazy dog near the rivr bank. Afterwards it ran "
             "back to it's den, where its freinds were waiting with some bread and cheeze.")
DATES_TEXT = ("The museum opened on 12 March 1998 and closed for repairs on 3 June 2004. It reopened "
              "on 21 September 2006, and the new wing followed on 8 January 2015.")
COPY = [f"Rewrite this paragraph with the typos fixed:\n\n{PARAGRAPH}",
        f"Extract every date from this text, one per line:\n\n{DATES_TEXT}",
        f"Repeat this text exactly, then say how many sentences it has:\n\n{PARAGRAPH}",
        f"Copy this sentence in capital letters: {DATES_TEXT}"]
CHAT = ["What are three good habits for learning a new language?", "Explain why the sky is blue.",
        "Give me a short recipe for a vegetable soup.", "What is the difference between weather and climate?"]


def run(engine, groups, max_tokens: int) -> dict:
    """Each group of prompts at once, the groups one after another (batch 1 runs every prompt)."""
    from runtime.model.sampling import SamplingParams

    p = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    t0 = time.perf_counter()
    reqs = [r for g in groups for r in engine.generate(g, p)]
    dt = time.perf_counter() - t0
    toks = sum(len(r.output_ids) for r in reqs)
    itl = [(r.last_token_time - r.first_token_time) / (len(r.output_ids) - 1) for r in reqs if len(r.output_ids) > 1]
    return {"tok_s": toks / dt, "itl_ms": 1e3 * statistics.mean(itl), "tokens": toks,
            "proposed": sum(r.spec.proposed for r in reqs), "accepted": sum(r.spec.accepted for r in reqs),
            "outputs": [r.output_ids for r in reqs]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default=str(ROOT / "checkpoints" / "smollm2-135m-instruct"))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--speculative-config", nargs="+", default=['{"method": "ngram"}'],
                    help="one engine per config, each against the plain engine")
    ap.add_argument("--rounds", type=int, default=2, help="runs per row and engine (alternating); the median counts")
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args(argv)

    from runtime.bench.machine import machine_info
    from runtime.cli import enable_compilation_cache
    from runtime.core.engine import LLMEngine
    from runtime.core.engine_args import add_engine_arguments, engine_config_from_args

    enable_compilation_cache()
    info = machine_info()
    print(f"# {info['cpu_model']}, {info['cores']} cores, jax {info.get('jax')}; load average "
          f"{os.getloadavg()[0]:.2f} at start", flush=True)
    engines = {}
    from runtime.config import SpeculativeConfig

    def label(text: str) -> str:
        c = SpeculativeConfig.parse(text)
        return f"{c.method} k={c.num_speculative_tokens}, off from {c.disable_by_batch_size}"

    variants = [("plain", [])] + [(label(c), ["--speculative-config", c]) for c in args.speculative_config]
    for name, extra in variants:
        p = argparse.ArgumentParser()
        add_engine_arguments(p)
        ns = p.parse_args(["--max-model-len", "2048", *extra])
        engines[name] = LLMEngine.from_checkpoint(Path(args.checkpoint), engine_config_from_args(ns), progress=False)
    tok = engines["plain"].tokenizer
    sets = {w: [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in qs]
            for w, qs in (("copy", COPY), ("chat", CHAT))}
    rows = []
    names = [n for n, _ in variants[1:]]
    print("| workload | batch | proposer | plain tok/s | spec tok/s | ratio | plain ITL ms | spec ITL ms | kept / proposed "
          "| same tokens | load |", flush=True)
    print("|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for w, prompts in sets.items():
        for b in args.batches:
            batch = [prompts[i % len(prompts)] for i in range(max(b, len(prompts)))]
            groups = [batch[i:i + b] for i in range(0, len(batch), b)]
            runs: dict[str, list[dict]] = {n: [] for n, _ in variants}
            for _ in range(args.rounds):
                for name, e in engines.items():
                    runs[name].append(run(e, groups, args.max_tokens))
            med = {n: sorted(rs, key=lambda r: r["tok_s"])[len(rs) // 2] for n, rs in runs.items()}
            a = med["plain"]
            for n in names:
                s = med[n]
                same = sum(x == y for x, y in zip(a["outputs"], s["outputs"]))
                row = dict(workload=w, batch=b, proposer=n, plain_tok_s=a["tok_s"], spec_tok_s=s["tok_s"],
                           ratio=s["tok_s"] / a["tok_s"], plain_itl_ms=a["itl_ms"], spec_itl_ms=s["itl_ms"],
                           proposed=s["proposed"], accepted=s["accepted"], same=f"{same}/{len(batch)}",
                           load=os.getloadavg()[0])
                rows.append(row)
                print(f"| {w} | {b} | {n} | {a['tok_s']:.1f} | {s['tok_s']:.1f} | {row['ratio']:.2f}x | "
                      f"{a['itl_ms']:.1f} | {s['itl_ms']:.1f} | {s['accepted']} / {s['proposed']} | {row['same']} | "
                      f"{row['load']:.2f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "max_tokens": args.max_tokens, "rounds": args.rounds,
                                               "configs": args.speculative_config,
                                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
