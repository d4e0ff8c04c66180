"""The native /generate and /generate_stream routes (Text Generation Inference's shapes), in
process on a tiny model: same greedy text as /v1/completions, details, streaming, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from litestar.testing import TestClient

from console.app import create_app
from console.settings import ServerSettings
from runtime.core.async_engine import AsyncEngine
from tests.engine_util import make_engine

KEY = "gen-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def client(tiny_ckpt):
    settings = ServerSettings(admin_token="tadmin", api_key=KEY, model_name="tiny", checkpoint=Path("tiny"),
                              access_log=False, warmup=False)
    app = create_app(settings, engine=AsyncEngine(make_engine(tiny_ckpt)))
    with TestClient(app, timeout=60) as c:
        yield c


def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


def test_generate_matches_completions_greedy_and_reports_details(client):
    r = client.post("/generate", headers=AUTH,
                    json={"inputs": PROMPT, "parameters": {"max_new_tokens": 12, "details": True}})
    assert r.status_code == 200, r.text
    body = r.json()
    ref = client.post("/v1/completions", headers=AUTH,
                      json={"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}).json()
    assert body["generated_text"] == ref["choices"][0]["text"]
    d = body["details"]
    assert d["generated_tokens"] == ref["usage"]["completion_tokens"] == len(d["tokens"])
    assert d["finish_reason"] == ("length" if d["generated_tokens"] == 12 else "eos_token")
    assert all(t["logprob"] is not None and t["logprob"] <= 0 for t in d["tokens"])
    full = client.post("/generate", headers=AUTH, json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 12, "return_full_text": True}}).json()
    assert full["generated_text"] == PROMPT + body["generated_text"] and full.get("details") is None


def test_generate_stream_tokens_add_up_to_the_text(client):
    r = client.post("/generate_stream", headers=AUTH, json={"inputs": PROMPT, "parameters": {"max_new_tokens": 10}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r.text)
    assert [e["index"] for e in events] == list(range(len(events)))
    assert all(e["generated_text"] is None for e in events[:-1])
    last = events[-1]
    assert last["generated_text"] == "".join(e["token"]["text"] for e in events)
    assert last["details"]["generated_tokens"] == len(events)
    plain = client.post("/generate", headers=AUTH, json={"inputs": PROMPT, "parameters": {"max_new_tokens": 10}})
    assert plain.json()["generated_text"] == last["generated_text"]
    # stream: true on /generate answers the same way
    assert _events(client.post("/generate", headers=AUTH, json={
        "inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 10}}).text)[-1] == last


def test_stop_sequence_and_seeded_sampling(client):
    text = client.post("/generate", headers=AUTH,
                       json={"inputs": PROMPT, "parameters": {"max_new_tokens": 24}}).json()["generated_text"]
    stop = next((text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].strip()), None)
    if stop is None:
        pytest.skip("the tiny model produced no usable stop string")
    r = client.post("/generate", headers=AUTH, json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 24, "stop": [stop], "details": True}}).json()
    assert r["details"]["finish_reason"] == "stop_sequence" and stop not in r["generated_text"]
    kw = {"inputs": PROMPT, "parameters": {"max_new_tokens": 8, "do_sample": True, "seed": 7, "temperature": 1.5}}
    a, b = (client.post("/generate", headers=AUTH, json=kw).json() for _ in range(2))
    assert a == b


def test_decoder_input_details_gives_prompt_logprobs_as_completions_echo(client):
    r = client.post("/generate", headers=AUTH, json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 2, "details": True, "decoder_input_details": True}})
    assert r.status_code == 200, r.text
    prefill = r.json()["details"]["prefill"]
    ref = client.post("/v1/completions", headers=AUTH, json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1}).json()
    lp = ref["choices"][0]["logprobs"]
    n = len(prefill)
    assert n > 3 and prefill[0]["logprob"] is None and lp["token_logprobs"][0] is None
    assert [t["text"] for t in prefill] == lp["tokens"][:n]
    assert [t["logprob"] for t in prefill[1:]] == pytest.approx(lp["token_logprobs"][1:n], abs=1e-4)


@pytest.mark.parametrize("body, param", [
    ({"inputs": PROMPT, "stream": True, "parameters": {"decoder_input_details": True}},
     "parameters.decoder_input_details"),
    ({"inputs": PROMPT, "parameters": {"best_of": 2}}, "parameters.best_of"),
    ({"inputs": PROMPT, "parameters": {"temperature": 0}}, "parameters.temperature"),
    ({"inputs": ""}, "inputs"),
    ({"inputs": PROMPT, "parameters": {"max_new_tokens": 10**6}}, "parameters.max_new_tokens"),
])
def test_bad_generate_input_is_400_naming_the_field(client, body, param):
    r = client.post("/generate", headers=AUTH, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert client.post("/generate", json={"inputs": PROMPT}).status_code == 401
