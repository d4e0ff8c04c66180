"""Gemma 2 and Gemma 3 (runtime/model/families/gemma.py) against transformers on tiny random
checkpoints that transformers itself builds, converted with `convert --from hf`: both layer
types present, a 12-token window that 80-token prompts run far past (whole 16-token blocks
fall out of it), Gemma 2's attention and final soft-caps, Gemma 3's q/k norms and per-layer-type
RoPE (linear scaling on the full layers). Through the engine: chunked prefill under a 32-token
budget, prefix caching, a preemption, batch invariance. Plus the attention paths' window and
soft-cap against a float64 oracle (XLA path A / B, the cascade, the C++ kernel) and the
refusals of what is not implemented."""

from __future__ import annotations

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

from runtime.checkpoint.hf_source import HFSource
from runtime.checkpoint.mapping import CheckpointError
from runtime.checkpoint.store import convert, load_checkpoint
from runtime.config import ModelConfig
from runtime.model.families import dense_logits, family, param_shapes
from runtime.model.families.llama import causal_mask, dense_causal_attention
from runtime.model.kv_pages import SharedPrefix
from runtime.model.xla_attention import xla_ragged_paged_attention
from tests.attention_oracle import random_batch
from tests.model_files import write_hf_config_dir
from tests.runtime.test_families_config import (PROMPT, SIZES, TOK_JSON, assert_engine_matches,
                                                 assert_prefix_cache_and_preemption_match, hf_reference, log_softmax)

transformers = pytest.importorskip("transformers", reason="transformers not installed (pip install -e .[peer])")
torch = pytest.importorskip("torch", reason="torch not installed (pip install -e .[peer])")

