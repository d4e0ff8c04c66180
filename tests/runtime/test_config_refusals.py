"""No config field is silently ignored, in any family: a config.json with a key pagedjax does
not know, or a known key with a value it does not implement, is refused in one line naming
the field, at `convert --from hf` (exit code 2) and, for pagedjax's own config.json edited
after conversion, at load (`inspect` exit code 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.checkpoint import hf_source
from runtime.checkpoint.hf_source import HFSource
from runtime.checkpoint.mapping import CheckpointError
from runtime.checkpoint.store import load_config, write_checkpoint
from runtime.cli import main
from runtime.model.families import init_params
from tests.model_files import write_hf_config_dir
from tests.tiny import tiny_tokenizer_json

transformers = pytest.importorskip("transformers", reason="transformers not installed (pip install -e .[peer])")

TOK_JSON, VOCAB = tiny_tokenizer_json()
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5)
# architecture -> transformers' config class; families another change adds count once hf_source has them
CONFIG_CLASSES = {"LlamaForCausalLM": "LlamaConfig", "MistralForCausalLM": "MistralConfig",
                  "Qwen2ForCausalLM": "Qwen2Config", "Qwen3ForCausalLM": "Qwen3Config",
                  "Phi3ForCausalLM": "Phi3Config", "Gemma2ForCausalLM": "Gemma2Config",
                  "Gemma3ForCausalLM": "Gemma3TextConfig", "MixtralForCausalLM": "MixtralConfig",
                  "Qwen3MoeForCausalLM": "Qwen3MoeConfig", "DeepseekV2ForCausalLM": "DeepseekV2Config"}
# beside SIZES: few, narrow experts (the config classes' defaults would make 128 of width 768)
EXTRA = {"MixtralForCausalLM": {"num_local_experts": 4},
         "Qwen3MoeForCausalLM": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
         "DeepseekV2ForCausalLM": {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                   "kv_lora_rank": 32, "q_lora_rank": None, "qk_rope_head_dim": 8,
                                   "qk_nope_head_dim": 16, "v_head_dim": 16, "num_key_value_heads": 4}}
ARCHS = [a for a in CONFIG_CLASSES if a in hf_source.ARCHS]


def test_every_supported_architecture_is_covered():
    assert set(hf_source.ARCHS) <= set(CONFIG_CLASSES), "add the new architecture's config class here"


def config_dir(tmp_path: Path, arch: str, **changes) -> Path:
    """config.json as transformers writes it for `arch` (tiny sizes) plus `changes`, and what
    the directory needs to open; no weights are read before the config is checked."""
    c = getattr(transformers, CONFIG_CLASSES[arch])(architectures=[arch], **{**SIZES, **EXTRA.get(arch, {})}).to_dict()
    return write_hf_config_dir(tmp_path / arch, {**c, **changes}, TOK_JSON)


# (changes to config.json, what the refusal names)
AT_CONVERT = [
    ({"frobnicate_scale": 2.0}, "'frobnicate_scale'"),  # unknown key
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),  # known key, value not implemented
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "quantization_config"),
    ({"auto_map": {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}}, "auto_map"),
]


def test_transformers_default_config_converts(tmp_path):
    """The unchanged config.json of each family is accepted (the refusals below are the changes)."""
    for arch in ARCHS:
        assert HFSource(config_dir(tmp_path, arch)).model_config().architecture == hf_source.ARCHS[arch][0]


@pytest.mark.parametrize("changes,named", AT_CONVERT, ids=[n for _, n in AT_CONVERT])
@pytest.mark.parametrize("arch", ARCHS)
def test_convert_refuses_in_one_line(tmp_path, capsys, arch, changes, named):
    src = config_dir(tmp_path, arch, **changes)
    code = main(["convert", "--from", "hf", str(src), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert named in err and "config.json: " in err
    assert not (tmp_path / "out").exists()


AT_LOAD = [
    ({"frobnicate_scale": 2.0}, "unknown fields ['frobnicate_scale']"),
    ({"rope_scaling": {"rope_type": "proportional", "factor": 2.0}}, "rope_scaling.rope_type: 'proportional'"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "beta_fast": 8.0}}, "rope_scaling.beta_fast"),
    ({"hidden_activation": "relu"}, "hidden_activation"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"layer_types": ["chunked_attention", "full_attention"]}, "layer_types"),
    ({"architecture": "phi4"}, "architecture"),
    # dynamic NTK is served exactly up to its original length only: a longer context is refused
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 128}},
     "max_position_embeddings"),
]


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, Path]:
    """Per family, a pagedjax checkpoint (random weights) of the config HFSource converts."""
    out = {}
    for arch in ARCHS:
        tmp = tmp_path_factory.mktemp(arch)
        cfg = HFSource(config_dir(tmp, arch)).model_config()
        out[arch] = write_checkpoint(tmp / "ck", cfg, init_params(cfg), TOK_JSON, None)
    return out


@pytest.mark.parametrize("changes,named", AT_LOAD, ids=[n for _, n in AT_LOAD])
@pytest.mark.parametrize("arch", ARCHS)
def test_load_refuses_an_edited_config_in_one_line(tmp_path, capsys, converted, arch, changes, named):
    import shutil

    ck = Path(shutil.copytree(converted[arch], tmp_path / "ck"))
    assert load_config(ck).architecture == hf_source.ARCHS[arch][0]
    c = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps({**c, **changes}))
    with pytest.raises(CheckpointError) as exc:
        load_config(ck)
    assert named in str(exc.value) and "\n" not in str(exc.value)
    assert main(["inspect", str(ck)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err
