"""The RoPE scalings Qwen, DeepSeek-style exports and Phi-3 use (yarn, dynamic, longrope)
against transformers: the inverse frequencies and cos/sin amplitude transformers computes for
the same config.json, then greedy tokens and logprobs through the engine; and the limits where
transformers' frequencies depend on the sequence's length (dynamic, longrope), which the
converted config caps (a longer max_model_len is refused)."""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

from runtime.checkpoint.hf_source import HFSource
from runtime.checkpoint.mapping import CheckpointError
from runtime.checkpoint.store import convert, load_checkpoint, load_config
from runtime.config import RopeScaling
from runtime.model.families import dense_logits
from runtime.model.families.llama import rope_inv_freq
from tests.runtime.test_families_config import (PROMPT, assert_engine_matches, build_hf, config_dir, hf_reference,
                                                 log_softmax)
from tests.tiny import make_tiny_checkpoint

transformers = pytest.importorskip("transformers", reason="transformers not installed (pip install -e .[peer])")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

rng = np.random.default_rng(3)
# head_dim 32 (16 frequencies); theta 1e4 with original 256: yarn's ramp spans dimensions 0-7
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 1e4}
LONGROPE = {"rope_type": "longrope", "short_factor": [float(x) for x in rng.uniform(1, 4, 16)],
            "long_factor": [float(x) for x in rng.uniform(4, 16, 16)], "original_max_position_embeddings": 64,
            "rope_theta": 1e4}


