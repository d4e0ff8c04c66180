"""Where a decode step's time goes, part by part, beside each part's floor on this machine;
and how much host time the async pipeline leaves exposed.

breakdown  one jitted decode step at S sequences sharing a system prompt (the workload the
           engine is tuned for), against isolated timings of its parts: the layer matmuls
           (projections + MLP), the LM head, sampling, attention (full step - the same step
           with attention replaced by a no-op), the KV write, the rest (norms, RoPE,
           embedding and penalty-state updates, padding); plus the host's per-step work:
           building the padded input, the device->host copy, detokenizing and SSE encoding.
           Floors: matmuls at the machine's measured rate of the product the layers use (XLA's
           dot, or the C++ float32 / int8 kernel) for S rows (or one read of
           their weights, if slower), attention/sampling/KV write at its measured read
           bandwidth (the shared prefix read once).
overlap    the engine itself in steady decode at S sequences: wall time per step with async
           scheduling on and off; exposed host time = step wall - device time of the step,
           the device time being the engine's own compiled program replayed on that step's
           input (the breakdown's step above is a stand-alone program: not the same one).
"""

from __future__ import annotations

import json
import time
from functools import partial
from typing import Any

import numpy as np

from runtime.bench.report import summarize


def _median_ms(fn, iters: int, warmup: int = 1) -> float:
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn())
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts) * 1e3)


def _layer_matmuls(cfg: Any, params: Any, x: Any) -> Any:
    """The decoder's projections and MLP alone (what XLA must do at best for these rows),
    through the same functions as the model (int8 weights take the quantized product, packed
    ones the C++ kernel, whose layer tail makes wo, the MLP and the next layer's qkv one call)."""

    from runtime.model.linear import typed
    from runtime.model.families.llama import first_made_qkv, post_attention, qkv_linear, scan_layers, split_qkv

    layers, eps = typed(params)["layers"], cfg.rms_norm_eps

    def body(carry, xs):
        h, made = carry
        lp, layer = xs
        q, k, v = qkv_linear(cfg, lp, h) if made is None else split_qkv(cfg, made)
        a = q + 0 * (k.sum() + v.sum())  # (attention's place: q stands in for its output)
        return post_attention(lp, a, h, (lp["mlp_norm"], eps)), None

    return scan_layers(body, (x, first_made_qkv(layers, x, eps)), layers, cfg.num_layers)[0][0]


