"""Mixture-of-experts families (runtime/model/families/moe.py) against transformers on tiny
random checkpoints transformers builds: Mixtral (top-2 of 8, renormalised) and Qwen3-MoE
(top-2 of 6 with and without norm_topk_prob, per-head q/k norms). Greedy tokens and logprobs
through the engine with chunked prefill, prefix caching, batch invariance, and the config
fields that are refused in one line."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runtime.checkpoint.hf_source import HFSource
from runtime.checkpoint.mapping import CheckpointError
from runtime.checkpoint.store import convert, load_checkpoint
from runtime.model.sampling import SamplingParams
from tests.engine_util import make_engine
from tests.runtime.test_families_config import PROMPT, assert_engine_matches, build_hf, hf_reference

pytest.importorskip("transformers", reason="transformers not installed (pip install -e .[peer])")

MIXTRAL = dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=48)
QWEN3_MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=40, decoder_sparse_step=1,
                 mlp_only_layers=[])


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe", "qwen3_moe_norm", "qwen3_moe_dense"])
def moe(request, tmp_path_factory):
    """qwen3_moe_dense: layer 1 of 2 a dense MLP (mlp_only_layers), after an expert layer."""
    tmp = tmp_path_factory.mktemp(request.param)
    arch = request.param.removesuffix("_norm").removesuffix("_dense")
    kw = dict(MIXTRAL) if arch == "mixtral" else dict(QWEN3_MOE, norm_topk_prob=request.param.endswith("_norm"))
    if request.param.endswith("_dense"):
        kw["mlp_only_layers"] = [1]
    src = build_hf(tmp / "hf", arch, **kw)
    convert(HFSource(src), tmp / "ck", progress=False)
    return request.param, src, tmp / "ck"


def test_moe_converts_its_router_and_stacked_experts(moe):
    name, src, ck = moe
    cfg, params, _ = load_checkpoint(ck)
    lay = params["layers"]
    E, f = (8, 48) if name == "mixtral" else (6, 40)
    assert cfg.architecture == name.split("_norm")[0].split("_dense")[0] and cfg.num_experts == E
    assert cfg.num_experts_per_tok == 2 and cfg.norm_topk_prob == (name in ("mixtral", "qwen3_moe_norm"))
    Ls = 1 if name.endswith("_dense") else 2  # the experts are stacked over the expert layers only
    assert cfg.dense_layers == ((1,) if name.endswith("_dense") else ())
    assert lay["router"].shape == (Ls, 64, E) and lay["experts_gate"].shape == (Ls, E, 64, f)
    assert lay["experts_down"].shape == (Ls, E, f, 64) and "w_gate" not in lay
    assert ("dense_gate" in lay) == name.endswith("_dense")
    if name.endswith("_dense"):
        assert lay["dense_gate"].shape == (1, 64, 128) and lay["dense_down"].shape == (1, 128, 64)
    assert ("q_norm" in lay) == (name != "mixtral")
    assert cfg.param_count() == sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))


def test_moe_matches_transformers_through_the_engine(moe):
    """80 prompt tokens through a 32-token step budget (chunked prefill), then decode: greedy
    tokens equal transformers', logprobs within 1e-3."""
    _, src, ck = moe
    assert_engine_matches(ck, src, PROMPT, 16)


def test_moe_prefix_cache_and_batch_invariance(moe):
    """Each prompt alone gives the tokens it gets in a batch with another (its experts' rows do
    not depend on the other tokens routed with them), and a shared prefix's cached blocks give
    transformers' tokens."""
    _, src, ck = moe
    other = PROMPT[:64] + [int(t) for t in np.random.default_rng(3).integers(3, 200, 12)]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    eng = make_engine(ck, num_blocks=64, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=128)
    first = eng.generate([PROMPT], sp)[0]
    second = eng.generate([other], sp)[0]
    assert second.num_cached_tokens >= 48
    assert second.output_ids == hf_reference(src, other, 8)[0]
    fresh = make_engine(ck, num_blocks=64, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=128)
    both = fresh.generate([PROMPT, other], sp)
    assert [r.output_ids for r in both] == [first.output_ids, second.output_ids]


