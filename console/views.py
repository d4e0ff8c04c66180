"""View models for the console pages: plain dicts and dataclasses built from the engine's
snapshot API, so templates never reach into the engine or hold its lock.

Every read holds `engine.lock` only for copying; aggregation, decoding and formatting
happen after it is released so a console viewer never stalls the engine thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from console import charts
from runtime.block_pool import hash_block
from runtime.metrics import percentile
from runtime.snapshot import BlockView, take_snapshot

if TYPE_CHECKING:
    from runtime.engine import LLMEngine

MAX_CELLS = 1024          # block-map cells; bigger caches aggregate blocks per cell
STATE_CODES = ("free", "cached", "used", "shared")
RECENT_S = 60.0           # window for "now" rates and latency percentiles
HORIZON_S, BIN_S = 180.0, 3.0


def _pool_blocks(pool: Any) -> Sequence[Any]:
    # pool.snapshot() copies every BlockInfo (~0.2 s at 50k blocks, under the engine lock,
    # once a second per viewer). Reading the live records for a few fields is ~50x cheaper;
    # callers hold engine.lock and copy what they need.
    return pool.infos


def _state_code(info: Any) -> int:
    rc = info.ref_count
    return 3 if rc > 1 else 2 if rc == 1 else 1 if info.block_hash is not None else 0


@dataclass(frozen=True)
class Cell:
    state: str          # dominant state in the cell
    title: str          # hover text


@dataclass(frozen=True)
class BlockMap:
    cells: list[Cell]
    per_cell: int       # blocks per cell (1 = one cell per block)
    counts: dict[str, int]


def _owners(engine: LLMEngine) -> dict[int, list[str]]:
    owners: dict[int, list[str]] = {}
    for r in engine.scheduler.running:
        for b in r.block_ids:
            owners.setdefault(b, []).append(r.request_id)
    return owners


def block_views(engine: LLMEngine, start: int, stop: int) -> list[BlockView]:
    """BlockViews for ids [start, stop); same rules as runtime.snapshot.take_snapshot,
    without copying the whole pool."""
    now = time.monotonic()
    with engine.lock:
        owners = _owners(engine)
        infos = [(i.block_id, _state_code(i), i.ref_count, i.block_hash is not None, i.last_used, i.hits)
                 for i in _pool_blocks(engine.pool)[max(0, start):stop]]
    return [BlockView(b, STATE_CODES[c], rc, tuple(owners.get(b, ())), h, max(0.0, now - lu) if lu else 0.0, hits)
            for b, c, rc, h, lu, hits in infos]


def block_title(v: BlockView) -> str:
    parts = [f"block {v.block_id}", v.state, f"ref {v.ref_count}"]
    if v.owners:
        parts.append("owner " + ", ".join(v.owners))
    parts.append("prefix hash" if v.cached_hash else "no hash")
    parts.append(f"age {v.age_s:.1f} s")
    return " · ".join(parts)


def block_map(engine: LLMEngine, max_cells: int = MAX_CELLS) -> BlockMap:
    n = engine.pool.num_blocks
    if n <= max_cells:
        views = block_views(engine, 0, n)
        counts = {s: 0 for s in STATE_CODES}
        for v in views:
            counts[v.state] += 1
        return BlockMap([Cell(v.state, block_title(v)) for v in views], 1, counts)
    with engine.lock:
        codes = bytes(_state_code(i) for i in _pool_blocks(engine.pool))
    per = -(-n // max_cells)
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


def _p(values: list[float], q: float) -> float | None:
    return percentile(values, q)


def dashboard(engine: LLMEngine) -> dict[str, Any]:
    bmap = block_map(engine)
    w = engine.metrics.window
    with engine.lock:
        snap = take_snapshot(engine, with_blocks=False)
        steps, ttft, itl = list(w.steps), list(w.ttft), list(w.itl)
        ages = list(engine.pool.evicted_ages)
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


def requests_view(engine: LLMEngine) -> dict[str, Any]:
    with engine.lock:
        snap = take_snapshot(engine, with_blocks=False)
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


def _follow(parent: tuple, groups: dict[float, list[tuple]], everything: list[tuple], budget: list[int]
            ) -> tuple | None:
    """The most-hit child block of `parent` (hash chaining: child = H(parent, tokens)).
    Blocks freed or hit together share last_used, so that group is searched first; a
    bounded scan of all hashed blocks covers the rest."""
    found = []
    for pool in (groups.get(parent[4], []), everything):
        for c in pool:
            if budget[0] <= 0:
                break
            if c is parent:
                continue
            budget[0] -= 1
            if hash_block(parent[1], c[2]) == c[1]:
                found.append(c)
        if found:
            break
    return max(found, key=lambda c: c[3]) if found else None


def top_prefixes(engine: LLMEngine, k: int = 10, decode_tokens: int = 48,
                 hash_budget: int = 20_000) -> list[PrefixRow]:
    """Prompt prefixes that later prompts reused, most hits first."""
    with engine.lock:
        hashed = [(i.block_id, i.block_hash, i.token_ids, i.hits, i.last_used, i.ref_count)
                  for i in _pool_blocks(engine.pool) if i.block_hash is not None and i.token_ids]
    # Roots (first block of a prompt) hash with no parent; salted prefixes do not verify
    # here and are left out rather than shown mid-prompt.
    roots = [b for b in hashed if b[3] > 0 and hash_block(None, b[2]) == b[1]]
    roots.sort(key=lambda b: (-b[3], b[0]))
    groups: dict[float, list[tuple]] = {}
    for b in hashed:
        groups.setdefault(b[4], []).append(b)
    budget = [hash_budget]
    rows = []
    for root in roots[:k]:
        chain, cur = [root], root
        # Follow the reused part of the prompt: children that were hit at least once.
        while budget[0] > 0 and len(chain) < 4096:
            nxt = _follow(cur, groups, hashed if len(hashed) <= 4096 else [], budget)
            if nxt is None or nxt[3] == 0:
                break
            chain.append(nxt)
            cur = nxt
        ids = [t for b in chain for t in b[2]][:decode_tokens]
        rows.append(PrefixRow(root[0], engine.tokenizer.decode(ids), root[3], len(chain),
                              len(chain) * len(root[2]), any(b[5] > 0 for b in chain)))
    return rows


def prefix_cache(engine: LLMEngine) -> dict[str, Any]:
    with engine.lock:
        snap = take_snapshot(engine, with_blocks=False)
        ages = list(engine.pool.evicted_ages)
        age_total = getattr(engine.pool, "evicted_age_total", 0.0)
    return {"snap": snap, "cached_tokens": snap.cached_blocks * snap.block_size,
            "misses": snap.prefix_queries - snap.prefix_hits, "top": top_prefixes(engine),
            "evicted_age_p50": _p(ages, 50), "evicted_age_max": max(ages) if ages else None,
            "evicted_age_mean": (age_total / snap.evictions) if snap.evictions else None,
            "enabled": engine.config.cache.enable_prefix_cache}


def _jax_device() -> str:
    try:
        import jax

        d = jax.devices()[0]
        return f"{d.platform} ({getattr(d, 'device_kind', d.platform)}) × {jax.device_count()}"
    except Exception:  # noqa: BLE001 -- informational only
        return "unknown"


def model_view(engine: LLMEngine, settings: Any) -> dict[str, Any]:
    from runtime import planner
    from runtime.config import DTYPE_BYTES, KV_SCALE_BYTES, QUANTIZED_KV_DTYPES
    from runtime.model_runner import compilations

    cfg = engine.config
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
        "m": m, "cache": c, "env": env, "dtype": cfg.dtype, "backend": engine.runner.attention_backend
        + (" (decode rows: C++ kernel, runtime/cpu_attention.cc)" if engine.runner.attention_kernel else "")
        + ("; int8 products: C++ kernel, runtime/cpu_matmul.cc" if engine.runner.matmul_kernel else ""),
        "quantization": cfg.quantization, "lm_head_int8": cfg.quantize_lm_head, "kv_quantized": c.kv_dtype in QUANTIZED_KV_DTYPES,
        "kv_elem_bytes": DTYPE_BYTES[c.kv_dtype], "kv_scale_bytes": KV_SCALE_BYTES,
        "device": _jax_device(), "params": m.param_count(),
        "weight_bytes": m.param_count() * planner.WEIGHT_DTYPE_BYTES.get(cfg.dtype, 4),
        "kv_per_token": per_token, "bytes_per_block": c.bytes_per_block(m),
        "kv_cache_bytes": engine.runner.kv_cache_bytes(), "seq_len": seq_len,
        "c_seq": per_token * seq_len, "cache_seqs": c.num_tokens // seq_len,
        "buckets": env.bucket_pairs(), "compilations": now_compiled,
        "compilations_at_ready": engine.compilations_at_ready,
        "compilations_since_ready": now_compiled - engine.compilations_at_ready,
        "warmup_s": engine.warmup_seconds, "plans": plans,
    }
