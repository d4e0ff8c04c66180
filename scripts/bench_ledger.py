"""What the per-request decision ledger costs a step (runtime/core/ledger.py), SmolLM2, one run.

Two engines alike but for `--no-request-ledger`; each round times `--steps` engine steps while
`--batch` requests decode (runtime/bench/step_rows.timed_steps: the host's whole beat, the
ledger's writes included), alternating engines round by round so drift in the machine's speed
hits both. Medians per engine and their ratio; the CPU and the load are printed beside them.

    PYTHONPATH=. .venv/bin/python scripts/bench_ledger.py [--batch 64] [--json bench-results/ledger.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=str(ROOT / "checkpoints" / "smollm2-135m-instruct"))
    p.add_argument("--batch", type=int, nargs="+", default=[8, 64])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    from runtime.bench.machine import announce, engine_from_flags, loadavg_1m
    from runtime.bench.step_rows import timed_steps
    from runtime.model.sampling import SamplingParams

    info = announce()
    top = max(args.batch)

    def build(extra: list[str]):
        return engine_from_flags(args.checkpoint, ["--max-model-len", "1024", "--max-num-seqs", str(top),
                                                   "--kv-cache-memory", "1GiB", *extra])

    engines = {"ledger on": build([]), "ledger off": build(["--no-request-ledger"])}
    prompts = [[1] + [1000 + 17 * i + j for j in range(63)] for i in range(top)]
    sp = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
    for eng in engines.values():  # compile the step shapes first
        for b in args.batch:
            timed_steps(eng, prompts[:b], sp, 2)
    walls: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for b in args.batch:
            for name, eng in engines.items():
                walls.setdefault((name, b), []).extend(timed_steps(eng, prompts[:b], sp, args.steps))
    load = loadavg_1m() or 0.0
    rows = []
    for b in args.batch:
        on, off = (statistics.median(walls[(n, b)]) * 1e3 for n in engines)
        rows.append({"batch": b, "on_ms": on, "off_ms": off, "ratio": on / off})
    print(f"medians over {args.rounds} alternating rounds of {args.steps} steps; load {load:.2f} at the end")
    print("| batch | step ms, ledger on | step ms, ledger off | on / off |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['on_ms']:.2f} | {r['off_ms']:.2f} | {r['ratio']:.3f} |")
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "rows": rows, "rounds": args.rounds, "steps": args.steps,
                                         "load": load, "measured_at": time.strftime("%Y-%m-%d %H:%M", time.gmtime())},
                                        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