@pytest.mark.parametrize("cpu_kernel", [False, True], ids=["xla", "kernel"])
def test_experts_run_as_grouped_products_of_the_routed_rows(cpu_kernel):
    """experts_mlp equals the per-token sum over its top-k experts written out densely, on
    the XLA loop and on the C++ kernel, reading layer 1 of two stacked layers."""
    from runtime.kernels.cpu import experts as cpu_experts
    from runtime.model.linear import StackedExperts

    if cpu_kernel and not cpu_experts.available():
        pytest.skip("the C++ CPU kernels are not built here")
    hold = cpu_experts.pack_held if cpu_kernel else (lambda p: p)
    from runtime.config import ModelConfig
    from runtime.model.families import moe as fam

    cfg = ModelConfig("mixtral", 50, 16, 8, 1, 2, 1, 8, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=8)
    rng = np.random.default_rng(0)
    lp = {"router": rng.standard_normal((16, 4)).astype(np.float32),
          "experts_gate": rng.standard_normal((4, 16, 8)).astype(np.float32),
          "experts_up": rng.standard_normal((4, 16, 8)).astype(np.float32),
          "experts_down": rng.standard_normal((4, 8, 16)).astype(np.float32)}
    x = rng.standard_normal((7, 16)).astype(np.float32)
    names = ("experts_gate", "experts_up", "experts_down")
    stacked = hold({"layers": {n: StackedExperts(jnp.asarray(np.stack([-lp[n], lp[n]]))) for n in names}})["layers"]
    assert all(isinstance(v, cpu_experts.PackedExperts) == cpu_kernel for v in stacked.values())
    held = {"router": jnp.asarray(lp["router"]), **{n: stacked[n].at(jnp.int32(1)) for n in names}}
    got = np.asarray(jax.jit(lambda held, x: fam.experts_mlp(cfg, held, x)[0])(held, jnp.asarray(x)))
    logits = x @ lp["router"]
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = np.zeros_like(x)
    for t in range(7):
        top = np.argsort(-p[t])[:2]
        w = p[t, top] / p[t, top].sum()
        for e, we in zip(top, w):
            g, u = x[t] @ lp["experts_gate"][e], x[t] @ lp["experts_up"][e]
            want[t] += we * ((g / (1 + np.exp(-g))) * u) @ lp["experts_down"][e]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)



