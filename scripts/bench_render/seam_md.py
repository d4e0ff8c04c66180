"""BENCHMARKS.md sections for the model-seam work (issue #36): the throughput A/B before and
after it (bench-results/seam-ab/), and the kernels' yardstick against XLA's own CPU library
paths (bench-results/yardstick.json, scripts/bench_yardstick.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from scripts.bench_render.md import table as _table


def _load(p: Path) -> Any:
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def render_seam_ab(results: str | Path) -> list[str]:
    d = Path(results) / "seam-ab"
    meta = _load(d / "meta.json")
    L = ["## Model seam: throughput before and after (issue #36)", ""]
    if meta is None:
        return L + ["_not run_", ""]
    L.append(f"`{meta['command']}`: 64 streaming chat requests at concurrency 64 sharing a ~320-token system "
             f"prompt, 64 tokens each (ignore EOS), SmolLM2-135M-Instruct float32 with the `serve` defaults. "
             f"Before: {meta['old_commit']}; after: {meta['new_commit']}. {meta['cpu']}.")
    L.append("")
    rows, means = [], {}
    for run in meta["runs"]:
        r = _load(d / f"{run['version']}-{run['round']}.json")
        if r is None:
            continue
        tok = r["output_throughput"]
        means.setdefault(run["version"], []).append(tok)
        rows.append([run["version"], run["round"], run["start"], f"{run['load1']:.2f}", f"{tok:.1f}",
                     f"{r['ttft_s']['p50']:.2f}", f"{r['itl_s']['p50'] * 1e3:.1f}"])
    L += _table(("build", "round", "start", "load (1 min)", "output tok/s", "TTFT p50 s", "ITL p50 ms"), rows)
    if "old" in means and "new" in means:
        old, new = (sum(v) / len(v) for v in (means["old"], means["new"]))
        L += ["", f"After / before, mean of the rounds: {new:.1f} / {old:.1f} tok/s = **{new / old:.3f}x** "
                  "(the goal: within ±5%)."]
    return L + [""]


def render_yardstick(results: str | Path) -> list[str]:
    r = _load(Path(results) / "yardstick.json")
    L = ["## The CPU kernels against XLA's own CPU libraries (`scripts/bench_yardstick.py`)", ""]
    if r is None:
        return L + ["_not run_", ""]
    L.append(f"One jitted decode step of SmolLM2-135M-Instruct (context {r['context_len']} tokens per row) "
             f"per setting, each setting in a fresh process, best of {r['rounds']} round(s) of the median of "
             f"{r['iters']} steps: the hand-written kernels (`kernels`) against XLA's default (which hands dots of "
             "2+ rows to YNNPACK), XLA with no library, and XLA with YNN fusions widened. Keep a kernel only "
             "where it wins: it wins every cell. oneDNN (`--xla_cpu_use_onednn`) compiled the 64-row float32 step "
             "and the w8a8 steps but died of SIGILL running them in this jaxlib; `--xla_cpu_use_xnnpack` changes "
             "nothing here (this jaxlib links YNNPACK only).")
    L.append("")
    L += ["```", r["table"].rstrip(), "```", ""] if r.get("table") else []
    return L