WINDOW = 12
GEMMA = dict(SIZES, num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=24, tie_word_embeddings=True)
LAYERS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
GEMMA2 = dict(attn_logit_softcapping=4.0, final_logit_softcapping=6.0,  # small: they change the outputs
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
GEMMA3 = dict(layer_types=LAYERS, rope_parameters={
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})


def build_gemma(out, arch: str, seed: int = 0, **kw):
    """A transformers Gemma with random weights scaled like build_hf's (norm weights around 0:
    Gemma multiplies by 1 + w), saved with our tiny tokenizer."""
    cls = {"gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
           "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM)}[arch]
    config = cls[0](**{**GEMMA, **(GEMMA2 if arch == "gemma2" else GEMMA3), **kw})
    torch.manual_seed(seed)
    model = cls[1](config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.1 * torch.randn_like(p))
            elif "embed_tokens" in name:  # (scaled by sqrt(64) = 8 in the model)
                p.copy_(0.5 * torch.randn_like(p) / p.shape[1] ** 0.5)
            else:
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
    model.save_pretrained(out)
    (out / "tokenizer.json").write_text(TOK_JSON)
    return out


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    src = build_gemma(tmp / "hf", request.param)
    convert(HFSource(src), tmp / "ck", progress=False)
    return request.param, src, tmp / "ck"


def test_gemma_converts(gemma):
    arch, src, ck = gemma
    cfg, params, _ = load_checkpoint(ck)
    assert cfg.architecture == arch and cfg.hidden_activation == "gelu_tanh" and cfg.tie_word_embeddings
    assert cfg.sliding_window == WINDOW and cfg.layer_windows() == (WINDOW, 0, WINDOW, 0)
    assert cfg.query_pre_attn_scalar == 24.0
    if arch == "gemma2":
        assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (4.0, 6.0)
        assert cfg.rope_local_theta is None
    else:
        assert cfg.attn_logit_softcapping is None and cfg.final_logit_softcapping is None
        assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling.rope_type, cfg.rope_scaling.factor) == (
            1e6, 1e4, "linear", 8.0)
    names = {"attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm", "wq", "wk", "wv", "wo", "w_gate", "w_up",
             "w_down"} | ({"q_norm", "k_norm"} if arch == "gemma3" else set())
    assert set(params["layers"]) == names and "lm_head" not in params
    # norms are stored as Gemma's effective multiplier 1 + w
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    w = hf.model.layers[1].pre_feedforward_layernorm.weight.detach().numpy()
    np.testing.assert_allclose(np.asarray(params["layers"]["mlp_norm"][1]), 1.0 + w, rtol=1e-6)
    n = sum(int(np.prod(np.shape(a))) for a in _leaves(params))
    assert cfg.param_count() == n == sum(p.numel() for p in hf.parameters())


def _leaves(tree):
    return [a for v in tree.values() for a in (_leaves(v) if isinstance(v, dict) else [v])]


def test_gemma_dense_reference_matches_transformers(gemma):
    """The cache-free reference (llama.dense_logits with the family's forward and head) on a
    prompt 6 windows long; the window and the soft-caps change the outputs (else the parity
    would prove nothing about them)."""
    import dataclasses

    arch, src, ck = gemma
    cfg, params, _ = load_checkpoint(ck)
    ids = jnp.asarray(PROMPT)
    got = np.asarray(dense_logits(cfg, params, ids))
    _, logp = hf_reference(src, PROMPT, 0)
    np.testing.assert_allclose(log_softmax(got), logp, atol=1e-4)
    variants = [dataclasses.replace(cfg, sliding_window=None, layer_types=())]
    if arch == "gemma2":
        variants += [dataclasses.replace(cfg, attn_logit_softcapping=None),
                     dataclasses.replace(cfg, final_logit_softcapping=None)]
    else:
        variants += [dataclasses.replace(cfg, rope_local_theta=None)]
    for other in variants:
        assert np.abs(np.asarray(dense_logits(other, params, ids)) - got).max() > 0.05, other


def test_gemma_matches_transformers_through_the_engine(gemma):
    """80 prompt tokens (6+ windows) through a 32-token step budget, then 16 decoded: tokens
    equal transformers' and logprobs within 1e-3. Gemma 2 runs the XLA path (soft-cap),
    Gemma 3 the C++ kernel where it is built."""
    arch, src, ck = gemma
    assert_engine_matches(ck, src, PROMPT, 16)


def test_gemma_prefix_cache_preemption_and_batch_invariance(gemma):
    """A second prompt sharing the first's 64 leading tokens reuses their blocks; four
    requests of 90-120 tokens in a pool of 16 blocks force a preemption; every request still gives
    transformers' tokens, alone or batched."""
    _, src, ck = gemma
    assert_prefix_cache_and_preemption_match(src, ck)


# --- the attention paths: window and soft-cap against a float64 oracle ---------------------

def oracle(q, kc, vc, kv_lens, tables, qsl, num_seqs, sm_scale, window=0, soft_cap=None):
    """tests/attention_oracle.oracle with the window (a query at p sees p - window < k <= p)
    and the soft-cap on the scaled scores."""
    q, kc, vc = (np.asarray(a, np.float64) for a in (q, kc, vc))
    T, Hq, D = q.shape
    bs, hkv = kc.shape[1], kc.shape[2]
    out = np.zeros((T, Hq, D))
    for s in range(int(np.asarray(num_seqs).reshape(-1)[0])):
        a, b, kv = int(qsl[s]), int(qsl[s + 1]), int(kv_lens[s])
        pos = np.arange(kv)
        blocks = np.asarray(tables[s])[pos // bs]
        k, v = kc[blocks, pos % bs], vc[blocks, pos % bs]
        for i, t in enumerate(range(a, b)):
            p = kv - (b - a) + i
            lo = max(0, p - window + 1) if window else 0
            for h in range(Hq):
                kh = h // (Hq // hkv)
                sc = (k[lo: p + 1, kh] @ q[t, h]) * sm_scale
                if soft_cap is not None:
                    sc = soft_cap * np.tanh(sc / soft_cap)
                w = np.exp(sc - sc.max())
                out[t, h] = (w / w.sum()) @ v[lo: p + 1, kh]
    return out


def shared_batch(rng, window):
    """Three sequences whose tables start with the same 4 blocks (a 64-token shared prefix,
    the cascade) plus one unshared: decode rows and prefill chunks mixed."""
    q_lens, kv_lens = [1, 20, 1, 37], [90, 100, 70, 60]
    q, kc, vc, kvl, tables, qsl, ns = random_batch(rng, q_lens, kv_lens, d=32, bs=16, num_blocks=64)
    tables[1:3, :4] = tables[0, :4]
    blocks = np.zeros_like(tables[0])
    blocks[:4] = tables[0, :4]
    suffix = tables.copy()  # members' tables after the shared blocks
    suffix[:3] = np.pad(tables[:3, 4:], ((0, 0), (0, 4)))
    sh = SharedPrefix(jnp.asarray(blocks), jnp.asarray([64], jnp.int32), jnp.asarray([64, 64, 64, 0], jnp.int32),
                      jnp.asarray(suffix))
    return (q, kc, vc, kvl, tables, qsl, ns), sh


@pytest.mark.parametrize("window", [0, 1, 12, 16, 40])
@pytest.mark.parametrize("cascade", [False, True], ids=["plain", "cascade"])
def test_window_in_every_attention_path(window, cascade):
    """Path A (decode rows), path B (prefill tiles), the shared-prefix cascade of both, as XLA
    and as the C++ kernel (where built), against the oracle: windows inside a block, a block
    long, across blocks, and none."""
    from runtime.kernels.cpu import attention as cpu_attention

    batch, sh = shared_batch(np.random.default_rng(window), window)
    want = oracle(*batch, 0.2, window)
    kernels = [False] + ([True] if cpu_attention.available() else [])
    for kernel in kernels:
        got = np.asarray(xla_ragged_paged_attention(*map(jnp.asarray, batch), sm_scale=0.2, cpu_kernel=kernel,
                                                    window=jnp.int32(window), shared=sh if cascade else None,
                                                    prefill_chunk_blocks=2, q_tile=8))
        np.testing.assert_allclose(got, want, atol=2e-5, err_msg=f"cpu_kernel={kernel}")


def test_window_on_an_int8_cache_kernel_against_xla():
    """The C++ kernel's int8 target (blocks dequantized inside it) with a window: the numbers
    of the XLA path reading the same quantized cache."""
    from runtime.kernels.cpu import attention as cpu_attention
    from runtime.model.kv_pages import QuantizedPages

    if not cpu_attention.available():
        pytest.skip("the C++ CPU kernels are not built here")
    (q, kc, vc, *rest), sh = shared_batch(np.random.default_rng(5), 12)
    kp, vp = (QuantizedPages.of(jnp.asarray(c), jnp.int8, kc.shape[-1] // n) for c, n in ((kc, 8), (vc, 32)))
    got = [np.asarray(xla_ragged_paged_attention(jnp.asarray(q), kp, vp, *map(jnp.asarray, rest), sm_scale=0.2,
                                                 cpu_kernel=kernel, window=12, shared=sh)) for kernel in (False, True)]
    np.testing.assert_allclose(got[1], got[0], atol=2e-5)


@pytest.mark.parametrize("cascade", [False, True], ids=["plain", "cascade"])
def test_soft_cap_and_window_on_the_xla_path(cascade):
    batch, sh = shared_batch(np.random.default_rng(9), 12)
    batch = (batch[0] * 4, *batch[1:])  # large scores: the cap bends them
    want = oracle(*batch, 0.2, 12, soft_cap=3.0)
    assert np.abs(want - oracle(*batch, 0.2, 12)).max() > 0.05
    got = np.asarray(xla_ragged_paged_attention(*map(jnp.asarray, batch), sm_scale=0.2, cpu_kernel=False,
                                                window=12, soft_cap=3.0, shared=sh if cascade else None))
    np.testing.assert_allclose(got, want, atol=2e-5)
    with pytest.raises(ValueError, match="soft-cap"):
        xla_ragged_paged_attention(*map(jnp.asarray, batch), sm_scale=0.2, cpu_kernel=True, soft_cap=3.0)


def test_dense_reference_attention_window_and_soft_cap():
    rng = np.random.default_rng(1)
    T = 30
    q, k, v = (rng.standard_normal((T, h, 16)).astype(np.float32) for h in (4, 2, 2))
    got = np.asarray(dense_causal_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), causal_mask(T, 7),
                                            sm_scale=0.3, soft_cap=2.0))
    qsl, kvl, tables = np.array([0, T]), np.array([T]), np.arange(2)[None]
    kc, vc = (np.pad(a, ((0, 2), (0, 0), (0, 0))).reshape(2, 16, 2, 16) for a in (k, v))
    np.testing.assert_allclose(got, oracle(q, kc, vc, kvl, tables, qsl, [1], 0.3, 7, 2.0), atol=1e-5)
    assert np.array_equal(np.asarray(causal_mask(4, 2)), np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0],
                                                                   [0, 0, 1, 1]], bool))
    assert np.array_equal(np.asarray(causal_mask(4, 0)), np.tril(np.ones((4, 4), bool)))


