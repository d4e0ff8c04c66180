"""Bad input, auth and overload answers in the OpenAI error shape (real `pagedjax serve`; the
duplicate-id check in process, against an engine the test steps)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from runtime.model.sampling import SamplingParams
from tests.console.admin_util import API_KEY, console_client
from tests.console.server_util import ServerHandle, start_server
from tests.engine_util import make_engine

MODEL = "tiny-test"
C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_ckpt) -> ServerHandle:
    # A short queue so the overload test can fill it; nothing else here queues.
    with start_server(tiny_ckpt, "--max-queue-len", "2", "--served-model-name", MODEL) as srv:
        yield srv


def _c(**kw):
    return {"model": MODEL, "prompt": "hello", "max_tokens": 4, **kw}


def _chat(**kw):
    return {"model": MODEL, "messages": USER, "max_tokens": 4, **kw}


# (id, route, body (dict: JSON-encoded; bytes: sent as is), param the error must name (None: any), message bit)
CASES = [
    ("max_tokens-string", C, _c(max_tokens="5"), "max_tokens", "int"),
    ("max_tokens-negative", C, _c(max_tokens=-1), "max_tokens", ">= 1"),
    ("max_tokens-zero", CHAT, _chat(max_tokens=0), "max_tokens", ">= 1"),
    ("max_tokens-huge", C, _c(max_tokens=10**9), "max_tokens", "context length"),
    ("max_tokens-overflow", C, _c(max_tokens=2**70), "max_tokens", ""),
    ("max_completion_tokens-huge", CHAT, _chat(max_completion_tokens=10**6), "max_completion_tokens", "context"),
    ("temperature-high", C, _c(temperature=2.5), "temperature", "<= 2"),
    ("temperature-negative", CHAT, _chat(temperature=-0.1), "temperature", ">= 0"),
    ("temperature-string", CHAT, _chat(temperature="hot"), "temperature", "float"),
    ("top_p-above-1", C, _c(top_p=1.5), "top_p", "<= 1"),
    ("top_p-zero", CHAT, _chat(top_p=0), "top_p", "> 0"),
    ("n-zero", C, _c(n=0), "n", ">= 1"),
    ("n-float", C, _c(n=1.5), "n", "int"),
    ("stream-string", C, _c(stream="yes"), "stream", "bool"),
    ("penalty-range", C, _c(presence_penalty=3), "presence_penalty", "<= 2"),
    ("logprobs-too-many", C, _c(logprobs=21), "logprobs", "<= 20"),
    ("top_logprobs-without-logprobs", CHAT, _chat(top_logprobs=2), "top_logprobs", "logprobs"),
    ("priority-unknown", C, _c(priority="urgent"), "priority", "urgent"),
    ("stop-empty-string", C, _c(stop=[""]), "stop[0]", "length >= 1"),
    ("prompt-int", C, _c(prompt=5), "prompt", ""),
    ("prompt-mixed-list", C, _c(prompt=["a", 1]), "prompt", "mix"),
    ("prompt-empty", C, _c(prompt=""), "prompt", "at least one token"),
    ("prompt-token-out-of-vocab", C, _c(prompt=[999999]), "prompt", "vocabulary"),
    ("prompt-over-context", C, _c(prompt="x" * 600), "prompt", "maximum context length"),
    ("prompt-plus-max_tokens-over-context", C, _c(prompt="x" * 500, max_tokens=100), "max_tokens", "context"),
    ("messages-over-context", CHAT, _chat(messages=[{"role": "user", "content": "x" * 600}]), "messages",
     "maximum context length"),
    ("messages-empty", CHAT, _chat(messages=[]), "messages", "length >= 1"),
    ("messages-string", CHAT, _chat(messages="hi"), "messages", "array"),
    ("messages-unknown-role", CHAT, _chat(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role",
     "wizard"),
    ("messages-missing-role", CHAT, _chat(messages=[{"content": "hi"}]), "messages[0].role", "role"),
    ("messages-image-part", CHAT,
     _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages[0].content[0].type", "image_url"),
    ("model-missing", CHAT, {"messages": USER}, "model", "model"),
    ("invalid-json", C, b'{"model": "tiny-test", "prompt": ', None, "not valid JSON"),
    ("not-json", CHAT, b"hello there", None, "not valid JSON"),
    ("empty-body", C, b"", None, "empty"),
    ("json-array", CHAT, b"[]", None, "object"),
    ("json-null", C, b"null", None, "object"),
]


@pytest.mark.parametrize("route,body,param,bit", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(server, route, body, param, bit):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + route, content=content,
                   headers={**server.headers, "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
        assert param.split("[")[0] in err["message"]
    assert bit.lower() in err["message"].lower(), err
    assert "Traceback" not in r.text


def test_unknown_model_is_404_model_not_found(server):
    """OpenAI's answer for a model (or LoRA adapter) the server does not have."""
    for route, body in ((C, _c(model="gpt-4")), (CHAT, _chat(model="gpt-4"))):
        r = httpx.post(server.url + route, json=body, headers=server.headers)
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert err["code"] == "model_not_found" and err["param"] == "model" and "'gpt-4' does not exist" in err["message"]


def test_routing_errors_in_openai_shape(server):
    r = httpx.get(server.url + C, headers=server.headers)
    assert r.status_code == 405 and "error" in r.json()
    r = httpx.post(server.url + "/v1/nothing-here", headers=server.headers, json={})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(server.url + C, json=_c(), headers={"Authorization": "Basic abc"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"] == "Bearer"


def test_overload_gets_429_and_nothing_breaks(server):
    body = _c(prompt="the the the", max_tokens=200, ignore_eos=True)

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120) as client:
            return await asyncio.gather(*(client.post(C, json=body) for _ in range(40)))

    responses = asyncio.run(main())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}, codes
    refused = [r for r in responses if r.status_code == 429]
    # At least the queue (2) gets in; how many more depends on how fast the engine thread
    # moves arrivals into the running batch while the burst lands.
    assert refused and codes.count(200) >= 2
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1
        err = r.json()["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "queue_full"
    for r in responses:
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] == 200
    assert server.metric("pagedjax:admission_rejections_total", reason="queue_full") == len(refused)
    assert server.wait_metric("pagedjax:kv_blocks", 0, state="used") == 0
    r = httpx.post(server.url + C, json=_c(), headers=server.headers)
    assert r.status_code == 200 and httpx.get(server.url + "/health").status_code == 200


def test_duplicate_request_id_while_running(tiny_ckpt):
    # In process, with an engine nobody steps: the first request stays running however
    # loaded the machine is (against a live server the tiny model can finish it first).
    engine = make_engine(tiny_ckpt, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256)
    headers = {"Authorization": f"Bearer {API_KEY}", "X-Request-Id": "dup-id-1"}
    with console_client(engine) as c:
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=8), request_id="dup-id-1-0")  # the id of its first job
        again = c.post(C, json={**_c(), "model": "tiny"}, headers=headers)
        assert again.status_code == 400, again.text
        err = again.json()["error"]
        assert err["param"] == "x-request-id" and err["code"] == "duplicate_request_id"
        assert engine.has_unfinished()  # the first request is untouched
        engine.abort("dup-id-1-0")
        while engine.has_unfinished():
            engine.step()
        # the id is free again once its request is gone (now served by the engine's own thread)
        c.app.state.engine.start()
        try:
            r = c.post(C, json={**_c(), "model": "tiny"}, headers=headers)
        finally:
            c.app.state.engine.stop()
        assert r.status_code == 200 and r.headers["x-request-id"] == "dup-id-1", r.text


