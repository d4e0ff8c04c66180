"""The host-RAM KV tier (--kv-offload-memory) on a long shared document, SmolLM2, one run.

RAG-style: every `doc` request is one shared document (`--doc-tokens` of runtime/corpus.py's words)
plus its own short question; between two of them an unrelated long prompt of the same length
(other traffic) needs the pool's blocks. The device pool (`--pool-tokens`) holds one such
request and a little more, so the other traffic evicts most of the document's cached blocks
each time: without a tier each doc request recomputes them, with one they come back from host
memory. Two engines built the same way but for `--kv-offload-memory`, the requests one at a
time, alternating engines per request so drift in the machine's speed hits both; TTFT is the
engine's own (first token time - arrival). The first doc request (cold) is left out. Tokens of
the two engines are compared. The CPU, its vector flags and the load average are printed.

    PYTHONPATH=. .venv/bin/python scripts/bench_kv_tier.py [--doc-tokens 2000] [--requests 8] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=str(ROOT / "checkpoints" / "smollm2-135m-instruct"))
    p.add_argument("--doc-tokens", type=int, default=2000)
    p.add_argument("--requests", type=int, default=8, help="doc requests (each followed by an unrelated prompt)")
    p.add_argument("--pool-tokens", type=int, default=None, help="device KV pool (default: doc + 25%%)")
    p.add_argument("--offload", default="1GiB", help="the tiered engine's --kv-offload-memory")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    import random

    from runtime.bench.machine import announce, engine_from_flags, loadavg_1m

    from runtime.corpus import WORDS
    from runtime.model.sampling import SamplingParams

    info = announce()
    pool_tokens = args.pool_tokens or int(args.doc_tokens * 1.25) + 256
    import tempfile

    disk = Path(tempfile.mkdtemp(prefix="pagedjax-kv-tier-"))

    def build_engine(extra: list[str]):
        return engine_from_flags(args.checkpoint, ["--max-model-len", str(args.doc_tokens + 256), "--max-num-seqs", "4",
                                                   *extra], num_blocks=-(-pool_tokens // 16))

    tiered = ["--kv-offload-memory", args.offload, "--kv-offload-dir", str(disk)]
    engines = {"no tier": build_engine([]), "host tier": build_engine(tiered)}
    tok = engines["no tier"].tokenizer
    def text(seed: int) -> list[int]:
        rng = random.Random(seed)
        return tok.encode(" ".join(rng.choice(WORDS) for _ in range(2 * args.doc_tokens)))[:args.doc_tokens]

    doc = text(0)
    others = [text(1 + i) for i in range(args.requests)]
    questions = [tok.encode(f"\n\nQuestion {i}: what is the main point of paragraph {i + 1}?") for i in range(args.requests)]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ttft: dict[str, list[float]] = {n: [] for n in engines}
    outs: dict[str, list[list[int]]] = {n: [] for n in engines}
    cached: dict[str, list[int]] = {n: [] for n in engines}
    for i in range(args.requests):
        for name, eng in engines.items():
            req = eng.add_request(doc + questions[i], sp)
            while eng.has_unfinished():
                eng.step()
            if i:  # (the first is cold on both)
                ttft[name].append(req.first_token_time - req.arrival_time)
                cached[name].append(req.num_cached_tokens)
            outs[name].append(req.output_ids)
            eng.generate([others[i]], sp)  # other traffic: evicts the document's blocks
    rows = []
    for name in engines:
        rows.append({"engine": name, "ttft_p50_s": statistics.median(ttft[name]), "ttft_mean_s": statistics.mean(ttft[name]),
                     "cached_tokens_p50": int(statistics.median(cached[name]))})
    ratio = rows[1]["ttft_p50_s"] / rows[0]["ttft_p50_s"]
    same = sum(a == b for a, b in zip(outs["no tier"], outs["host tier"]))
    # A restart: a fresh engine over the same directory (empty device pool and host tier)
    # against a fresh engine without tiers (a cold prefill); the first doc request of each.
    from runtime.core import kv_tiers

    kv_tiers.flush_to_disk(engines["host tier"])  # (a graceful stop writes what is still on the device)
    tier = engines.pop("host tier").host_tier
    restart: dict[str, float] = {}
    for name, extra in (("cold", []), ("disk tier", tiered)):
        eng = build_engine(extra)
        req = eng.add_request(doc + questions[0], sp)
        while eng.has_unfinished():
            eng.step()
        restart[name] = req.first_token_time - req.arrival_time
        outs.setdefault(name, []).append(req.output_ids)
        if name == "disk tier":
            restart_cached = req.num_cached_tokens
    load = loadavg_1m() or 0.0
    print("| engine | TTFT p50 s | TTFT mean s | cached prompt tokens (p50) |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['engine']} | {r['ttft_p50_s']:.3f} | {r['ttft_mean_s']:.3f} | {r['cached_tokens_p50']} |")
    print(f"host tier / no tier TTFT p50: {ratio:.2f}x; same tokens {same}/{args.requests}; tier held "
          f"{tier.bytes / 2**20:.1f} MiB in {len(tier.blocks)} blocks, {tier.promoted} blocks served back; load {load:.2f}")
    restart_same = outs["cold"][0] == outs["disk tier"][0] == outs["no tier"][0]
    print(f"after a restart: first doc request TTFT {restart['disk tier']:.3f} s from the disk tier ({restart_cached} "
          f"prompt tokens from disk) against {restart['cold']:.3f} s cold: {restart['disk tier'] / restart['cold']:.2f}x; "
          f"same tokens: {restart_same}")
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "doc_tokens": len(doc), "pool_tokens": pool_tokens,
                                         "requests": args.requests, "rows": rows, "ratio": ratio, "same": same,
                                         "promoted_blocks": tier.promoted, "tier_bytes": tier.bytes, "load": load,
                                         "restart": {**restart, "cached_tokens": restart_cached,
                                                     "ratio": restart["disk tier"] / restart["cold"],
                                                     "same": restart_same}},
                                        indent=1) + "\n")
    import shutil

    shutil.rmtree(disk, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
