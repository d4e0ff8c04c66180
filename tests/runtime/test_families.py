"""Families beyond Llama on the model seam, against transformers on tiny random checkpoints
that transformers itself builds: greedy tokens and logprobs through the engine (chunked
prefill: prompts longer than the step's token budget), prefix caching and batch invariance.

Qwen3 is the seam's proof: one module (runtime/model/families/qwen3.py: the per-head q/k norms) and
two checkpoint rules, no change to the runner, the kernels or the scheduler."""

from __future__ import annotations

import json

import numpy as np
import pytest

from runtime.checkpoint.hf_source import HFSource
from runtime.checkpoint.mapping import CheckpointError
from runtime.checkpoint.store import convert, load_checkpoint
from runtime.model.sampling import SamplingParams
from tests.engine_util import make_engine
from tests.runtime.test_families_config import PROMPT, assert_engine_matches, build_hf, hf_reference

pytest.importorskip("transformers", reason="transformers not installed (pip install -e .[peer])")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qwen3")
    src = build_hf(tmp / "hf", "qwen3", rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    convert(HFSource(src), tmp / "ck", progress=False)
    return src, tmp / "ck"


def test_qwen3_converts_with_its_qk_norms(qwen3):
    src, ck = qwen3
    cfg, params, _ = load_checkpoint(ck)
    assert cfg.architecture == "qwen3" and cfg.rope_theta == 1e6 and not cfg.attention_bias
    assert params["layers"]["q_norm"].shape == (2, 32) and params["layers"]["k_norm"].shape == (2, 32)
    assert "bq" not in params["layers"]


def test_qwen3_matches_transformers_through_the_engine(qwen3):
    """80 prompt tokens through a 32-token step budget: chunked prefill, then decode."""
    src, ck = qwen3
    assert_engine_matches(ck, src, PROMPT, 16)


def test_qwen3_prefix_cache_and_batch_invariance(qwen3):
    """A second prompt sharing the first's 64 leading tokens reuses their blocks and still
    gives transformers' tokens; each prompt alone gives the batch's tokens."""
    src, ck = qwen3
    other = PROMPT[:64] + [int(t) for t in np.random.default_rng(3).integers(3, 200, 12)]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    eng = make_engine(ck, num_blocks=64, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=128)
    first = eng.generate([PROMPT], sp)[0]
    second = eng.generate([other], sp)[0]
    assert second.num_cached_tokens >= 48  # whole 16-token blocks of the shared 64
    assert first.output_ids == hf_reference(src, PROMPT, 8)[0]
    assert second.output_ids == hf_reference(src, other, 8)[0]
    fresh = make_engine(ck, num_blocks=64, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=128)
    both = fresh.generate([PROMPT, other], sp)
    assert [r.output_ids for r in both] == [first.output_ids, second.output_ids]


def test_qwen3_attention_bias_is_refused(tmp_path):
    src = build_hf(tmp_path / "hf", "qwen3", attention_bias=True)
    with pytest.raises(CheckpointError, match="attention_bias True is not supported"):
        HFSource(src).model_config()


def test_qwen3_unknown_field_is_refused(tmp_path):
    src = build_hf(tmp_path / "hf", "qwen3")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "qk_layernorm_style": "rms"}))
    with pytest.raises(CheckpointError, match="unknown field 'qk_layernorm_style'"):
        HFSource(src).model_config()
