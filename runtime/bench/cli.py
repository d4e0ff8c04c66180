"""`pagedjax bench serve | sweep | offline | accuracy | structured | interference | tp`
(BENCHMARKS.md is rendered by scripts/render_benchmarks.py, outside the package)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

EXIT_USAGE = 2


def _err(msg: str) -> int:
    print(f"pagedjax bench: error: {msg}", file=sys.stderr)
    return EXIT_USAGE


def _need_matplotlib(args: argparse.Namespace) -> bool:
    """--plot without matplotlib: one line naming the package (runtime/cli.py prints it), before the run."""
    from runtime.bench.report import have_matplotlib
    from runtime.optional import MissingDependency

    if getattr(args, "plot", None) and not have_matplotlib():
        raise MissingDependency(f"pagedjax bench {args.bench_command} --plot", "matplotlib")
    return True


def _load_config(args: argparse.Namespace, **over: Any):
    from runtime.bench.loadgen import LoadConfig

    kw = dict(url=args.url, scenario=args.scenario, model=args.model, num_requests=args.num_requests,
              rate=getattr(args, "rate", None), concurrency=getattr(args, "concurrency", None),
              max_tokens=args.max_tokens, seed=args.seed, api_key=args.api_key, timeout_s=args.timeout,
              max_duration_s=args.max_duration, input_len=args.input_len, prefix_words=args.prefix_words,
              ignore_eos=args.ignore_eos, as_text=args.as_text, progress=not args.no_progress)
    kw.update(over)
    return LoadConfig(**kw)


def cmd_serve(args: argparse.Namespace) -> int:
    from runtime.bench.loadgen import run_load
    from runtime.bench.report import format_report, plot_report, write_json

    if not _need_matplotlib(args):
        return EXIT_USAGE
    try:
        report = run_load(_load_config(args))
    except ValueError as exc:
        return _err(str(exc))
    print(format_report(report))
    if args.out:
        write_json(report, args.out)
        print(f"wrote {args.out}")
    if args.plot:
        plot_report(report, args.plot)
        print(f"wrote {args.plot}")
    return 0 if report["successful_requests"] else 1


def _parse_list(text: str, kind: type, name: str) -> list:
    try:
        vals = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{name}: expected a comma-separated list of numbers, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise ValueError(f"{name}: values must be positive, got {text!r}")
    return vals


def cmd_sweep(args: argparse.Namespace) -> int:
    from runtime.bench.loadgen import run_load
    from runtime.bench.report import build_sweep, format_report, format_sweep, plot_sweep, write_json

    if not _need_matplotlib(args):
        return EXIT_USAGE
    try:
        if args.rates:
            mode, values = "rate", _parse_list(args.rates, float, "rates")
        else:
            mode, values = "concurrency", _parse_list(args.concurrencies, int, "concurrencies")
        runs = []
        for i, v in enumerate(values):
            # A different seed per point: the previous point's prompts would be prefix-cache hits.
            cfg = _load_config(args, rate=v if mode == "rate" else None,
                               concurrency=v if mode == "concurrency" else None, seed=args.seed + 1000 * i)
            report = run_load(cfg)
            print(format_report(report), flush=True)
            runs.append((v, report))
    except ValueError as exc:
        return _err(str(exc))
    sweep = build_sweep(mode, runs)
    print(format_sweep(sweep))
    if args.out:
        write_json(sweep, args.out)
        print(f"wrote {args.out}")
    if args.plot:
        plot_sweep(sweep, args.plot)
        print(f"wrote {args.plot}")
    return 0 if all(r["successful_requests"] for _, r in runs) else 1


def cmd_offline(args: argparse.Namespace) -> int:
    from runtime.bench.offline import run_offline

    return run_offline(args)


def _add_load_arguments(p: argparse.ArgumentParser) -> None:
    from runtime.bench.loadgen import SCENARIOS

    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model name sent in requests (default: the first of /v1/models)")
    p.add_argument("--scenario", choices=SCENARIOS, default="shared-prefix",
                   help="shared-prefix: chat, one ~320-token system prompt + short user messages; "
                        "multi-prefix: the same with 4 different system prompts interleaved (fleet routing); "
                        "random: random-length completions; long-prompt: long completions prompts")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--input-len", type=int, default=None,
                   help="approximate prompt tokens (random: mean, default 256; long-prompt: default 1536)")
    p.add_argument("--prefix-words", type=int, default=None,
                   help="shared-prefix: use only the first N words of the system prompt (small test models)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos (a vLLM/pagedjax extension): every request makes max_tokens tokens")
    p.add_argument("--as-text", action="store_true",
                   help="chat scenarios as plain /v1/completions prompts (for base models without a chat template)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    p.add_argument("--timeout", type=float, default=120.0, help="per-request timeout, seconds")
    p.add_argument("--max-duration", type=float, default=900.0,
                   help="stop the run after this many seconds; unfinished requests count as failed")
    p.add_argument("--out", metavar="FILE.json", help="write the results as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="write a plot (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_bench_parser(subparsers: Any) -> None:
    from runtime.bench.offline import add_offline_arguments

    bench = subparsers.add_parser("bench", help="benchmarks: load-test a server, sweep, offline engine numbers")
    sub = bench.add_subparsers(dest="bench_command", required=True)

    s = sub.add_parser("serve", help="load-test an OpenAI-compatible server over streaming HTTP")
    _add_load_arguments(s)
    g = s.add_mutually_exclusive_group()
    g.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests per second")
    g.add_argument("--concurrency", type=int, default=None, help="fixed number of concurrent clients")
    s.set_defaults(func=cmd_serve)

    s = sub.add_parser("sweep", help="bench serve across several rates or concurrencies (throughput vs latency)")
    _add_load_arguments(s)
    g = s.add_mutually_exclusive_group(required=True)
    g.add_argument("--rates", help="comma-separated request rates, e.g. 1,2,4")
    g.add_argument("--concurrencies", help="comma-separated concurrencies, e.g. 1,4,16")
    s.set_defaults(func=cmd_sweep)

    s = sub.add_parser("offline", help="in-process engine benchmarks: host step, throughput, decode split")
    add_offline_arguments(s)
    s.set_defaults(func=cmd_offline)

    from runtime.bench.accuracy import add_accuracy_arguments, run_accuracy

    s = sub.add_parser("accuracy", help="a quantized model against float32: perplexity, logprob difference, "
                                        "greedy agreement, with the quantization gates")
    add_accuracy_arguments(s)
    s.set_defaults(func=run_accuracy)

    from runtime.bench.structured import add_structured_arguments, run_structured

    s = sub.add_parser("structured", help="per-step cost of structured outputs at 1, 16 and 64 constrained rows")
    add_structured_arguments(s)
    s.set_defaults(func=run_structured)

    from runtime.bench.interference import add_interference_parser
    from runtime.bench.tp_step import add_tp_parser

    add_interference_parser(sub)
    add_tp_parser(sub)
