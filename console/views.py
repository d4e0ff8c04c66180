"""View models for the console pages: plain dicts and dataclasses built from the engine's
read model (runtime/core/snapshot.py), so templates never reach into the engine or hold its lock.

Only the read model touches the engine's pool, scheduler and metrics, holding
`engine.lock` just for copying; aggregation, decoding and formatting happen here, after
it is released, so a console viewer never stalls the engine thread. Besides it, views
read only the engine's immutable config, envelope and tokenizer.
"""

from __future__ import annotations

import statistics

import time
from pathlib import Path
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from console import charts
from runtime.core import snapshot as read
from runtime.core.snapshot import BLOCK_STATES, BlockView

if TYPE_CHECKING:
    from runtime.core.engine import LLMEngine

MAX_CELLS = 1024          # block-map cells; bigger caches aggregate blocks per cell
STATE_CODES = BLOCK_STATES  # index = state code (runtime.core.block_pool.block_state)
RECENT_S = 60.0           # window for "now" rates and latency percentiles
HORIZON_S, BIN_S = 180.0, 3.0


@dataclass(frozen=True)
class Cell:
    state: str          # dominant state in the cell
    title: str          # hover text


@dataclass(frozen=True)
class BlockMap:
    cells: list[Cell]
    per_cell: int       # blocks per cell (1 = one cell per block)
    counts: dict[str, int]


