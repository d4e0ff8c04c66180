"""Phi-3 (Phi3ForCausalLM) against transformers: Llama's math with q|k|v and gate|up stored
as one fused weight each (split at convert), every layer sliding when sliding_window is set,
LongRoPE within the original context; and the config.json forms Microsoft's repositories ship."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from runtime.checkpoint.hf_source import HFSource
from runtime.checkpoint.mapping import CheckpointError
from runtime.checkpoint.store import convert, load_checkpoint
from runtime.config import RopeScaling
from tests.model_files import write_hf_config_dir
from tests.runtime.test_families_config import PROMPT, SIZES, TOK_JSON, assert_engine_matches

transformers = pytest.importorskip("transformers", reason="transformers not installed (pip install -e .[peer])")
torch = pytest.importorskip("torch", reason="torch not installed (pip install -e .[peer])")

PHI3_SIZES = {k: v for k, v in SIZES.items() if k != "head_dim"}  # Phi3Config derives it: 64 / 4 heads = 16
LONGROPE = {"rope_type": "longrope", "rope_theta": 1e4,
            "short_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0],
            "long_factor": [2.0, 3.0, 4.0, 6.0, 8.0, 10.0, 12.0, 16.0]}


def build_phi3(out: Path, seed: int = 0, **kw) -> Path:
    """A random Phi3ForCausalLM (weights scaled as test_families_config.build_hf's), saved
    with our tiny tokenizer."""
    config = transformers.Phi3Config(**{**PHI3_SIZES, **kw})
    torch.manual_seed(seed)
    model = transformers.Phi3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.copy_(4 * torch.randn_like(p) / p.shape[1] ** 0.5)
            else:
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
    model.save_pretrained(out)
    (out / "tokenizer.json").write_text(TOK_JSON)
    return out


def phi3_config_dir(tmp_path: Path, **changes) -> Path:
    """A Phi3 config.json (tiny sizes; a key set to None is dropped), no weights."""
    return write_hf_config_dir(tmp_path / "phi3-hf",
                               transformers.Phi3Config(architectures=["Phi3ForCausalLM"], **PHI3_SIZES).to_dict(),
                               TOK_JSON, **changes)


def test_phi3_matches_transformers(tmp_path):
    src = build_phi3(tmp_path / "hf")
    convert(HFSource(src), tmp_path / "ck", progress=False)
    cfg, params, _ = load_checkpoint(tmp_path / "ck")
    assert (cfg.architecture, cfg.head_dim, cfg.sliding_window, cfg.rope_scaling) == ("phi3", 16, None, None)
    # the fused weights split in their row order: q (4 heads), k, v (2 KV heads each); gate, up
    hf = transformers.Phi3ForCausalLM.from_pretrained(src).model.layers[1]
    qkv = hf.self_attn.qkv_proj.weight.detach().numpy()
    gate_up = hf.mlp.gate_up_proj.weight.detach().numpy()
    np.testing.assert_array_equal(np.asarray(params["layers"]["wk"][1]), qkv[64:96].T)
    np.testing.assert_array_equal(np.asarray(params["layers"]["wv"][1]), qkv[96:].T)
    np.testing.assert_array_equal(np.asarray(params["layers"]["w_up"][1]), gate_up[128:].T)
    assert_engine_matches(tmp_path / "ck", src, PROMPT, 16)


def test_phi3_longrope_matches_transformers_within_the_original_context(tmp_path):
    """Phi-3-mini-128k's form: longrope with a top-level original_max_position_embeddings and
    the attention factor from max / original positions; served (exactly) up to the original."""
    src = build_phi3(tmp_path / "hf", rope_parameters=dict(LONGROPE), max_position_embeddings=1024,
                     original_max_position_embeddings=64)
    convert(HFSource(src), tmp_path / "ck", progress=False)
    cfg, _, _ = load_checkpoint(tmp_path / "ck")
    assert cfg.rope_scaling == RopeScaling(rope_type="longrope", freq_factors=LONGROPE["short_factor"],
                                           original_max_position_embeddings=64,
                                           attention_factor=np.sqrt(1 + np.log(16) / np.log(64)))
    assert cfg.max_position_embeddings == 64
    assert_engine_matches(tmp_path / "ck", src, PROMPT[:40], 20, max_model_len=64)


def test_phi3_sliding_window_within_the_window(tmp_path):
    """Phi-3-mini-4k ships sliding_window 2047 (odd: the query and 2046 keys before it)."""
    src = build_phi3(tmp_path / "hf", sliding_window=47)
    convert(HFSource(src), tmp_path / "ck", progress=False)
    cfg, _, _ = load_checkpoint(tmp_path / "ck")
    assert cfg.sliding_window == 47 and cfg.layer_windows() == (47, 47)
    assert_engine_matches(tmp_path / "ck", src, PROMPT[:30], 17, max_model_len=47)


def test_phi3_sliding_window_past_the_window(tmp_path):
    """An 80-token prompt and 24 decoded through a 47-token window on every layer."""
    src = build_phi3(tmp_path / "hf", sliding_window=47)
    convert(HFSource(src), tmp_path / "ck", progress=False)
    assert_engine_matches(tmp_path / "ck", src, PROMPT, 24, max_model_len=128)


def test_phi3_configs_as_microsoft_ships_them(tmp_path):
    """4.x keys, auto_map naming the repository's own (upstreamed) modeling_phi3.py, dropout
    keys; the 128k form's rope_scaling type "su"."""
    mini_4k = dict(rope_parameters=None, rope_scaling=None, rope_theta=10000.0, sliding_window=2047,
                   attention_bias=False, resid_pdrop=0.0, embd_pdrop=0.0, original_max_position_embeddings=4096,
                   max_position_embeddings=4096,
                   auto_map={"AutoConfig": "configuration_phi3.Phi3Config",
                             "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"})
    cfg = HFSource(phi3_config_dir(tmp_path, **mini_4k)).model_config()
    assert (cfg.architecture, cfg.sliding_window, cfg.max_position_embeddings, cfg.rope_scaling) == (
        "phi3", 2047, 4096, None)
    su = {"type": "su", "short_factor": LONGROPE["short_factor"], "long_factor": LONGROPE["long_factor"]}
    cfg = HFSource(phi3_config_dir(tmp_path, **{**mini_4k, "rope_scaling": su, "max_position_embeddings": 131072,
                                                "sliding_window": 262144})).model_config()
    assert cfg.rope_scaling.rope_type == "longrope" and cfg.max_position_embeddings == 4096
    assert cfg.rope_scaling.attention_factor == pytest.approx(np.sqrt(1 + np.log(32) / np.log(4096)))


@pytest.mark.parametrize("changes,named", [
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
     "rope_parameters.rope_type 'linear' is not supported for phi3"),
    ({"attention_bias": True}, "attention_bias True"),
    ({"auto_map": {"AutoModelForCausalLM": "modeling_phi4.Phi4ForCausalLM"}}, "auto_map"),
    ({"sliding_window": 0}, "sliding_window 0"),
    ({"rope_parameters": {**LONGROPE, "short_factor": [1.0] * 16}},
     "rope_parameters.short_factor is not a list of 8 positive numbers"),
])
def test_phi3_unsupported_config_is_refused(tmp_path, changes, named):
    with pytest.raises(CheckpointError) as exc:
        HFSource(phi3_config_dir(tmp_path, **changes)).model_config()
    assert named in str(exc.value) and "\n" not in str(exc.value)


def test_phi3_fused_weight_of_the_wrong_shape_is_refused(tmp_path):
    from safetensors.numpy import load_file, save_file

    src = build_phi3(tmp_path / "hf")
    w = load_file(src / "model.safetensors")
    w["model.layers.0.self_attn.qkv_proj.weight"] = w["model.layers.0.self_attn.qkv_proj.weight"][:-16]
    save_file(w, src / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model.layers.0.self_attn.qkv_proj.weight' has shape \[112, 64\], "
                                              r"expected \[128, 64\]"):
        convert(HFSource(src), tmp_path / "ck", progress=False)