def table(cfg) -> tuple[np.ndarray, float]:
    """(inverse frequencies, amplitude) of rope_inv_freq's table."""
    t = rope_inv_freq(cfg)
    assert t.shape == (2, cfg.head_dim // 2) and np.all(t[1] == t[1][0])
    return t[0], float(t[1][0])


CASES = {
    "yarn": YARN,
    "yarn-betas-untruncated": {**YARN, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    "yarn-attention_factor": {**YARN, "attention_factor": 1.25},
    "yarn-mscale": {**YARN, "factor": 8.0, "mscale": 0.707, "mscale_all_dim": 1.0},
    "yarn-mscale-alone": {**YARN, "mscale": 0.707},  # transformers uses it only with mscale_all_dim
    "yarn-no-factor": {**YARN, "factor": None},  # max_position_embeddings / original
    "yarn-zero-betas": {**YARN, "beta_fast": 0, "beta_slow": 0},  # transformers: `or 32`, `or 1`
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
    "longrope": LONGROPE,
    "longrope-factor": {**LONGROPE, "factor": 3.0},
    "longrope-attention_factor": {**LONGROPE, "attention_factor": 1.5},
}


@pytest.mark.parametrize("rope", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_rope_table_equals_transformers(tmp_path, arch, rope):
    """Inverse frequencies and the cos/sin amplitude equal what transformers computes for the
    same config.json (at its start, i.e. for sequences within the original context)."""
    src = config_dir(tmp_path, arch, rope_parameters=dict(rope), head_dim=32)  # qwen2: not its default
    cfg = HFSource(src).model_config()
    assert cfg.rope_scaling.rope_type == rope["rope_type"]
    inv, amp = ROPE_INIT_FUNCTIONS[rope["rope_type"]](transformers.AutoConfig.from_pretrained(src))
    mine, my_amp = table(cfg)
    np.testing.assert_allclose(mine, inv.numpy(), rtol=1e-6)
    assert my_amp == pytest.approx(amp, rel=1e-6)
    if rope["rope_type"] != "dynamic":  # the scaling does something (else this proves nothing)
        plain, _ = table(dataclasses.replace(cfg, rope_scaling=None))
        assert not np.allclose(mine, plain, rtol=1e-3) or amp != 1.0


def test_top_level_original_max_position_embeddings_wins(tmp_path):
    """transformers: a top-level original_max_position_embeddings overrides the dict's."""
    src = config_dir(tmp_path, "llama", rope_parameters=dict(YARN), original_max_position_embeddings=512)
    cfg = HFSource(src).model_config()
    assert cfg.rope_scaling.original_max_position_embeddings == 512
    inv, _ = ROPE_INIT_FUNCTIONS["yarn"](transformers.AutoConfig.from_pretrained(src))
    np.testing.assert_allclose(table(cfg)[0], inv.numpy(), rtol=1e-6)


def test_4x_style_yarn_as_qwen_ships_it(tmp_path):
    """Qwen2.5's README form: rope_scaling {"type": "yarn", ...} next to a top-level rope_theta."""
    src = config_dir(tmp_path, "qwen2", rope_parameters=None, rope_theta=1e4,
                     rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256})
    assert HFSource(src).model_config().rope_scaling == RopeScaling(
        4.0, original_max_position_embeddings=256, rope_type="yarn", attention_factor=1 + 0.1 * np.log(4.0))


# --- through the engine: greedy tokens and logprobs equal transformers' --------------------

@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_yarn_matches_transformers(tmp_path, arch):
    src = build_hf(tmp_path / "hf", arch, rope_parameters=dict(YARN))
    convert(HFSource(src), tmp_path / "ck", progress=False)
    cfg, params, _ = load_checkpoint(tmp_path / "ck")
    assert cfg.rope_scaling.rope_type == "yarn" and cfg.max_position_embeddings == 1024  # static: no cap
    ids = jnp.asarray(PROMPT)
    plain = dataclasses.replace(cfg, rope_scaling=None)
    assert np.abs(np.asarray(dense_logits(cfg, params, ids)) - np.asarray(dense_logits(plain, params, ids))).max() > 0.1
    assert_engine_matches(tmp_path / "ck", src, PROMPT, 16)


def engine_args(*argv: str) -> argparse.Namespace:
    from runtime.core.engine_args import add_engine_arguments

    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    return p.parse_args(list(argv))


def test_dynamic_is_default_rope_within_max_positions_and_refused_past_them(tmp_path):
    """Dynamic NTK changes the frequencies only once a sequence passes max_position_embeddings
    (for the whole sequence, cached keys included: no KV cache can follow). Within it: the
    default RoPE, equal to transformers; a longer max_model_len is refused."""
    from runtime.core.engine_args import engine_config_from_args

    src = build_hf(tmp_path / "hf", "qwen2", max_position_embeddings=64,
                   rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4})
    convert(HFSource(src), tmp_path / "ck", progress=False)
    cfg, params, _ = load_checkpoint(tmp_path / "ck")
    assert cfg.rope_scaling == RopeScaling(4.0, original_max_position_embeddings=64, rope_type="dynamic")
    assert cfg.max_position_embeddings == 64
    with pytest.raises(ValueError, match=r"^max_model_len: 128 exceeds the model's 64"):
        engine_config_from_args(engine_args("--max-model-len", "128"))(cfg)
    # past 64 positions transformers rescales every position: the limit is real
    _, logp = hf_reference(src, PROMPT, 0)
    mine = log_softmax(np.asarray(dense_logits(cfg, params, jnp.asarray(PROMPT))))
    assert np.abs(mine[:64] - logp[:64]).max() > 0.01  # its first 64 positions too: no cache could follow
    assert_engine_matches(tmp_path / "ck", src, PROMPT[:40], 20, max_model_len=64)


def test_longrope_matches_transformers_within_the_original_context(tmp_path):
    """LongRoPE (short factors, the attention factor of max/original positions) within
    original_max_position_embeddings; past it transformers switches every position to the long
    factors, so the converted context stops there."""
    from runtime.core.engine_args import engine_config_from_args

    src = build_hf(tmp_path / "hf", rope_parameters=dict(LONGROPE))
    convert(HFSource(src), tmp_path / "ck", progress=False)
    cfg, params, _ = load_checkpoint(tmp_path / "ck")
    assert cfg.rope_scaling.rope_type == "longrope" and cfg.rope_scaling.max_exact_len == 64
    assert cfg.max_position_embeddings == 64  # capped from 1024
    assert cfg.rope_scaling.attention_factor == pytest.approx(np.sqrt(1 + np.log(1024 / 64) / np.log(64)))
    with pytest.raises(ValueError, match=r"^max_model_len: 65 exceeds the model's 64"):
        engine_config_from_args(engine_args("--max-model-len", "65"))(cfg)
    ids = jnp.asarray(PROMPT[:60])
    plain = dataclasses.replace(cfg, rope_scaling=None)
    assert np.abs(np.asarray(dense_logits(cfg, params, ids)) - np.asarray(dense_logits(plain, params, ids))).max() > 0.1
    assert_engine_matches(tmp_path / "ck", src, PROMPT[:40], 20, max_model_len=64)


# --- refusals: at convert and in a converted config.json ----------------------------------

@pytest.mark.parametrize("rope,named", [
    ({**YARN, "truncate": "yes"}, "rope_parameters.truncate 'yes'"),
    ({**YARN, "attention_factor": 0.0}, "rope_parameters.attention_factor"),
    ({**YARN, "short_factor": [1.0] * 16}, "rope_parameters.short_factor is not supported with rope_type 'yarn'"),
    ({"rope_type": "dynamic", "rope_theta": 1e4}, "rope_parameters.factor is missing"),
    ({"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 32},
     "rope_parameters.original_max_position_embeddings is not supported with rope_type 'dynamic'"),
    ({**LONGROPE, "short_factor": [1.0] * 15}, "rope_parameters.short_factor is not a list of 16 positive numbers"),
    ({**LONGROPE, "long_factor": None}, "rope_parameters.long_factor is not a list of 16"),
    ({**LONGROPE, "beta_fast": 32}, "rope_parameters.beta_fast is not supported with rope_type 'longrope'"),
])
def test_unsupported_rope_fields_are_refused(tmp_path, rope, named):
    with pytest.raises(CheckpointError) as exc:
        HFSource(config_dir(tmp_path, "llama", rope_parameters=rope)).model_config()
    assert named in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize("scaling,named", [
    ({"rope_type": "linear", "factor": 2.0, "beta_fast": 16.0}, "rope_scaling.beta_fast: not used by rope_type 'linear'"),
    ({"rope_type": "llama3", "attention_factor": 2.0}, "rope_scaling.attention_factor: not used by rope_type 'llama3'"),
    ({"rope_type": "yarn", "factor": 4.0, "freq_factors": [1.0] * 8}, "rope_scaling.freq_factors: not used"),
    ({"rope_type": "yarn", "factor": 4.0, "attention_factor": -1.0}, "rope_scaling.attention_factor: must be positive"),
    ({"rope_type": "longrope", "freq_factors": []}, "rope_scaling.freq_factors: must be positive finite"),
    ({"rope_type": "proportional", "factor": 2.0}, "rope_scaling.rope_type: 'proportional' is not supported"),
])
def test_converted_config_with_unused_or_bad_rope_field_is_refused_at_load(tmp_path, scaling, named):
    ck = make_tiny_checkpoint(tmp_path / "ck")
    c = json.loads((ck / "config.json").read_text())
    c["rope_scaling"] = scaling
    (ck / "config.json").write_text(json.dumps(c))
    with pytest.raises(CheckpointError) as exc:
        load_config(ck)
    assert named in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize("scaling", [
    RopeScaling(4.0, original_max_position_embeddings=256, rope_type="yarn", attention_factor=1.2, beta_fast=16.0,
                beta_slow=2.0, truncate=False),
    RopeScaling(2.0, original_max_position_embeddings=64, rope_type="dynamic"),
    RopeScaling(rope_type="longrope", freq_factors=(1.0, 2.0) * 4, original_max_position_embeddings=64,
                attention_factor=1.1),
])
def test_new_rope_types_round_trip_through_a_converted_config(tmp_path, scaling):
    # head_dim 16: 8 frequencies; dynamic and longrope are served up to their original length only
    ck = make_tiny_checkpoint(tmp_path / "ck", rope_scaling=scaling, max_position_embeddings=scaling.max_exact_len or 1024)
    assert load_config(ck).rope_scaling == scaling
    stored = json.loads((ck / "config.json").read_text())["rope_scaling"]
    assert stored["rope_type"] == scaling.rope_type and "low_freq_factor" not in stored  # only what the type reads