def blocks_per_cell(num_blocks: int, max_cells: int = MAX_CELLS) -> int:
    return 1 if num_blocks <= max_cells else -(-num_blocks // max_cells)


def block_views(engine: LLMEngine, start: int, stop: int) -> list[BlockView]:
    return read.block_views(engine, start, stop)


def block_title(v: BlockView) -> str:
    parts = [f"block {v.block_id}", v.state, f"ref {v.ref_count}"]
    if v.owners:
        parts.append("owner " + ", ".join(v.owners))
    parts.append("prefix hash" if v.cached_hash else "no hash")
    parts.append(f"age {v.age_s:.1f} s")
    return " · ".join(parts)


def block_map(engine: LLMEngine, max_cells: int = MAX_CELLS) -> BlockMap:
    codes = read.block_states(engine)
    n = len(codes)
    per = blocks_per_cell(n, max_cells)
    if per == 1:
        # One cell per block: its hover text names owners and age, so copy full views.
        views = read.block_views(engine, 0, n)
        counts = {s: 0 for s in STATE_CODES}
        for v in views:
            counts[v.state] += 1
        return BlockMap([Cell(v.state, block_title(v)) for v in views], 1, counts)
    cells: list[Cell] = []
    totals = [0, 0, 0, 0]
    for a in range(0, n, per):
        chunk = codes[a:a + per]
        c = [chunk.count(k) for k in range(4)]
        totals = [x + y for x, y in zip(totals, c, strict=True)]
        # Ties go to the busier state so a half-used cell never looks idle.
        dom = max(range(4), key=lambda k: (c[k], k))
        cells.append(Cell(STATE_CODES[dom], f"blocks {a}–{a + len(chunk) - 1}: {c[2]} used, {c[3]} shared, "
                                            f"{c[1]} cached, {c[0]} free"))
    return BlockMap(cells, per, dict(zip(STATE_CODES, totals, strict=True)))


def _p(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def dashboard(engine: LLMEngine) -> dict[str, Any]:
    bmap = block_map(engine)
    snap = read.take_snapshot(engine, with_blocks=False)
    w = read.metrics_window(engine)
    steps, ttft, itl, ages = list(w.steps), w.ttft, w.itl, snap.evicted_ages
    now = time.monotonic()
    n = snap.num_blocks
    bins = charts.bin_steps(steps, now, HORIZON_S, BIN_S)
    recent = [s for s in steps if s.t >= now - RECENT_S]
    base = next((s for s in reversed(steps) if s.t < now - RECENT_S), recent[0] if recent else None)
    last = steps[-1] if steps else None
    rq = (last.prefix_queries - base.prefix_queries) if (last and base) else 0
    rh = (last.prefix_hits - base.prefix_hits) if (last and base) else 0
    span = (last.t - base.t) if (last and base and last.t > base.t) else RECENT_S
    ev_rate = ((last.evictions - base.evictions) / span) if (last and base) else 0.0
    eviction = engine.eviction()
    rttft = [v for t, v in ttft if t >= now - RECENT_S]
    ritl = [v for t, v in itl if t >= now - RECENT_S]
    states = [r.state for r in snap.requests]
    headroom = snap.free_blocks + snap.cached_blocks - snap.watermark_blocks
    occ = {k: bmap.counts[k] for k in STATE_CODES}
    xs = bins.xs
    s = charts.Series

    def chart(cid: str, title: str, series: list[charts.Series], fmt: charts.Fmt, **kw: Any) -> charts.Chart:
        return charts.line_chart(cid, title, xs, series, fmt, horizon_s=HORIZON_S, **kw)

    return {
        "snap": snap, "map": bmap, "occ": occ, "headroom": headroom,
        "occ_bar": charts.occupancy_bar(occ, n, snap.watermark_blocks),
        "pct": {k: (v / n if n else 0.0) for k, v in occ.items()},
        "recent_s": int(RECENT_S),
        "recent_hit_rate": rh / rq if rq else None, "evictions_per_s": ev_rate,
        "eviction": eviction, "eviction_cfg": engine.config.eviction,
        "slo": slo_rows(engine), "quote_check": quote_check(engine),
        "evicted_age_p50": _p(ages, 50), "evicted_age_max": max(ages) if ages else None,
        "running": states.count("running"), "waiting": states.count("waiting"),
        "preempted": states.count("preempted"),
        "ttft_p50": _p(rttft, 50), "ttft_p99": _p(rttft, 99), "itl_p50": _p(ritl, 50), "itl_p99": _p(ritl, 99),
        "ttft_n": len(rttft), "itl_n": len(ritl),
        "output_tps": sum(x.new_tokens for x in recent) / RECENT_S,
        "charts": {
            "hit_rate": chart("c-hit", "Prefix hit rate per interval", [s("hit rate", bins.hit_rate)],
                              charts.pct, y_max=1.0),
            "evictions": chart("c-evict", "Evictions per second", [s("evictions/s", bins.evictions_per_s)],
                               charts.num),
            "queue": chart("c-queue", "Queue depth", [s("running", bins.running), s("waiting", bins.waiting)],
                           charts.num),
            "tokens": chart("c-tokens", "Tokens per step", [s("tokens/step", bins.tokens_per_step)], charts.num),
            "step_time": chart("c-step", "Step time", [s("step time", bins.step_time)], charts.ms),
            "tps": chart("c-tps", "Output tokens per second", [s("tokens/s", bins.output_tps)], charts.num),
            "used": chart("c-used", "Used KV blocks", [s("used blocks", bins.used_blocks)], charts.num),
        },
    }


# Below this share of quotes within +-30% of the measured TTFT (after 20 requests), the
# dashboard says the quote model has drifted.
QUOTE_DRIFT_BELOW = 0.6


def slo_rows(engine: LLMEngine) -> list[dict[str, Any]]:
    """One row per tier and metric with a target: the target and the share met per window."""
    from runtime.core.metrics import SLO_WINDOWS

    per = {w: engine.slo_attainment(w) for w in SLO_WINDOWS}
    pol = engine.policy
    rows = []
    for tier, kind in sorted(per[SLO_WINDOWS[0]]):
        cells = [(int(w), *per[w][(tier, kind)]) for w in SLO_WINDOWS]
        rows.append({"tier": tier, "kind": kind, "target": getattr(pol, f"slo_{kind}_{tier}_s"),
                     "cells": [{"window": w, "met": met, "total": total, "share": met / total if total else None}
                               for w, met, total in cells]})
    return rows


def quote_check(engine: LLMEngine) -> dict[str, Any]:
    m = engine.step_model
    import math

    return {"checked": m.ttft_checked, "within": m.ttft_within_30 if m.ttft_checked else None,
            "calibration": math.exp(m.ttft_log_ratio),
            "drifted": m.ttft_checked >= 20 and m.ttft_within_30 < QUOTE_DRIFT_BELOW}


def policy_preview(engine: LLMEngine, proposed: Any) -> dict[str, Any]:
    """What a policy change would do at the current load, before it is applied: B_max (typical
    requests the KV pool holds under each policy: blocks above the watermark over a typical
    request's claim -- prompt + max_tokens in reserve mode, its context so far in optimistic
    mode -- capped by max_num_seqs) and the admission quote of a typical fresh request now
    (runtime/core/step_model.py) under the current and the proposed policy. Typical: the median
    prompt and max_tokens of the running and waiting requests (512 and 128 when there are none)."""
    from runtime.core import capacity, step_model

    with engine.lock:
        reqs = [*engine.scheduler.running, *engine.scheduler.waiting_requests()]
        prompt = int(statistics.median(r.num_prompt_tokens for r in reqs)) if reqs else 512
        max_tokens = int(statistics.median(r.params.max_tokens for r in reqs)) if reqs else 128
        context = int(statistics.median(r.num_tokens for r in reqs)) if reqs else prompt
        pool, bs = engine.pool, engine.pool.block_size
        vocab = engine.config.model.vocab_size
        ids = [3 + (7 * i) % max(1, vocab - 3) for i in range(prompt)]
        out = {}
        for name, pol in (("current", engine.policy), ("proposed", proposed)):
            claim = prompt + max_tokens if pol.admission_mode == "reserve" else max(context, prompt)
            usable = pool.num_blocks - capacity.watermark_blocks(pol, pool.num_blocks)
            b_max = min(pol.max_num_seqs, usable // max(1, capacity.blocks_for(claim, bs)))
            q = step_model.quote(engine, ids, max_tokens, "interactive", True, policy=pol)
            out[name] = {"b_max": b_max, "admit": q.admit, "reason": q.reason, "ttft": q.predicted_ttft_s,
                         "itl": q.predicted_itl_s, "queue_ahead": q.queue_ahead}
    return {"typical_prompt": prompt, "typical_max_tokens": max_tokens, "based_on": len(reqs), **out}


def ledger_view(led: dict[str, Any] | None) -> dict[str, Any]:
    """The timeline's rows: each decision with its offset from the first, in seconds."""
    if not led or not led["entries"]:
        return {"rows": []}
    t0 = led["entries"][0]["t"]
    rows = [{**e, "at_s": e["t"] - t0, "until_s": e["last_t"] - t0,
             "inputs_text": ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in e["inputs"].items())}
            for e in led["entries"]]
    return {"rows": rows}


def requests_view(engine: LLMEngine) -> dict[str, Any]:
    snap = read.take_snapshot(engine, with_blocks=False)
    order = {"running": 0, "preempted": 1, "waiting": 2}
    reqs = sorted(snap.requests, key=lambda r: (order.get(r.state, 3), -r.age_s))
    return {"requests": reqs, "num_running": sum(r.state == "running" for r in reqs),
            "num_waiting": sum(r.state != "running" for r in reqs)}


@dataclass(frozen=True)
class PrefixRow:
    block_id: int
    text: str
    hits: int
    blocks: int
    tokens: int
    in_use: bool


def top_prefixes(engine: LLMEngine, k: int = 10, decode_tokens: int = 48) -> list[PrefixRow]:
    """Prompt prefixes that later prompts reused, most hits first (runtime.core.snapshot.prefix_chains)."""
    rows = []
    for chain in read.prefix_chains(read.hashed_blocks(engine), k):
        root = chain[0]
        ids = [t for b in chain for t in b.token_ids][:decode_tokens]
        rows.append(PrefixRow(root.block_id, engine.tokenizer.decode(ids), root.hits, len(chain),
                              sum(len(b.token_ids) for b in chain), any(b.ref_count > 0 for b in chain)))
    return rows


def flush_confirm(engine: LLMEngine) -> dict[str, Any]:
    return {"cached": read.take_snapshot(engine, with_blocks=False).cached_blocks}


def prefix_cache(engine: LLMEngine) -> dict[str, Any]:
    snap = read.take_snapshot(engine, with_blocks=False)
    ages = snap.evicted_ages
    return {"snap": snap, "cached_tokens": snap.cached_blocks * snap.block_size,
            "misses": snap.prefix_queries - snap.prefix_hits, "top": top_prefixes(engine),
            "evicted_age_p50": _p(ages, 50), "evicted_age_max": max(ages) if ages else None,
            "evicted_age_mean": snap.evicted_age_mean,
            "enabled": engine.config.cache.enable_prefix_cache}


def _quantization_text(cfg: Any, checkpoint: Any) -> str:
    """What the weights are served as (runtime/model/quant.py describe): a checkpoint stored
    quantized says its own group and GGUF origin; one quantized at start-up groups by 32 where
    every projection's input width divides (quantize_params)."""
    from runtime.model.quant import W8A8_GROUP, describe

    m, meta = cfg.model, {}
    if checkpoint and (Path(checkpoint) / "pagedjax.json").is_file():
        from runtime.checkpoint.store import read_meta

        meta = read_meta(Path(checkpoint))
    group = meta.get("group_size") if meta.get("quantization") == cfg.quantization else None
    if group is None and cfg.quantization in ("w8a8", "w4a16") and all(
            d % W8A8_GROUP == 0 for d in (m.hidden_size, m.intermediate_size, m.num_heads * m.head_dim)):
        group = W8A8_GROUP
    exact = meta.get("quantization") == cfg.quantization and (meta.get("exact_gguf") or meta.get("exact_q8_0"))
    return describe(cfg.quantization, cfg.quantize_lm_head, group, bool(exact))


def _jax_device() -> str:
    try:
        import jax

        d = jax.devices()[0]
        return f"{d.platform} ({getattr(d, 'device_kind', d.platform)}) × {jax.device_count()}"
    except Exception:  # noqa: BLE001 -- informational only
        return "unknown"


def model_view(engine: LLMEngine, settings: Any) -> dict[str, Any]:
    from runtime import planner
    from runtime.config import DTYPE_BYTES, INT8_KV_GROUP, QUANTIZED_KV_DTYPES, kv_scale_bytes, kv_scale_groups
    from runtime.model.runner import compilations

    cfg, info = engine.config, read.model_info(engine)
    m, c, env = cfg.model, cfg.cache, engine.envelope
    per_token = m.kv_bytes_per_token(c.kv_dtype)
    seq_len = env.max_model_len
    now_compiled = compilations()
    plans = []
    for name in ("h100", "h200"):
        try:
            plans.append(planner.plan(m, planner.DEVICES[name], context_len=seq_len,
                                      weight_dtype=planner.normalize_dtype(cfg.dtype, weights=True),
                                      kv_dtype=planner.normalize_dtype(c.kv_dtype)))
        except ValueError:
            continue
    return {
        "checkpoint": str(getattr(settings, "checkpoint", "") or "—"),
        "model_name": getattr(settings, "model_name", None) or m.name,
        "m": m, "cache": c, "env": env, "dtype": cfg.dtype, "backend": info.attention_backend
        + (" (decode rows: C++ kernel, runtime/kernels/cpu/cpu_attention.cc)" if info.attention_kernel else "")
        + ("; int8 products: C++ kernel, runtime/kernels/cpu/cpu_matmul.cc" if info.matmul_kernel else ""),
        "quantization": _quantization_text(cfg, getattr(settings, "checkpoint", None)),
        "kv_quantized": c.kv_dtype in QUANTIZED_KV_DTYPES,
        "kv_elem_bytes": DTYPE_BYTES[c.kv_dtype],
        "kv_scale_bytes": (kv_scale_groups(c.kv_dtype, m.head_dim, "latent") * 4 if m.mla
                           else kv_scale_bytes(c.kv_dtype, m.head_dim)),
        "kv_layout": (f"a float16 scale and zero per {INT8_KV_GROUP['latent']} columns of the latent row" if m.mla
                      and c.kv_dtype == "int8" else
                      f"a float16 scale and zero per {INT8_KV_GROUP['k']} channels of K and {INT8_KV_GROUP['v']} of V"
                      if c.kv_dtype == "int8" else "one float32 scale per token and KV head"),
        "device": _jax_device(), "params": m.param_count(), "active_params": int(m.params_touched(1)),
        "tensor_parallel": info.tensor_parallel,
        "mesh": info.mesh,
        "weight_bytes": m.param_count() * planner.WEIGHT_DTYPE_BYTES.get(cfg.dtype, 4),
        "kv_per_token": per_token, "bytes_per_block": c.bytes_per_block(m),
        "kv_cache_bytes": info.kv_cache_bytes, "seq_len": seq_len,
        "c_seq": per_token * seq_len, "cache_seqs": c.num_tokens // seq_len,
        "buckets": env.bucket_pairs(), "compilations": now_compiled,
        "compilations_at_ready": info.compilations_at_ready,
        "compilations_since_ready": now_compiled - info.compilations_at_ready,
        "warmup_s": info.warmup_s, "plans": plans, "expert_load": expert_load_view(engine),
    }


def expert_load_view(engine: LLMEngine) -> dict[str, Any] | None:
    """A mixture of experts' routing balance (runtime/core/metrics.py ExpertLoad), copied under
    the engine lock; None for a dense model."""
    load = getattr(engine, "expert_load", None)
    if load is None:
        return None
    with engine.lock:
        view = load.view()
    per_expert = view["per_expert"]
    total = sum(per_expert)
    view["hottest"] = sorted(range(len(per_expert)), key=lambda e: -per_expert[e])[:8]
    view["shares"] = [n / total if total else 0.0 for n in per_expert]
    return view