def test_pallas_is_refused_for_windows_and_soft_caps():
    from runtime.model.attention_backend import XlaAttention, make_backend

    with pytest.raises(ValueError, match="^attention_backend: pallas does not implement sliding-window"):
        make_backend("pallas", "float32", cpu_kernels=True, windowed=True)
    with pytest.raises(ValueError, match="attention logit soft-capping"):
        make_backend("pallas", "float32", cpu_kernels=True, soft_cap=50.0)
    assert make_backend("xla", "float32", cpu_kernels=True, soft_cap=50.0) == XlaAttention(cpu_kernel=False)


def test_runner_skips_the_swiglu_tail_for_gemma():
    """The float kernel's packing: Gemma's projections each on their own (no SwiGLU pair, no
    fused tail), Llama's with them."""
    from runtime.model.families import init_params
    from runtime.model.runner import pack_float_for

    cfg = ModelConfig("gemma3", 64, 64, 128, 2, 4, 2, 16, layer_types=("sliding_attention", "full_attention"),
                      sliding_window=8, hidden_activation="gelu_tanh")
    packed = pack_float_for(cfg, init_params(cfg))["layers"]
    assert "gate_up" not in packed and {"qkv", "wo", "w_gate", "w_up", "w_down"} <= set(packed)
    assert family(cfg).SWIGLU_TAIL is False and "post_mlp_norm" in param_shapes(cfg)["layers"]


