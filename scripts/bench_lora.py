"""Multi-LoRA throughput: one batch of `--requests` rows under 0, 1, 4 and 16 adapters, SmolLM2, one run.

Adapters: random PEFT LoRAs of rank `--rank` on all seven projections (q, k, v, o, gate, up,
down), written here in PEFT's format (adapter_config.json + adapter_model.safetensors), scaled
small so they perturb rather than wreck the model. Workload: `--requests` greedy requests with
distinct `--prompt-tokens` prompts and `--max-tokens` outputs each, all queued at once, so the
decode steps are `--requests` rows; the requests go round-robin over the adapters. Engines:

    base          no LoRA at all (the reference)
    base, LoRA on the LoRA engine, every row without an adapter (the cost of holding the slots)
    N adapters    the LoRA engine (--max-loras 16, --max-lora-rank R), rows over N adapters

Each run is timed whole (prefill and decode) and its tokens per second of output reported; runs
alternate over `--rounds` and medians are kept. Then one decode step of all the rows per setting
(the step program replayed on that step's input) is timed, settings alternating, medians. Also reported: the step programs compiled after
warm-up while adapters were loaded and swapped (goal: 0), and an adapter's swap into a device
slot (the host -> device write; its disk read separately). The CPU, its vector flags and the
load are printed.

    PYTHONPATH=. .venv/bin/python scripts/bench_lora.py [--json bench-results/lora.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(out: Path, cfg, rank: int, seed: int, scale: float = 0.05) -> Path:
    """A random PEFT LoRA on every projection of every layer."""
    from safetensors.numpy import save_file

    from runtime.model.lora import module_shape

    ours = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo", "gate_proj": "w_gate",
            "up_proj": "w_up", "down_proj": "w_down"}
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for m, block in MODULES.items():
            din, dout = module_shape(cfg, ours[m])
            key = f"base_model.model.model.layers.{layer}.{block}.{m}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, din)) / np.sqrt(din)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (scale * rng.standard_normal((dout, rank)) / np.sqrt(rank)).astype(np.float32)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": rank,
                                                         "target_modules": list(MODULES), "bias": "none"}))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=str(ROOT / "checkpoints" / "smollm2-135m-instruct"))
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    from runtime.bench.machine import announce, engine_from_flags, loadavg_1m
    from runtime.corpus import WORDS
    from runtime.model.runner import compilations
    from runtime.model.sampling import SamplingParams

    info = announce()
    common = ["--max-model-len", str(args.prompt_tokens + args.max_tokens + 16), "--max-num-seqs", str(args.requests),
              "--max-num-batched-tokens", "512"]
    plain = engine_from_flags(args.checkpoint, common)
    slots = [*common, "--enable-lora", "--max-loras", "16", "--max-lora-rank", str(args.rank), "--max-cpu-loras", "16"]
    lora = engine_from_flags(args.checkpoint, slots)
    lora16 = engine_from_flags(args.checkpoint, [*slots, "--lora-dtype", "bfloat16"])
    cfg = plain.config.model
    tmp = Path(tempfile.mkdtemp(prefix="pagedjax-lora-bench-"))
    paths = [write_adapter(tmp / f"a{i}", cfg, args.rank, i) for i in range(16)]
    t0 = time.perf_counter()
    for i, path in enumerate(paths):
        lora.load_lora(f"a{i}", str(path))
    read_s = (time.perf_counter() - t0) / len(paths)
    for i, path in enumerate(paths):
        lora16.load_lora(f"a{i}", str(path))
    tok = plain.tokenizer

    def text(seed: int) -> list[int]:
        rng = random.Random(seed)
        return tok.encode(" ".join(rng.choice(WORDS) for _ in range(2 * args.prompt_tokens)))[:args.prompt_tokens]

    prompts = [text(i) for i in range(args.requests)]
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    settings = {"base": (plain, 0), "base, LoRA on": (lora, 0), "1 adapter": (lora, 1), "4 adapters": (lora, 4),
                "16 adapters": (lora, 16), "16 adapters, bfloat16 slots": (lora16, 16)}

    def run(eng, n: int) -> tuple[float, list[list[int]]]:
        t0 = time.perf_counter()
        reqs = [eng.add_request(pr, sp, lora=f"a{i % n}" if n else None) for i, pr in enumerate(prompts)]
        eng.run_until_done()
        return time.perf_counter() - t0, [r.output_ids for r in reqs]

    for name, (eng, n) in settings.items():  # warm-up: every step shape the workload meets, each slot written
        run(eng, n)
    compiled = compilations(), compilations("_write")
    walls: dict[str, list[float]] = {n: [] for n in settings}
    outs: dict[str, list[list[int]]] = {}
    for _ in range(args.rounds):
        for name, (eng, n) in settings.items():
            wall, outs[name] = run(eng, n)
            walls[name].append(wall)
    # One decode step of all the rows, replayed: the same 64-row step per setting, alternating.
    step_inputs = {}
    for name, (eng, n) in settings.items():
        orig, seen = eng.runner.launch, {}

        def launch(seqs, *a, _orig=orig, _eng=eng, _seen=seen, **k):
            h = _orig(seqs, *a, **k)
            if len(seqs) == args.requests and all(len(sq.token_ids) == 1 for sq in seqs):
                _seen.setdefault("inp", _eng.runner.last_input)
            return h
        eng.runner.launch = launch
        run(eng, n)
        eng.runner.launch = orig
        step_inputs[name] = seen["inp"]
    step_times: dict[str, list[float]] = {n: [] for n in settings}
    for _ in range(args.rounds * 4):
        for name, (eng, _n) in settings.items():
            step_times[name] += [eng.runner.replay(step_inputs[name]) for _ in range(3)]
    compiled_after = (compilations() - compiled[0], compilations("_write") - compiled[1])
    toks = args.requests * args.max_tokens
    base_tps = toks / statistics.median(walls["base"])
    base_step = statistics.median(step_times["base"])
    rows = [{"setting": n, "wall_s": statistics.median(walls[n]), "tok_s": toks / statistics.median(walls[n]),
             "vs_base": toks / statistics.median(walls[n]) / base_tps,
             "step_ms": 1e3 * statistics.median(step_times[n]),
             "step_vs_base": base_step / statistics.median(step_times[n])} for n in settings]
    snap = lora.loras.snapshot()
    swap_ms = 1e3 * snap["swap_seconds"] / max(1, snap["swaps_in"])
    load = loadavg_1m() or 0.0
    same_base = outs["base, LoRA on"] == outs["base"]
    same16 = sum(a == b for a, b in zip(outs["16 adapters, bfloat16 slots"], outs["16 adapters"]))
    print(f"{args.requests} requests x ({args.prompt_tokens} prompt + {args.max_tokens} output tokens) in one batch, "
          f"adapters of rank {args.rank} on all 7 projections, round-robin; medians of {args.rounds} alternating "
          f"rounds; load {load:.2f}")
    print("| setting | wall s | output tok/s | vs base | decode step ms | step vs base |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['setting']} | {r['wall_s']:.2f} | {r['tok_s']:.0f} | {r['vs_base']:.2f}x | {r['step_ms']:.1f} | "
              f"{r['step_vs_base']:.2f}x |")
    print(f"base rows on the LoRA engine give the base engine's tokens: {same_base}")
    print(f"bfloat16 slots give float32 slots' tokens on {same16}/{args.requests} requests")
    print(f"adapter swap into a device slot: {swap_ms:.1f} ms (mean of {snap['swaps_in']}); read from disk: "
          f"{1e3 * read_s:.1f} ms per adapter")
    print(f"step programs compiled after warm-up: {compiled_after[0]} (slot writes: {compiled_after[1]})")
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "requests": args.requests, "prompt_tokens": args.prompt_tokens,
                                         "max_tokens": args.max_tokens, "rank": args.rank, "rounds": args.rounds,
                                         "rows": rows, "swap_ms": swap_ms, "read_ms": 1e3 * read_s,
                                         "swaps": snap["swaps_in"], "compiled_after_warmup": compiled_after,
                                         "same_base_tokens": same_base, "same_bf16_tokens": same16, "load": load,
                                         "measured_at": time.strftime("%Y-%m-%d %H:%M", time.gmtime())},
                                        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
