"""BENCHMARKS.md section for speculative decoding (issue #39): bench-results/speculative.json,
written by scripts/bench_spec.py --json."""

from __future__ import annotations

import json
from pathlib import Path

from scripts.bench_render.md import table as _table


def render_speculative(results: str | Path) -> list[str]:
    L = ["## Speculative decoding: n-gram prompt lookup (`scripts/bench_spec.py`)", ""]
    try:
        r = json.loads((Path(results) / "speculative.json").read_text())
    except (OSError, ValueError):
        return L + ["_not run_", ""]
    m = r["machine"]
    configs = ", ".join(f"`{c}`" for c in r.get("configs", []))
    L.append(f"SmolLM2-135M-Instruct float32, greedy chats of up to {r.get('max_tokens', 128)} tokens, the `serve` "
             f"engine defaults plus `--speculative-config` {configs} (the proposer column: proposals per step, and "
             f"the running-request count from which speculation is off; `off from 1000` forces it on at every "
             f"batch size, to show where it stops paying). `copy`: rewrite / extract / repeat a "
             f"given text; `chat`: open questions. Each row the median of {r.get('rounds', 2)} runs per engine, the "
             f"engines alternating; {m['cpu_model']}, {m['cores']} cores. `same tokens`: requests whose output equals "
             f"the plain engine's.")
    L.append("")
    rows = [[x["workload"], x["batch"], x["proposer"], f"{x['plain_tok_s']:.1f}", f"{x['spec_tok_s']:.1f}",
             f"**{x['ratio']:.2f}x**", f"{x['plain_itl_ms']:.1f}", f"{x['spec_itl_ms']:.1f}",
             f"{x['accepted']} / {x['proposed']}", x["same"], f"{x['load']:.2f}"] for x in r["rows"]]
    L += _table(("workload", "batch", "proposer", "plain tok/s", "spec tok/s", "ratio", "plain ITL ms",
                 "spec ITL ms", "kept / proposed", "same tokens", "load (1 min)"), rows)
    if any(x["proposer"].startswith("suffix") for x in r["rows"]):
        L += ["", "The `suffix` rows (a second run, with its own plain rows) measure its own case: the benchmark "
                  "repeats its prompts (each round, each batch size), so after the first run of a prompt its answer "
                  "is in the suffix cache and is proposed whole. The first row of each workload starts cold."]
    if any(x["proposer"].startswith("draft_model") for x in r["rows"]):
        L += ["", "The `draft_model` rows (a second run, with its own plain rows) use SmolLM2-135M-Instruct as its "
                  "own draft: every greedy proposal is the target's own token, so they are an upper bound for "
                  "acceptance, not for speed (the draft costs as much as the target, one step per proposed token). "
                  "Proposals past the end of an answer (after its EOS) count as proposed, not kept."]
    return L + [""]
