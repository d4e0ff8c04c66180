"""The engine's in-process benchmarks behind `pagedjax bench offline --part PART[,PART...]|all`.

host        Scheduler.schedule() + commit() per step with N running sequences, no device
            (a fake runner appends a token per sequence); plus the host cost of building
            the padded step input. Target: <= 1 ms per step at 256 sequences.
throughput  output tokens/s on chat requests sharing a ~320-token system prompt (LLMEngine
            in-process, warm-up excluded), beside the same requests one at a time.
decode      the jitted decode step (S == T) at several batch sizes and a fixed context,
            against the same step with attention replaced by a no-op of the same shapes:
            attention time = difference. Plus the memory-bandwidth limit at batch 1.
breakdown   the decode step part by part against each part's floor (runtime/bench/breakdown.py).
overlap     exposed host time per step with async scheduling on and off (same module).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from runtime.bench.report import summarize
from runtime.bench.step_rows import _noop_attention, decode_rows  # noqa: F401  (re-exported)

PARTS = ("host", "throughput", "decode", "breakdown", "overlap")
ALL_PARTS = ("host", "throughput", "decode")  # breakdown/overlap want a 256-sequence envelope: asked by name
HOST_TARGET_US = 1000.0


# --- (a) host-side scheduler + block pool --------------------------------------------------
def bench_host(num_seqs: int = 256, steps: int = 200, *, prompt_len: int = 48, shared_prefix_len: int = 32,
               block_size: int = 16, token_budget: int = 2048) -> dict[str, Any]:
    from runtime.core.request import step_row
    from runtime.model.batch import build_step_input
    from runtime.core.block_pool import BlockPool
    from runtime.config import AdmissionPolicy, CacheConfig, SchedulerConfig
    from runtime.core.request import Request
    from runtime.model.sampling import SamplingParams
    from runtime.core.scheduler import Scheduler
    from runtime.model.structured import TokenMasks

    masks = TokenMasks(49152)  # SmolLM2's vocabulary: the bitmask every step carries
    if num_seqs < 1 or steps < 1:
        raise ValueError("num_seqs/steps: must be >= 1")
    prefill_steps = math.ceil(num_seqs * prompt_len / token_budget) + 2
    max_len = prompt_len + prefill_steps + steps + block_size
    blocks_per_seq = math.ceil(max_len / block_size)
    num_blocks = num_seqs * blocks_per_seq + 64
    budget = max(token_budget, num_seqs)
    envelope = SchedulerConfig(num_seqs, budget, blocks_per_seq * block_size)
    policy = AdmissionPolicy(max_num_seqs=num_seqs, max_num_batched_tokens=budget,
                             long_prefill_token_threshold=budget, max_admissions_per_step=num_seqs,
                             max_queue_len=num_seqs, max_queued_tokens=1 << 30)
    pool = BlockPool(num_blocks, block_size, True)
    sched = Scheduler(CacheConfig(block_size, num_blocks, "float32", True), envelope, policy, pool)
    params = SamplingParams(temperature=0.0, max_tokens=max_len - prompt_len, ignore_eos=True)
    prefix = [(7 * i) % 40000 + 3 for i in range(shared_prefix_len)]
    for i in range(num_seqs):
        unique = [(i * 131 + j * 17) % 40000 + 3 for j in range(prompt_len - shared_prefix_len)]
        sched.add(Request(f"h{i}", prefix + unique, params))

    sched_us: list[float] = []
    build_us: list[float] = []
    step = 0
    while len(sched_us) < steps:
        if step > prefill_steps + steps + 10:
            raise RuntimeError("host benchmark: the running batch never reached steady decode")
        t0 = time.perf_counter()
        plan = sched.schedule()
        t1 = time.perf_counter()
        seqs = [step_row(r, n) for r, n in plan.scheduled]
        s_b, t_b = envelope.bucket_for(len(seqs), plan.num_batched_tokens)
        build_step_input(seqs, s_b, t_b, blocks_per_seq, block_size, num_seqs, masks.all_allowed(s_b))
        t2 = time.perf_counter()
        for i, (req, n) in enumerate(plan.scheduled):
            if sched.commit(req, n):
                sched.append_token(req, (step * 7 + i) % 40000 + 3)  # the fake runner's "sampled" token
        t3 = time.perf_counter()
        if len(plan.scheduled) == num_seqs and plan.num_batched_tokens == num_seqs:  # steady decode
            sched_us.append((t1 - t0 + t3 - t2) * 1e6)
            build_us.append((t2 - t1) * 1e6)
        step += 1
    pool.check_invariants()
    return {"num_seqs": num_seqs, "steps": steps, "num_blocks": num_blocks, "block_size": block_size,
            "prompt_len": prompt_len, "shared_prefix_len": shared_prefix_len, "target_us": HOST_TARGET_US,
            "schedule_commit_us": summarize(sched_us), "build_input_us": summarize(build_us),
            "prefix_cache_hit_rate": sched.counters.prefix_hits / max(1, sched.counters.prefix_queries)}


def format_host(r: dict[str, Any]) -> str:
    s, b = r["schedule_commit_us"], r["build_input_us"]
    verdict = "OK" if s["mean"] <= r["target_us"] else "OVER TARGET"
    return (f"== host: {r['num_seqs']} running sequences, {r['steps']} decode steps, {r['num_blocks']} blocks ==\n"
            f"  schedule + commit     mean {s['mean']:,.0f} us  p50 {s['p50']:,.0f}  p99 {s['p99']:,.0f} us/step "
            f"(target <= {r['target_us']:,.0f}: {verdict})\n"
            f"  build_step_input      mean {b['mean']:,.0f} us  p99 {b['p99']:,.0f} us/step")


# --- (b) offline throughput ------------------------------------------------------------------
def shared_prefix_prompts(tokenizer: Any, n: int, seed: int = 0) -> list[list[int]]:
    from runtime.bench.loadgen import shared_prefix_messages

    return [tokenizer.encode(tokenizer.apply_chat_template(m)) for m in shared_prefix_messages(n, seed)]


def system_prompt_tokens(tokenizer: Any) -> int:
    from runtime.bench.loadgen import SYSTEM_PROMPT

    return len(tokenizer.encode(SYSTEM_PROMPT))


def _timed_generate(engine: Any, prompts: list[list[int]], params: Any, one_at_a_time: bool) -> dict[str, Any]:
    engine.reset_prefix_cache()
    t0 = time.perf_counter()
    if one_at_a_time:
        reqs = [engine.generate([p], params)[0] for p in prompts]
    else:
        reqs = engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    out = sum(len(r.output_ids) for r in reqs)
    prompt = sum(len(r.prompt_ids) for r in reqs)
    cached = sum(max(0, r.num_cached_tokens) for r in reqs)
    return {"num_requests": len(reqs), "output_tokens": out, "prompt_tokens": prompt, "seconds": dt,
            "output_tokens_per_s": out / dt, "prefix_cache_hit_rate": cached / max(1, prompt),
            "failed": sum(1 for r in reqs if r.finish_reason not in ("length", "stop"))}


def bench_throughput(engine: Any, *, num_requests: int = 64, max_tokens: int = 64, sequential_requests: int = 16,
                     seed: int = 0) -> dict[str, Any]:
    from runtime.model.sampling import SamplingParams

    tok = engine.tokenizer
    prompts = shared_prefix_prompts(tok, num_requests, seed)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # touch caches
    batched = _timed_generate(engine, prompts, params, one_at_a_time=False)
    seq = _timed_generate(engine, prompts[:max(1, min(sequential_requests, num_requests))], params,
                          one_at_a_time=True)
    env = engine.envelope
    return {"model": engine.config.model.name, **batched, "max_tokens": max_tokens,
            "system_prompt_tokens": system_prompt_tokens(tok), "prompt_tokens_min": min(map(len, prompts)),
            "prompt_tokens_max": max(map(len, prompts)), "max_num_seqs": env.max_num_seqs,
            "max_num_batched_tokens": env.max_num_batched_tokens, "warmup_s": engine.warmup_seconds,
            "sequential": seq}


def format_throughput(r: dict[str, Any]) -> str:
    s = r["sequential"]
    return (f"== throughput: {r['num_requests']} chat requests, shared {r['system_prompt_tokens']}-token system "
            f"prompt, {r['max_tokens']} output tokens each, {r['model']} ==\n"
            f"  continuous batching   {r['output_tokens']:,} tokens in {r['seconds']:.1f} s = "
            f"{r['output_tokens_per_s']:,.1f} output tok/s  (prefix-cache hit rate "
            f"{r['prefix_cache_hit_rate'] * 100:.1f}%)\n"
            f"  one at a time ({s['num_requests']})   {s['output_tokens']:,} tokens in {s['seconds']:.1f} s = "
            f"{s['output_tokens_per_s']:,.1f} output tok/s  (hit rate {s['prefix_cache_hit_rate'] * 100:.1f}%)\n"
            f"  speed-up              {r['output_tokens_per_s'] / s['output_tokens_per_s']:.1f}x")


# --- (c) decode step split ----------------------------------------------------------------------
def _decode_input(runner: Any, batch: int, context_len: int) -> Any:
    from runtime.model.batch import build_step_input

    return build_step_input(decode_rows(runner, batch, context_len), batch, batch, runner.max_blocks_per_seq,
                            runner.cache_cfg.block_size, runner.scratch_row, runner.masks.all_allowed(batch))


def _time_steps(fns: list[Callable], runner: Any, inp: Any, iters: int, warmup: int,
                between: Callable[[], Any] | None = None) -> list[list[float]]:
    """Seconds per call of each jitted step fn, interleaved call by call (so a burst of
    load from elsewhere on the machine hits every variant alike), and `between()` after
    each timed round. The donated KV cache and penalty state are threaded through and
    handed back to the runner."""
    import jax

    inp = jax.device_put(inp)
    kv, pen = runner.kv, runner.penalty
    times: list[list[float]] = [[] for _ in fns]
    try:
        for i in range(warmup + iters):
            for fn, ts in zip(fns, times):
                t0 = time.perf_counter()
                kv, pen, out, *_ = fn(runner.params, kv, pen, inp)
                jax.block_until_ready(out.token_ids)
                if i >= warmup:
                    ts.append(time.perf_counter() - t0)
            if between is not None and i >= warmup:
                between()
    finally:
        runner.kv, runner.penalty = kv, pen
    return times


def bench_decode(engine: Any, *, batches: tuple[int, ...] = (1, 8, 32, 64), context_len: int = 350,
                 iters: int = 10, warmup: int = 2, bandwidth_mb: int = 512) -> dict[str, Any]:
    import jax

    from runtime.model.runner import _step
    from runtime.planner.core import ReadProbe, read_bandwidth

    runner = engine.runner
    cfg = runner.cfg
    noop = partial(_step, cfg, _noop_attention, runner.cache_cfg.num_blocks, None)
    noop.__name__ = "pagedjax_bench_noop_attention_step"  # type: ignore[attr-defined]
    noop_jit = jax.jit(noop, donate_argnums=(1, 2))
    # what a 1-row step reads: every weight, the head once: where the float kernel's packed copy
    # serves it (models/llama.py lm_head), that copy and not the embedding table (one row of it)
    # or an untied lm_head
    skip = ("embed", "lm_head") if "head_f32" in runner.params else ()
    read = {k: v for k, v in runner.params.items() if k not in skip}
    weight_bytes = sum(int(a.size) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(read))
    # The read bandwidth: a pass over an array of the weights' size (at least bandwidth_mb)
    # after each timed batch-1 round, the fastest taken (a limit is what the machine can
    # do), so probe and steps see the shared machine in the same minutes
    probe = ReadProbe(max(weight_bytes, bandwidth_mb << 20)) if 1 in batches else None
    rows = []
    try:
        for b in batches:
            inp = _decode_input(runner, b, context_len)
            full_t, bare_t = _time_steps([runner._step, noop_jit], runner, inp, iters, warmup,
                                         between=probe.sample if probe is not None and b == 1 else None)
            full, bare = (summarize(full_t)["p50"] or 0.0), (summarize(bare_t)["p50"] or 0.0)
            attn = max(0.0, full - bare)
            rows.append({"batch": b, "full_ms": full * 1e3, "no_attention_ms": bare * 1e3, "attention_ms": attn * 1e3,
                         "attention_share": attn / full, "tokens_per_s": b / full,
                         "full_min_ms": min(full_t) * 1e3, "no_attention_min_ms": min(bare_t) * 1e3})
        bandwidth = max(probe.rates) if probe is not None else read_bandwidth(bandwidth_mb)
        passes = list(probe.rates) if probe is not None else []
    finally:
        if probe is not None:
            probe.close()
    engine.reset_prefix_cache()  # the benchmark wrote KV into blocks behind the pool's back
    limit = weight_bytes / bandwidth
    b1 = next((r for r in rows if r["batch"] == 1), None)
    bw = {"weight_bytes": weight_bytes, "read_bandwidth_gb_s": bandwidth / 1e9,
          "limit_ms": limit * 1e3, "measured_ms": b1["full_ms"] if b1 else None,
          "achieved_pct": (limit * 1e3 / b1["full_ms"] * 100) if b1 else None,
          "kv_bytes_per_token": cfg.kv_bytes_per_token(runner.cache_cfg.kv_dtype),
          "probe_passes": len(passes),
          "read_bandwidth_median_gb_s": sorted(passes)[len(passes) // 2] / 1e9 if passes else None}
    return {"model": cfg.name, "context_len": context_len, "iters": iters, "dtype": str(runner.kv[0].dtype),
            "rows": rows, "bandwidth": bw}


def format_decode(r: dict[str, Any]) -> str:
    lines = [f"== decode step: {r['model']}, context {r['context_len']} tokens, median of {r['iters']} ==",
             f"  {'batch':>5} {'full ms':>9} {'no-attn ms':>11} {'attn ms':>9} {'attn share':>11} {'tok/s':>9}"]
    for x in r["rows"]:
        lines.append(f"  {x['batch']:>5} {x['full_ms']:>9.2f} {x['no_attention_ms']:>11.2f} {x['attention_ms']:>9.2f} "
                     f"{x['attention_share'] * 100:>10.0f}% {x['tokens_per_s']:>9,.0f}")
    bw = r["bandwidth"]
    if bw["measured_ms"] is not None:
        lines.append(f"  batch-1 bandwidth limit: {bw['weight_bytes'] / 1e6:,.0f} MB weights / "
                     f"{bw['read_bandwidth_gb_s']:.1f} GB/s = {bw['limit_ms']:.2f} ms; measured "
                     f"{bw['measured_ms']:.2f} ms = {bw['achieved_pct']:.0f}% of the limit")
        if bw.get("probe_passes"):
            lines.append(f"  (read bandwidth: the fastest of {bw['probe_passes']} passes over "
                         f"{bw['weight_bytes'] / 1e6:,.0f}+ MB, one after each batch-1 round; their median "
                         f"{bw['read_bandwidth_median_gb_s']:.1f} GB/s)")
    return "\n".join(lines)


# --- the command ----------------------------------------------------------------------------------
def loadavg() -> float | None:
    """1-minute load average when a part starts: on a shared machine it explains the noise."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def run_offline(args: argparse.Namespace) -> int:
    import json

    from runtime.bench.machine import machine_info
    from runtime.bench.report import write_json

    parts = ALL_PARTS if args.part == "all" else tuple(args.part.split(","))
    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise SystemExit(f"pagedjax bench offline: error: part: unknown {bad[0]!r} (known: {', '.join(PARTS)}, all)")
    result: dict[str, Any] = {}
    if args.out and Path(args.out).is_file():
        try:  # running parts one by one accumulates them in one file
            result = json.loads(Path(args.out).read_text())
        except ValueError:
            result = {}
    result.update(kind="offline", machine=machine_info())
    if "host" in parts:
        load = loadavg()
        result["host"] = {**bench_host(args.host_seqs, args.host_steps), "loadavg_1m": load}
        print(format_host(result["host"]), flush=True)
    if any(p in parts for p in ("throughput", "decode", "breakdown", "overlap")):
        from runtime.checkpoint.pull import resolve_checkpoint

        result["checkpoint"] = Path(resolve_checkpoint(args.checkpoint)).resolve().name
        engine = build_engine(args, warmup="throughput" in parts)
        if "throughput" in parts:
            load = loadavg()
            result["throughput"] = bench_throughput(engine, num_requests=args.num_requests,
                                                    max_tokens=args.max_tokens,
                                                    sequential_requests=args.sequential_requests, seed=args.seed)
            result["throughput"]["loadavg_1m"] = load
            print(format_throughput(result["throughput"]), flush=True)
        if "decode" in parts:
            batches = tuple(int(x) for x in args.batches.split(","))
            load = loadavg()
            result["decode"] = bench_decode(engine, batches=batches, context_len=args.context_len,
                                            iters=args.iters)
            result["decode"]["loadavg_1m"] = load
            print(format_decode(result["decode"]), flush=True)
        if "breakdown" in parts or "overlap" in parts:
            from runtime.bench.breakdown import bench_breakdown, bench_overlap, format_breakdown, format_overlap

            batches = tuple(int(x) for x in args.breakdown_batches.split(","))
            if "breakdown" in parts:
                load = loadavg()
                bd = bench_breakdown(engine, batches=batches, iters=args.iters)
                result["breakdown"] = {**bd, "loadavg_1m": load}
                print(format_breakdown(bd), flush=True)
            if "overlap" in parts:
                load = loadavg()
                ov = bench_overlap(engine, batches=batches)
                result["overlap"] = {**ov, "loadavg_1m": load}
                print(format_overlap(ov), flush=True)
    if args.out:
        write_json(result, args.out)
        print(f"wrote {args.out}")
    return 0


