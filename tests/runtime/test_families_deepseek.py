"""DeepSeek-V2 (runtime/model/families/deepseek.py) against transformers on tiny random
checkpoints transformers builds: multi-head latent attention over a latent paged cache, shared
and routed experts, the first layer dense. Two variants: a plain query projection with greedy
routing; a low-rank query (q_lora_rank), group-limited routing, routed_scaling_factor and YaRN
with DeepSeek's mscale_all_dim (which widens the softmax scale)."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from runtime.checkpoint.hf_source import HFSource
from runtime.checkpoint.mapping import CheckpointError
from runtime.checkpoint.store import convert, load_checkpoint
from runtime.model.sampling import SamplingParams
from tests.engine_util import make_engine
from tests.runtime.test_families_config import assert_prefix_cache_and_preemption_match, PROMPT, assert_engine_matches, build_hf, hf_reference

pytest.importorskip("transformers", reason="transformers not installed (pip install -e .[peer])")

C, R, DN, DV, H = 32, 8, 16, 16, 4  # kv_lora_rank, qk_rope, qk_nope, v_head, heads (tests' SIZES)
DEEPSEEK = dict(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=C, q_lora_rank=None,
                qk_rope_head_dim=R, qk_nope_head_dim=DN, v_head_dim=DV, topk_method="greedy", n_group=1,
                topk_group=1, num_key_value_heads=H)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.707,
        "mscale_all_dim": 1.0, "rope_theta": 10000.0, "beta_fast": 32, "beta_slow": 1}
VARIANTS = {
    "plain": {},
    "lora_grouped_yarn": dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                              routed_scaling_factor=2.5, rope_parameters=YARN, max_position_embeddings=256),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def ds(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    src = build_hf(tmp / "hf", "deepseek_v2", **{**DEEPSEEK, **VARIANTS[request.param]})
    convert(HFSource(src), tmp / "ck", progress=False)
    return request.param, src, tmp / "ck"


def test_deepseek_converts_to_a_latent_cache_and_experts_over_the_moe_layers(ds):
    name, _, ck = ds
    cfg, params, _ = load_checkpoint(ck)
    lay = params["layers"]
    assert cfg.architecture == "deepseek_v2" and cfg.mla and cfg.dense_layers == (0,)
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim) == (1, C + R, C, R)
    assert lay["wkv_a"].shape == (2, 64, C + R) and lay["wkv_b"].shape == (2, C, H * (DN + DV))
    assert lay["router"].shape == (1, 64, 8) and lay["experts_gate"].shape == (1, 8, 64, 32)
    assert lay["shared_gate"].shape == (1, 64, 32) and lay["dense_gate"].shape == (1, 64, 96)
    assert ("wq_a" in lay) == (name != "plain") and ("wq" in lay) == (name == "plain")
    assert cfg.param_count() == sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
    if name != "plain":  # yarn's mscale_all_dim multiplies the softmax scale by mscale(4, 1.0) ** 2
        m = 0.1 * np.log(4.0) + 1.0
        assert cfg.query_pre_attn_scalar == pytest.approx((DN + R) / m ** 4)
        assert cfg.topk_method == "group_limited_greedy" and cfg.routed_scaling_factor == 2.5


def test_deepseek_matches_transformers_through_the_engine(ds):
    """80 prompt tokens in 32-token chunks through the latent cache, then decode: greedy tokens
    equal transformers', logprobs within 1e-3."""
    _, src, ck = ds
    assert_engine_matches(ck, src, PROMPT, 16)


