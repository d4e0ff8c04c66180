"""Capacity planner: the seeds' worked numbers, GQA/int8 effects, and the `plan` CLI glue."""

import argparse
import dataclasses
import json
import math
import re
import sys

import pytest

from runtime.config import GiB
from runtime.planner import (DEVICES, MODELS, CapacityPlan, DeviceProfile, add_plan_arguments,
                             device_profile, fleet_size, format_plan, measure_cpu, plan, run_plan,
                             step_time_s, tokens_per_s)

GB = 10**9
H100 = DEVICES["h100"]


def _13b(**kw) -> CapacityPlan:
    return plan(MODELS["llama-2-13b"], H100, context_len=1000, **kw)


def test_llama2_13b_h100_matches_seeds():
    p = _13b()
    assert p.num_kv_heads == 40 and p.weight_bytes == pytest.approx(26e9, rel=0.01)
    assert p.kv_bytes_per_token == 2 * 40 * 40 * 128 * 2
    # seeds: "0.78 GB" (= 781 MiB) / "0.82 GB" per sequence at S=1000
    assert 0.78e9 <= p.kv_bytes_per_seq <= 0.84e9
    assert p.kv_bytes_per_seq / (1 << 20) == pytest.approx(781.25)
    # default GPU overhead 3 GB on 80 GiB HBM reproduces the seeds' B_max = 69
    assert p.overhead_bytes == 3 * GB and p.b_max == 69
    assert p.step_time_b1_s == pytest.approx(8.0e-3, abs=0.1e-3)
    assert p.b_star == pytest.approx(31, abs=1.5)  # seeds: B* ~ 31
    assert p.prefill_time_s == pytest.approx(26e-3, abs=1e-3)  # seeds: ~26 ms per 1000 tokens
    # W / C_seq: seeds 4,295 using C_seq = 0.78e9 B; exact bytes give ~4,090
    assert 4000 <= p.tps_asymptote <= 4400
    # TPS at B_max: seeds ~2,900 (with 0.78e9 B); exact bytes give ~2,800
    assert 2700 <= p.tps_ceiling <= 2950
    rows = {r.batch: r for r in p.rows}
    assert rows[1].tps == pytest.approx(125, rel=0.02)
    assert rows[16].step_time_s == pytest.approx(11.5e-3, rel=0.03)
    assert rows[64].memory_fits and not rows[128].memory_fits and rows[69].memory_fits
    assert [r.batch for r in p.rows] == sorted(r.batch for r in p.rows)


def test_b_max_under_other_overhead_assumptions():
    model = MODELS["llama-2-13b"]
    # spec-sheet 80e9 B with nothing held back: 65 (the seeds' range is 64-69)
    p = plan(model, DeviceProfile("h100-dec", 80 * GB, 3.35e12, 989e12), context_len=1000,
             overhead_bytes=0)
    assert 64 <= p.b_max <= 69
    # the other seed: "~50 GB free" for KV at S=1024 -> 59 sequences
    w = plan(model, H100, context_len=1024).weight_bytes
    p = plan(model, H100, context_len=1024, overhead_bytes=H100.memory_bytes - w - 50 * GB)
    assert p.kv_bytes_per_seq == pytest.approx(838.9e6, rel=1e-3) and p.b_max == 59


def test_formulas_with_the_seeds_literal_numbers():
    w, c, bw = 26e9, 0.78e9, 3.35e12
    assert step_time_s(1, w, c, bw) == pytest.approx(8.0e-3, abs=0.05e-3)
    assert step_time_s(64, w, c, bw) == pytest.approx(22.7e-3, abs=0.1e-3)
    assert tokens_per_s(69, w, c, bw) == pytest.approx(2900, rel=0.01)
    assert bw / c == pytest.approx(4295, abs=1)  # the seeds' "theoretical TPS ceiling"
    assert tokens_per_s(64, w, c, bw) / tokens_per_s(1, w, c, bw) == pytest.approx(22.6, abs=0.1)
    assert tokens_per_s(0, w, c, bw) == 0.0