# --- refusals ---------------------------------------------------------------------------------

def gemma_config_dir(tmp_path, arch="gemma2", name=None, **changes):
    cls = {"gemma2": (transformers.Gemma2Config, "Gemma2ForCausalLM"),
           "gemma3": (transformers.Gemma3TextConfig, "Gemma3ForCausalLM")}[arch]
    return write_hf_config_dir(tmp_path / "hf", cls[0](architectures=[name or cls[1]], **GEMMA).to_dict(), TOK_JSON,
                               **changes)


REFUSED = [
    ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
    ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention True"),
    ("gemma2", {"attention_bias": True}, "attention_bias True"),
    ("gemma2", {"final_logit_softcapping": -1.0}, "final_logit_softcapping -1.0"),
    ("gemma2", {"layer_types": ["sliding_attention", "chunked_attention"] * 2}, "layer_types 'chunked_attention'"),
    ("gemma2", {"sliding_window": 0}, "sliding_window 0"),
    ("gemma2", {"altup_num_inputs": 4}, "'altup_num_inputs'"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping 50.0"),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "rope_parameters.sliding_attention.rope_type 'linear'"),
    ("gemma3", {"layer_types": None, "sliding_window_pattern": 0}, "sliding_window_pattern 0"),
]


@pytest.mark.parametrize("arch,changes,named", REFUSED, ids=[n for _, _, n in REFUSED])
def test_unsupported_gemma_field_is_refused_naming_it(tmp_path, arch, changes, named):
    with pytest.raises(CheckpointError, match="config.json: ") as exc:
        HFSource(gemma_config_dir(tmp_path, arch, **changes)).model_config()
    assert named in str(exc.value) and "\n" not in str(exc.value)


def test_gemma3_multimodal_checkpoint_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="unsupported architecture 'Gemma3ForConditionalGeneration'"):
        HFSource(gemma_config_dir(tmp_path, "gemma3", name="Gemma3ForConditionalGeneration"))


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_transformers_default_and_4x_configs(tmp_path, arch):
    """transformers' defaults (Gemma 2 alternates sliding layers, soft-caps 50 / 30; Gemma 3
    every 6th layer full) and Gemma 3's 4.x keys (rope_theta, rope_local_base_freq,
    rope_scaling, sliding_window_pattern) read as 5.x's."""
    d = gemma_config_dir(tmp_path, arch, layer_types=None, attn_logit_softcapping=None if arch == "gemma3" else 50.0)
    cfg = HFSource(d).model_config()
    if arch == "gemma2":
        assert cfg.layer_types == ("sliding_attention", "full_attention") * 2
        assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (50.0, 30.0)
        return
    assert cfg.layer_types == ("sliding_attention",) * 4 and (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)
    c = json.loads((d / "config.json").read_text())
    c.pop("rope_parameters")
    c.pop("_sliding_window_pattern")
    c.update(rope_theta=500000.0, rope_local_base_freq=20000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
             sliding_window_pattern=2)
    (d / "config.json").write_text(json.dumps(c))
    cfg = HFSource(d).model_config()
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling.factor) == (500000.0, 20000.0, 8.0)
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 2
    assert math.isclose(cfg.query_pre_attn_scalar, 24.0)
