"""The engine-side benchmarks on the tiny model: the step breakdown, exposed host time, the
accuracy evaluation and the Llama-3-shaped random-weight engine run (structure and
invariants only; no wall-clock asserts)."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.bench.accuracy import evaluate, token_logprobs
from runtime.bench.breakdown import bench_breakdown, bench_overlap, format_breakdown, format_overlap
from runtime.bench.gpu_engine import LLAMA3_SCALED, engine_decode_tps, format_engine_tps, synthetic_tokenizer
from runtime.checkpoint.store import load_checkpoint
from tests.engine_util import make_engine

PARTS = ("matmuls_ms", "lm_head_ms", "sampling_ms", "attention_ms", "kv_write_ms", "other_ms")


def test_breakdown_and_overlap_report_every_part(tiny_ckpt):
    eng = make_engine(tiny_ckpt, num_blocks=200, max_num_seqs=8, max_num_batched_tokens=64)
    bd = bench_breakdown(eng, batches=(2, 8), shared_len=32, unique_len=8, iters=2, bandwidth_mb=16)
    assert [r["batch"] for r in bd["rows"]] == [2, 8]
    for r in bd["rows"]:
        assert set(r["parts"]) == set(PARTS) and all(v >= 0 for v in r["parts"].values())
        assert r["full_ms"] > 0 and r["matmul_floor_ms"] > 0 and r["shared_len"] == 32
        assert set(r["host"]) == {"build_input_ms", "device_to_host_ms", "detokenize_ms", "sse_encode_ms"}
    assert "batch 8" in format_breakdown(bd)
    assert eng.pool.num_cached_blocks == 0  # the benchmark's KV writes were not left in the prefix cache
    ov = bench_overlap(eng, batches=(2, 8), steps=3, rounds=2, shared_len=32)
    for r in ov["rows"]:
        for key in ("async", "sync"):
            assert r[f"{key}_step_ms"] > 0 and r[f"{key}_device_ms"] > 0 and 0 <= r[f"{key}_exposed_share"] < 1
            assert r[f"{key}_exposed_host_ms"] == pytest.approx(max(0.0, r[f"{key}_step_ms"] - r[f"{key}_device_ms"]))
    assert "exposed host" in format_overlap(ov)
    assert eng.async_scheduling and not eng.has_unfinished() and eng.pool.num_used_blocks == 0


def test_accuracy_of_the_float_model_against_itself_is_exact(tiny_ckpt):
    cfg, params, _ = load_checkpoint(tiny_ckpt)
    ids = list(np.random.default_rng(0).integers(3, 260, size=70))
    lp = token_logprobs(cfg, params, ids, window=32)
    assert lp.shape == (69,) and (lp <= 0).all()
    r = evaluate(cfg, params, ids, "w8a8", 32)
    assert r["tokens"] == 69 and r["perplexity"] > 1 and r["perplexity_float32"] > 1
    assert abs(r["perplexity_increase"]) < 0.5 and r["mean_abs_logprob_diff"] > 0


def test_llama3_shaped_random_engine_run():
    tok = synthetic_tokenizer(300)
    assert tok.decode([5, 250]) and tok.eos_token_ids == (1,)
    cfg = {**LLAMA3_SCALED, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4,
           "num_kv_heads": 2, "head_dim": 16}
    r = engine_decode_tps(cfg, (1, 4), context_len=40, steps=2, dtype="float32", kv_memory=8 << 20,
                          device_name="h200")
    assert [x["batch"] for x in r["rows"]] == [1, 4]
    for x in r["rows"]:
        assert x["tokens_per_s"] > 0 and x["planner_tokens_per_s"] > 0 and x["device_step_ms"] > 0
    assert "B=4" in format_engine_tps(r)


def test_breakdown_of_a_quantized_engine_uses_its_own_floor(tiny_ckpt):
    """w8a8 weights and an int8 KV cache: the matmul floor is the int8 product's rate, and
    the layer bytes are the int8 weights'."""
    f32 = make_engine(tiny_ckpt, num_blocks=200, max_num_seqs=8, max_num_batched_tokens=64)
    q = make_engine(tiny_ckpt, num_blocks=200, max_num_seqs=8, max_num_batched_tokens=64, quantization="w8a8",
                    kv_dtype="int8")
    rows, gb_s = {}, {}
    for name, eng in (("f32", f32), ("q", q)):
        bd = bench_breakdown(eng, batches=(4,), shared_len=32, unique_len=8, iters=2, bandwidth_mb=16)
        rows[name], gb_s[name] = bd["rows"][0], bd["read_bandwidth_gb_s"]
        assert all(v >= 0 for v in rows[name]["parts"].values())
    assert bd["quantization"] == "w8a8" and bd["kv_cache_dtype"] == "int8"
    assert "w8a8, KV int8" in format_breakdown(bd)
    # same FLOPs, a quarter of the weight bytes: the bandwidth term of the floor shrinks
    assert rows["q"]["floors"]["matmuls_ms"] > 0 and rows["q"]["dot_gflops"] > 0
    # the KV write floor is bytes / the bandwidth measured in each call (noisy between calls,
    # once 3x apart under load): compare the bytes, the floor times its own bandwidth
    kv_bytes = {k: rows[k]["floors"]["kv_write_ms"] * gb_s[k] for k in rows}
    assert kv_bytes["q"] < 0.5 * kv_bytes["f32"]   # int8 + a scale per head vector, vs float32