def test_the_cache_holds_one_latent_row_per_token_and_layer(ds):
    """kv_lora_rank + qk_rope_head_dim numbers per token and layer, nothing for V: the pool's
    bytes, the block bytes and the planner's per-token figure agree, and are the expanded K/V's
    H (dn + r + dv) / (c + r) = 4 x 40 / 40 = 4x smaller here."""
    _, _, ck = ds
    eng = make_engine(ck, num_blocks=32, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=128)
    cfg = eng.config.model
    per_token = 2 * (C + R) * 4  # 2 layers, float32
    assert cfg.kv_bytes_per_token("float32") == per_token
    assert eng.runner.kv_cache_bytes() == 32 * 16 * per_token
    assert eng.config.cache.bytes_per_block(cfg) == 16 * per_token
    expanded = 2 * H * (DN + R + DV) * 4
    assert expanded / per_token == 4


def test_deepseek_prefix_cache_preemption_and_batch_invariance(ds):
    """A prompt sharing 64 tokens with a cached one reads their latent rows from the cache;
    four requests of 90-120 tokens in a pool of 16 blocks force a preemption (their latent rows
    recomputed); every request still gives transformers' tokens, alone or batched."""
    _, src, ck = ds
    assert_prefix_cache_and_preemption_match(src, ck)


def test_group_limited_routing_keeps_only_the_best_groups_experts():
    """route(): 8 experts in 4 groups of 2. The two best experts (2 and 6) sit in groups 1 and 3;
    keeping the best 2 groups picks them, keeping only the best group (1) picks 2 and its group
    mate 3 although 6 scores higher. Weights are the softmax over all 8, times
    routed_scaling_factor, not renormalised."""
    import dataclasses

    import jax.numpy as jnp

    from runtime.config import ModelConfig
    from runtime.model.families.moe import route

    cfg = ModelConfig("deepseek_v2", 50, 8, 8, 1, 2, 1, 12, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=8, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                      norm_topk_prob=False, routed_scaling_factor=3.0, kv_lora_rank=8, qk_rope_head_dim=4,
                      qk_nope_head_dim=4, v_head_dim=4)
    logits = jnp.asarray([[0.0, 0.0, 5.0, 1.0, 0.0, 0.0, 4.99, 0.0]])
    p = np.exp(np.asarray(logits[0])) / np.exp(np.asarray(logits[0])).sum()
    weights, experts = route(cfg, jnp.eye(8), logits)
    assert np.asarray(experts)[0].tolist() == [2, 6]
    np.testing.assert_allclose(np.asarray(weights)[0], 3.0 * p[[2, 6]], rtol=1e-6)
    weights, experts = route(dataclasses.replace(cfg, topk_group=1), jnp.eye(8), logits)
    assert np.asarray(experts)[0].tolist() == [2, 3]
    np.testing.assert_allclose(np.asarray(weights)[0], 3.0 * p[[2, 3]], rtol=1e-6)


@pytest.mark.parametrize("field, value, message", [
    ("scoring_func", "sigmoid", "scoring_func 'sigmoid' is not supported \\(supported: softmax"),
    ("norm_topk_prob", True, "norm_topk_prob True is not supported"),
    ("moe_layer_freq", 2, "moe_layer_freq 2 is not supported"),
    ("num_key_value_heads", 2, "num_key_value_heads 2 is not supported \\(latent attention"),
    ("index_topk", 8, "unknown field 'index_topk'"),
])
def test_deepseek_fields_it_does_not_implement_are_refused(tmp_path, field, value, message):
    src = build_hf(tmp_path / "hf", "deepseek_v2", **DEEPSEEK)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(CheckpointError, match=message):
        HFSource(src).model_config()


def test_the_pallas_kernel_is_refused_for_a_latent_cache():
    """The Pallas kernel has no latent mode: by name it is one line; under auto the XLA path
    (without the C++ kernel, which has none either) serves it."""
    from runtime.model.attention_backend import XlaAttention, make_backend

    with pytest.raises(ValueError, match="pallas does not implement multi-head latent attention"):
        make_backend("pallas", "float32", cpu_kernels=True, latent=True)
    assert make_backend("xla", "float32", cpu_kernels=True, head_dim=64, latent=True) == XlaAttention(cpu_kernel=False)


