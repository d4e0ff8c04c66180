"""`pagedjax plan`'s arguments and command: the capacity plan, with the disaggregated
split and the tensor-parallel table when asked."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from runtime.config import ModelConfig
from runtime.planner.core import DEVICE_NAMES, GB, MODELS, device_profile, format_plan, plan, plot_plan
from runtime.planner.disagg import format_disagg, plan_disagg
from runtime.planner.tp import format_tp, plan_tp


# --- CLI glue ---------------------------------------------------------------------------
def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help=f"named config: {', '.join(MODELS)}")
    parser.add_argument("--checkpoint", help="checkpoint directory (reads DIR/config.json)")
    parser.add_argument("--device", default="h100", help=f"{'|'.join(DEVICE_NAMES)} (cpu is measured)")
    parser.add_argument("--context-len", type=int, default=1000, help="tokens of KV per sequence (S)")
    parser.add_argument("--output-tokens", type=int, default=200, help="mean output tokens per request")
    parser.add_argument("--rps", type=float, default=None, help="target requests/s (sizes a fleet)")
    parser.add_argument("--weight-dtype", default="bfloat16", help="bfloat16|float16|float32|int8|fp8_e4m3|int4")
    parser.add_argument("--kv-dtype", default="bfloat16", help="bf16|bfloat16|int8|fp8_e4m3|float32 (int8 adds a float16 scale and zero per 8 channels of K and 32 of V; fp8 a float32 scale per token and head)")
    parser.add_argument("--overhead", type=float, default=None,
                        help="GB (1e9 B) held back besides weights; default 3 for GPUs, 1 for cpu")
    parser.add_argument("--headroom", type=float, default=0.2, help="fleet burst headroom (0.2 = 20%%)")
    parser.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N",
                        help="also a table at TP 1, 2, 4, ... up to N: per-device weights, KV and B_max, and the "
                             "step with its all-reduces")
    parser.add_argument("--disagg", action="store_true",
                        help="also size separate prefill and decode pools from --ttft-ms and --itl-ms")
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="with --disagg: prompt length to prefill (default: --context-len)")
    parser.add_argument("--ttft-ms", type=float, default=500.0, help="with --disagg: TTFT target (default 500)")
    parser.add_argument("--itl-ms", type=float, default=50.0, help="with --disagg: ITL target (default 50)")
    parser.add_argument("--mfu", type=float, default=0.5,
                        help="with --disagg: fraction of peak FLOP/s prefill achieves (default 0.5)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--plot", metavar="FILE.png", help="plot TPS and step time vs batch (matplotlib)")


def _load_model(args: argparse.Namespace) -> ModelConfig:
    if args.checkpoint:
        ckpt = Path(args.checkpoint)
        if not (ckpt / "config.json").is_file():
            raise ValueError(f"checkpoint: {ckpt}/config.json not found")
        try:
            cfg = ModelConfig.load(ckpt / "config.json")
        except (OSError, json.JSONDecodeError, TypeError) as e:
            raise ValueError(f"checkpoint: cannot read {ckpt}/config.json: {e}") from None
        return cfg if cfg.name != "model" else dataclasses.replace(cfg, name=ckpt.name)
    if not args.model:
        raise ValueError("model: give --model NAME or --checkpoint DIR")
    if args.model.lower() not in MODELS:
        raise ValueError(f"model: unknown model {args.model!r} (known: {', '.join(MODELS)})")
    return MODELS[args.model.lower()]


def run_plan(args: argparse.Namespace) -> int:
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("plan: --plot needs matplotlib, which is not installed", file=sys.stderr)
            return 2
    try:
        model = _load_model(args)
        device = device_profile(args.device)
        overhead = args.overhead if args.overhead is not None else (1.0 if device.name == "cpu" else 3.0)
        p = plan(model, device, context_len=args.context_len, weight_dtype=args.weight_dtype,
                 kv_dtype=args.kv_dtype, overhead_bytes=int(overhead * GB), target_rps=args.rps,
                 output_tokens=args.output_tokens, headroom=args.headroom)
        d = plan_disagg(model, device, p, prompt_tokens=args.prompt_tokens or args.context_len,
                        ttft_target_s=args.ttft_ms / 1e3, itl_target_s=args.itl_ms / 1e3,
                        mfu=args.mfu) if args.disagg else None
        tp = None
        if args.tensor_parallel_size is not None:
            n = args.tensor_parallel_size
            sizes = tuple(sorted({1, n} | {k for k in (2, 4, 8, 16, 32) if k < n}))
            tp = plan_tp(model, device, p, sizes)
    except ValueError as e:
        print(f"plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        extra = {**({"disagg": d.to_json()} if d else {}),
                 **({"tensor_parallel": [dataclasses.asdict(r) for r in tp]} if tp else {})}
        print(json.dumps({**p.to_json(), **extra}, indent=2))
    else:
        print(format_plan(p) + (f"\n{format_disagg(d, device)}" if d else "") + (f"\n{format_tp(tp, device)}" if tp else ""))
    if args.plot:
        try:
            plot_plan(p, args.plot)
        except OSError as e:
            print(f"plan: cannot write plot {args.plot}: {e}", file=sys.stderr)
            return 2
    return 0
