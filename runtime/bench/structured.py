"""`pagedjax bench structured`: what a structured output costs per step, at 1, 16 and 64
constrained rows -- the host filling the [rows, V/32] bitmask with llguidance, the jitted
sampler applying it, and a whole engine decode step with constrained rows against free
rows (the engine reads a constrained row's step back before planning the next).
Prints the CPU model and load beside the numbers."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "maxItems": 4, "items": {"enum": ["a", "b", "c"]}}}}


def add_structured_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", type=Path, default=None, help="default: the default model")
    p.add_argument("--rows", default="1,16,64", help="constrained rows per step, comma-separated")
    p.add_argument("--steps", type=int, default=24, help="steps measured per point")
    p.add_argument("--engine", action="store_true", help="also time whole engine decode steps")
    p.add_argument("--json", type=Path, help="write the numbers here")


def _host_fill(compiler: Any, masks: Any, rows: int, steps: int, rng: np.random.Generator) -> float:
    """Mean seconds per step to fill `rows` masks, each matcher walking a random valid path."""
    from runtime.model.structured import Guide, allowed_ids

    guide = Guide.json_schema(SCHEMA, "bench")
    matchers = [compiler.compile(guide) for _ in range(rows)]
    total = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        mask = masks.build(rows, [(i, m) for i, m in enumerate(matchers)], [], compiler.executor)
        total += time.perf_counter() - t0
        for i, m in enumerate(matchers):
            if m.is_stopped():
                m.reset()
                continue
            ok = allowed_ids(mask[i], masks.vocab_size)
            m.consume_token(int(rng.choice(ok)))
    return total / steps


def _device_apply(vocab: int, rows: int, steps: int) -> tuple[float, float]:
    """Mean seconds of the jitted sampler on [64, V] logits: no mask vs `rows` masked rows."""
    import jax
    import jax.numpy as jnp

    from runtime.model.sampling import SamplingParams, SamplingRow, make_sampling_inputs, sample

    S, W = 64, -(-vocab // 32)
    logits = jax.random.normal(jax.random.key(0), (S, vocab), jnp.float32)
    inp_rows = [SamplingRow(SamplingParams(temperature=0.0))] * S
    free = np.full((S, W), -1, np.int32)
    masked = free.copy()
    masked[:rows, ::2] = 0x55555555  # half the vocabulary forbidden in those rows
    fn = jax.jit(lambda lg, si: sample(lg, si, None, None, num_logprobs=0).token_ids)
    out = []
    for m in (free, masked):
        si = make_sampling_inputs(inp_rows, S, m)
        fn(logits, si).block_until_ready()
        t0 = time.perf_counter()
        for _ in range(steps):
            fn(logits, si).block_until_ready()
        out.append((time.perf_counter() - t0) / steps)
    return out[0], out[1]


def _engine_steps(ckpt: Path, rows: int, steps: int) -> tuple[float, float]:
    """Mean decode-step seconds of a 64-row engine batch: all free vs `rows` constrained."""
    from runtime.config import AdmissionPolicy, CacheConfig, EngineConfig, SchedulerConfig
    from runtime.core.engine import LLMEngine
    from runtime.model.sampling import SamplingParams
    from runtime.model.structured import Guide

    env = SchedulerConfig(64, 512, 512)

    def build(model: Any) -> EngineConfig:
        return EngineConfig(model, CacheConfig(16, 64 * 8 + 16, "float32", False), env,
                            AdmissionPolicy(max_num_seqs=64, max_num_batched_tokens=512), "xla", "float32")

    eng = LLMEngine.from_checkpoint(ckpt, build, progress=False)
    prompt = eng.tokenizer.encode("Describe a person as JSON: ")
    times = []
    for k in (0, rows):
        guide = Guide.json_schema(SCHEMA, "bench")
        for i in range(64):
            p = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True,
                               guide=guide if i < k else None)
            eng.add_request(prompt, p)
        while eng.scheduler.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running):
            eng.step()
        eng.step()
        t0, n = time.perf_counter(), 0
        while n < steps and eng.has_unfinished():
            eng.step()
            n += 1
        times.append((time.perf_counter() - t0) / max(n, 1))
        for r in list(eng.scheduler.running) + eng.scheduler.waiting_requests():
            eng.abort(r.request_id)
        eng.run_until_done()
    return times[0], times[1]


def run_structured(args: argparse.Namespace) -> int:
    from runtime.bench.machine import cpu_busy_pct, loadavg_1m, machine_info
    from runtime.checkpoint.pull import resolve_checkpoint
    from runtime.checkpoint.store import load_checkpoint
    from runtime.model.structured import GuideCompiler, TokenMasks

    ckpt = resolve_checkpoint(args.checkpoint)
    cfg, _, tok = load_checkpoint(ckpt)
    info = machine_info()
    print(f"CPU: {info['cpu_model']} ({info['cores']} cores), load {loadavg_1m()}, busy {cpu_busy_pct(1.0):.0f}%")
    compiler, masks = GuideCompiler(tok, cfg.vocab_size), TokenMasks(cfg.vocab_size)
    rng = np.random.default_rng(0)
    results = []
    for rows in [int(x) for x in args.rows.split(",")]:
        host = _host_fill(compiler, masks, rows, args.steps, rng)
        free, masked = _device_apply(cfg.vocab_size, rows, args.steps)
        row = {"rows": rows, "host_fill_ms": host * 1e3, "sampler_free_ms": free * 1e3,
               "sampler_masked_ms": masked * 1e3}
        line = (f"{rows:3d} constrained rows: host mask fill {host * 1e3:7.2f} ms/step; sampler [64, V] "
                f"{free * 1e3:6.2f} ms free, {masked * 1e3:6.2f} ms masked")
        if args.engine:
            e_free, e_con = _engine_steps(ckpt, rows, args.steps)
            row.update(engine_step_free_ms=e_free * 1e3, engine_step_constrained_ms=e_con * 1e3)
            line += f"; engine decode step (64 rows) {e_free * 1e3:.1f} ms free, {e_con * 1e3:.1f} ms constrained"
        print(line, flush=True)
        results.append(row)
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "load_1m": loadavg_1m(), "results": results}, indent=2))
    return 0