def test_llama3_shaped_engine_run_with_int8_weights_and_fp8_cache():
    """The GPU check's quantization rows, scaled down: random int8 weights made in the served
    tree (no requantizing), an fp8 cache; fewer weight bytes than the float run."""
    cfg = {**LLAMA3_SCALED, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4,
           "num_kv_heads": 2, "head_dim": 16}
    kw = dict(context_len=40, steps=2, dtype="float32", kv_memory=8 << 20, device_name="h200")
    base = engine_decode_tps(cfg, (2,), **kw)
    q = engine_decode_tps(cfg, (2,), quantization="w8a16", kv_dtype="fp8_e4m3", **kw)
    assert q["quantization"] == "w8a16" and q["kv_cache_dtype"] == "fp8_e4m3" and q["attention_backend"] == "xla"
    assert q["weight_bytes"] < base["weight_bytes"] and q["rows"][0]["tokens_per_s"] > 0
    assert q["kv_blocks"] > base["kv_blocks"]  # the same memory holds more fp8 blocks
    assert "w8a16 weights, KV fp8_e4m3 (xla attention)" in format_engine_tps(q)
    w4 = engine_decode_tps(cfg, (2,), quantization="w4a16", **kw)  # (on a GPU: the Pallas w4a16 kernel)
    assert w4["quantization"] == "w4a16" and w4["rows"][0]["tokens_per_s"] > 0
    assert w4["weight_bytes"] < q["weight_bytes"]


def test_mixtral_shaped_engine_run_counts_the_experts_a_step_reads():
    """gpu_check's mixtral variant, scaled down on CPU: the engine decodes a random MoE and the
    planner's figure uses the weights a step of B rows reads (not all experts at B = 1)."""
    from runtime.bench.gpu_engine import MIXTRAL_SCALED, model_config

    r = engine_decode_tps(MIXTRAL_SCALED, (1, 4), context_len=64, steps=2, dtype="float32", kv_memory=16 << 20,
                          device_name="h100")
    cfg = model_config(MIXTRAL_SCALED)
    assert r["model"] == "mixtral-shaped-scaled" and [x["batch"] for x in r["rows"]] == [1, 4]
    assert cfg.params_touched(1) < 0.5 * cfg.param_count()
    from runtime.planner import DEVICES, tokens_per_s
    from runtime.planner.core import kv_bytes_per_seq

    want = tokens_per_s(1, r["weight_bytes"] * cfg.params_touched(1) / cfg.param_count(),
                        kv_bytes_per_seq(cfg, "float32", 64), DEVICES["h100"].bandwidth_bytes_per_s)
    assert r["rows"][0]["planner_tokens_per_s"] == pytest.approx(want, rel=0.05)


def test_verify_step_cost_times_a_verifying_step_beside_a_decode_step():
    """gpu_check's speculative row (run on CPU here at a tiny shape): both steps timed at each
    batch, the ratio and the break-even kept count reported."""
    from runtime.bench.gpu_engine import format_verify_cost, verify_step_cost

    cfg = {**LLAMA3_SCALED, "num_layers": 2}
    r = verify_step_cost(cfg, (1, 4), k=3, context_len=40, steps=2, dtype="float32", kv_memory=8 << 20)
    assert [x["batch"] for x in r["rows"]] == [1, 4] and r["k"] == 3
    for x in r["rows"]:
        assert x["decode_ms"] > 0 and x["verify_ms"] > 0
        assert abs(x["ratio"] - x["verify_ms"] / x["decode_ms"]) < 1e-9 and x["break_even_kept"] == x["ratio"] - 1
    assert "k=3 proposals a row" in format_verify_cost(r)


def test_deepseek_shaped_engine_run_caches_one_latent_row():
    """gpu_check's deepseek variant, scaled down on CPU: the engine decodes a random DeepSeek-V2
    shape on the XLA attention path, and the KV bytes it plans with are the latent rows'."""
    from runtime.bench.gpu_engine import DEEPSEEK_SCALED, model_config

    r = engine_decode_tps(DEEPSEEK_SCALED, (1, 4), context_len=64, steps=2, dtype="float32", kv_memory=16 << 20,
                          device_name="h100", attention_backend="xla")
    cfg = model_config(DEEPSEEK_SCALED)
    assert r["model"] == "deepseek-v2-shaped-scaled" and all(x["tokens_per_s"] > 0 for x in r["rows"])
    assert cfg.kv_bytes_per_token("float32") == 2 * (64 + 16) * 4