def build_engine(args: argparse.Namespace, warmup: bool) -> Any:
    from runtime.checkpoint.pull import resolve_checkpoint
    from runtime.core.engine import LLMEngine
    from runtime.core.engine_args import engine_config_from_args

    path = resolve_checkpoint(args.checkpoint)
    return LLMEngine.from_checkpoint(path, engine_config_from_args(args), warmup=warmup,
                                     progress=not args.no_progress)


def add_offline_arguments(p: argparse.ArgumentParser) -> None:
    from runtime.core.engine_args import add_engine_arguments

    p.add_argument("--checkpoint", help="checkpoint directory (default: the pulled default model)")
    p.add_argument("--part", default="all", help=f"all ({', '.join(ALL_PARTS)}) or a comma-separated list of "
                                                 f"{', '.join(PARTS)}")
    p.add_argument("--out", metavar="FILE.json", help="write (merge) results as JSON")
    p.add_argument("--host-seqs", type=int, default=256, help="host: running sequences")
    p.add_argument("--host-steps", type=int, default=200, help="host: measured decode steps")
    p.add_argument("--num-requests", type=int, default=64, help="throughput: chat requests")
    p.add_argument("--max-tokens", type=int, default=64, help="throughput: output tokens per request")
    p.add_argument("--sequential-requests", type=int, default=16,
                   help="throughput: how many of the requests the one-at-a-time run serves")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batches", default="1,8,32,64", help="decode: batch sizes")
    p.add_argument("--context-len", type=int, default=350, help="decode: context tokens per sequence")
    p.add_argument("--breakdown-batches", default="64,256",
                   help="breakdown/overlap: batch sizes (the envelope's --max-num-seqs must cover them)")
    p.add_argument("--iters", type=int, default=10, help="decode: timed steps per batch size (median)")
    p.add_argument("--no-progress", action="store_true")
    add_engine_arguments(p, serving=True)
    p.set_defaults(max_num_seqs=64, max_num_batched_tokens=512, max_model_len=1024, kv_cache_memory="1536MiB",
                   max_admissions_per_step=64)