def test_llama3_8b_kv_per_token_and_block():
    p = plan(MODELS["llama-3-8b"], H100, context_len=1000)
    assert p.kv_bytes_per_token == 128 * 1024
    assert p.kv_bytes_per_block == 2 * (1 << 20)
    assert p.num_kv_heads == 8 and p.kv_bytes_per_token_mha == 4 * p.kv_bytes_per_token


def test_fleet_size_seed_example():
    assert fleet_size(500, 200, 2900) == 35
    assert fleet_size(500, 200, 2900, headroom=0.2) == 42
    assert fleet_size(500, 200, 2900, headroom=0.3) == 46
    assert fleet_size(100, 1, 100.0) == 1  # exact division does not round up
    with pytest.raises(ValueError):
        fleet_size(1, 1, 0)
    p = _13b(target_rps=500, output_tokens=200, headroom=0.2)
    assert p.fleet == fleet_size(500, 200, p.tps_ceiling) == 36  # ~2,800 tokens/s per H100
    assert 34 <= p.fleet <= 38 and p.fleet_with_headroom == fleet_size(500, 200, p.tps_ceiling, 0.2)
    assert _13b().fleet is None


def test_int8_kv_counts_its_scales_and_b_max_grows():
    bf, i8, f8 = _13b(), _13b(kv_dtype="int8"), _13b(kv_dtype="fp8_e4m3")
    # int8 elements plus a float16 scale and zero per 8 channels of K and 32 of V (head_dim 128:
    # 16 + 4 groups of 4 bytes), per token and KV head: the real footprint
    m = bf.num_layers * bf.num_kv_heads
    assert i8.kv_bytes_per_token == bf.kv_bytes_per_token // 2 + m * 20 * 4
    assert i8.kv_bytes_per_seq == i8.kv_bytes_per_token * bf.context_len
    assert "+ 40 B scales" in format_plan(i8)
    assert 1.4 * bf.b_max <= i8.b_max <= 1.6 * bf.b_max and i8.tps_ceiling > bf.tps_ceiling
    assert f8.kv_bytes_per_token == bf.kv_bytes_per_token // 2 + 2 * m * 4  # one float32 scale each
    assert 1.9 * bf.b_max <= f8.b_max <= 2 * bf.b_max + 1
    assert _13b(kv_dtype="bf16").kv_bytes_per_token == bf.kv_bytes_per_token  # alias
    with pytest.raises(ValueError, match="kv_dtype"):
        _13b(kv_dtype="int3")


def test_gqa_effect_70b_vs_mha():
    gqa = MODELS["llama-2-70b"]
    mha = dataclasses.replace(gqa, num_kv_heads=64, name="mha-70b")
    h200 = DEVICES["h200"]
    a, b = plan(gqa, h200, context_len=1000), plan(mha, h200, context_len=1000)
    assert b.kv_bytes_per_token == 8 * a.kv_bytes_per_token == a.kv_bytes_per_token_mha
    assert a.b_max > 7 * b.b_max
    text = format_plan(a)
    assert "N_kv=8" in text and "320.00 KiB" in text and "GQA 8:1" in text


def test_model_that_does_not_fit():
    p = plan(MODELS["llama-2-70b"], H100, context_len=1000, target_rps=10)
    assert p.b_max == 0 and p.tps_ceiling == 0 and p.fleet is None
    assert p.min_devices_for_weights == 2 and not any(r.memory_fits for r in p.rows)
    assert "DOES NOT FIT" in format_plan(p)
    json.dumps(p.to_json())


