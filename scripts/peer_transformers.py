#!/usr/bin/env python
"""Peer comparison: the offline shared-prefix workload through Hugging Face transformers.

The same chat requests as `pagedjax bench offline --part throughput` (SYSTEM_PROMPT plus
short user messages, rendered with the checkpoint's chat template and tokenized by
pagedjax, so both sides see identical prompt token ids), greedy, the same number of
output tokens per request, on the same model: transformers loads the GGUF that
`pagedjax pull` converts (`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`,
dequantized to float32). Served the way a transformers user would: static batches,
left padding, `model.generate`. Prints output tokens/s per batch size and the ratio to
pagedjax's number from the offline JSON.

The transformers side is optional: `pip install -e .[peer]`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default=None, help="pagedjax checkpoint (tokenizer + chat template)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--batch-sizes", default="8,16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--offline-json", default="bench-results/offline.json",
                   help="pagedjax's offline results (for the ratio)")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="per batch size: stop starting new batches after this long and report the "
                        "requests served so far (whole batches; the requests are alike)")
    p.add_argument("--out", default=None, help="write results as JSON")
    args = p.parse_args(argv)

    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError:
        print("peer_transformers: transformers/torch are not installed (pip install -e .[peer])", file=sys.stderr)
        return 2

    from runtime.bench.offline import shared_prefix_prompts
    from runtime.bench.report import write_json
    from runtime.checkpoint.pull import KNOWN_MODELS, default_checkpoint, fetch_gguf
    from runtime.checkpoint.store import load_config
    from runtime.tokenizer import TextTokenizer

    ckpt = Path(args.checkpoint) if args.checkpoint else ROOT / default_checkpoint()
    if not (ckpt / "config.json").is_file():
        print(f"peer_transformers: no checkpoint at {ckpt} (run `pagedjax pull`)", file=sys.stderr)
        return 2
    offline = None
    if args.offline_json and Path(args.offline_json).is_file():
        offline = json.loads(Path(args.offline_json).read_text()).get("throughput")
        if offline and (offline["num_requests"], offline["max_tokens"]) != (args.num_requests, args.max_tokens):
            print(f"peer_transformers: warning: pagedjax ran {offline['num_requests']} requests x "
                  f"{offline['max_tokens']} tokens, this run {args.num_requests} x {args.max_tokens}", file=sys.stderr)

    cfg = load_config(ckpt)
    tok = TextTokenizer.from_checkpoint(ckpt, cfg.bos_token_id, cfg.eos_token_ids, cfg.add_bos_token)
    prompts = shared_prefix_prompts(tok, args.num_requests, args.seed)
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else cfg.eos_token_ids[0]

    gguf = fetch_gguf(KNOWN_MODELS["smollm2"], progress=False)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.eval()
    load_s = time.perf_counter() - t0
    print(f"transformers {transformers.__version__}, torch {torch.__version__} ({torch.get_num_threads()} threads): "
          f"loaded {gguf.name} as float32 in {load_s:.1f} s", flush=True)

    def run_batch(batch: list[list[int]]) -> int:
        width = max(map(len, batch))
        ids = torch.tensor([[pad_id] * (width - len(x)) + x for x in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in batch])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.max_tokens,
                                 min_new_tokens=args.max_tokens, do_sample=False, pad_token_id=pad_id)
        return int((out.shape[1] - width) * len(batch))

    run_batch(prompts[:2])  # warm-up, not timed
    results = []
    for bs in (int(x) for x in args.batch_sizes.split(",")):
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        tokens = served = 0
        for i in range(0, len(prompts), bs):
            if args.time_budget is not None and served and time.perf_counter() - t0 > args.time_budget:
                break
            tokens += run_batch(prompts[i:i + bs])
            served += len(prompts[i:i + bs])
        dt = time.perf_counter() - t0
        row = {"batch_size": bs, "num_requests": served, "output_tokens": tokens, "seconds": dt,
               "output_tokens_per_s": tokens / dt, "loadavg_1m": load}
        if offline:
            row["pagedjax_ratio"] = offline["output_tokens_per_s"] / row["output_tokens_per_s"]
        results.append(row)
        print(f"  static batches of {bs:>3}: {served} requests, {tokens:,} tokens in {dt:.1f} s = "
              f"{tokens / dt:,.1f} output tok/s"
              + (f"  (pagedjax {offline['output_tokens_per_s']:,.1f} tok/s = {row['pagedjax_ratio']:.2f}x)"
                 if offline else ""), flush=True)
    if not offline:
        print("  (no pagedjax offline results to compare with: run `pagedjax bench offline --part throughput "
              "--out bench-results/offline.json`)")
    data = {"kind": "peer", "transformers_version": transformers.__version__, "torch_version": torch.__version__,
            "torch_threads": torch.get_num_threads(), "gguf": gguf.name, "dtype": "float32",
            "num_requests": args.num_requests, "max_tokens": args.max_tokens, "load_s": load_s,
            "cpu_count": os.cpu_count(), "batches": results,
            "pagedjax_output_tokens_per_s": offline["output_tokens_per_s"] if offline else None}
    if args.out:
        write_json(data, args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