def bench_breakdown(engine: Any, *, batches: tuple[int, ...] = (64, 256), shared_len: int = 320,
                    unique_len: int = 48, iters: int = 5, bandwidth_mb: int = 256) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    from runtime.model.xla_attention import write_kv
    from runtime.model.batch import build_step_input
    from runtime.bench.step_rows import _noop_attention, decode_rows
    from runtime.model.runner import NUM_LOGPROBS, _step, allocate_kv
    from runtime.model.quant import linear
    from runtime.model.families.llama import lm_head
    from runtime.planner import measure_cpu
    from runtime.model.sampling import make_sampling_inputs, sample

    runner, cfg = engine.runner, engine.runner.cfg
    d, V, L = cfg.hidden_size, cfg.vocab_size, cfg.num_layers
    dev = measure_cpu(size_mb=bandwidth_mb)
    bw = dev.bandwidth_bytes_per_s
    kv_tok = cfg.kv_bytes_per_token(runner.cache_cfg.kv_dtype)
    from runtime.kernels.cpu import matmul as cpu_matmul
    from runtime.model.quant import LINEAR_WEIGHTS, quantization_of

    method = quantization_of(runner.params)
    packed = bool(getattr(runner, "matmul_kernel", False))
    f32k = bool(getattr(runner, "f32_kernel", False))
    layer_w = [w for k, w in runner.params["layers"].items() if k in (*LINEAR_WEIGHTS, *cpu_matmul.FUSED)]
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    layer_flops_per_row = 2 * L * (d * qkv + cfg.num_heads * cfg.head_dim * d + 3 * d * cfg.intermediate_size)
    layer_bytes = sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(layer_w))
    head_bytes = int(runner.params["embed"].size) * runner.params["embed"].dtype.itemsize
    noop = jax.jit(partial(_step, cfg, _noop_attention, runner.cache_cfg.num_blocks, None), donate_argnums=(1, 2))
    detok_tok = engine.tokenizer
    rows_out = []
    for S in batches:
        seqs = decode_rows(runner, S, shared_len // runner.cache_cfg.block_size * runner.cache_cfg.block_size
                           + unique_len, shared_len)
        host_in = build_step_input(seqs, S, S, runner.max_blocks_per_seq, runner.cache_cfg.block_size,
                                   runner.scratch_row, runner.masks.all_allowed(S))
        inp = jax.device_put(host_in)
        state = {"kv": runner.kv, "rows": runner.penalty}

        def run(fn):
            def go():
                state["kv"], state["rows"], out, *_ = fn(runner.params, state["kv"], state["rows"], inp)
                return out.token_ids
            return go
        x = jnp.ones((S, d), runner.params["embed"].dtype)
        # dot rate of XLA for this row count: the issue's own yardstick (S x d by d x 4d), in
        # the product the layers use (w8a8: int8 x int8 -> int32 with the per-row activation
        # quantization, w8a16: dequantize + float; both the new matmul floor; packed: the kernel)
        ones8, ones_s = np.ones((d, 4 * d), np.int8), np.ones((4 * d,), np.float32)
        w = (jax.tree.map(jnp.asarray, cpu_matmul.pack_float(np.ones((d, 4 * d), np.float32))) if f32k
             else jnp.ones((d, 4 * d), x.dtype)) if method == "none" else jax.tree.map(
            jnp.asarray, cpu_matmul.pack_weight(ones8, ones_s) if packed
            else {("q" if method == "w8a8" else "w8"): ones8, "s": ones_s})
        dot = jax.jit(linear)  # (the weight an argument, as in the step: a captured constant
        # measured the float kernel at 61-79 GFLOP/s against 99 for the layers' own products)
        # The full step and the yardstick each as the best of three medians (one burst of load
        # from elsewhere during a single median once put the floor above the whole step),
        # taken in alternation: on this shared VM the yardstick's rate moved by a quarter
        # between runs minutes apart, and step and floor must see the same machine.
        fulls, dots = [], []
        try:
            for r in range(3):
                fulls.append(_median_ms(run(runner._step), iters))
                dots.append(_median_ms(lambda: dot(x, w), max(iters, 10)))
                if r == 0:
                    no_attn = _median_ms(run(noop), iters)
        finally:
            runner.kv, runner.penalty = state["kv"], state["rows"]
        full, dot_ms = min(fulls), min(dots)
        mm = jax.jit(partial(_layer_matmuls, cfg))
        matmuls = _median_ms(lambda: mm(runner.params, x), iters)
        lm = jax.jit(partial(lm_head, cfg))
        head = _median_ms(lambda: lm(runner.params, x), iters)
        logits = lm(runner.params, x)
        si = jax.device_put(make_sampling_inputs([sq.sampling_row for sq in seqs], S))
        smp = jax.jit(partial(sample, num_logprobs=NUM_LOGPROBS, only_if_asked=True))
        sampling = _median_ms(lambda: smp(logits, si, None, None).token_ids, iters)
        kc = allocate_kv((64, *runner.kv[0].shape[1:]), runner.cache_cfg.kv_dtype)[0]
        kv_new = jnp.ones((S, cfg.num_kv_heads, cfg.head_dim), jnp.float32)
        slots = jnp.arange(S, dtype=jnp.int32) % (64 * runner.cache_cfg.block_size)

        @jax.jit
        def kv_writes(kc):
            return jax.lax.fori_loop(0, L, lambda i, c: write_kv(c[0], c[1], kv_new, kv_new, slots), (kc, kc))
        kv_write = _median_ms(lambda: kv_writes(kc), iters)
        gflops = 2 * S * d * 4 * d / (dot_ms / 1e3) / 1e9
        # host side
        t0 = time.perf_counter()
        for _ in range(iters):
            build_step_input(seqs, S, S, runner.max_blocks_per_seq, runner.cache_cfg.block_size, runner.scratch_row,
                             runner.masks.all_allowed(S))
        build_ms = (time.perf_counter() - t0) / iters * 1e3
        out = smp(logits, si, None, None)
        jax.block_until_ready(out)
        t0 = time.perf_counter()
        for _ in range(iters):
            jax.device_get(out)
        d2h_ms = (time.perf_counter() - t0) / iters * 1e3
        dets = [detok_tok.detokenizer([1, 2, 3]) for _ in range(S)]
        t0 = time.perf_counter()
        for k in range(iters):
            for i, dt in enumerate(dets):
                dt.push([(i * 7 + k * 13) % 2000 + 100])
        detok_ms = (time.perf_counter() - t0) / iters * 1e3
        chunk = {"id": "cmpl-x", "object": "chat.completion.chunk", "created": 0, "model": "m",
                 "choices": [{"index": 0, "delta": {"content": " word"}, "finish_reason": None}]}
        t0 = time.perf_counter()
        for _ in range(iters):
            for _ in range(S):
                ("data: " + json.dumps(chunk) + "\n\n").encode()
        sse_ms = (time.perf_counter() - t0) / iters * 1e3
        attention = max(0.0, full - no_attn)
        other = max(0.0, no_attn - matmuls - head - sampling - kv_write)
        shared_blocks = shared_len // runner.cache_cfg.block_size
        attn_bytes = (shared_blocks * runner.cache_cfg.block_size + S * unique_len) * kv_tok
        # a matmul can beat neither the dot rate nor one read of its weights
        floors = {
            "matmuls_ms": max(S * layer_flops_per_row / (gflops * 1e9), layer_bytes / bw) * 1e3,
            "lm_head_ms": max(2 * S * d * V / (gflops * 1e9), head_bytes / bw) * 1e3,
            "sampling_ms": S * V * 4 / bw * 1e3,
            "attention_ms": attn_bytes / bw * 1e3,
            "kv_write_ms": S * kv_tok / bw * 1e3,
        }
        parts = {"matmuls_ms": matmuls, "lm_head_ms": head, "sampling_ms": sampling, "attention_ms": attention,
                 "kv_write_ms": kv_write, "other_ms": other}
        rows_out.append({"batch": S, "context_len": shared_blocks * runner.cache_cfg.block_size + unique_len,
                         "shared_len": shared_blocks * runner.cache_cfg.block_size, "full_ms": full,
                         "no_attention_ms": no_attn, "parts": parts, "floors": floors,
                         "matmul_floor_ms": floors["matmuls_ms"] + floors["lm_head_ms"],
                         "dot_gflops": gflops,
                         "host": {"build_input_ms": build_ms, "device_to_host_ms": d2h_ms,
                                  "detokenize_ms": detok_ms, "sse_encode_ms": sse_ms}})
    engine.reset_prefix_cache()  # the benchmark wrote KV into blocks behind the pool's back
    return {"model": cfg.name, "dtype": str(runner.params["embed"].dtype), "quantization": method,
            "lm_head_int8": "head" in runner.params, "matmul_kernel": packed,
            "amx": bool(packed and cpu_matmul.amx()),
            "f32_kernel": f32k,
            "attention_kernel": bool(getattr(runner, "attention_kernel", False)),
            "kv_cache_dtype": runner.cache_cfg.kv_dtype, "iters": iters,
            "read_bandwidth_gb_s": bw / 1e9, "rows": rows_out}