@pytest.mark.parametrize("tokens", [1, 5, 40, 300])
def test_expert_products_multiply_each_row_by_its_experts_matrix_only(tokens):
    """linear.expert_products (on CPU: a loop over the experts with rows, in tiles) and the C++
    kernel over stacked layers equal ragged_dot, with empty experts, one-row experts, more
    rows than one tile or one register block, K past one K block and N not a whole strip."""
    from runtime.kernels.cpu import experts as cpu_experts
    from runtime.model.linear import expert_products

    rng = np.random.default_rng(tokens)
    E, K, N = 6, 300, 72
    picks = np.sort(rng.integers(0, E - 1, tokens))  # expert E-1 (and maybe others) empty
    sizes = jnp.asarray(np.bincount(picks, minlength=E), jnp.int32)
    x = jnp.asarray(rng.standard_normal((tokens, K)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((E, K, N)).astype(np.float32))
    got = np.asarray(jax.jit(expert_products)(x, w, sizes))
    want = np.stack([np.asarray(x[i]) @ np.asarray(w[e]) for i, e in enumerate(picks)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got, np.asarray(jax.lax.ragged_dot(x, w, sizes)), rtol=1e-5, atol=1e-4)
    stacked = jnp.stack([w * 2, w, w * 3])  # [L, E, K, N]: layer 1 is w
    np.testing.assert_allclose(np.asarray(jax.jit(expert_products)(x, stacked, sizes, jnp.int32(1))), want,
                               rtol=1e-5, atol=1e-4)
    if cpu_experts.available():
        packed = jnp.asarray(cpu_experts.pack(np.asarray(stacked)))
        assert packed.shape == (3, E, 2, K, 64)  # 72 columns: two strips, the second padded
        kernel = np.asarray(jax.jit(cpu_experts.expert_products, static_argnums=4)(x, packed, jnp.int32(1), sizes, N))
        np.testing.assert_allclose(kernel, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("field, value, message", [
    ("mlp_only_layers", [7], "mlp_only_layers \\[7\\] is not supported \\(expected a list of layer indices"),
    ("decoder_sparse_step", 0, "decoder_sparse_step 0 is not supported \\(expected a positive integer"),
    ("router_scoring", "sigmoid", "unknown field 'router_scoring'"),
])
def test_moe_fields_it_does_not_implement_are_refused(tmp_path, field, value, message):
    src = build_hf(tmp_path / "hf", "qwen3_moe", **QWEN3_MOE)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(CheckpointError, match=message):
        HFSource(src).model_config()


@pytest.mark.parametrize("moe, method", [("mixtral", "w8a8"), ("qwen3_moe_dense", "w8a16")], indirect=["moe"])
def test_quantized_experts_serve_close_to_float(moe, method):
    """--quantization w8a16 / w8a8: the expert stacks become int8 with a scale per expert and
    output channel (w8a8 quantizing each routed row too), the attention projections as for a
    dense model; first-token logprobs stay within 0.1 of the float model's and most greedy
    starts agree (tiny random weights have near-ties)."""
    _, _, ck = moe
    rng = np.random.default_rng(5)
    prompts = [PROMPT] + [[int(t) for t in rng.integers(3, 260, 60)] for _ in range(5)]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    runs = {}
    for q in ("none", method):
        eng = make_engine(ck, num_blocks=64, max_num_seqs=6, max_num_batched_tokens=64, max_model_len=128, quantization=q)
        runs[q] = eng.generate(prompts, sp)
    held = eng.runner.params["layers"]["experts_gate"]
    assert held.w.dtype == jnp.int8 and held.s is not None and held.int8_acts == (method == "w8a8")
    err = max(abs(a.formatted_logprobs()[0][0] - b.formatted_logprobs()[0][0]) for a, b in zip(runs["none"], runs[method]))
    assert err < 0.1, err
    assert sum(a.output_ids[:3] == b.output_ids[:3] for a, b in zip(runs["none"], runs[method])) >= 4


@pytest.mark.parametrize("int8_acts", [False, True], ids=["w8a16", "w8a8"])
def test_quantized_expert_products_match_their_reference(int8_acts):
    """The CPU loop and the ragged_dot path (the one off CPU) over int8 experts equal a numpy
    reference of the same quantization: weights int8 x per-(expert, column) scales, rows per-row
    int8 for w8a8."""
    from runtime.model.linear import _ragged_products, expert_products
    from runtime.model.quant import quantize_weight

    rng = np.random.default_rng(1)
    E, K, N, sizes = 4, 32, 24, np.array([3, 0, 5, 1], np.int32)
    w = rng.standard_normal((2, E, K, N)).astype(np.float32)
    qw = quantize_weight(w)
    x = rng.standard_normal((int(sizes.sum()), K)).astype(np.float32)
    want = np.zeros((x.shape[0], N), np.float32)
    row = 0
    for e, n in enumerate(sizes):
        xe = x[row:row + n]
        if int8_acts:
            sx = np.abs(xe).max(-1, keepdims=True) / 127.0
            xe = np.clip(np.rint(xe / sx), -127, 127) * sx
        want[row:row + n] = xe @ (qw["q"][1, e].astype(np.float32) * qw["s"][1, e])
        row += n
    args = (jnp.asarray(x), jnp.asarray(qw["q"]), jnp.asarray(sizes))
    loop = jax.jit(lambda x, w, s, sc: expert_products(x, w, s, jnp.int32(1), sc, int8_acts))(*args, jnp.asarray(qw["s"]))
    ragged = _ragged_products(jnp.asarray(x), jnp.asarray(qw["q"][1]), jnp.asarray(sizes), jnp.asarray(qw["s"][1]),
                              int8_acts)
    np.testing.assert_allclose(np.asarray(loop), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(ragged), want, rtol=1e-4, atol=1e-4)


def test_moe_quantization_it_does_not_implement_is_refused_in_one_line(moe, tmp_path):
    from runtime.cli import main

    _, src, ck = moe
    with pytest.raises(ValueError, match="quantization: w4a16 of a mixture of experts is not implemented"):
        make_engine(ck, num_blocks=16, quantization="w4a16")
    with pytest.raises(ValueError, match="quantize_lm_head: not implemented for a mixture of experts"):
        make_engine(ck, num_blocks=16, quantization="w8a8", quantize_lm_head=True)
    assert main(["convert", "--from", "hf", str(src), "--out", str(tmp_path / "q"), "--quantize", "w8a16"]) == 2


def test_mla_tensor_parallelism_is_refused_in_one_line():
    from runtime.config import ModelConfig
    from runtime.model import tp

    cfg = ModelConfig("deepseek_v2", 50, 16, 8, 1, 2, 1, 12, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=8, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4)
    with pytest.raises(ValueError, match="tensor_parallel_size: multi-head latent attention is not sharded yet"):
        tp.validate(cfg, 2, num_devices=2)
    w8 = ModelConfig("mixtral", 50, 16, 8, 1, 2, 2, 8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    with pytest.raises(ValueError, match="tensor_parallel_size: w8a8 expert weights are not sharded yet"):
        tp.validate(w8, 2, quantization="w8a8", num_devices=2)


def test_inspect_shows_the_experts_and_the_active_parameters(moe, capsys):
    from runtime.cli import main

    name, _, ck = moe
    cfg = load_checkpoint(ck)[0]
    assert main(["inspect", str(ck)]) == 0
    out = capsys.readouterr().out
    assert f"{cfg.num_experts} experts of width {cfg.moe_intermediate_size}, top 2" in out
    assert f"{int(cfg.params_touched(1)):,} active per token" in out
    # active: everything but the unpicked experts (E - k of them per layer)
    assert cfg.params_touched(1) == cfg.param_count() - len(cfg.moe_layers()) * (cfg.num_experts - 2) * 3 * 64 * cfg.moe_intermediate_size


def test_console_model_page_shows_the_experts(moe):
    from tests.console.admin_util import console_client, logged_in
    from tests.console.test_admin_pages import text_of

    _, _, ck = moe
    eng = make_engine(ck, num_blocks=16, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=128)
    with console_client(eng) as c:
        logged_in(c)
        page = c.get("/admin/model").text
    m = eng.config.model
    assert text_of(page, "experts").startswith(f"{m.num_experts} of width {m.moe_intermediate_size}, top 2 per token; ")
    assert f"({int(m.params_touched(1)):,})" in text_of(page, "experts")


@pytest.mark.parametrize("arch, defaults", [
    ("mixtral", {"rope_theta": 1e6, "rms_norm_eps": 1e-5, "num_kv_heads": 8}),
    ("qwen3_moe", {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "num_kv_heads": 4}),
])
def test_absent_keys_take_the_config_classes_defaults(tmp_path, arch, defaults):
    """A config.json without rope_theta, rms_norm_eps or num_key_value_heads means what
    transformers' MixtralConfig / Qwen3MoeConfig default to, not another family's values."""
    src = build_hf(tmp_path / "hf", arch, **(MIXTRAL if arch == "mixtral" else QWEN3_MOE))
    cfg = json.loads((src / "config.json").read_text())
    for key in ("rope_theta", "rope_parameters", "rope_scaling", "rms_norm_eps", "num_key_value_heads"):
        cfg.pop(key, None)
    (src / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": 8}))
    got = HFSource(src).model_config()
    assert {"rope_theta": got.rope_theta, "rms_norm_eps": got.rms_norm_eps, "num_kv_heads": got.num_kv_heads} == defaults


def test_decoder_sparse_step_makes_the_skipped_layers_dense(tmp_path):
    """Qwen3-MoE's decoder_sparse_step 2: layer i has experts when (i + 1) % 2 == 0, so layer 0
    of 2 is dense; with mlp_only_layers both are, and the config names them."""
    src = build_hf(tmp_path / "hf", "qwen3_moe", **dict(QWEN3_MOE, decoder_sparse_step=2))
    assert HFSource(src).model_config().dense_layers == (0,)
    convert(HFSource(src), tmp_path / "ck", progress=False)
    assert_engine_matches(tmp_path / "ck", src, PROMPT, 8)


def test_expert_parallel_2_and_4_give_1s_tokens(tmp_path):
    """--tensor-parallel-size 2 / 4 on a mixture of experts: attention by heads, the experts
    split whole across the devices (each device routes every token and runs the picks of its
    own experts; one all-reduce combines them), shared / dense MLPs Megatron-style. Qwen3-MoE
    (8 experts, layer 1 dense) at EP 2 and 4 and Mixtral (8 experts) at EP 4 give EP 1's tokens
    with the prefix cache, chunked prefill and preemptions, logprobs within 1e-4, nothing
    compiled after warm-up, and each device holds E / N experts."""
    from tests.runtime.test_tp import _assert_parity, _run_check

    for arch, kw, sizes in (("qwen3_moe", dict(QWEN3_MOE, num_experts=8, mlp_only_layers=[1]), ("2", "4")),
                            ("mixtral", MIXTRAL, ("4",))):
        src = build_hf(tmp_path / arch / "hf", arch, **kw)
        convert(HFSource(src), tmp_path / arch / "ck", progress=False)
        res = _run_check(tmp_path / arch / "ck", *sizes)
        _assert_parity(res, [int(n) for n in sizes])
        if "2" in sizes:
            assert res[2]["expert_shard_shape"][:2] == [1, 4]  # (layer 1 is dense: one expert layer)
        assert res[4]["expert_shard_shape"][1] == 2


def test_expert_parallel_sizes_that_do_not_divide_are_one_line(tmp_path):
    """6 experts over 4 devices: refused at start with the reason, exit 2."""
    import os
    import subprocess
    import sys

    convert(HFSource(build_hf(tmp_path / "hf", "qwen3_moe", **QWEN3_MOE)), tmp_path / "ck", progress=False)
    ck = tmp_path / "ck"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    p = subprocess.run([sys.executable, "-m", "runtime.cli", "generate", "--checkpoint", str(ck), "--prompt", "hi",
                        "--max-tokens", "2", "--tensor-parallel-size", "4"], capture_output=True, text=True,
                       timeout=300, env=env)
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.strip().splitlines()[-1].endswith(
        "tensor_parallel_size: 4 does not divide the model's 6 experts (expert parallelism gives each device "
        "whole experts)")


def test_expert_load_counts_every_real_token_once_per_expert_layer(moe):
    """Each step reports its tokens per expert of each layer: 21 prompt tokens (one 32-token
    step, 11 padding rows not counted) and 2 decode tokens give 23 x k routed pairs in every
    expert layer and none in a dense one; the console's model page and /metrics show the
    balance it makes."""
    from tests.console.admin_util import console_client, logged_in
    from tests.console.test_admin_pages import text_of

    name, _, ck = moe
    eng = make_engine(ck, num_blocks=32, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=128)
    eng.generate([PROMPT[:21]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    cfg, load = eng.config.model, eng.expert_load
    per_layer = load.total.sum(axis=1).tolist()
    assert per_layer == [0 if i in cfg.dense_layers else 23 * cfg.num_experts_per_tok for i in range(cfg.num_layers)]
    assert load.steps == 3 and 1.0 <= load.imbalance(load.total) <= cfg.num_experts / cfg.num_experts_per_tok
    metrics = eng.metrics.render().decode()
    gauge = next(x for x in metrics.splitlines() if x.startswith("pagedjax:moe_expert_load_imbalance "))
    # the last step decoded one token (k pairs, fewer than the experts): too few to say, so the
    # gauge keeps the prefill step's value
    assert load.imbalance() is None and 1.0 <= float(gauge.split()[-1]) <= cfg.num_experts / cfg.num_experts_per_tok
    routed = sum(float(x.split()[-1]) for x in metrics.splitlines() if x.startswith("pagedjax:moe_expert_tokens_total{"))
    assert routed == 23 * cfg.num_experts_per_tok * len(cfg.moe_layers())
    with console_client(eng) as c:
        logged_in(c)
        page = c.get("/admin/model").text
    assert text_of(page, "expert-imbalance-total") == f"{load.imbalance(load.total):.2f}"
    assert page.count("<tr><td>") >= len(cfg.moe_layers())
