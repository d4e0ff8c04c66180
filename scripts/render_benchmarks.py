"""Render BENCHMARKS.md from a results directory, and the guidellm summary it shows.

    python scripts/render_benchmarks.py [--results bench-results] [--commands FILE] [--out BENCHMARKS.md]
    python scripts/render_benchmarks.py guidellm IN.json OUT.json DESCRIPTION
    python scripts/render_benchmarks.py guidellm-failed OUT.json REASON

Run from a checkout (scripts/run_benchmarks.sh does); the renderers live in
scripts/bench_render/, outside the installed package.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runtime.bench.report import write_json  # noqa: E402
from scripts.bench_render.benchmarks_md import guidellm_summary, render_benchmarks  # noqa: E402


def render(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="render_benchmarks.py", description="render BENCHMARKS.md from a results "
                                "directory")
    p.add_argument("--results", default="bench-results")
    p.add_argument("--commands", help="file with the commands to list in the page")
    p.add_argument("--out", help="output file (default: stdout)")
    args = p.parse_args(argv)
    if not Path(args.results).is_dir():
        print(f"render_benchmarks.py: error: results: {args.results} is not a directory", file=sys.stderr)
        return 2
    commands = Path(args.commands).read_text().strip() if args.commands else None
    text = render_benchmarks(args.results, commands)
    if args.out:
        tmp = Path(args.out).with_name(f".{Path(args.out).name}.tmp")
        tmp.write_text(text)
        tmp.replace(args.out)
        print(f"wrote {args.out}")
    else:
        print(text)
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["guidellm"] and len(argv) == 4:
        write_json(guidellm_summary(argv[1], argv[3]), argv[2])
        return 0
    if argv[:1] == ["guidellm-failed"] and len(argv) == 3:
        write_json({"ok": False, "reason": argv[2]}, argv[1])
        return 0
    if argv[:1] in (["guidellm"], ["guidellm-failed"]):
        print(__doc__, file=sys.stderr)
        return 2
    return render(argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