def _product_name(r: dict[str, Any]) -> str:
    if r.get("matmul_kernel"):
        return "C++ int8 kernel" + (" (AMX)" if r.get("amx") else "")
    return "C++ float32 kernel" if r.get("f32_kernel") else "XLA dot"


def format_breakdown(r: dict[str, Any]) -> str:
    q = f", {r['quantization']}" if r.get("quantization", "none") != "none" else ""
    kv = f", KV {r['kv_cache_dtype']}" if r.get("kv_cache_dtype") else ""
    lines = [f"== decode step breakdown: {r['model']} ({r['dtype']}{q}{kv}), shared-prefix contexts, median of "
             f"{r['iters']}; read bandwidth {r['read_bandwidth_gb_s']:.1f} GB/s =="]
    for x in r["rows"]:
        p, f, h = x["parts"], x["floors"], x["host"]
        lines.append(f"  batch {x['batch']} (context {x['context_len']}, {x['shared_len']} shared): full step "
                     f"{x['full_ms']:.1f} ms = {x['full_ms'] / x['matmul_floor_ms']:.2f}x its matmul floor "
                     f"{x['matmul_floor_ms']:.1f} ms ({_product_name(r)} "
                     f"{x['dot_gflops']:.0f} GFLOP/s at {x['batch']} rows)")
        for k in ("matmuls_ms", "lm_head_ms", "attention_ms", "sampling_ms", "kv_write_ms", "other_ms"):
            fl = f.get(k)
            lines.append(f"    {k[:-3]:<10} {p[k]:>8.2f} ms" + (f"   floor {fl:>7.2f} ms" if fl is not None else ""))
        lines.append(f"    host: build input {h['build_input_ms']:.2f} ms, device->host {h['device_to_host_ms']:.2f} ms, "
                     f"detokenize {h['detokenize_ms']:.2f} ms, SSE encode {h['sse_encode_ms']:.2f} ms per step")
    return "\n".join(lines)