@pytest.mark.parametrize("ds, kv_dtype", [("plain", "int8"), ("lora_grouped_yarn", "fp8_e4m3")], indirect=["ds"])
def test_a_quantized_latent_cache(ds, kv_dtype):
    """--kv-cache-dtype int8 / fp8_e4m3 on the latent cache: one quantized row per token and
    layer (int8: a float16 scale and zero per 32 columns, here 40 columns: one group; fp8: one
    float32 scale), nothing for V; the pool's bytes are those, and the engine's greedy tokens
    stay close to the float cache's (tiny random weights have near-ties, so not all of them:
    the accuracy gates of docs/quantization.md need a real model)."""
    from runtime.model.kv_pages import QuantizedPages

    _, _, ck = ds
    rng = np.random.default_rng(5)
    prompts = [PROMPT] + [[int(t) for t in rng.integers(3, 260, 60)] for _ in range(3)]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    runs = {}
    for dt in ("float32", kv_dtype):
        eng = make_engine(ck, num_blocks=32, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, kv_dtype=dt)
        runs[dt] = eng.generate(prompts, sp)
    k, v = eng.runner.kv
    assert isinstance(k, QuantizedPages) and k.values.shape[-2:] == (1, C + R) and v.shape[-1] == 0
    per_token = 2 * ((C + R) + 4)  # 2 layers x (one byte per column + one group's 4 bytes)
    assert eng.config.model.kv_bytes_per_token(kv_dtype) == per_token
    assert eng.runner.kv_cache_bytes() == 32 * 16 * per_token
    first = [(a.formatted_logprobs()[0][0], b.formatted_logprobs()[0][0]) for a, b in zip(runs["float32"], runs[kv_dtype])]
    err = max(abs(x - y) for x, y in first)
    assert err < (0.01 if kv_dtype == "int8" else 0.1), err
    assert sum(a.output_ids[:4] == b.output_ids[:4] for a, b in zip(runs["float32"], runs[kv_dtype])) >= 3


def test_inspect_and_the_console_show_the_latent_cache(ds):
    from runtime.cli import main
    from tests.console.admin_util import console_client, logged_in
    from tests.console.test_admin_pages import text_of

    _, _, ck = ds
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["inspect", str(ck)]) == 0
    assert f"multi-head latent: {H} heads over one cached row of {C} latent + {R} RoPE columns" in out.getvalue()
    assert "1 shared; layers 0 dense of width 96" in out.getvalue()
    eng = make_engine(ck, num_blocks=16, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=128)
    with console_client(eng) as c:
        logged_in(c)
        page = c.get("/admin/model").text
    assert text_of(page, "attention").startswith(f"multi-head latent: {H} heads read one cached row of {C} latent")
    assert "one latent row of (40 · 4 B)" in text_of(page, "kv-per-token")