def test_named_configs():
    assert {"llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b", "llama-3-70b",
            "smollm2-135m"} <= set(MODELS)
    assert {m.architecture for m in MODELS.values()} == {"llama", "mixtral", "qwen3_moe", "deepseek_v2"}
    s = MODELS["smollm2-135m"]
    assert (s.num_layers, s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim) == (30, 576, 9, 3, 64)
    assert s.tie_word_embeddings and s.param_count() == pytest.approx(134.5e6, rel=0.01)
    assert MODELS["llama-2-7b"].param_count() == pytest.approx(6.74e9, rel=0.01)
    assert MODELS["llama-3-8b"].param_count() == pytest.approx(8.03e9, rel=0.01)
    assert MODELS["llama-3-70b"].param_count() == pytest.approx(70.6e9, rel=0.01)


def test_cpu_profile_measures():
    d = measure_cpu(size_mb=8, repeats=2, matmul_n=128)
    assert d.name == "cpu" and d.bandwidth_bytes_per_s > 0 and d.peak_flops > 0
    assert d.memory_bytes > 256 * (1 << 20)
    with pytest.raises(ValueError, match="device"):
        device_profile("tpu9")
    assert device_profile("H100") == H100 and DEVICES["a100"].memory_bytes == 80 * GiB


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    return parser.parse_args(list(argv))


def test_cli_json(capsys):
    assert run_plan(_args("--model", "llama-2-13b", "--rps", "500", "--json")) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("weight_bytes", "kv_bytes_per_token", "kv_bytes_per_seq", "kv_bytes_per_block",
                "b_max", "b_star", "rows", "tps_ceiling", "prefill_time_s", "fleet",
                "fleet_with_headroom"):
        assert key in out
    assert out["b_max"] == 69 and out["device"]["name"] == "h100"
    assert out["rows"][0] == {"batch": 1, "step_time_s": pytest.approx(8.0e-3, abs=1e-4),
                              "tps": pytest.approx(125, rel=0.02), "memory_fits": True}


def test_cli_table_and_options(capsys):
    assert run_plan(_args("--model", "llama-3-8b", "--kv-dtype", "int8", "--overhead", "0",
                          "--device", "a100", "--context-len", "2000")) == 0
    out = capsys.readouterr().out
    assert "llama-3-8b on a100" in out and "KV / token    84.00 KiB" in out and "B_max" in out


def test_cli_checkpoint(tmp_path, capsys):
    MODELS["smollm2-135m"].save(tmp_path / "config.json")
    assert run_plan(_args("--checkpoint", str(tmp_path), "--json", "--device", "h100")) == 0
    assert json.loads(capsys.readouterr().out)["param_count"] == MODELS["smollm2-135m"].param_count()


@pytest.mark.parametrize("argv", [
    ("--model", "gpt-5"),
    ("--checkpoint", "/nonexistent/dir"),
    (),
    ("--model", "llama-2-7b", "--device", "tpu"),
    ("--model", "llama-2-7b", "--kv-dtype", "int3"),
    ("--model", "llama-2-7b", "--context-len", "0"),
])
def test_cli_bad_input(argv, capsys):
    assert run_plan(_args(*argv)) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1


