"""`pagedjax bench tp`: the decode step at tensor-parallel size 1 and N side by side, in one
process. On CPU the N devices are forced host devices
(XLA_FLAGS=--xla_force_host_platform_device_count=N) that share the same cores, so the
ratio is the cost of the sharded program (its all-reduces, the per-shard attention, the
vocabulary-sharded head and the logits gather), not a speed-up.

Setups, each timed round by round in turn (a burst of load from elsewhere hits all alike):
TP 1 as served (the C++ kernels), TP 1 on the plain XLA path (what TP N runs per shard),
and TP N."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np


def _engine(ckpt: Path, tp: int, kernels: bool, max_seqs: int, context_len: int) -> Any:
    from runtime.config import AdmissionPolicy, CacheConfig, EngineConfig, SchedulerConfig
    from runtime.core.engine import LLMEngine

    blocks = max_seqs * (-(-context_len // 16)) + 8
    env = SchedulerConfig(max_seqs, max_seqs, max(context_len + 16, 512))

    def build(model):
        return EngineConfig(model, CacheConfig(16, blocks, "float32", True), env,
                            AdmissionPolicy(max_num_seqs=max_seqs, max_num_batched_tokens=max_seqs,
                                            long_prefill_token_threshold=max_seqs),
                            "xla", "float32", quantization="auto", tensor_parallel_size=tp)

    build.tensor_parallel_size = tp  # restore straight into shards
    old = os.environ.get("PAGEDJAX_CPU_KERNELS")
    os.environ["PAGEDJAX_CPU_KERNELS"] = "1" if kernels else "0"  # read when the engine is built
    try:
        return LLMEngine.from_checkpoint(ckpt, build, warmup=False, progress=False)
    finally:
        if old is None:
            os.environ.pop("PAGEDJAX_CPU_KERNELS", None)
        else:
            os.environ["PAGEDJAX_CPU_KERNELS"] = old


def _step_input(runner: Any, batch: int, context_len: int) -> Any:
    import jax

    from runtime.model.batch import build_step_input
    from runtime.bench.step_rows import decode_rows

    host = build_step_input(decode_rows(runner, batch, context_len), batch, batch, runner.max_blocks_per_seq,
                            runner.cache_cfg.block_size, runner.scratch_row, runner.masks.all_allowed(batch))
    if runner.mesh is None:
        return jax.device_put(host)
    from runtime.model import tp

    return jax.device_put(host, tp.replicated(runner.mesh))  # as the step's in_shardings want it


def _time(runner: Any, inp: Any, iters: int) -> list[float]:
    import jax

    out_s = []
    for _ in range(iters):
        t0 = time.perf_counter()
        runner.kv, runner.penalty, out, *_ = runner._step(runner.params, runner.kv, runner.penalty, inp)
        jax.block_until_ready(out.token_ids)
        out_s.append(time.perf_counter() - t0)
    return out_s


def bench_tp(ckpt: Path, size: int, *, batches: tuple[int, ...] = (1, 8, 32), context_len: int = 350,
             rounds: int = 5, iters: int = 4) -> dict[str, Any]:
    import jax

    from runtime.bench.machine import loadavg_1m, machine_info

    if jax.device_count() < size:
        raise ValueError(f"tensor_parallel_size: {size} needs {size} devices, only {jax.device_count()}; on CPU "
                         f"set XLA_FLAGS=--xla_force_host_platform_device_count={size}")
    setups = [("TP 1, C++ kernels (as served)", 1, True), ("TP 1, plain XLA", 1, False),
              (f"TP {size}, plain XLA", size, False)]
    load = loadavg_1m()
    engines = [_engine(ckpt, tp, k, max(batches), context_len) for _, tp, k in setups]
    rows = []
    for b in batches:
        inputs = [_step_input(e.runner, b, context_len) for e in engines]
        for e, inp in zip(engines, inputs):  # compile + warm
            _time(e.runner, inp, 2)
        times: list[list[float]] = [[] for _ in engines]
        for r in range(rounds):
            order = range(len(engines)) if r % 2 == 0 else reversed(range(len(engines)))
            for i in order:
                times[i] += _time(engines[i].runner, inputs[i], iters)
        ms = [float(np.median(t)) * 1e3 for t in times]
        rows.append({"batch": b, "step_ms": dict(zip([s for s, _, _ in setups], ms)),
                     "tp_over_tp1_xla": ms[2] / ms[1], "tp_over_tp1_served": ms[2] / ms[0]})
    for e in engines:
        e.reset_prefix_cache()
    return {"kind": "tp_step", "model": engines[0].config.model.name, "tensor_parallel_size": size,
            "devices": jax.device_count(), "context_len": context_len, "rounds": rounds, "iters": iters,
            "setups": [s for s, _, _ in setups], "rows": rows, "machine": machine_info(), "loadavg_1m": load}


def format_tp(r: dict[str, Any]) -> str:
    n = r["tensor_parallel_size"]
    lines = [f"== decode step at TP 1 and TP {n}: {r['model']}, context {r['context_len']}, {r['devices']} host "
             f"devices on {r['machine'].get('cores')} cores ({r['machine'].get('cpu_model')}; load "
             f"{r['loadavg_1m'] or 0:.2f}) =="]
    for row in r["rows"]:
        parts = ", ".join(f"{k} {v:.1f} ms" for k, v in row["step_ms"].items())
        lines.append(f"  batch {row['batch']:>3}: {parts}; TP {n} / TP 1 plain XLA = {row['tp_over_tp1_xla']:.2f}x")
    return "\n".join(lines)


def add_tp_parser(sub: Any) -> None:
    s = sub.add_parser("tp", help="decode step time at tensor-parallel size 1 vs N (on CPU: forced host devices, "
                                  "an overhead figure, not a speed-up)")
    s.add_argument("--checkpoint", help="checkpoint directory (default: the pulled default model)")
    s.add_argument("--tensor-parallel-size", type=int, default=2)
    s.add_argument("--batches", default="1,8,32")
    s.add_argument("--context-len", type=int, default=350)
    s.add_argument("--rounds", type=int, default=5)
    s.add_argument("--iters", type=int, default=4, help="timed steps per setup per round")
    s.add_argument("--out", metavar="FILE.json")
    s.set_defaults(func=cmd_tp)


def cmd_tp(args: argparse.Namespace) -> int:
    from runtime.checkpoint.pull import resolve_checkpoint

    r = bench_tp(resolve_checkpoint(args.checkpoint), args.tensor_parallel_size,
                 batches=tuple(int(b) for b in args.batches.split(",")), context_len=args.context_len,
                 rounds=args.rounds, iters=args.iters)
    print(format_tp(r))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(r, indent=2))
    return 0