def test_deepseek_through_the_openai_api(ds):
    """/v1/completions (the prompt as token ids) on the HTTP app: each answered token's logprob
    is the logprob transformers gives its own greedy token there, within 1e-3 (a different token
    would carry a lower one: no near-ties in these weights)."""
    from pathlib import Path

    from litestar.testing import TestClient

    from console.app import create_app
    from console.settings import ServerSettings
    from runtime.core.async_engine import AsyncEngine

    _, src, ck = ds
    gen, logp = hf_reference(src, PROMPT, 12)
    settings = ServerSettings(admin_token="tadmin", api_key="k", model_name="ds", checkpoint=Path("ds"),
                              access_log=False, warmup=False)
    eng = make_engine(ck, num_blocks=64, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=128)
    with TestClient(create_app(settings, engine=AsyncEngine(eng)), timeout=120) as c:
        r = c.post("/v1/completions", headers={"Authorization": "Bearer k"},
                   json={"model": "ds", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 1,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert len(choice["logprobs"]["token_logprobs"]) == 12
    theirs = [logp[len(PROMPT) - 1 + i, t] for i, t in enumerate(gen)]
    np.testing.assert_allclose(choice["logprobs"]["token_logprobs"], theirs, atol=1e-3)


def test_latent_blocks_transfer_between_prefill_and_decode_engines(ds):
    """Disaggregated prefill/decode carries the latent rows (and V's empty arrays): the decode
    engine computes only the tail and answers the colocated engine's tokens."""
    from runtime.core.disagg import prefill_then_decode
    from runtime.core.kv_transfer import InProcessConnector

    _, _, ck = ds
    pre, dec = (make_engine(ck, num_blocks=64, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=128)
                for _ in range(2))
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = pre.generate([PROMPT[:50]], sp)[0]
    req = prefill_then_decode(pre, dec, InProcessConnector(), PROMPT[:50], sp)
    assert req.output_ids == want.output_ids and req.num_cached_tokens == 48


def test_the_published_deepseek_v2_lite_config_is_read(ds, tmp_path):
    """config.json as DeepSeek-V2-Lite ships it (its own modelling code named in auto_map, YaRN
    as rope_scaling "type" with mscale = mscale_all_dim = 0.707, factor 40, moe_layer_freq,
    seq_aux, aux_loss_alpha, scoring_func): accepted, YaRN's cos/sin factor 1 and the softmax
    scale widened by mscale(40, 0.707)^2."""
    import math
    import shutil

    _, src, _ = ds
    shutil.copytree(src, tmp_path / "hf")
    c = json.loads((tmp_path / "hf" / "config.json").read_text())
    for k in ("rope_parameters", "dtype", "head_dim", "qk_head_dim", "mlp_bias", "output_router_logits"):
        c.pop(k, None)
    c.update({"aux_loss_alpha": 0.001, "moe_layer_freq": 1, "scoring_func": "softmax", "seq_aux": True,
              "torch_dtype": "bfloat16", "rope_theta": 10000, "max_position_embeddings": 163840,
              "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                               "original_max_position_embeddings": 4096, "type": "yarn"},
              "norm_topk_prob": False, "q_lora_rank": None, "transformers_version": "4.33.1", "use_cache": True,
              "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV2Config",
                           "AutoModel": "modeling_deepseek.DeepseekV2Model",
                           "AutoModelForCausalLM": "modeling_deepseek.DeepseekV2ForCausalLM"}})
    (tmp_path / "hf" / "config.json").write_text(json.dumps(c))
    cfg = HFSource(tmp_path / "hf").model_config()
    m = 0.1 * 0.707 * math.log(40) + 1.0
    assert cfg.rope_scaling.rope_type == "yarn" and cfg.rope_scaling.factor == 40
    assert cfg.rope_scaling.attention_factor == pytest.approx(1.0)
    assert cfg.query_pre_attn_scalar == pytest.approx((DN + R) / m ** 4)
    c["auto_map"]["AutoModelForCausalLM"] = "modeling_custom.Other"
    (tmp_path / "hf" / "config.json").write_text(json.dumps(c))
    with pytest.raises(CheckpointError, match="custom modelling code is not supported"):
        HFSource(tmp_path / "hf").model_config()


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
def test_the_accuracy_benchmark_emulates_a_latent_cache(ds, kv_dtype):
    """bench accuracy's cache emulation on MLA: the latent row round-tripped as the cache stores
    it (the latent groups), the model's own softmax scale; close to float32's logits."""
    import jax.numpy as jnp

    from runtime.bench.accuracy import kv_roundtrip_logits
    from runtime.model.families import dense_logits

    _, _, ck = ds
    cfg, params, _ = load_checkpoint(ck)
    ids = jnp.asarray(PROMPT[:40])
    got = np.asarray(kv_roundtrip_logits(cfg, params, ids, kv_dtype))
    want = np.asarray(dense_logits(cfg, params, ids))
    assert np.abs(got - want).max() < 0.1 and not np.array_equal(got, want)