def test_cli_plot_without_matplotlib(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    assert run_plan(_args("--model", "llama-2-7b", "--plot", str(tmp_path / "p.png"))) == 2
    captured = capsys.readouterr()
    assert "matplotlib" in captured.err and len(captured.err.strip().splitlines()) == 1
    assert not (tmp_path / "p.png").exists()


def test_cli_plot_with_matplotlib(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert run_plan(_args("--model", "llama-2-7b", "--plot", str(tmp_path / "p.png"))) == 0
    assert (tmp_path / "p.png").stat().st_size > 0


def test_disaggregated_split_from_the_latency_targets():
    """Prefill sized by FLOP/s, decode by the largest batch whose step meets the ITL target."""
    from runtime.planner import plan_disagg

    model, dev = MODELS["llama-3-8b"], DEVICES["h200"]
    p = plan(model, dev, context_len=2200, target_rps=20, output_tokens=200)
    d = plan_disagg(model, dev, p, prompt_tokens=2000, ttft_target_s=0.5, itl_target_s=0.02, mfu=0.5)
    flops = 2 * p.param_count * 2000
    assert d.prefill_flops_per_request == flops and d.prefill_flops_for_ttft == flops / 0.5
    assert d.prefill_time_s == pytest.approx(flops / (dev.peak_flops * 0.5)) and d.ttft_feasible
    # step(B) <= 20 ms at the largest B, and B + 1 would miss it
    assert (p.weight_bytes + d.decode_batch_for_itl * p.kv_bytes_per_seq) / dev.bandwidth_bytes_per_s <= 0.02
    assert (p.weight_bytes + (d.decode_batch_for_itl + 1) * p.kv_bytes_per_seq) / dev.bandwidth_bytes_per_s > 0.02
    assert d.prefill_devices == -(-20 * flops // (dev.peak_flops * 0.5))
    assert d.decode_devices == math.ceil(20 * 200 / d.decode_tps) == 1
    assert d.kv_transfer_bytes_per_request == p.kv_bytes_per_token * 2000
    assert d.kv_transfer_bytes_per_s == pytest.approx(20 * d.kv_transfer_bytes_per_request)
    tight = plan_disagg(model, dev, p, prompt_tokens=2000, ttft_target_s=0.01, itl_target_s=0.001)
    assert not tight.ttft_feasible and tight.decode_batch_for_itl == 0 and tight.decode_devices is None
    with pytest.raises(ValueError, match="mfu"):
        plan_disagg(model, dev, p, prompt_tokens=10, ttft_target_s=1, itl_target_s=1, mfu=1.5)


def test_cli_disagg_table_and_json(capsys):
    from runtime.planner import run_plan

    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    args = parser.parse_args(["--model", "llama-3-8b", "--device", "h200", "--context-len", "2200", "--rps", "20",
                              "--disagg", "--prompt-tokens", "2000", "--itl-ms", "20"])
    assert run_plan(args) == 0
    out = capsys.readouterr().out
    assert "Disaggregated: TTFT <= 500 ms for 2,000-token prompts, ITL <= 20 ms" in out
    assert re.search(r"split\s+2 x h200 prefill \+ 1 x h200 decode", out)
    args.json = True
    assert run_plan(args) == 0
    assert json.loads(capsys.readouterr().out)["disagg"]["prefill_devices"] == 2


def test_tensor_parallel_table_splits_weights_and_kv_and_adds_allreduces():
    from runtime.planner import allreduce_s, plan_tp

    model, dev = MODELS["llama-3-70b"], DEVICES["h100"]
    p = plan(model, dev, context_len=1000)
    rows = {r.tensor_parallel: r for r in plan_tp(model, dev, p, (1, 2, 4, 8, 16, 3))}
    assert rows[1].b_max == 0 and rows[1].allreduce_b1_s == 0          # 141 GB of bf16 weights: not on one H100
    assert rows[2].weight_bytes_per_device == p.weight_bytes / 2 and rows[2].b_max > 0
    assert rows[8].kv_bytes_per_token_per_device == p.kv_bytes_per_token / 8 and rows[8].kv_heads_per_device == 1
    assert rows[16].kv_heads_per_device == 1 and rows[16].shards      # 8 KV heads replicated twice
    assert rows[16].kv_bytes_per_token_per_device == rows[8].kv_bytes_per_token_per_device
    assert not rows[3].shards                                          # 64 heads do not split in 3
    # one all-reduce of a batch-1 bf16 hidden vector over 8 devices, 2 per layer
    one = dev.allreduce_latency_s + 2 * 7 / 8 * (model.hidden_size * 2) / dev.link_bytes_per_s
    assert allreduce_s(model.hidden_size * 2, 8, dev) == pytest.approx(one)
    assert rows[8].allreduce_b1_s == pytest.approx(2 * model.num_layers * one)
    assert rows[8].step_b1_s == pytest.approx(p.weight_bytes / 8 / dev.bandwidth_bytes_per_s
                                              + p.kv_bytes_per_seq / 8 / dev.bandwidth_bytes_per_s + rows[8].allreduce_b1_s)
    assert rows[4].step_b1_s < rows[2].step_b1_s and rows[4].b_max > rows[2].b_max


def test_cli_tensor_parallel_table(capsys):
    from runtime.planner import run_plan

    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    assert run_plan(parser.parse_args(["--model", "llama-3-70b", "--device", "h200", "--tensor-parallel-size", "8"])) == 0
    out = capsys.readouterr().out
    assert "Tensor parallel on h200" in out
    assert [line.split()[0] for line in out.splitlines()[-4:]] == ["1", "2", "4", "8"]


def test_sliding_window_layers_hold_only_their_window_and_b_max_follows():
    """Gemma 3 270M's shape (15 of 18 layers slide over 512 tokens): an 8k-token sequence holds
    what the engine's KV groups keep -- 3 layers' whole context and 15 layers' window -- so it
    costs <= 25% of the keep-everything KV and B_max grows to match."""
    from runtime.config import ModelConfig

    types = tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18))
    gemma = ModelConfig(architecture="gemma3", vocab_size=262144, hidden_size=640, intermediate_size=2048,
                        num_layers=18, num_heads=4, num_kv_heads=1, head_dim=256, max_position_embeddings=32768,
                        sliding_window=512, layer_types=types, query_pre_attn_scalar=256.0,
                        hidden_activation="gelu_tanh", rope_local_theta=10000.0, name="gemma3-270m-shape")
    keep = dataclasses.replace(gemma, layer_types=(), sliding_window=None)
    p, k = plan(gemma, H100, context_len=8192), plan(keep, H100, context_len=8192)
    per_layer_token = gemma.kv_bytes_per_token("bfloat16") // 18
    # 3 full layers x 8192 tokens + 15 sliding layers x the 32 pages (512 tokens) their window reads
    assert p.kv_bytes_per_seq == per_layer_token * (3 * 8192 + 15 * 32 * 16)
    assert k.kv_bytes_per_seq == per_layer_token * 18 * 8192
    assert p.kv_bytes_per_seq / k.kv_bytes_per_seq <= 0.25
    assert p.b_max == p.kv_budget_bytes // p.kv_bytes_per_seq >= 4 * k.b_max
    # a model without sliding layers keeps its exact per-token figure (not rounded to pages)
    assert plan(keep, H100, context_len=1000).kv_bytes_per_seq == keep.kv_bytes_per_token("bfloat16") * 1000


def test_moe_plan_reads_the_experts_a_batch_touches():
    """A mixture of experts: memory holds every expert (46.7 B for Mixtral 8x7B) but a decode
    step reads the attention, embeddings and the experts its tokens pick: at one token the
    active 12.9 B (top 2 of 8), toward all of them as the batch grows (uniform routing)."""
    from runtime.planner.core import weights_read

    m = MODELS["mixtral-8x7b"]
    assert m.param_count() == pytest.approx(46.70e9, rel=2e-3)
    assert m.params_touched(1) == pytest.approx(12.88e9, rel=2e-3)
    q3 = MODELS["qwen3-30b-a3b"]
    assert q3.param_count() == pytest.approx(30.53e9, rel=2e-3) and q3.params_touched(1) == pytest.approx(3.35e9, rel=5e-3)
    reads = [weights_read(m, b, 2) for b in (1, 2, 8, 64)]
    assert reads == sorted(reads) and reads[-1] == pytest.approx(m.param_count() * 2, rel=1e-6)
    dense = MODELS["llama-3-8b"]
    assert dense.params_touched(1) == dense.params_touched(64) == dense.param_count()
    p = plan(m, DEVICES["h200"], context_len=4096)
    assert p.weight_bytes == m.param_count() * 2 and p.active_param_count == int(m.params_touched(1))
    assert p.step_time_b1_s == pytest.approx((m.params_touched(1) * 2 + p.kv_bytes_per_seq) / DEVICES["h200"].bandwidth_bytes_per_s)
    assert p.b_max == (DEVICES["h200"].memory_bytes - p.weight_bytes - 3 * GB) // p.kv_bytes_per_seq
    assert "12.880 B active per token" in format_plan(p)
    # B*: a step's KV bytes equal the weight bytes that step reads (more experts at larger B)
    assert p.b_star * p.kv_bytes_per_seq == pytest.approx(weights_read(m, p.b_star, 2), rel=1e-3)
    assert plan(m, DEVICES["h100"], context_len=4096).b_max == 0  # 93 GB of bfloat16 weights: not on one H100


def test_mla_plan_counts_one_latent_row_per_token():
    """DeepSeek-V2: the cache holds kv_lora_rank + qk_rope = 576 numbers per token and layer
    (67.5 KiB in bfloat16 over 60 layers) where the expanded K/V would be 128 heads x
    (128 + 64 + 128): 71x more; B_max follows the latent size. Parameters as published:
    236 B, 21 B active per token (V2-Lite: 15.7 B)."""
    m = MODELS["deepseek-v2"]
    assert m.param_count() == pytest.approx(236e9, rel=5e-3) and m.params_touched(1) == pytest.approx(21.4e9, rel=1e-2)
    assert MODELS["deepseek-v2-lite"].param_count() == pytest.approx(15.7e9, rel=5e-3)
    assert m.kv_bytes_per_token("bfloat16") == 60 * 576 * 2
    p = plan(m, DEVICES["h200"], weight_dtype="int4", context_len=4096)
    assert p.latent and p.kv_bytes_per_token_mha == 60 * 128 * 320 * 2
    assert p.kv_bytes_per_seq == 60 * 576 * 2 * 4096
    assert p.b_max == (DEVICES["h200"].memory_bytes - p.weight_bytes - 3 * GB) // p.kv_bytes_per_seq
    text = format_plan(p)
    assert "N_kv=1 (MLA)" in text and "= 60 x (one latent row of 576 x 2 B)" in text
    assert "the expanded K/V would be 4.69 MiB, 71.1x more" in text

    q = plan(m, DEVICES["h200"], weight_dtype="int4", kv_dtype="int8", context_len=4096)
    assert q.kv_bytes_per_token == 60 * (576 + 18 * 4)  # int8 values + a scale and zero per 32 columns
    assert "= 60 x (one latent row of 576 x 1 B + 72 B scales)" in format_plan(q)


def test_the_plan_says_when_one_sequence_needs_context_parallelism():
    """The seeds' rule C_seq(S) > M - 2P (here M - weights - overhead): Llama 2 13B's 819,200 B
    per token on an H100 hold 1,000 tokens easily, but 131,072 tokens are 107 GB of KV against
    ~57 GB of budget: two devices must split the sequence."""
    short = _13b()
    assert short.context_parallel == 1 and "context par." not in format_plan(short)
    long = plan(MODELS["llama-2-13b"], H100, context_len=131072)
    assert long.kv_bytes_per_seq == 819200 * 131072 and long.kv_bytes_per_seq > long.kv_budget_bytes > 0
    assert long.b_max == 0 and long.context_parallel == math.ceil(long.kv_bytes_per_seq / long.kv_budget_bytes) == 2
    text = format_plan(long)
    assert "context parallelism over >= 2 devices" in text and "refused" in text
    assert plan(MODELS["llama-2-70b"], H100, context_len=1000).context_parallel == 0  # (no KV room at all)
    assert json.loads(json.dumps(long.to_json()))["context_parallel"] == 2