# --- exposed host time ---------------------------------------------------------------------------
def bench_overlap(engine: Any, *, batches: tuple[int, ...] = (64, 256), steps: int = 8, rounds: int = 3,
                  shared_len: int = 320, output_thread: bool = True) -> dict[str, Any]:
    """Steady decode through LLMEngine.step() with async scheduling on and off: per-step
    wall time against the device time of the very same program on the very same input
    (ModelRunner.replay of the last launch, back to back). The two alternate in `rounds`
    so that a noisy machine's drift falls on both alike. Requests share a system prompt and
    never finish during the measurement; they are aborted after it (replays garble them).
    `output_thread`: text and callbacks on the output processor's thread, as served
    (AsyncEngine); False keeps them inside step()."""

    if output_thread:
        engine.outputs.start()
    try:
        return _bench_overlap(engine, batches, steps, rounds, shared_len, output_thread)
    finally:
        engine.outputs.stop()


def _bench_overlap(engine: Any, batches: tuple[int, ...], steps: int, rounds: int, shared_len: int,
                   output_thread: bool) -> dict[str, Any]:
    from runtime.model.sampling import SamplingParams

    vocab = engine.config.model.vocab_size
    token = lambda x: 3 + x % (vocab - 3)
    rows = []
    prefix = [token(7 * j) for j in range(shared_len)]
    for S in batches:
        if S > engine.envelope.max_num_seqs:
            raise ValueError(f"max_num_seqs: batch {S} exceeds the envelope ({engine.envelope.max_num_seqs})")
        res: dict[str, Any] = {"batch": S}
        for mode in (True, False):
            engine.set_async_scheduling(mode)
            params = SamplingParams(temperature=0.0, max_tokens=2 * rounds * steps + 64, ignore_eos=True)
            reqs = [engine.add_request(prefix + [token(31 * i + j + 1) for j in range(40)], params)
                    for i in range(S)]
            for _ in range(400):  # prefill until every request decodes
                engine.step()
                if all(r.num_output_tokens > 0 for r in reqs) and len(engine.scheduler.running) == S:
                    break
            for _ in range(2):
                engine.step()
            walls, device = [], []
            for _ in range(rounds):
                for _ in range(steps):
                    t0 = time.perf_counter()
                    engine.step()
                    walls.append((time.perf_counter() - t0) * 1e3)
                inp = engine.runner.last_input
                engine.runner.replay(inp)  # waits out the step still in flight
                device += [engine.runner.replay(inp) * 1e3 for _ in range(steps)]
            for r in reqs:
                engine.abort(r.request_id)
            while engine.has_unfinished() or not engine.outputs.idle:
                engine.step()
            key = "async" if mode else "sync"
            wall, dev = summarize(walls)["p50"], summarize(device)["p50"]
            res[f"{key}_step_ms"], res[f"{key}_device_ms"] = wall, dev
            res[f"{key}_wall_minus_device_ms"] = wall - dev  # raw: below 0 is noise
            res[f"{key}_exposed_host_ms"] = max(0.0, wall - dev)
            res[f"{key}_exposed_share"] = max(0.0, wall - dev) / wall
        engine.set_async_scheduling(True)
        rows.append(res)
    engine.reset_prefix_cache()
    return {"steps": steps, "rounds": rounds, "output_thread": output_thread, "rows": rows}


def format_overlap(r: dict[str, Any]) -> str:
    lines = ["== exposed host time: LLMEngine.step() in steady decode (median step wall - the same program "
             "replayed back to back) =="]
    if r.get("output_thread"):
        lines.append("  (text, stop strings and callbacks on the output processor's thread, as served)")
    for x in r["rows"]:
        line = f"  batch {x['batch']}: "
        for key in ("async", "sync"):
            line += (f"{key} step {x[f'{key}_step_ms']:.1f} ms, device {x[f'{key}_device_ms']:.1f} ms "
                     f"(exposed host {x[f'{key}_exposed_host_ms']:.2f} ms = {x[f'{key}_exposed_share'] * 100:.1f}%); ")
        lines.append(line.rstrip("; "))
    return "\n".join(lines)
